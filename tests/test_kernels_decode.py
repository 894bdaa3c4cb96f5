"""The decode kernels through their backend (kernels.backend.TritonSteps; Triton, run by the interpreter on
CPU) against pace_core's reference backend and a float64 plain recurrence, each on a layer's
pace_core.schedule.PeriodicState; GQA γ = 2 and 3; outputs and the buffer slot being written poisoned
before each launch."""

from __future__ import annotations

import copy

import pytest
import torch
from calibration_support import calibrated
from kernels_support import DEVICE, SIZES, kernel_modules
from numerics import assert_within_one_step, fp32_bound, rel

from kernels.settings import Launch, RecurrentSettings, SplitSettings
from pace_core import quant
from pace_core.backend import REFERENCE
from pace_core.buffer import BufferFormat, DecodeBuffer
from pace_core.config import PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.methods import state_format
from pace_core.recurrence import RECURRENT_BELOW, gdn_recurrent, prepare_qk
from pace_core.schedule import Capture, PeriodicState

pytestmark = pytest.mark.numerics

KERNELS = kernel_modules()
backend = KERNELS["backend"]
plan_mod = KERNELS["plan"]
recurrent_step = KERNELS["recurrent_step"]

B, H, K, V, PERIOD, GROUP = (SIZES[x] for x in ("B", "H", "K", "V", "PERIOD", "GROUP"))
STEP_TOL = fp32_bound(4 * K + 2 * PERIOD)
"""One token given the same stored records: the dots of length K (the checkpoint's and the records'
keys), the records' sum and the output, in another order (tests/numerics.py)."""
CONFIGS = {
    # groups as PACE-4 (key 2g), PACE-4/8 (key g, a quarter of the heads at 8 bits), RTN (value g)
    "fp32": get_config("fp32").replace(decode_period=PERIOD, buffer="fp32"),
    "bf16": get_config("bf16").replace(decode_period=PERIOD, buffer="bf16"),
    "pace-4": get_config("pace-4").replace(group_size=2 * GROUP, decode_period=PERIOD),
    "pace-4-8": get_config("pace-4-8").replace(group_size=GROUP, decode_period=PERIOD),
    "pace-3": get_config("pace-3").replace(group_size=2 * GROUP, decode_period=PERIOD),
    "pace-3-8": get_config("pace-4-8").replace(name="pace-3-8", bits=3, group_size=GROUP, decode_period=PERIOD),
    "rtn-value-3": get_config("rtn-int3").replace(group_size=GROUP, decode_period=PERIOD, buffer="int8"),
    "rtn-value": get_config("rtn-int4").replace(symmetric=False, group_size=GROUP, decode_period=PERIOD,
                                                buffer="int8"),
    "pace-4 stored current": get_config("pace-4").replace(group_size=2 * GROUP, decode_period=PERIOD,
                                                          exact_current_token=False),
    "rtn-value stored current": get_config("rtn-int4").replace(symmetric=False, group_size=GROUP,
                                                               decode_period=PERIOD, buffer="int8",
                                                               exact_current_token=False),
    # buffer vectors in groups (several per vector and per flush tile), with and without zero points
    "pace-4-8 grouped buffer": get_config("pace-4-8").replace(group_size=GROUP, decode_period=PERIOD,
                                                              buffer_key_group=GROUP // 2),
    "pace-4 grouped buffer": get_config("pace-4").replace(group_size=2 * GROUP, decode_period=PERIOD,
                                                          buffer_key_group=GROUP, buffer_key_symmetric=False,
                                                          buffer_value_group=GROUP // 2,
                                                          buffer_value_symmetric=False),
    "rtn-value grouped buffer": get_config("rtn-int4").replace(symmetric=False, group_size=GROUP, decode_period=PERIOD,
                                                               buffer="int8", buffer_key_group=GROUP // 2,
                                                               buffer_key_symmetric=False, buffer_value_group=GROUP),
}


def _config(name: str, hv: int, group: int | None = None) -> PaceConfig:
    cfg = CONFIGS[name]
    if group is not None:
        cfg = cfg.replace(group_size=group)
    if cfg.high_share:
        cfg = cfg.replace(high_heads=(tuple(h for h in range(hv) if h % 4 == 1),))
    return cfg


def _states(name: str, hv: int, v_dim: int = V, group: int | None = None, S: torch.Tensor | None = None,
            launch: Launch | None = None):
    """The same layer state ``(kernels, reference)``: checkpoint of ``S [B, HV, K, V]`` (random when None)
    in the configuration's format, empty buffers of dP records; the kernels with the ``launch`` settings."""
    cfg = _config(name, hv, group)
    fmt = state_format(cfg, cfg.head_bits(0, hv) if cfg.quantized else (cfg.bits,) * hv)
    S = torch.randn(B, hv, K, v_dim) * 0.3 if S is None else S
    out = []
    for steps in (backend.TritonSteps(launch), REFERENCE):
        st = PeriodicState(fmt, steps, (B, H, hv, K, v_dim), DEVICE, prefill_period=SIZES["P"], decode_period=PERIOD,
                           buffer=cfg.buffer_format, exact_current=cfg.exact_current_token, chunk_size=SIZES["CHUNK"])
        st.set_checkpoint(REFERENCE.store(fmt, S)[0])
        out.append(st)
    return out


def _token(hv: int, v_dim: int = V):
    q, k = prepare_qk(torch.randn(B, H, K), torch.randn(B, H, K))
    return q, k, torch.randn(B, hv, v_dim), -torch.rand(B, hv) * 0.7, torch.rand(B, hv)


def _tokens(hv: int, T: int, v_dim: int = V):
    q, k = prepare_qk(torch.randn(B, T, H, K), torch.randn(B, T, H, K))
    return q, k, torch.randn(B, T, hv, v_dim), -torch.rand(B, T, hv) * 0.7, torch.rand(B, T, hv)


def _fill(states, n: int, u_scale: float = 0.5, decays: bool = True) -> None:
    """The same ``n`` random records appended to each state's buffer: values of size ``u_scale``, log decays (0 where
    ``decays`` is False)."""
    hv, v_dim = states[0].shape[2], states[0].shape[4]
    for _ in range(n):
        _, k, _, g, _ = _token(hv)
        u = torch.randn(B, hv, v_dim) * u_scale
        for st in states:
            st.buffer.append(k, u, g if decays else g * 0.0)


def _poison_slot(buf: DecodeBuffer) -> None:
    """Garbage in record slot len(buf) of every storage tensor (so an unwritten record shows)."""
    slot = len(buf)
    for store in (buf._keys, buf._values):
        for t in store.tensors:
            t[:, slot] = (0xAB if t.dtype == torch.uint8 else float("nan"))
    buf._decays[:, slot] = float("nan")


def _assert_within_one_step(got, ref, exact_rounding: bool = True, slack: torch.Tensor | None = None) -> None:
    """Requantised checkpoints: equal except near a rounding boundary (:func:`numerics.assert_within_one_step`
    derives the bound). Dense checkpoints: float32 rounding of the fold (one term per record and the decayed
    checkpoint), then the bfloat16 cast's half ulp. ``exact_rounding``: the folded values agree to float32
    rounding, so nearly every entry is equal; False where they agree less closely (fla's tensor-core prefill: a
    group's range and so its fp16 scale moves, and all its entries with it). There each entry's bound adds the
    folded values' own difference, :data:`kernels.chunk.AGREEMENT` of the largest |value| of its head (the H100 of
    2026-12-06 met an 8-bit entry 1 % beyond the bound without this term). ``slack [B, HV, K, V]``: where the folded
    records themselves may differ (:func:`_token_without_flush`), each entry's bound adds it."""
    if isinstance(ref, torch.Tensor):
        bound = fp32_bound(2 * PERIOD + 2) if ref.dtype == torch.float32 else 2.0**-8
        assert rel(got, ref) <= bound
        return
    assert_within_one_step(got, ref, 0.0 if exact_rounding else KERNELS["chunk"].AGREEMENT, slack)


def _storage_step(precision: str, u: torch.Tensor) -> torch.Tensor:
    """An upper bound of one storage step of the buffered values ``u [B, HV, V]``: 0 in fp32, one
    bfloat16 ulp (at most ``2^-7 |u|``), or the int8 per-vector scale (``max |u| / 127``)."""
    if precision == "fp32":
        return torch.zeros_like(u)
    if precision == "int8":
        return u.abs().amax(-1, keepdim=True).expand_as(u) / 127 * 1.01
    return u.abs() * 2.0 ** -7


def _token_without_flush(states, token, gamma: int) -> tuple[torch.Tensor, ...]:
    """One token on copies of the two states, its record kept (no flush), kernel against reference given
    the same stored records. The current token's part of ``o_t`` uses its exact ``u_t``, or, without
    ``exact_current``, its stored record: then where the kernel's ``u_t`` (float32-rounding close to the
    reference's) rounds to another bfloat16 / int8 value, ``o_t`` moves by ``(k̂_t·q_t) Δû_t``, by design.
    Returns the kernel's ``o_t``, that possible move's bound (one storage step times ``|k̂_t·q_t|``; 0
    with the exact current token), and what the record moves in a fold of this token's period, ``|k̂_t| |Δû_t|
    [B, HV, K, V]``: with the records' actual difference here, and with one storage step for ``Δû_t``, the
    difference a folding kernel's own record may add (the 8-bit head of PACE-3/8 on an H100 of 2026-12-07 stored an
    entry 1.09 times the bound that left the records' difference out)."""
    st_k, st_r = (copy.deepcopy(st) for st in states)
    n, precision, q = len(st_k.buffer), st_k.buffer.precision, token[0]
    o_ref = st_r.steps.step(st_r, *token, flush=False)
    _poison_slot(st_k.buffer)
    o = st_k.steps.step(st_k, *token, flush=False)
    assert torch.isfinite(o).all()
    buf_k, buf_r = st_k.buffer, st_r.buffer
    assert len(buf_k) == len(buf_r) == n + 1
    assert torch.equal(buf_k.log_decays(), buf_r.log_decays())
    assert torch.equal(buf_k.keys(), buf_r.keys())
    got, ref = buf_k.values(), buf_r.values()
    assert torch.isfinite(got).all()
    if precision == "fp32":
        assert rel(got, ref) <= STEP_TOL
    else:
        assert (got == ref).float().mean() > 0.95 and rel(got, ref) < 1e-2
    step = _storage_step(precision, got[:, n].float())
    k_t = buf_k.keys()[:, n].float()
    k_abs = k_t.abs().repeat_interleave(gamma, dim=1)[..., None]
    fold_gap = k_abs * (got[:, n] - ref[:, n]).float().abs()[:, :, None, :]
    fold_step = k_abs * step[:, :, None, :]
    if st_k.exact_current:
        assert rel(o, o_ref) <= STEP_TOL
        return o, torch.zeros_like(o), fold_gap, fold_step
    kq = torch.einsum("bhk,bhk->bh", k_t, q).repeat_interleave(gamma, dim=1)
    assert rel(o, o_ref + kq[..., None] * (got[:, n] - ref[:, n]).float()) <= STEP_TOL
    return o, kq[..., None].abs() * step, fold_gap, fold_step


def _check_flush_token_output(split: bool, o_flush, o_kept, slack) -> None:
    """``o_t`` of the token run with the fold after it against the same token run without (the
    kernel's own, from :func:`_token_without_flush`): the split path runs the same step kernel, so they
    are equal; the fused kernel's folding variant sums in another order, so ``û_t`` may round the other
    way (``slack``: one storage step times ``|k̂_t·q_t|``)."""
    if split:
        assert torch.equal(o_flush, o_kept)
    else:
        assert ((o_flush - o_kept).abs() <= STEP_TOL * o_kept.pow(2).mean().sqrt() + slack).all()


def _one_token(name: str, gamma: int, n: int, v_dim: int = V, group: int | None = None, launch: Launch | None = None):
    """One token with n records buffered, value heads ``v_dim`` wide (key groups of ``group`` rows, else
    the configuration's), the kernels with the ``launch`` settings: output and appended record
    (:func:`_token_without_flush`), and at n = dP - 1 the fold + requantise. Returns the launch plan (whether it
    took the split path, and with which kernels)."""
    HV = H * gamma
    states = _states(name, HV, v_dim, group, launch=launch)
    _fill(states, n)
    token = _token(HV, v_dim)
    o_kept, slack, fold_gap, fold_step = _token_without_flush(states, token, gamma)
    st_k, st_r = states
    plan = st_k.steps.plan(st_k)
    flush = n == PERIOD - 1
    st_r.steps.step(st_r, *token, flush=flush)
    o = st_k.steps.step(st_k, *token, flush=flush)
    assert len(st_k.buffer) == len(st_r.buffer) == (0 if flush else n + 1)
    _check_flush_token_output(plan.split, o, o_kept, slack)
    if flush:  # the split path folds the record its step kernel stored without the flush, the fused one its own
        moved = fold_gap if plan.split else fold_gap + fold_step
        _assert_within_one_step(st_k.checkpoint, st_r.checkpoint, slack=moved)
    return plan


@pytest.mark.parametrize("gamma", [2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("n", [1, PERIOD - 1])
def test_decode_step_matches_reference(name: str, gamma: int, n: int) -> None:
    """One token with n records buffered (:func:`_one_token`)."""
    _one_token(name, gamma, n)


@pytest.mark.parametrize("gamma", [2, 3])
def test_buffered_fp32_equals_plain_recurrence(gamma: int) -> None:
    """Spec §3's first test on the kernels: quantisation off, fp32 buffer, dP = 2 -> the plain recurrence
    (float64): T tokens of dots of length K through the state."""
    HV, T = H * gamma, 5
    S0 = torch.randn(B, HV, K, V) * 0.3
    tokens = _tokens(HV, T)
    o_ref, S_ref = gdn_recurrent(*(x.double() for x in tokens), initial_state=S0.double())
    cfg = get_config("fp32").replace(decode_period=2, buffer="fp32")
    st = PeriodicState(state_format(cfg, (32,) * HV), backend.TritonSteps(), (B, H, HV, K, V), DEVICE,
                       prefill_period=8, decode_period=2, buffer="fp32")
    st.set_checkpoint(S0.clone())
    o = st.decode(*tokens)
    assert rel(o, o_ref) <= fp32_bound(T * 2 * K) and len(st.buffer) == T % 2
    assert rel(st.effective_state(), S_ref) <= fp32_bound(T * 2 * K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gamma", [2, 3])
def test_dense_step_matches_recurrence(dtype: torch.dtype, gamma: int) -> None:
    """The per-token step on a dense state against one float64 step: dots of length K; a bfloat16 state
    is then the fp32 result rounded (one bfloat16 ulp at most, rarely)."""
    HV = H * gamma
    S = (torch.randn(B, HV, K, V) * 0.3).to(dtype)
    q, k, v, g, beta = _token(HV)
    o_ref, S_ref = gdn_recurrent(q[:, None].double(), k[:, None].double(), v[:, None].double(),
                                 g[:, None].double(), beta[:, None].double(), initial_state=S.double())
    out = torch.full((B, HV, V), float("nan"))
    o = recurrent_step.dense_recurrent_step(S, q, k, v, g, beta, RecurrentSettings(block_v=8), out=out)
    assert o is out
    assert rel(o, o_ref[:, 0]) <= fp32_bound(3 * K)
    assert rel(S, S_ref) <= (fp32_bound(3 * K) if dtype == torch.float32 else 2.0**-8)
    if dtype == torch.bfloat16:
        assert (S != S_ref.to(torch.bfloat16)).float().mean() < 0.02


@pytest.mark.parametrize("name,gamma", [("fp32", 2), ("pace-4", 3), ("pace-4-8", 2)])
def test_prefill_matches_reference(name: str, gamma: int) -> None:
    """P-token segments through the kernels' backend (chunk, store, load) against the reference backend.
    Segments of at least RECURRENT_BELOW tokens without fla (or off the GPU) are the reference's own chunked
    GDN and the stores are bit-identical, so outputs and checkpoints are equal. fla's chunk kernel computes
    its dot products in tf32 / bf16 on tensor cores, so there outputs agree to :data:`kernels.chunk.AGREEMENT` and
    checkpoints to one code step. Shorter segments run the recurrence kernel: float32 rounding of the dots
    (length K, three per token) against the float64 recurrence for fp32; a quantised checkpoint may then be
    stored one code apart where a state lies within that of a rounding boundary, which moves the later
    segments by its share (2e-3, one code step)."""
    HV, T = H * gamma, SIZES["T"]
    S0 = torch.randn(B, HV, K, V) * 0.3
    states = _states(name, HV, S=S0)
    tokens = _tokens(HV, T)
    o_k, o_r = (st.prefill(*tokens) for st in states)
    assert type(states[0].checkpoint) is type(states[1].checkpoint)
    fla, agreement = KERNELS["chunk"].runs_fla(o_k), KERNELS["chunk"].AGREEMENT
    short = SIZES["P"] < RECURRENT_BELOW
    o64, S64 = gdn_recurrent(*(x.double() for x in tokens), initial_state=S0.double())
    if short and name == "fp32":
        assert rel(o_k, o64) <= fp32_bound(T * 3 * K) and rel(states[0].loaded(), S64) <= fp32_bound(T * 3 * K)
    elif fla or short:
        assert rel(o_k, o_r) <= agreement
        if isinstance(states[1].checkpoint, torch.Tensor):
            assert rel(states[0].loaded(), states[1].loaded()) <= agreement
        else:
            _assert_within_one_step(states[0].checkpoint, states[1].checkpoint, exact_rounding=False)
    else:
        assert torch.equal(o_k, o_r)
        assert torch.equal(states[0].loaded(), states[1].loaded())
        if name == "fp32":
            assert rel(o_k, o64) <= fp32_bound(T * 2 * K) and rel(states[0].loaded(), S64) <= fp32_bound(T * 2 * K)
    assert states[0].prefill(*(x[:, :0] for x in tokens)).shape == (B, 0, HV, V)


def test_kernels_cover_what_they_support() -> None:
    """The Triton backend serves rtn / pace (with a buffer or rounding every token) and method none; not
    DSQ, DAMP, the combinations (stochastic rounding, the key rotation, static scales), the float64 test buffer,
    or keys narrower than a tensor-core tile."""
    def covered(cfg, buffer, k_dim=K):
        bits = cfg.head_bits(0, 2 * H) if cfg.quantized else (cfg.bits,) * (2 * H)
        cal = calibrated(cfg, 2 * H, k_dim, 1, d_v=V).calibrated
        return backend.TritonSteps.for_layer(state_format(cfg, bits, None if cal is None else cal.layers[0]),
                                             buffer and BufferFormat(buffer), k_dim, V) is not None
    assert covered(CONFIGS["pace-4"], "int8") and covered(CONFIGS["fp32"], "fp32") and covered(get_config("bf16"), None)
    assert covered(get_config("rtn-int4").replace(group_size=GROUP), None)
    assert not covered(get_config("qmamba-dsq"), None)
    assert not covered(CONFIGS["pace-4"], "fp64") and not covered(CONFIGS["pace-4"].replace(group_size=8), "int8", 8)
    assert not covered(get_config("damp-int4"), None)
    assert covered(CONFIGS["pace-3"], "int8") and covered(_config("pace-3-8", 2 * H), "mixed")
    assert covered(get_config("rtn-int3").replace(group_size=GROUP), None)
    for bits in (2, 5, 6, 7):  # densely packed widths without a kernel: the reference, for a stated reason
        assert not covered(get_config(f"rtn-int{bits}").replace(group_size=GROUP), None)
        if bits > 4:
            assert not covered(_config("pace-4-8", 2 * H).replace(high_bits=bits), "mixed")
    assert not covered(get_config("rtn-int3").replace(group_size=GROUP, symmetric=False), None)
    for combination in (dict(rounding="stochastic"), dict(key_hadamard=True), dict(scales="static")):
        cfg = CONFIGS["pace-4"].replace(**combination)  # covered without it
        assert not covered(cfg, "int8") and not covered(cfg.replace(decode_period=1), None)


@pytest.mark.parametrize("name,gamma", [("pace-4", 2), ("pace-4-8", 3), ("pace-3", 3), ("pace-3-8", 2)])
def test_packed_key_axis_split_path_over_two_periods(name: str, gamma: int) -> None:
    """Packed key-axis checkpoints take the split path (dots and record kernels, then a separate flush
    kernel). Two whole periods through the schedule, every token against the reference run from the
    kernel's own checkpoint and buffer (a low-precision buffer would otherwise let one-ulp differences
    of earlier records add up; :func:`_token_without_flush`), and each period's flush against the
    reference's fold + requantisation."""
    HV = H * gamma
    st_k, _ = _states(name, HV)
    assert st_k.steps.plan(st_k).split
    for _ in range(2):
        start = st_k.loaded().clone()
        for _ in range(PERIOD):
            token = _token(HV)
            ref = copy.deepcopy(st_k)
            ref.steps = REFERENCE
            o_kept, slack, fold_gap, _ = _token_without_flush((st_k, ref), token, gamma)
            ref.decode(*(x[:, None] for x in token))
            _poison_slot(st_k.buffer)
            o = st_k.decode(*(x[:, None] for x in token))[:, 0]
            _check_flush_token_output(True, o, o_kept, slack)
            assert len(st_k.buffer) == len(ref.buffer)
        assert len(st_k.buffer) == 0  # the reference folded the kernel's records but the last (fold_gap)
        _assert_within_one_step(st_k.checkpoint, ref.checkpoint, slack=fold_gap)
        assert not torch.equal(st_k.loaded(), start)  # the in-place flush shows in the dequantised checkpoint


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name,gamma", [("pace-4", 2), ("pace-4-8", 3), ("pace-3", 2)])
def test_split_path_on_half_tiles(name: str, gamma: int, fused: bool) -> None:
    """Heads at least 32 values wide, so that the dots kernel takes 4-bit codes as even / odd half
    tiles of 16 or more columns (narrower heads pad them) and the step may run as one kernel
    (``fused``) or as the dots and record kernels: a period's last token, its output and the fold +
    requantisation against the reference."""
    plan = _one_token(name, gamma, PERIOD - 1, max(V, 32), launch=Launch.of(SplitSettings(fused_step=fused)))
    assert plan.split and plan.split.fusable and plan.split.settings.fused_step == fused


@pytest.mark.parametrize("name", ["pace-4", "pace-4-8", "pace-3-8"])
def test_split_path_on_small_groups(name: str) -> None:
    """Key groups of 8 rows, so that a flush tile of 16 key rows holds two groups."""
    assert _one_token(name, 2, PERIOD - 1, group=8).split


def test_narrow_keys_are_refused() -> None:
    """Keys narrower than a tensor-core tile (K = 8) are refused by the decode kernels (the flush gave
    wrong PACE-4/8 checkpoints there on the H200), with a message naming the limit."""
    ckpt = quant.quantize(torch.randn(B, H, 8, V), quant.QuantSpec(4, True, "key", 8))
    with pytest.raises(PaceError, match="K >= 16"):
        plan_mod.plan_decode(ckpt, DecodeBuffer(B, H, H, 8, V, PERIOD, "int8", DEVICE))
    with pytest.raises(PaceError, match="K >= 16"):
        plan_mod.plan_decode(torch.zeros(B, H, 8, V), DecodeBuffer(B, H, H, 8, V, PERIOD, "fp32", DEVICE))
    with pytest.raises(PaceError, match="fp64"):
        plan_mod.plan_decode(torch.zeros(B, H, K, V), DecodeBuffer(B, H, H, K, V, PERIOD, "fp64", DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_decode_backends_agree(dtype: torch.dtype) -> None:
    """dP = 1 of method none: the kernels' in-place step against the reference's recurrence step, through
    the schedule (dots of length K, then the state's own dtype)."""
    HV = 2 * H
    cfg = get_config("fp32" if dtype == torch.float32 else "bf16")
    fmt = state_format(cfg, (cfg.bits,) * HV)
    S = torch.randn(B, HV, K, V) * 0.3
    states = []
    for steps in (backend.TritonSteps(), REFERENCE):
        st = PeriodicState(fmt, steps, (B, H, HV, K, V), DEVICE, prefill_period=8, decode_period=1)
        st.set_checkpoint(S.to(dtype).clone())
        states.append(st)
    token = _tokens(HV, 1)
    o_k, o_r = (st.decode(*token) for st in states)
    assert rel(o_k, o_r) <= fp32_bound(3 * K)
    S_k, S_r = (st.checkpoint for st in states)
    assert S_k.dtype == S_r.dtype == dtype and not torch.equal(S_k, S.to(dtype))
    assert rel(S_k, S_r) <= (fp32_bound(3 * K) if dtype == torch.float32 else 2.0**-8)


@pytest.mark.parametrize("name", ["rtn-int4", "pace-4", "rtn-int3", "pace-3"])
def test_per_token_rounding_backends_agree(name: str) -> None:
    """dP = 1 of a quantised state: the kernels' load, in-place step and store against the reference's
    recurrence step and store, three tokens through the schedule, each from the kernels' own checkpoint
    (a code one step apart would otherwise carry on): outputs to float32 rounding of the dots (length K),
    the stored checkpoints within one code step (a state within float32 rounding of a rounding boundary)."""
    HV = 2 * H
    cfg = get_config(name).replace(decode_period=1, group_size=GROUP)
    fmt = state_format(cfg, cfg.head_bits(0, HV))
    st_k = PeriodicState(fmt, backend.TritonSteps(), (B, H, HV, K, V), DEVICE, prefill_period=8, decode_period=1)
    st_k.set_checkpoint(REFERENCE.store(fmt, torch.randn(B, HV, K, V) * 0.3)[0])
    for _ in range(3):
        ref = copy.deepcopy(st_k)
        ref.steps = REFERENCE
        token = _tokens(HV, 1)
        o_k, o_r = (st.decode(*token) for st in (st_k, ref))
        assert rel(o_k, o_r) <= fp32_bound(3 * K)
        _assert_within_one_step(st_k.checkpoint, ref.checkpoint)
        assert type(st_k.checkpoint) is type(ref.checkpoint)


def _run_and_single_tokens(fmt, S0, T: int, at: frozenset[int]):
    """Two kernel states from the checkpoint ``S0`` in ``fmt``: ``T`` tokens in one decode call (one launch
    per run between the captures ``at``) and the same tokens one call each; returns both sides' outputs,
    captured states and final checkpoints."""
    HV = S0.shape[1]
    tokens = _tokens(HV, T)
    sides = []
    for single in (False, True):
        st = PeriodicState(fmt, backend.TritonSteps(), (B, H, HV, K, V), DEVICE, prefill_period=8, decode_period=1)
        st.set_checkpoint(copy.deepcopy(S0))
        seen = {}
        capture = Capture(at, lambda n, S, seen=seen: seen.setdefault(n, S.clone()))
        if single:
            o = []
            for t in range(T):
                o.append(st.decode(*(x[:, t:t + 1] for x in tokens)))
                if t + 1 in at:
                    seen[t + 1] = st.effective_state().clone()
            o = torch.cat(o, 1)
        else:
            o = st.decode(*tokens, capture=capture)
        sides.append((o, seen, st.checkpoint))
    return sides


def _checkpoints_equal(got, ref) -> None:
    """Two checkpoints (dense, packed or mixed) of the same layout, bit for bit (interpreter) or within
    :func:`_same_run` (compiled)."""
    if isinstance(ref, torch.Tensor):
        _same_run(got.float(), ref.float())
        return
    for a, r in zip(plan_mod.as_mixed(got).parts.values(), plan_mod.as_mixed(ref).parts.values()):
        _same_run(quant.dequantize(a), quant.dequantize(r))


@pytest.mark.parametrize("name", ["rtn-int4", "pace-4", "pace-4-8", "rtn-value", "bf16", "pace-3-8"])
def test_per_token_run_is_its_tokens_one_by_one(name: str) -> None:
    """dP = 1: a run of tokens in one launch (the state rounded in registers after each) is the same kernel
    code, token by token, as one launch per token (the state through memory): outputs, the states captured
    mid-run and the final checkpoint. With the one-token test against the reference this ties every token of
    a run to the reference's step and store."""
    HV = 2 * H
    cfg = (_config(name, HV) if name in CONFIGS else get_config(name)).replace(decode_period=1)
    if name == "rtn-int4":
        cfg = cfg.replace(group_size=GROUP)
    fmt = state_format(cfg, cfg.head_bits(0, HV) if cfg.quantized else (cfg.bits,) * HV)
    S0 = REFERENCE.store(fmt, torch.randn(B, HV, K, V) * 0.3)[0]
    (o_run, seen_run, c_run), (o_one, seen_one, c_one) = _run_and_single_tokens(fmt, S0, 5, frozenset({2}))
    _same_run(o_run, o_one)
    assert seen_run.keys() == seen_one.keys() == {2}
    _same_run(seen_run[2], seen_one[2])
    _checkpoints_equal(c_run, c_one)
    assert type(c_run) is type(S0)


@pytest.mark.parametrize("name", ["rtn-value", "pace-4-8", "fp32"])
def test_per_token_run_plan_serves_every_checkpoint_of_its_layout(name: str) -> None:
    """A run's launch plan (:func:`kernels.recurrent_step.plan_recurrent`), made once from one checkpoint,
    launches the runs from the next checkpoints of that layout (the kernel's new storage) exactly as a plan
    made from each: the same kernel on the same inputs, bit for bit; a dense state is still updated in
    place."""
    run = recurrent_step.recurrent_run
    HV = 2 * H
    cfg = _config(name, HV).replace(decode_period=1)
    fmt = state_format(cfg, cfg.head_bits(0, HV) if cfg.quantized else (cfg.bits,) * HV)
    first = REFERENCE.store(fmt, torch.randn(B, HV, K, V) * 0.3)[0]
    planned, fresh = copy.deepcopy(first), copy.deepcopy(first)
    plan = recurrent_step.plan_recurrent(first)
    for _ in range(3):
        tokens = _tokens(HV, 2)
        o_p, planned, _ = run(planned, *tokens, plan=plan)
        before = fresh
        o_f, fresh, _ = run(fresh, *tokens)
        assert torch.equal(o_p, o_f)
        _checkpoints_equal(planned, fresh)
        assert (fresh is before) == isinstance(first, torch.Tensor)


@pytest.mark.parametrize("poison", ["overflow", "non-finite"])
def test_per_token_run_refuses_a_state_as_a_store_does(poison: str) -> None:
    """A run whose third token's state would overflow an fp16 scale (or turn non-finite) raises the store's
    own PaceError at that token, as the reference does, and keeps what came before: the checkpoint after two
    tokens, equal to the reference's (the kernel's run is discarded and the reference runs it again)."""
    HV = 2 * H
    cfg = get_config("pace-4").replace(decode_period=1, group_size=GROUP)
    fmt = state_format(cfg, cfg.head_bits(0, HV))
    S0 = REFERENCE.store(fmt, torch.randn(B, HV, K, V) * 0.3)[0]
    q, k, v, g, beta = _tokens(HV, 4)
    if poison == "overflow":
        v[:, 2] *= 1e9
    else:
        g[:, 2] = 200.0  # e^200 overflows float32
    states, errors = [], []
    for steps in (backend.TritonSteps(), REFERENCE):
        st = PeriodicState(fmt, steps, (B, H, HV, K, V), DEVICE, prefill_period=8, decode_period=1)
        st.set_checkpoint(copy.deepcopy(S0))
        with pytest.raises(PaceError) as err:
            st.decode(q, k, v, g, beta)
        states.append(st)
        errors.append(str(err.value))
    assert errors[0] == errors[1]
    assert ("overflows" if poison == "overflow" else "non-finite") in errors[0]
    torch.testing.assert_close(states[0].loaded(), states[1].loaded(), rtol=0, atol=0)


def test_short_exact_segments_run_on_the_recurrence_kernel() -> None:
    """The exact fp32 reference's short segments (fewer than RECURRENT_BELOW tokens: a decode token, the
    tokens between captures) on the kernel, unrounded, against the float64 recurrence: dots of length K per
    token, T tokens in a chain; ``S0`` is left as it was."""
    HV, T = 2 * H, 5
    S0 = torch.randn(B, HV, K, V) * 0.3
    kept = S0.clone()
    tokens = _tokens(HV, T)
    o, S = backend.TritonSteps().chunk(*tokens, S0, 64)
    o_ref, S_ref = gdn_recurrent(*(x.double() for x in tokens), initial_state=S0.double())
    assert torch.equal(S0, kept)
    assert rel(o, o_ref) <= fp32_bound(3 * K * T)
    assert rel(S, S_ref) <= fp32_bound(3 * K * T)


def _same_run(got: torch.Tensor, ref: torch.Tensor) -> None:
    """The same kernel code on the same inputs: bit for bit in the interpreter. Compiled, the window kernel
    and the one-token kernel are two compilations of that code (the H200 check found a quarter of the
    outputs one ulp or so apart: other tensor-core layouts, another accumulation order): float32 rounding,
    and then a buffered value may be stored one storage step apart (int8: 1/127 of its vector's range)
    and move what follows by its share, as :func:`_token_without_flush` allows the records."""
    if not got.is_cuda:
        assert torch.equal(got, ref)
    else:
        assert rel(got, ref) < 1e-2


@pytest.mark.parametrize("name,gamma", [("pace-4", 2), ("pace-4-8", 3), ("pace-4 stored current", 2),
                                        ("pace-4 grouped buffer", 2)])
def test_window_kernel_is_the_one_kernel_step(name: str, gamma: int) -> None:
    """Tokens known at once (teacher forcing) in one window launch against the same tokens through the
    one-kernel step one at a time: each token is that step's code with the records before it, the
    window's own included. Windows of 1, 2 and the rest of a period (its flush after the last), on heads
    wide enough for the one-kernel step: outputs, every record and the flushed checkpoint."""
    launch = Launch.of(SplitSettings(fused_step=True, gluon_step=False))  # the Triton step, the window's code
    HV, v_dim = H * gamma, max(V, 32)
    st_w, _ = _states(name, HV, v_dim, launch=launch)
    assert st_w.steps.plan(st_w).split.fusable
    st_t = copy.deepcopy(st_w)
    st_t.steps = backend.TritonSteps(launch)  # its own launch plan, on its own tensors
    tokens = _tokens(HV, PERIOD, v_dim)
    for lo, hi in ((0, 1), (1, 3), (3, PERIOD)):
        part = [x[:, lo:hi] for x in tokens]
        flush = hi == PERIOD
        _poison_slot(st_w.buffer)
        o_w = st_w.steps.window(st_w, *part, flush=flush)
        o_t = torch.stack([st_t.steps.step(st_t, *(x[:, t] for x in part), flush=flush and t == hi - lo - 1)
                           for t in range(hi - lo)], 1)
        assert o_w.shape == (B, hi - lo, HV, v_dim) and torch.isfinite(o_w).all()
        _same_run(o_w, o_t)
        assert len(st_w.buffer) == len(st_t.buffer) == (0 if flush else hi)
        if not flush:
            _same_run(st_w.buffer.values(), st_t.buffer.values())
            assert torch.equal(st_w.buffer.keys(), st_t.buffer.keys())
            assert torch.equal(st_w.buffer.log_decays(), st_t.buffer.log_decays())
    if st_w.loaded().is_cuda:
        _assert_within_one_step(st_w.checkpoint, st_t.checkpoint, exact_rounding=False)
    else:
        assert torch.equal(st_w.loaded(), st_t.loaded())
    too_many = [x.transpose(0, 1).contiguous() for x in _tokens(HV, PERIOD + 1, v_dim)]
    with pytest.raises(PaceError, match="do not fit in the buffer"):
        KERNELS["packed_step"].launch_window(st_w.steps.plan(st_w), st_w.buffer, *too_many,
                                              torch.empty_like(too_many[2]))


@pytest.mark.parametrize("gamma", [2, 3])
def test_launches_per_bit_width_are_the_one_launch(gamma: int) -> None:
    """PACE-4/8's dots, window and flush kernels launched once per bit width over that width's heads
    (:func:`kernels.plan.ckpt_launches`) against one launch over all heads through the head table: the same
    code per head on the same inputs (:func:`_same_run`). A window of tokens, then the rest of a period one
    token at a time through the dots and record kernels, its flush after the last; the next period's first
    token reads the flushed checkpoint."""
    HV, v_dim = H * gamma, max(V, 32)
    st_p, _ = _states("pace-4-8", HV, v_dim)
    st_o = copy.deepcopy(st_p)
    st_p.steps = backend.TritonSteps(Launch.of(SplitSettings(fused_step=False, per_part=True, dots_per_part=True)))
    st_o.steps = backend.TritonSteps(Launch.of(SplitSettings(fused_step=False, per_part=False, dots_per_part=False)))
    split = st_p.steps.plan(st_p).split
    assert len(split.launches[True]) == 2 and split.fusable
    tokens = _tokens(HV, PERIOD + 1, v_dim)
    outputs = {}
    for st in (st_p, st_o):
        outs = [st.steps.window(st, *(x[:, :3] for x in tokens), flush=False)]
        outs += [st.steps.step(st, *(x[:, t] for x in tokens), flush=t == PERIOD - 1)[:, None]
                 for t in range(3, PERIOD + 1)]
        outputs[st is st_p] = torch.cat(outs, 1)
    _same_run(outputs[True], outputs[False])
    assert len(st_p.buffer) == len(st_o.buffer) == 1
    if st_p.loaded().is_cuda:
        _assert_within_one_step(st_p.checkpoint, st_o.checkpoint, exact_rounding=False)
    else:
        assert torch.equal(st_p.loaded(), st_o.loaded())


def test_step_writes_into_out_and_refuses_a_wrong_one() -> None:
    """TritonSteps.step(out=...) (kernels/bench/bench.py's layer output): ``o_t`` written into the given tensor, the
    same values as into a new one (the same kernels on the same inputs); a tensor of another dtype or shape is
    refused before any launch, with what is allowed."""
    HV = H * 2
    st, _ = _states("pace-4", HV)
    twin = copy.deepcopy(st)
    tok = _token(HV)
    out = torch.full((B, HV, V), float("nan"))
    assert st.steps.step(st, *tok, flush=False, out=out) is out
    assert torch.equal(out, twin.steps.step(twin, *tok, flush=False))
    for wrong in (torch.empty(B, HV, V, dtype=torch.float64), torch.empty(B, HV, V + 1)):
        with pytest.raises(PaceError, match="allowed: contiguous float32"):
            st.steps.step(st, *tok, flush=False, out=wrong)
    assert len(st.buffer) == 1


@pytest.mark.skipif(DEVICE.type != "cuda", reason="inline PTX: compiled kernels only (the interpreter runs the "
                    "dots kernel's integer path, which the tests above check)")
def test_nibbles_unpack_every_code_of_a_byte() -> None:
    """kernels.primitives.nibbles_bf16 on every byte value, at positions 0-3 of a packed register: the low nibble
    of byte i is element i of the first output, the high nibble of the second, as 128 + code in bfloat16."""
    import triton
    import triton.language as tl

    nibbles_bf16 = KERNELS["primitives"].nibbles_bf16

    @triton.jit
    def unpack(p_ptr, lo_ptr, hi_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        lo, hi = nibbles_bf16(tl.load(p_ptr + i))
        tl.store(lo_ptr + i, lo)
        tl.store(hi_ptr + i, hi)

    p = torch.randperm(256, device=DEVICE).to(torch.uint8).repeat(4)
    lo = torch.full(p.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
    hi = lo.clone()
    unpack[(1,)](p, lo, hi, N=p.numel())
    assert torch.equal(lo.float(), 128 + (p & 15).float())
    assert torch.equal(hi.float(), 128 + (p >> 4).float())


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the Gluon dots kernel is compiled-only (tests/test_kernels_sass.py "
                    "compiles it for sm_90a on any machine)")
@pytest.mark.parametrize("name,gamma,cap", [("pace-4", 2, None), ("pace-4-8", 3, None), ("pace-4-8", 3, 128),
                                            ("pace-4", 3, 80)])
def test_gluon_dots_are_the_triton_dots(name: str, gamma: int, cap: int | None) -> None:
    """kernels.gluon_dots (4-bit parts, symmetric and zero-point; with a register ``cap``) against the Triton dots
    kernel on the same checkpoint and token: ``Ŝᵀk, Ŝᵀq`` agree to float32 rounding (both sum exact products in
    fp32, in other orders; STEP_TOL), every entry written (the workspace poisoned first)."""
    packed_step = KERNELS["packed_step"]
    st, _ = _states(name, H * gamma)
    q, k, *_ = _token(H * gamma)
    out = {}
    for gluon in (True, False):
        plan = backend.TritonSteps(Launch.of(SplitSettings(gluon_dots=gluon, dots_per_part=True,
                                                           dots_maxnreg=cap))).plan(st)
        assert any(launch.gluon_dots for launch in plan.split.launches[True]) == gluon
        plan.workspace.fill_(float("nan"))
        packed_step.launch_dots(plan, q, k)
        out[gluon] = plan.workspace.clone()
    assert torch.isfinite(out[True]).all()
    assert rel(out[True], out[False]) <= STEP_TOL


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the Gluon step kernel is compiled-only (tests/test_kernels_sass.py "
                    "compiles it for sm_90a on any machine)")
@pytest.mark.parametrize("group,gamma,n,warps,cap", [
    (None, 2, 0, 1, None), (None, 2, 3, 1, None), (None, 3, PERIOD - 1, 1, None), (16, 2, 5, 1, None),
    (GROUP, 3, PERIOD - 1, 1, None), (None, 2, 0, 4, None), (None, 3, PERIOD - 1, 4, None), (16, 2, 5, 2, None),
    (GROUP, 3, 3, 2, 80), (None, 2, PERIOD - 1, 1, 96)])
def test_gluon_step_is_the_triton_step(group: int | None, gamma: int, n: int, warps: int, cap: int | None) -> None:
    """kernels.gluon_step against the Triton dots and record kernels on the same PACE-4 checkpoint, token and ``n``
    records, on one warp per head or split over ``warps`` (the value columns' code places), with a register ``cap``.
    ``o_t`` agrees to float32 rounding (exact products, fp32 sums in other orders: STEP_TOL), every entry
    written (the output poisoned first). The token's record: its log decay, key codes and key scale are equal (the
    same quantisation of the same ``k_t``: the range is a maximum, free of order, and the rest is correctly rounded);
    the value ``u_t`` agrees to float32 rounding, so its codes are equal except near a rounding boundary (at most
    one step apart: a code moves only where ``u / s`` lies within about ``127 STEP_TOL`` (< 0.01) of a rounding
    midpoint, so well over 98 % are equal) and its scale within an fp16 ulp. The reference is the Triton dots and
    record kernels (``gluon_dots`` off: no code shared with the kernel under test)."""
    packed_step = KERNELS["packed_step"]
    HV = H * gamma
    st0, _ = _states("pace-4", HV, group=group)
    _fill([st0], n)
    q, k, v, g, beta = _token(HV)
    out, rec = {}, {}
    for gluon in (True, False):
        st = copy.deepcopy(st0)
        plan = backend.TritonSteps(Launch.of(SplitSettings(gluon_step=gluon, fused_step=gluon, gluon_dots=gluon,
                                                           gluon_step_warps=warps, step_maxnreg=cap))).plan(st)
        assert plan.split.gluon_step == gluon
        out[gluon] = torch.full((B, HV, V), float("nan"))
        packed_step.launch_packed_step(plan, st.buffer, q, k, v, g, beta, out[gluon])
        rec[gluon] = {name: x[:, n] for name, x in st.buffer.storage().items()}
    assert torch.isfinite(out[True]).all()
    assert rel(out[True], out[False]) <= STEP_TOL
    for name in ("log_decays", "keys", "key_scale"):
        assert torch.equal(rec[True][name], rec[False][name]), name
    codes = (rec[True]["values"].int() - rec[False]["values"].int()).abs()
    assert codes.max() <= 1 and (codes == 0).float().mean() > 0.98
    assert rel(rec[True]["value_scale"].float(), rec[False]["value_scale"].float()) <= 2.0**-10


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the Gluon flush kernel is compiled-only (tests/test_kernels_sass.py "
                    "compiles it for sm_90a on any machine)")
@pytest.mark.parametrize("name,group,gamma,n,big,blocks,cap", [
    ("pace-4", None, 2, PERIOD, False, 1, None), ("pace-4", None, 3, 3, False, 1, None),
    ("pace-4", GROUP, 2, PERIOD, False, 1, None), ("pace-4", 16, 3, PERIOD, False, 1, None),
    ("pace-4", None, 2, 0, False, 1, None), ("pace-4", None, 2, PERIOD, True, 1, None),
    ("pace-4-8", None, 3, PERIOD, False, 1, None), ("pace-4-8", 16, 2, 5, False, 1, None),
    ("pace-4-8", 2 * GROUP, 2, PERIOD, False, 1, None), ("pace-4", None, 2, PERIOD, False, 2, None),
    ("pace-4", 16, 3, PERIOD, True, 8, 80), ("pace-4-8", None, 3, PERIOD, False, 4, 96)])
def test_gluon_flush_is_the_triton_flush(name: str, group: int | None, gamma: int, n: int, big: bool, blocks: int,
                                         cap: int | None) -> None:
    """kernels.gluon_flush against the Triton flush kernel on the same checkpoint and ``n`` records: PACE-4 (4-bit
    symmetric key groups of 16 to 64 rows, int8 records) and PACE-4/8's 4-bit heads (zero points, 4-bit keys in
    groups of 16 and bfloat16 values; the flush launched per bit width, the 8-bit heads on the Triton kernel in
    both). Both fold exact products with fp32 sums in other orders and requantise alike, so the checkpoints are equal
    except near a rounding boundary (:func:`_assert_within_one_step`, nearly every entry equal). ``big``: records of
    values near 1e6, so that the folded state overflows fp16 scales (clamped at 65504) and the symmetric codes take
    the clamp of the rare branch. ``blocks``: programs per head along the key rows (whole key groups), ``cap``: a
    register cap."""
    flush = KERNELS["flush"]
    HV = H * gamma
    st0, _ = _states(name, HV, group=group)
    _fill([st0], n, u_scale=3e5 if big else 0.5, decays=not big)
    out = {}
    for gluon in (True, False):
        st = copy.deepcopy(st0)
        plan = backend.TritonSteps(Launch.of(SplitSettings(gluon_flush=gluon, per_part=True, flush_row_blocks=blocks,
                                                           flush_maxnreg=cap))).plan(st)
        assert any(launch.gluon_flush for launch in plan.split.launches[True]) == gluon
        flush.launch_flush(plan, st.buffer)
        out[gluon] = st.checkpoint
    if big:  # the clamp was needed: some scales at fp16's largest
        assert (out[False].scale == 65504).any()
    _assert_within_one_step(out[True], out[False])


@pytest.mark.parametrize("name,per_part", [("pace-4", True), ("pace-4-8", True), ("pace-4-8", False)])
def test_the_flush_folds_alike_at_every_column_width(name: str, per_part: bool) -> None:
    """The Triton flush with fewer value columns per program (``flush_columns``: more programs per head) against the
    widest on the same checkpoint and full buffer: the same products and sums per entry, so the checkpoints are equal
    but near a rounding boundary. PACE-4/8 (zero points, key records in groups narrower than a tile) launched once
    per bit width and once over both; on the GPU its narrower launches are refused (they folded wrong there:
    kernels.plan.check_flush_tile)."""
    flush = KERNELS["flush"]
    st0, _ = _states(name, 2 * H)
    _fill([st0], PERIOD)
    out = {}
    for columns in (V, V // 2, V // 4):
        st = copy.deepcopy(st0)
        launch = Launch.of(SplitSettings(gluon_flush=False, per_part=per_part, flush_columns=columns))
        try:
            plan = backend.TritonSteps(launch).plan(st)
        except PaceError as refused:  # kernels.plan.check_flush_tile: these folded wrong on the GPU
            assert DEVICE.type == "cuda" and name == "pace-4-8" and columns < V, refused
            continue
        flush.launch_flush(plan, st.buffer)
        out[columns] = st.checkpoint
    for columns in set(out) - {V}:
        _assert_within_one_step(out[columns], out[V])


KERNEL_RESIDENT = {**{name: name for name in ("fp32", "bf16", "rtn-int3", "rtn-int4", "rtn-int8", "pace-3", "pace-4",
                                                "pace-4-8")},
                   "pace-3-8": get_config("pace-4-8").replace(name="pace-3-8", bits=3)}
"""The configurations (names or PaceConfigs) whose store on the kernels is counted (PACE-4/8 at 3 bits: two widths
of which one is 3-bit)."""


@pytest.mark.parametrize("name", KERNEL_RESIDENT)
def test_kernel_path_holds_the_accounted_bytes(name):
    """The Triton backend's store (kernels.backend.TritonSteps: its launch plans, packed checkpoints updated in
    place, records written by the kernels; interpreted here, compiled on CUDA in the GPU check) holds after a
    prefill and decode exactly what
    pace_core.accounting.state_bytes counts; the launch plans' head tables are process-wide (kernels.plan's
    table per head layout, shared by every layer and store of it) and their scratch is not any store's."""
    from test_state_store import RESIDENT_SHAPE, resident_store

    from pace_core.accounting import state_bytes
    from pace_core.memory import held_bytes, held_storages

    store = resident_store(KERNEL_RESIDENT[name], "triton", DEVICE)
    assert all(store.layer(layer).uses_kernels() for layer in store.layers)
    tables = set(held_storages(plan_mod._TABLES))
    assert held_bytes(store, skip=tables) == state_bytes(store.cfg, RESIDENT_SHAPE, store.batch) == store.nbytes()
