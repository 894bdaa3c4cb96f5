"""Tests of pace_core.quant against an independent numpy reference of PACE_SPEC §2."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pace_core.errors import PaceError
from pace_core.quant import (
    QuantSpec,
    all_finite,
    dequantize,
    fake_quantize,
    group_ranges,
    pack_codes,
    packed_nbytes,
    quantize,
    quantize_heads,
    unpack_codes,
)

pytestmark = pytest.mark.numerics

F16_TINY = 2.0**-14
F16_MAX = 65504.0
PROPERTY = settings(max_examples=60, deadline=None)


def ref_quantize(x: np.ndarray, bits: int, symmetric: bool, axis: str, g: int):
    """numpy reference: codes (unsigned) [..., K, V], fp16 scales, zero points or None, dequant (float64).

    Groups are formed on the last axis of a view (the key axis is swapped to the end first).
    Working precision: float64 for float64 data, else float32; amax / qmax in float32.
    """
    work = np.float64 if x.dtype == np.float64 else np.float32
    xs = np.swapaxes(x.astype(work), -1, -2) if axis == "key" else x.astype(work)
    *lead, rows, cols = xs.shape
    grp = xs.reshape(*lead, rows, cols // g, g)

    def fp16(ratio, nonzero):
        clipped = np.clip(ratio.astype(np.float32), np.float32(F16_TINY), np.float32(F16_MAX))
        return np.where(nonzero, clipped, np.float32(0)).astype(np.float16)

    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        amax = np.abs(grp).max(-1)
        s = fp16(amax.astype(np.float32) / np.float32(qmax), amax > 0)
        div = np.where(s == 0, np.float16(1), s).astype(work)[..., None]
        q = np.clip(np.round(grp / div), -qmax, qmax)
        codes, z, deq = q + qmax + 1, None, q * s.astype(np.float64)[..., None]
    else:
        top = 2**bits - 1
        lo, hi = np.minimum(grp.min(-1), 0), np.maximum(grp.max(-1), 0)
        s = fp16((hi.astype(np.float32) - lo.astype(np.float32)) / np.float32(top), hi > lo)
        div = np.where(s == 0, np.float16(1), s).astype(work)
        z = np.clip(np.round(-lo / div), 0, top)
        codes = np.clip(np.round(grp / div[..., None]) + z[..., None], 0, top)
        deq = (codes - z[..., None]) * s.astype(np.float64)[..., None]

    def back(t):
        t = t.reshape(*lead, rows, cols)
        return np.swapaxes(t, -1, -2) if axis == "key" else t

    def meta(t):
        return None if t is None else (np.swapaxes(t, -1, -2) if axis == "key" else t)

    return back(codes).astype(np.int64), meta(s), meta(z), back(deq)


def _zero_codes(p) -> torch.Tensor:
    return unpack_codes(p.zero, p.spec.bits, p.scale.shape[-1])


def ref_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """numpy reference of the dense packing: each row's codes as one little-endian bit string, ``bits`` bits per
    code, LSB first, cut into bytes (the last one padded with zero bits)."""
    stream = np.unpackbits(codes.astype(np.uint8)[..., None], axis=-1, bitorder="little")[..., :bits]
    stream = stream.reshape(*codes.shape[:-1], codes.shape[-1] * bits)
    return np.packbits(stream, axis=-1, bitorder="little")


def _state(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Random values with group magnitudes spread over decades and a few large columns."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = x * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=gen, dtype=torch.float64))
    x[..., 1] *= 40
    return x.to(dtype)


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("axis", ["key", "value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_matches_numpy_reference(bits, symmetric, axis, dtype):
    shape = (2, 3, 16, 24) if dtype == torch.float32 else (3, 8, 12)
    g = 8 if axis == "key" else 4
    x = _state(shape, seed=bits * 7 + symmetric, dtype=dtype)
    spec = QuantSpec(bits, symmetric, axis, g)
    p = quantize(x, spec)
    np_in = x.double().numpy() if dtype == torch.float64 else x.float().numpy()
    codes, scale, zero, deq = ref_quantize(np_in, bits, symmetric, axis, g)
    assert p.shape == shape and p.scale.dtype == torch.float16
    assert np.array_equal(unpack_codes(p.codes, bits, shape[-1]).numpy(), codes)
    assert np.array_equal(p.scale.numpy(), scale)
    if symmetric:
        assert p.zero is None
    else:
        assert np.array_equal(_zero_codes(p).numpy(), zero)
    assert np.array_equal(dequantize(p, torch.float64).numpy(), deq)
    assert torch.equal(dequantize(p), torch.from_numpy(deq).float())


def test_two_dim_input_and_scale_shapes():
    x = _state((8, 6), seed=1)
    assert quantize(x, QuantSpec(4, True, "key", 4)).scale.shape == (2, 6)
    assert quantize(x, QuantSpec(4, False, "value", 3)).scale.shape == (8, 2)
    assert quantize(x, QuantSpec(4, True, "value", 6)).codes.shape == (8, 3)
    assert quantize(x, QuantSpec(6, True, "value", 6)).codes.shape == (8, 5)  # 36 bits in 5 bytes
    assert quantize(x, QuantSpec(8, True, "value", 6)).codes.shape == (8, 6)


def test_round_half_to_even():
    # 4-bit symmetric, amax 7 -> scale exactly 1: ties go to the even integer.
    x = torch.tensor([[7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5]])
    deq = fake_quantize(x, QuantSpec(4, True, "value", 8))
    assert deq.tolist() == [[7.0, 0.0, 2.0, 2.0, 0.0, -2.0, -2.0, 4.0]]
    # zero point, 2 bits: range [-1.5, 1.5] -> scale 1, z = round(1.5) = 2.
    p = quantize(torch.tensor([[-1.5, 0.5, 1.5, -0.5]]), QuantSpec(2, False, "value", 4))
    assert p.scale.item() == 1.0 and _zero_codes(p).item() == 2
    assert dequantize(p).tolist() == [[-2.0, 0.0, 1.0, 0.0]]


@st.composite
def cases(draw, lo=-1e4, hi=1e4, dtype=np.float32):
    bits = draw(st.integers(2, 8))
    symmetric = draw(st.booleans())
    axis = draw(st.sampled_from(["key", "value"]))
    k, v = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    n = k if axis == "key" else v
    g = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    width = 64 if dtype == np.float64 else 32
    lo, hi = float(dtype(lo)), float(dtype(hi))  # bounds exactly representable at this width
    x = draw(arrays(dtype, (2, k, v), elements=st.floats(lo, hi, width=width, allow_subnormal=True)))
    return torch.from_numpy(x), QuantSpec(bits, symmetric, axis, g)


def _scale_per_element(p) -> torch.Tensor:
    g = p.spec.group_size
    s = p.scale.double()
    return s.repeat_interleave(g, dim=-2) if p.spec.axis == "key" else s.repeat_interleave(g, dim=-1)


def _bound(p) -> torch.Tensor:
    """Documented per-element error bound."""
    s = _scale_per_element(p)
    if p.spec.symmetric:
        return s / 2
    return s * (0.5 + 1.001 * p.spec.levels * 2.0**-11)


@PROPERTY
@given(cases())
def test_error_bound(case):
    x, spec = case
    p = quantize(x, spec)
    err = (dequantize(p, torch.float64) - x.double()).abs()
    assert bool((err <= _bound(p)).all())


@PROPERTY
@given(cases(dtype=np.float64))
def test_error_bound_float64_input(case):
    x, spec = case
    p = quantize(x, spec)
    assert bool(((dequantize(p, torch.float64) - x).abs() <= _bound(p)).all())


@PROPERTY
@given(cases(), st.floats(-1e4, 1e4, width=32), st.booleans())
def test_zero_and_constant_groups(case, c, all_zero):
    x, spec = case
    fill = 0.0 if all_zero else c
    x = torch.full_like(x, fill)
    p = quantize(x, spec)
    deq = dequantize(p, torch.float64)
    assert not bool(deq.isnan().any())
    if fill == 0.0:
        assert bool((p.scale == 0).all()) and bool((deq == 0).all())
    else:
        assert bool(((deq - x.double()).abs() <= _bound(p)).all())


@PROPERTY
@given(cases(lo=-1e-6, hi=1e-6))
def test_tiny_values(case):
    x, spec = case
    p = quantize(x, spec)
    deq = dequantize(p, torch.float64)
    nonzero = p.scale != 0
    assert bool((p.scale[nonzero] == F16_TINY).all())  # clamped up to fp16's smallest normal
    assert bool(((deq - x.double()).abs() <= _bound(p)).all())


@PROPERTY
@given(cases(lo=-3e38, hi=3e38))
def test_huge_values_are_refused_not_saturated(case):
    """A group whose fp16 scale would exceed 65504 is refused (a PaceError naming the group, nothing
    stored); when every group fits, the values come back within the per-element bound."""
    x, spec = case
    g = spec.group_size
    *lead, k, v = x.shape
    xg = x.reshape(*lead, k // g, g, v) if spec.axis == "key" else x.reshape(*lead, k, v // g, g)
    dim = -2 if spec.axis == "key" else -1
    if spec.symmetric:
        ratio = xg.abs().amax(dim).float() / torch.tensor(float(spec.qmax))
    else:
        ratio = (xg.amax(dim).clamp(min=0).float() - xg.amin(dim).clamp(max=0).float()) / torch.tensor(
            float(spec.levels)
        )
    if bool((ratio > F16_MAX).any()):
        with pytest.raises(PaceError, match="fp16 scale overflows"):
            quantize(x, spec, name="state")
        return
    p = quantize(x, spec)
    deq = dequantize(p, torch.float64)
    assert bool(deq.isfinite().all()) and bool(((deq - x.double()).abs() <= _bound(p)).all())


@pytest.mark.parametrize("bits", range(2, 9))
@PROPERTY
@given(arrays(np.int64, st.tuples(st.integers(1, 3), st.integers(1, 19)), elements=st.integers(0, 255)))
def test_pack_unpack_round_trip(bits, codes):
    """Every width packs densely, a row padded only to a whole byte, as the numpy bit-string reference does."""
    codes = torch.from_numpy(codes % 2**bits)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape[-1] == math.ceil(codes.shape[-1] * bits / 8)
    assert np.array_equal(packed.numpy(), ref_pack(codes.numpy(), bits))
    assert torch.equal(unpack_codes(packed, bits, codes.shape[-1]).long(), codes)


@PROPERTY
@given(cases())
def test_stored_codes_and_zero_points_round_trip(case):
    """For every width, group size, axis, symmetric or zero point: the stored codes and zero points are the
    reference's packed densely (rows of whole bytes), and unpacking and packing them again gives the same bytes."""
    x, spec = case
    p = quantize(x, spec)
    codes, _, zero, _ = ref_quantize(x.numpy(), spec.bits, spec.symmetric, spec.axis, spec.group_size)
    assert np.array_equal(p.codes.numpy(), ref_pack(codes, spec.bits))
    assert torch.equal(pack_codes(unpack_codes(p.codes, spec.bits, x.shape[-1]), spec.bits), p.codes)
    if not spec.symmetric:
        assert np.array_equal(p.zero.numpy(), ref_pack(zero.astype(np.int64), spec.bits))
        assert torch.equal(pack_codes(_zero_codes(p), spec.bits), p.zero)


