"""pace_core.schedule.PeriodicState: P-token segments, the dP buffer and its flush, against the plain
recurrence (float64) and the schedule written out plainly (tests/references.py)."""

import pytest
import torch
import torch.nn.functional as F
from numerics import fp32_bound, rel
from references import periodic_decode
from test_recurrence import make_inputs

from pace_core import quant
from pace_core.backend import REFERENCE
from pace_core.checkpoint import RoundingFormat
from pace_core.recurrence import gdn_recurrent, prepare_qk
from pace_core.schedule import Capture, PeriodicState

pytestmark = pytest.mark.numerics

F64_TOL = 1e-12
"""float64 against float64 in another order (chunks, triangular solves, buffered sums) over these short
sequences: about 10^4 times float64's rounding, far from anything a CPU's code path changes."""


def state(S0, H, round_fn=lambda s: s, *, period=1, decode_period=1, precision="fp64", chunk_size=5):
    """A PeriodicState of ``S0 [B, HV, K, V]`` (H key heads) rounded by ``round_fn``, on the reference
    backend."""
    B, HV, K, V = S0.shape
    st = PeriodicState(RoundingFormat(round_fn, dtype=S0.dtype), REFERENCE, (B, H, HV, K, V), S0.device,
                       prefill_period=period,
                       decode_period=decode_period, buffer=precision, chunk_size=chunk_size)
    st.set_checkpoint(S0)
    return st


@pytest.mark.parametrize("period", [1, 4, 7, 16, 100])
def test_prefill_without_rounding_is_the_recurrence(period):
    q, k, v, g, beta, S0 = make_inputs(2, 23, 2, 3, 8, 4, seed=period)
    o_ref, S_ref = gdn_recurrent(q, k, v, g, beta, S0)
    st = state(S0, 2, period=period)
    o = st.prefill(q, k, v, g, beta)
    assert rel(o, o_ref) < F64_TOL and rel(st.loaded(), S_ref) < F64_TOL


def test_prefill_rounds_each_segment_end():
    """The rounding runs at every segment end (the short last one too) and the next segment starts from
    its result."""
    q, k, v, g, beta, S0 = make_inputs(1, 10, 2, 1, 4, 4, seed=21)
    calls = []

    def halve(S):
        calls.append(S.clone())
        return 0.5 * S

    st = state(S0, 2, halve, period=4, chunk_size=3)
    o = st.prefill(q, k, v, g, beta)
    S, outs = S0, []
    for start in (0, 4, 8):
        sl = slice(start, start + 4)
        o_seg, end = gdn_recurrent(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], S)
        outs.append(o_seg)
        assert rel(calls[len(outs) - 1], end) < F64_TOL
        S = 0.5 * end
    assert len(calls) == 3
    assert rel(o, torch.cat(outs, 1)) < F64_TOL and rel(st.loaded(), S) < F64_TOL


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("dP", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.float64, "fp64")])
def test_decode_without_rounding_is_the_recurrence(gamma, dP, dtype, precision):
    """Spec §3's first test: quantisation off, an exact buffer, any dP -> the plain recurrence (fp32: 19
    tokens of two dots of length 8 and up to 16 buffered terms per read)."""
    q, k, v, g, beta, S0 = make_inputs(2, 19, 2, gamma, 8, 6, dtype=dtype, seed=dP * 7 + gamma)
    o_ref, S_ref = gdn_recurrent(*(x.double() for x in (q, k, v, g, beta, S0)))
    st = state(S0, 2, decode_period=dP, precision=precision)
    o = st.decode(q, k, v, g, beta)
    tol = F64_TOL if dtype == torch.float64 else fp32_bound(19 * (2 * 8 + 16))
    assert o.dtype == dtype and rel(o, o_ref) <= tol and rel(st.effective_state(), S_ref) <= tol


def test_decode_flushes_after_every_period():
    """The rounding sees the exact state after tokens dP, 2dP, ...; later tokens start from its result."""
    q, k, v, g, beta, S0 = make_inputs(1, 10, 1, 2, 4, 3, seed=31)
    calls = []

    def halve(S):
        calls.append(S.clone())
        return 0.5 * S

    st = state(S0, 1, halve, decode_period=3)
    o = st.decode(q, k, v, g, beta)
    S, outs = S0, []
    for start in (0, 3, 6, 9):
        sl = slice(start, start + 3)
        o_seg, end = gdn_recurrent(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], S)
        outs.append(o_seg)
        if start < 9:
            assert rel(calls[len(outs) - 1], end) < F64_TOL
            end = 0.5 * end
        S = end
    assert len(calls) == 3 and len(st.buffer) == 1
    assert rel(o, torch.cat(outs, 1)) < F64_TOL and rel(st.effective_state(), S) < F64_TOL


