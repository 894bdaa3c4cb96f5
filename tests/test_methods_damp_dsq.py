"""Tests of the quantisers of pace_core.methods.dsq (Q-Mamba DSQ) and pace_core.methods.damp (DAMP) against
independent numpy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from test_quant import F16_MAX, F16_TINY, ref_quantize

from pace_core.checkpoint import hadamard
from pace_core.errors import PaceError
from pace_core.methods.damp import DampQuantizer, rank_outlier_rows
from pace_core.methods.dsq import dsq_dequantize, dsq_quantize, dsq_quantize_with_values
from pace_core.quant import QuantSpec, fake_quantize, unpack_codes

pytestmark = pytest.mark.numerics


def ref_dsq(x: np.ndarray, bits: int):
    """numpy DSQ reference: (signed codes, row scales fp16, column scales fp16, dequant float64)."""
    work = np.float64 if x.dtype == np.float64 else np.float32
    xw = x.astype(work)
    qmax = 2 ** (bits - 1) - 1

    def fp16(ratio, nonzero):
        clipped = np.clip(ratio.astype(np.float32), np.float32(F16_TINY), np.float32(F16_MAX))
        return np.where(nonzero, clipped, np.float32(0)).astype(np.float16)

    row_amax = np.abs(xw).max(-1)
    r = fp16(row_amax, row_amax > 0)
    r_div = np.where(r == 0, np.float16(1), r).astype(work)
    col_amax = np.abs(xw / r_div[..., :, None]).max(-2)
    c = fp16(col_amax.astype(np.float32) / np.float32(qmax), col_amax > 0)
    step = r.astype(work)[..., :, None] * c.astype(work)[..., None, :]
    q = np.clip(np.round(xw / np.where(step == 0, 1, step).astype(work)), -qmax, qmax)
    return q, r, c, q * r.astype(np.float64)[..., :, None] * c.astype(np.float64)[..., None, :]


def _state(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = x * torch.exp(torch.randn(*shape[:-2], shape[-2], 1, generator=gen, dtype=torch.float64))
    return x.to(dtype)


# ---------------------------------------------------------------- DSQ


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dsq_matches_reference(bits, dtype):
    x = _state((2, 3, 16, 12), seed=bits, dtype=dtype)
    x[0, 1, 4] = 0.0  # an all-zero row
    x[1, 2, :, 5] = 0.0  # an all-zero column
    t = dsq_quantize(x, bits)
    q, r, c, deq = ref_dsq(x.double().numpy() if dtype == torch.float64 else x.float().numpy(), bits)
    assert t.row_scale.dtype == t.col_scale.dtype == torch.float16
    assert np.array_equal(t.row_scale.numpy(), r) and np.array_equal(t.col_scale.numpy(), c)
    assert np.array_equal(unpack_codes(t.codes, bits, 12).numpy().astype(np.int64) - 2 ** (bits - 1), q)
    assert np.array_equal(dsq_dequantize(t, torch.float64).numpy(), deq)
    assert torch.equal(dsq_dequantize(t), torch.from_numpy(deq).float())
    assert bool((dsq_dequantize(t)[0, 1, 4] == 0).all()) and bool((dsq_dequantize(t)[1, 2, :, 5] == 0).all())
    # with its values: the same codes and scales, the values dequantize's (elementwise code x step: exact)
    t2, values = dsq_quantize_with_values(x, bits)
    assert torch.equal(t2.codes, t.codes) and torch.equal(t2.row_scale, t.row_scale)
    assert values.dtype == torch.float32 and torch.equal(values, dsq_dequantize(t))


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.sampled_from([1e-6, 1.0, 1e4, 3e38]),
       arrays(np.float32, st.tuples(st.integers(1, 8), st.integers(1, 8)),
              elements=st.floats(-1.0, 1.0, width=32)))
def test_dsq_error_bound(bits, magnitude, x):
    """Within half a step wherever the rows' fp16 scales fit; a row whose max |x| exceeds 65504 is refused."""
    x = torch.from_numpy(x) * magnitude
    if bool((x.abs().amax(-1) > F16_MAX).any()):
        with pytest.raises(PaceError, match="row scale overflows fp16"):
            dsq_quantize(x, bits)
        return
    t = dsq_quantize(x, bits)
    deq = dsq_dequantize(t, torch.float64)
    step = t.row_scale.double()[:, None] * t.col_scale.double()[None, :]
    assert bool(deq.isfinite().all())
    assert bool(((deq - x.double()).abs() <= step * (0.5 + 2.0**-16)).all())