def test_pack_layout():
    assert pack_codes(torch.tensor([1, 2, 15, 0, 7]), 4).tolist() == [0x21, 0x0F, 0x07]
    assert pack_codes(torch.tensor([200, 3]), 8).tolist() == [200, 3]
    # 3 bits: codes 1..7, 0 in one 24-bit word 1 | 2 << 3 | ... | 7 << 18 = 0x1F58D1, low byte first
    assert pack_codes(torch.tensor([1, 2, 3, 4, 5, 6, 7, 0]), 3).tolist() == [0xD1, 0x58, 0x1F]
    assert pack_codes(torch.tensor([1, 2, 3]), 3).tolist() == [0xD1, 0x00]  # 9 bits: two bytes
    # 6 bits: 1 | 2 << 6 | 3 << 12 | 4 << 18 = 0x103081
    assert pack_codes(torch.tensor([1, 2, 3, 4], dtype=torch.uint8), 6).tolist() == [0x81, 0x30, 0x10]
    assert pack_codes(torch.tensor([3, 0, 1, 2, 3]), 2).tolist() == [0b10010011, 0b11]
    assert pack_codes(torch.tensor([31, 1]), 5).tolist() == [0x3F, 0x00]
    assert pack_codes(torch.tensor([127, 127]), 7).tolist() == [0xFF, 0x3F]