def test_decode_is_the_plain_schedule():
    """Token by token (one token per call, as ``generate`` decodes), the buffered decode of a rounding
    schedule against the schedule written out plainly: the same functions in the same order, bit for bit
    (fp32, int8 buffer, 4-bit rounding)."""
    q, k, v, g, beta, S0 = make_inputs(2, 21, 2, 2, 16, 8, dtype=torch.float32, seed=5)
    spec = quant.QuantSpec(4, True, "key", 8)

    def round_fn(S):
        return quant.fake_quantize(S, spec)

    st = state(S0, 2, round_fn, decode_period=4, precision="int8")
    o = torch.cat([st.decode(*(x[:, t:t + 1] for x in (q, k, v, g, beta))) for t in range(21)], 1)
    o_ref, S_ref, buf = periodic_decode(q, k, v, g, beta, S0, 4, round_fn, "int8", windows=False)
    assert torch.equal(o, o_ref) and torch.equal(st.effective_state(), S_ref) and len(st.buffer) == len(buf) == 1


@pytest.mark.parametrize("exact_current", [True, False])
@pytest.mark.parametrize("precision", ["fp64", "fp32", "bf16", "int8", "mixed"])
def test_decode_windows_are_the_token_by_token_decode(precision, exact_current):
    """A call of many tokens runs the tokens up to each flush or capture as one window
    (pace_core.recurrence.buffered_window); one token per call runs buffered_step. Same schedule, same
    function: fp64 agrees to F64_TOL; fp32 to the rounding of 23 tokens' reads (two dots of 16 and up to 5
    buffered terms each); bf16 / int8 / mixed records (int8 / mixed with 4-bit checkpoints) are rounded to a
    grid, where a value that lands on another side of a rounding boundary in the other order moves by one grid
    step (at most 2^-8, 1/127, 1/7 relative to its vector), so those agree to a few such steps (measured: to
    1e-7, no value crossed). Captures split the windows and each is served."""
    dtype = torch.float64 if precision == "fp64" else torch.float32
    q, k, v, g, beta, S0 = make_inputs(2, 23, 2, 2, 16, 8, dtype=dtype, seed=11)
    spec = quant.QuantSpec(4, True, "key", 8)

    def round_fn(S):  # 4-bit checkpoints where the records' grid is as coarse; else none (no grid to cross)
        return quant.fake_quantize(S, spec) if precision in ("int8", "mixed") else S

    runs = []
    for per_call in (23, 1):
        st = state(S0, 2, round_fn, decode_period=6, precision=precision)
        st.exact_current = exact_current
        seen = {}
        capture = Capture(frozenset({2, 9, 17}), lambda c, S, seen=seen: seen.__setitem__(c, S.clone()))
        o = torch.cat([st.decode(*(x[:, t:t + per_call] for x in (q, k, v, g, beta)),
                                 capture=capture if per_call > 1 else None) for t in range(0, 23, per_call)], 1)
        runs.append((o, st.effective_state(), seen, len(st.buffer)))
    (o_w, S_w, seen, n_w), (o_t, S_t, _, n_t) = runs
    tol = {"fp64": F64_TOL, "fp32": fp32_bound(23 * (2 * 16 + 5)), "bf16": 3 * 2 ** -8, "int8": 3 / 127,
           "mixed": 3 / 7}[precision]
    assert n_w == n_t == 23 % 6 and sorted(seen) == [2, 9, 17]
    assert rel(o_w, o_t) <= tol and rel(S_w, S_t) <= tol


def test_periodic_rounding_beats_per_token_on_slow_decays():
    """Synthetic GDN run with realistic decays (α = exp(-softplus) in ~0.9..0.999): the 4-bit
    key-axis (g = 32) state error after N decode tokens is smaller at dP = 8 than at dP = 1."""
    gen = torch.Generator().manual_seed(1234)
    B, H, gamma, K, V, T0, N = 1, 4, 2, 64, 32, 48, 64
    HV = H * gamma
    q, k = prepare_qk(torch.randn(B, T0 + N, H, K, generator=gen, dtype=torch.float64),
                      torch.randn(B, T0 + N, H, K, generator=gen, dtype=torch.float64))
    v = torch.randn(B, T0 + N, HV, V, generator=gen, dtype=torch.float64)
    g = -F.softplus(torch.empty(B, T0 + N, HV, dtype=torch.float64).uniform_(-6.9, -2.3, generator=gen))
    assert 0.9 < float(g.exp().min()) and float(g.exp().max()) < 0.9995
    beta = torch.sigmoid(torch.randn(B, T0 + N, HV, generator=gen, dtype=torch.float64))
    _, S_prompt = gdn_recurrent(q[:, :T0], k[:, :T0], v[:, :T0], g[:, :T0], beta[:, :T0])
    dec = [x[:, T0:] for x in (q, k, v, g, beta)]
    _, S_ref = gdn_recurrent(*dec, S_prompt)
    spec = quant.QuantSpec(bits=4, symmetric=True, axis="key", group_size=32)
    errors = {}
    for dP in (1, 8):
        fmt = RoundingFormat(lambda S: quant.fake_quantize(S, spec), dtype=S_prompt.dtype)
        st = PeriodicState(fmt, REFERENCE, (B, H, HV, K, V),
                           S_prompt.device, prefill_period=256, decode_period=dP, buffer="fp64")
        st.set_checkpoint(S_prompt)
        st.decode(*dec)
        errors[dP] = rel(st.effective_state(), S_ref)
    assert 0 < errors[8] < errors[1]