def test_dsq_nbytes_and_errors():
    t = dsq_quantize(_state((2, 4, 128, 128), seed=1), 4)
    real = sum(v.numel() * v.element_size() for v in (t.codes, t.row_scale, t.col_scale))
    assert t.nbytes() == real == 2 * 4 * (128 * 128 * 4 // 8 + 128 * 2 + 128 * 2)
    assert dsq_quantize(_state((5, 7), seed=2), 8).nbytes() == 35 + 10 + 14
    with pytest.raises(PaceError, match=r"bits=9 .*allowed: integers 2\.\.8"):
        dsq_quantize(torch.ones(4, 4), 9)
    with pytest.raises(PaceError, match=r"state has 1 non-finite"):
        dsq_quantize(torch.tensor([[1.0, float("nan")]]))


# ---------------------------------------------------------------- Hadamard


@pytest.mark.parametrize("n", [1, 2, 8, 32, 128])
def test_hadamard_orthonormal(n):
    h = hadamard(n)
    ref = np.ones((1, 1))
    while ref.shape[0] < n:
        ref = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), ref)
    assert np.allclose(h.numpy(), ref / np.sqrt(n), rtol=0, atol=1e-16)
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-14)
    x = torch.randn(3, n, dtype=torch.float64)
    assert torch.allclose(x @ h @ h, x, rtol=0, atol=1e-13)


@pytest.mark.parametrize("n", [0, 3, 96, 2.0])
def test_hadamard_bad_size(n):
    with pytest.raises(PaceError, match=r"allowed: powers of two"):
        hadamard(n)


# ---------------------------------------------------------------- DAMP


def _rows(hv: int, k: int, r: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(k, generator=gen)[:r] for _ in range(hv)])


def _ref_rest(x: np.ndarray, rows: np.ndarray, bits: int, g: int, use_hadamard: bool) -> np.ndarray:
    """Reference dequantisation of the non-outlier rows, written per head with a Kronecker Hadamard."""
    *lead, hv, k, v = x.shape
    h = np.ones((1, 1))
    while h.shape[0] < v:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    h = h / np.sqrt(v)
    out = np.empty(x.shape)
    for head in range(hv):
        rest = np.setdiff1d(np.arange(k), rows[head])
        y = x[..., head, rest, :].astype(np.float64)
        if use_hadamard:
            y = y @ h
        deq = ref_quantize(y if use_hadamard else x[..., head, rest, :], bits, True, "value", g)[3]
        out[..., head, rest, :] = deq @ h if use_hadamard else deq
    return out


@pytest.mark.parametrize("bits", [4, 8, 3])
@pytest.mark.parametrize("use_hadamard", [True, False])
def test_damp_matches_reference(bits, use_hadamard):
    hv, k, v, r = 3, 16, 64, 4
    x = _state((2, hv, k, v), seed=bits)
    rows = _rows(hv, k, r, seed=bits)
    quantizer = DampQuantizer(rows, bits, hadamard=use_hadamard)
    t = quantizer.quantize(x)
    deq = quantizer.dequantize(t, torch.float64)
    heads = torch.arange(hv)[:, None]
    # outlier rows are exact to fp16
    assert t.outliers.dtype == torch.float16
    assert torch.equal(deq[:, heads, rows], x[:, heads, rows].half().double())
    assert torch.equal(quantizer.dequantize(t)[:, heads, rows], x[:, heads, rows].half().float())
    # with its values: the stored tensor and dequantize's float32 state (same operations on the same codes)
    t2, values = quantizer.quantize_with_values(x)
    assert torch.equal(t2.rest.codes, t.rest.codes) and torch.equal(t2.outliers, t.outliers)
    assert values.dtype == torch.float32 and torch.equal(values, quantizer.dequantize(t))
    ref = _ref_rest(x.numpy(), rows.numpy(), bits, 32, use_hadamard)
    mask = torch.ones(hv, k, dtype=torch.bool)
    mask[heads, rows] = False
    rest_deq, rest_ref = deq.permute(1, 2, 0, 3)[mask], torch.from_numpy(ref).permute(1, 2, 0, 3)[mask]
    if use_hadamard:
        assert torch.allclose(rest_deq, rest_ref, rtol=0, atol=1e-12)
    else:
        assert torch.equal(rest_deq, rest_ref)