@PROPERTY
@given(cases(), st.sampled_from([torch.float32, torch.float64]))
def test_fake_quantize_bit_identical(case, dtype):
    x, spec = case
    x = x.to(dtype)
    fake = fake_quantize(x, spec)
    assert fake.dtype == dtype
    assert torch.equal(fake, dequantize(quantize(x, spec), dtype))
    assert torch.equal(fake_quantize(x, spec, torch.float32), dequantize(quantize(x, spec)))


def _real_bytes(p) -> int:
    return sum(t.numel() * t.element_size() for t in (p.codes, p.scale, p.zero) if t is not None)


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("axis,shape,g", [("key", (2, 3, 32, 16), 8), ("value", (2, 3, 32, 16), 8),
                                          ("value", (1, 2, 8, 9), 3), ("key", (3, 4, 5), 4)])
def test_nbytes_is_real(bits, symmetric, axis, shape, g):
    spec = QuantSpec(bits, symmetric, axis, g)
    p = quantize(_state(shape, seed=bits), spec)
    assert p.nbytes() == _real_bytes(p) == packed_nbytes(shape, spec)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("axis", ["key", "value"])
@pytest.mark.parametrize("b", range(2, 9))
def test_nbytes_formula(symmetric, axis, b):
    """b bits per code and per zero point, 16 per scale; a row of zero points padded to a whole byte (value axis:
    4 per row, so 3, 5 and 7 bits pad 4 bits a row)."""
    g, (batch, hv, k, v) = 32, (2, 4, 128, 128)
    p = quantize(_state((batch, hv, k, v), seed=3), QuantSpec(b, symmetric, axis, g))
    n_scales = batch * hv * k * v // g
    per_row = v if axis == "key" else v // g
    zero = n_scales // per_row * math.ceil(per_row * b / 8)
    expected = batch * hv * k * v * b // 8 + n_scales * 2 + (0 if symmetric else zero)
    assert p.nbytes() == expected == packed_nbytes((batch, hv, k, v), QuantSpec(b, symmetric, axis, g))


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("g", [16, 32, 64])
@pytest.mark.parametrize("symmetric", [True, False])
def test_key_axis_beats_value_axis_on_outlier_columns(bits, g, symmetric):
    """Four value channels 30x larger. Measured: the key axis wins from 4 bits on; at 2-3 bits the
    coarse key-axis step on the outlier columns themselves costs more than it saves."""
    gen = torch.Generator().manual_seed(bits * g)
    x = torch.randn(2, 4, 128, 128, generator=gen)
    x[..., torch.randperm(128, generator=gen)[:4]] *= 30.0
    err = {}
    for axis in ("key", "value"):
        err[axis] = (fake_quantize(x, QuantSpec(bits, symmetric, axis, g)) - x).square().sum().item()
    assert err["key"] < err["value"]