def test_damp_dequantizes_each_tensor_with_its_own_rows():
    """The quantiser keeps its row index per device and K (made once); a tensor quantised with other rows is
    dequantised with those, and a repeated call gives the same values (same code, same inputs: bit-equal)."""
    hv, k, v, r = 3, 16, 64, 4
    x = _state((2, hv, k, v), seed=11)
    a, b = DampQuantizer(_rows(hv, k, r, seed=1), 4), DampQuantizer(_rows(hv, k, r, seed=2), 4)
    ta, tb = a.quantize(x), b.quantize(x)
    assert not torch.equal(ta.rows, tb.rows)
    assert torch.equal(b.dequantize(ta), a.dequantize(ta))
    assert torch.equal(a.dequantize(a.quantize(x)), a.dequantize(ta))
    heads = torch.arange(hv)[:, None]
    assert torch.equal(b.dequantize(ta)[:, heads, ta.rows.long()], x[:, heads, ta.rows.long()].half().float())


def test_damp_nbytes():
    b, hv, k, v, r, bits = 2, 4, 128, 128, 16, 4
    quantizer = DampQuantizer(_rows(hv, k, r, seed=0), bits)
    t = quantizer.quantize(_state((b, hv, k, v), seed=0))
    real = sum(x.numel() * x.element_size() for x in (t.outliers, t.rows, t.rest.codes, t.rest.scale))
    formula = b * hv * (r * v * 2 + (k - r) * v * bits // 8 + (k - r) * v // 32 * 2) + hv * r * 2
    assert t.nbytes() == real == quantizer.nbytes((b, hv, k, v)) == formula
    assert t.rest.zero is None and t.rows.dtype == torch.int16


def test_damp_outlier_rows_beyond_fp16_are_refused():
    x = torch.zeros(1, 1, 4, 32)
    x[0, 0, 2, 0] = 6e4
    quantizer = DampQuantizer(torch.tensor([[2]]), 8, hadamard=False)
    assert quantizer.dequantize(quantizer.quantize(x))[0, 0, 2, 0].item() == torch.tensor(6e4).half().item()
    x[0, 0, 2, 0] = 1e6
    with pytest.raises(PaceError, match="outlier row scale overflows fp16"):
        quantizer.quantize(x)


def test_damp_with_ranked_rows_beats_plain_int4():
    """Rows planted 100x larger are found by the ranking and removed from the INT4 error."""
    n, hv, k, v, r = 8, 2, 64, 64, 4
    states = torch.randn(n, hv, k, v, generator=torch.Generator().manual_seed(3))
    planted = _rows(hv, k, r, seed=3)
    states[:, torch.arange(hv)[:, None], planted] *= 100.0
    rows = rank_outlier_rows(states, torch.full((hv,), 0.9), r)
    assert torch.equal(rows.sort(1).values, planted.sort(1).values)
    damp = DampQuantizer(rows, 4)
    err_damp = (damp.dequantize(damp.quantize(states)) - states).square().sum()
    err_rtn = (fake_quantize(states, QuantSpec(4, True, "value", 32)) - states).square().sum()
    assert err_damp < err_rtn / 100


@pytest.mark.parametrize("use_hadamard", [True, False])
def test_rank_outlier_rows_matches_reference(use_hadamard):
    n, hv, k, v, r = 4, 3, 16, 32, 5
    states = _state((n, hv, k, v), seed=7)
    decays = torch.rand(hv, k, generator=torch.Generator().manual_seed(7))
    x = states.double().numpy()
    empty = np.empty((hv, 0), dtype=np.int64)
    err = ((_ref_rest(x, empty, 4, 16, use_hadamard) - x) ** 2).sum(-1).mean(0)
    score = err / (1 - decays.double().numpy() ** 2)
    expected = np.argsort(-score, axis=1, kind="stable")[:, :r]
    got = rank_outlier_rows(states, decays, r, bits=4, hadamard=use_hadamard, group_size=16)
    assert got.dtype == torch.long and np.array_equal(got.numpy(), expected)


def test_rank_outlier_rows_persistence_orders_equal_errors():
    """Two identical rows: the one with the larger decay persists longer and ranks first."""
    gen = torch.Generator().manual_seed(9)
    states = torch.randn(2, 1, 8, 32, generator=gen)
    states[:, :, 6] = states[:, :, 3] = 50 * torch.randn(2, 1, 32, generator=gen)
    decays = torch.full((1, 8), 0.5)
    assert rank_outlier_rows(states, decays, 2).tolist() == [[3, 6]]
    decays[0, 6] = 0.99
    assert rank_outlier_rows(states, decays, 2).tolist() == [[6, 3]]
    assert rank_outlier_rows(states, torch.tensor([1.0]), 2).tolist() == [[3, 6]]


def test_damp_bad_input():
    x = torch.randn(2, 3, 16, 64)
    with pytest.raises(PaceError, match=r"distinct non-negative row indices"):
        DampQuantizer(torch.tensor([[1, 1], [0, 2], [3, 4]]), 4)
    with pytest.raises(PaceError, match=r"integer tensor \[HV, r\]"):
        DampQuantizer(torch.zeros(3, 2), 4)
    with pytest.raises(PaceError, match=r"bits=1 .*allowed: integers 2\.\.8"):
        DampQuantizer(torch.zeros(3, 0, dtype=torch.long), 1)
    with pytest.raises(PaceError, match=r"out of range; allowed: 0\.\.15"):
        DampQuantizer(torch.tensor([[1], [16], [0]]), 4).quantize(x)
    with pytest.raises(PaceError, match=r"3 value heads but outlier_rows has 2"):
        DampQuantizer(torch.tensor([[1], [2]]), 4).quantize(x)
    with pytest.raises(PaceError, match=r"head dim\)=48 .*allowed: powers of two"):
        DampQuantizer(torch.tensor([[1], [2], [3]]), 4).quantize(torch.randn(2, 3, 16, 48))
    with pytest.raises(PaceError, match=r"group_size=32 does not divide the value axis"):
        DampQuantizer(torch.tensor([[1], [2], [3]]), 4, hadamard=False).quantize(torch.randn(2, 3, 16, 48))
    x[0, 0, 0, 0] = float("inf")
    with pytest.raises(PaceError, match=r"layer state has 1 non-finite"):
        DampQuantizer(torch.tensor([[1], [2], [3]]), 4).quantize(x, name="layer state")


def test_rank_outlier_rows_bad_input():
    states = torch.randn(2, 3, 8, 32)
    with pytest.raises(PaceError, match=r"r=9 .*allowed: integers 0\.\.8"):
        rank_outlier_rows(states, torch.rand(3), 9)
    with pytest.raises(PaceError, match=r"decays must have shape \[HV\]=\[3\] or \[HV, K\]=\[3, 8\]"):
        rank_outlier_rows(states, torch.rand(8), 2)
    with pytest.raises(PaceError, match=r"allowed: decays in \[0, 1\]"):
        rank_outlier_rows(states, torch.tensor([0.5, 1.5, 0.2]), 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    x = _state((4, 8, 128, 128), seed=5)
    for bits in (4, 8):
        cpu, gpu = dsq_quantize(x, bits), dsq_quantize(x.cuda(), bits)
        assert torch.equal(gpu.codes.cpu(), cpu.codes) and torch.equal(dsq_dequantize(gpu).cpu(), dsq_dequantize(cpu))
        rows = _rows(8, 128, 16, seed=bits)
        damp = DampQuantizer(rows, bits)
        deq_cpu = damp.dequantize(damp.quantize(x), torch.float64)
        deq_gpu = damp.dequantize(damp.quantize(x.cuda()), torch.float64).cpu()
        assert torch.allclose(deq_gpu, deq_cpu, rtol=0, atol=1e-12)
        ranked = rank_outlier_rows(x.cuda(), torch.rand(8).cuda(), 16)
        assert ranked.device.type == "cuda" and ranked.shape == (8, 16)


# ---------------------------------------------------------------- stochastic rounding (pace_core.methods: dsq, damp)


def _sides(q: torch.Tensor, y: torch.Tensor, qmax: int) -> bool:
    """Every signed code ``q`` is ``floor(y)`` or ``ceil(y)`` (clamped to ±qmax), and both sides occur."""
    lo, hi = y.floor().clamp(-qmax, qmax), y.ceil().clamp(-qmax, qmax)
    return bool(((q == lo) | (q == hi)).all()) and 0.2 < float((q == hi).double().mean()) < 0.8


def test_stochastic_rounding_of_dsq_and_damp_codes():
    """With a generator, DSQ's codes and DAMP's rest codes are ``floor(y + u)`` of their quotients ``y`` under the
    same scales as round to nearest (so one of the two sides), the fp16 outlier rows unchanged; the same seed gives
    the same codes. DSQ's mean over N roundings converges to x within 5 step / (2 √N) plus float32's ``y + u``
    rounding (2^-20 step) and a clamped code at ±qmax (the fp16 scales' rounding, 7 · 2^-10 step)."""
    x = _state((2, 3, 16, 32), seed=5)

    def gen(seed):
        return torch.Generator().manual_seed(seed)

    near = dsq_quantize(x, 4)
    t, values = dsq_quantize_with_values(x, 4, generator=gen(1))
    assert torch.equal(t.row_scale, near.row_scale) and torch.equal(t.col_scale, near.col_scale)
    assert torch.equal(values, dsq_dequantize(t))
    step = t.row_scale.double()[..., :, None] * t.col_scale.double()[..., None, :]
    assert _sides(unpack_codes(t.codes, 4, 32).double() - 8, x.double() / step, 7)
    assert torch.equal(dsq_quantize_with_values(x, 4, generator=gen(1))[0].codes, t.codes)
    assert not torch.equal(dsq_quantize_with_values(x, 4, generator=gen(2))[0].codes, t.codes)
    n, g = 2000, gen(3)
    mean = sum(dsq_quantize_with_values(x, 4, generator=g)[1].double() for _ in range(n)) / n
    assert float(((mean - x.double()).abs() / step).max()) <= 5 / (2 * n ** 0.5) + 2.0**-20 + 7 * 2.0**-10

    rows = _rows(3, 16, 4, seed=6)
    quantizer = DampQuantizer(rows, 4, hadamard=True)
    near = quantizer.quantize(x)
    t, values = quantizer.quantize_with_values(x, generator=gen(1))
    assert torch.equal(t.outliers, near.outliers) and torch.equal(t.rest.scale, near.rest.scale)
    assert torch.equal(values, quantizer.dequantize(t))
    keep = torch.ones(3, 16, dtype=torch.bool)
    keep[torch.arange(3)[:, None], rows] = False
    rest = torch.stack([x[:, h, keep[h]] for h in range(3)], 1).double() @ hadamard(32)
    s = t.rest.scale.double().repeat_interleave(32, -1)  # value-axis groups of 32
    assert _sides(unpack_codes(t.rest.codes, 4, 32).double() - 8, rest / s, 7)
    assert torch.equal(quantizer.quantize_with_values(x, generator=gen(1))[0].rest.codes, t.rest.codes)


def test_dsq_of_the_key_rotated_state():
    """DSQ with ``key_hadamard`` (pace_core.methods.dsq) stores DSQ of ``fl32(H S)`` (H along the key axis) and loads
    ``Hᵀ`` of its values: against the numpy DSQ reference on the rotated state, written with a Kronecker Hadamard,
    to one float32 rounding of the loaded value, DSQ's float32 rounding of each ``q · r · c`` carried through ``Hᵀ``
    (2^-24 of the terms' magnitudes) and the float64 sums' order (K · 2^-53 of them)."""
    from pace_core.config import get_config
    from pace_core.methods import state_format

    k = 16
    x = _state((2, 3, k, 32), seed=7)
    h = np.ones((1, 1))
    while h.shape[0] < k:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    h = h / np.sqrt(k)
    y = np.einsum("ij,bhjv->bhiv", h, x.double().numpy()).astype(np.float32)
    deq = ref_dsq(y, 4)[3]
    want = np.einsum("ji,bhjv->bhiv", h, deq)
    terms = np.einsum("ji,bhjv->bhiv", np.abs(h), np.abs(deq))
    fmt = state_format(get_config("qmamba-dsq").replace(key_hadamard=True), (4,) * 3)
    c, values = fmt.store_loaded(x)
    assert torch.equal(values, fmt.load(c))
    assert np.all(np.abs(values.double().numpy() - want) <= 2.0**-24 * (np.abs(want) + terms) + k * 2.0**-53 * terms)