def test_bad_bits():
    for bits in (1, 9, 4.0, True):
        with pytest.raises(PaceError, match=r"bits=.*allowed: integers 2\.\.8"):
            QuantSpec(bits, True, "key", 32)
        with pytest.raises(PaceError, match=r"bits=.*allowed: integers 2\.\.8"):
            pack_codes(torch.zeros(4, dtype=torch.uint8), bits)


def test_bad_spec_fields():
    with pytest.raises(PaceError, match=r"axis='row'.*allowed: 'key', 'value'"):
        QuantSpec(4, True, "row", 32)
    with pytest.raises(PaceError, match=r"group_size=0.*allowed: a positive integer"):
        QuantSpec(4, True, "key", 0)
    with pytest.raises(PaceError, match=r"symmetric=1.*allowed: True, False"):
        QuantSpec(4, 1, "key", 32)


def test_group_size_not_dividing():
    x = torch.zeros(2, 128, 96)
    with pytest.raises(PaceError, match=r"group_size=48 does not divide the key axis of state \(length 128\); "
                                        r"allowed: 1, 2, 4, 8, 16, 32, 64, 128"):
        quantize(x, QuantSpec(4, True, "key", 48), name="state")
    with pytest.raises(
        PaceError, match=r"group_size=64 .* value axis .*allowed: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96"
    ):
        fake_quantize(x, QuantSpec(4, True, "value", 64))
    with pytest.raises(PaceError, match="group_size=5"):
        packed_nbytes((128, 96), QuantSpec(4, True, "key", 5))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input(bad):
    x = torch.randn(2, 8, 8)
    x[1, 3, 5] = bad
    with pytest.raises(PaceError, match=r"layer 3 state has 1 non-finite value\(s\).*allowed: finite values"):
        quantize(x, QuantSpec(4, True, "key", 8), name="layer 3 state")
    with pytest.raises(PaceError, match="non-finite"):
        fake_quantize(x, QuantSpec(4, False, "value", 8))


def test_bad_tensors_and_codes():
    with pytest.raises(PaceError, match=r"must be a floating-point tensor \[\.\.\., K, V\]"):
        quantize(torch.zeros(8, dtype=torch.int32).view(2, 4), QuantSpec(4, True, "key", 2))
    with pytest.raises(PaceError, match=r"must be a floating-point tensor"):
        quantize(torch.zeros(8), QuantSpec(4, True, "key", 2))
    with pytest.raises(PaceError, match=r"outside \[0, 15\].*allowed: integers 0\.\.15"):
        pack_codes(torch.tensor([3, 16]), 4)
    with pytest.raises(PaceError, match=r"last_dim=4 does not match"):
        unpack_codes(torch.zeros(3, dtype=torch.uint8), 4, 4)
    with pytest.raises(PaceError, match=r"allowed: torch.uint8"):
        unpack_codes(torch.zeros(3, dtype=torch.int64), 4, 6)


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_heads_mixed(symmetric):
    S = _state((2, 5, 16, 8), seed=11)
    bits = [4, 8, 4, 2, 8]
    spec = QuantSpec(4, symmetric, "key", 8)
    mixed = quantize_heads(S, torch.tensor(bits), spec)
    assert sorted(mixed.parts) == [2, 4, 8]
    assert mixed.heads[4].tolist() == [0, 2] and mixed.heads[8].tolist() == [1, 4]
    deq = mixed.dequantize()
    for h, b in enumerate(bits):
        expected = fake_quantize(S[:, h], QuantSpec(b, symmetric, "key", 8))
        assert torch.equal(deq[:, h], expected)
    assert mixed.nbytes() == 2 * 5 + sum(
        packed_nbytes((2, len(mixed.heads[b]), 16, 8), QuantSpec(b, symmetric, "key", 8)) for b in (2, 4, 8)
    )
    assert torch.equal(
        quantize_heads(S, [4] * 5, spec).dequantize(torch.float64), fake_quantize(S, spec, torch.float64)
    )


def test_quantize_heads_bad_input():
    S = torch.zeros(1, 3, 8, 8)
    with pytest.raises(PaceError, match=r"bits_per_head has 2 entries; allowed: one per value head \(3\)"):
        quantize_heads(S, [4, 8], QuantSpec(4, True, "key", 8))
    with pytest.raises(PaceError, match=r"bits_per_head=16 .*allowed: integers 2\.\.8"):
        quantize_heads(S, [4, 16, 4], QuantSpec(4, True, "key", 8))


def test_fractional_widths_no_heads_and_no_states_are_refused():
    """Before: 4.5 bits were truncated to 4 (a float tensor of widths too), a state without value heads and ranges of
    no states raised StopIteration and IndexError."""
    spec = QuantSpec(4, True, "key", 8)
    S = _state((1, 2, 16, 8), seed=3)
    for widths in ([4.5, 4], [4, 7.9], torch.tensor([4.0, 8.0])):
        with pytest.raises(PaceError, match=r"bits_per_head holds .*; allowed: integers 2\.\.8"):
            quantize_heads(S, widths, spec)
    assert torch.equal(quantize_heads(S, torch.tensor([4, 8]), spec).dequantize(),
                       quantize_heads(S, [4, 8], spec).dequantize())
    with pytest.raises(PaceError, match="at least one value head"):
        quantize_heads(torch.empty(1, 0, 16, 8), [], spec)
    with pytest.raises(PaceError, match="at least one state"):
        group_ranges(torch.empty(0, 16, 8), spec)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cuda_matches_cpu(symmetric, dtype):
    x = _state((4, 8, 128, 128), seed=5, dtype=dtype)
    for bits in range(2, 9):
        for axis in ("key", "value"):
            spec = QuantSpec(bits, symmetric, axis, 32)
            cpu, gpu = quantize(x, spec), quantize(x.cuda(), spec)
            assert torch.equal(gpu.codes.cpu(), cpu.codes) and torch.equal(gpu.scale.cpu(), cpu.scale)
            assert torch.equal(dequantize(gpu).cpu(), dequantize(cpu))
            assert torch.equal(fake_quantize(x.cuda(), spec).cpu(), fake_quantize(x, spec))


def test_all_finite_finds_any_nan_or_inf_and_no_false_alarm_at_float32_max():
    """One non-finite entry anywhere in any of the tensors (NaN, +inf, -inf, or +inf and -inf that would cancel
    in a float32 sum) is found; tensors full of float32's largest values, whose float32 sum would overflow,
    are finite."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    shapes = [(3, 5, 7), (4, 9), (11,)]
    base = [torch.randn(s, generator=g) for s in shapes]
    assert all_finite(*base)
    big = torch.finfo(torch.float32).max
    assert all_finite(
        torch.full((1000,), big),
        torch.full((10,), -big),
        torch.full((7, 3), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16),
    )
    for bad in (float("nan"), float("inf"), -float("inf")):
        for which in range(len(base)):
            poisoned = [t.clone() for t in base]
            flat = poisoned[which].view(-1)
            flat[int(torch.randint(0, flat.numel(), (1,), generator=g))] = bad
            assert not all_finite(*poisoned)
    both = base[0].clone().view(-1)
    both[0], both[1] = float("inf"), -float("inf")
    assert not all_finite(both)
