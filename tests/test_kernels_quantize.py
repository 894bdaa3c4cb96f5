"""kernels.quantize (Triton, run by the interpreter on CPU) against pace_core.quant: bit-identical
codes, fp16 scales, zero points and dequantised values; outputs poisoned before each launch."""

from __future__ import annotations

import pytest
import torch
from kernels_support import DEVICE, SIZES, kernel_modules

from pace_core import quant
from pace_core.backend import REFERENCE
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.methods import state_format

pytestmark = pytest.mark.numerics

KERNELS = kernel_modules()
qp = KERNELS["quantize"]
steps = KERNELS["backend"].TritonSteps()


def _state(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random state with column outliers, an all-zero group and a tiny-valued group."""
    x = torch.randn(shape) * (1 + 8 * (torch.rand(shape[-1]) > 0.85))
    x[..., 0, :8, :8] = 0
    x[..., -1, -8:, -8:] *= 1e-7
    return x.to(dtype)


def _poisoned_like(m: quant.MixedPackedState) -> quant.MixedPackedState:
    """Storage of m's layout filled with garbage: 0xAB bytes, NaN scales."""
    parts = {}
    for b, p in m.parts.items():
        parts[b] = quant.PackedTensor(
            torch.full_like(p.codes, 0xAB), torch.full_like(p.scale, float("nan")),
            None if p.zero is None else torch.full_like(p.zero, 0xAB), p.spec, p.shape)
    return quant.MixedPackedState(parts, m.heads, m.shape)


def _assert_packed_equal(a: quant.PackedTensor, b: quant.PackedTensor) -> None:
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scale.view(torch.int16), b.scale.view(torch.int16))
    assert (a.zero is None) == (b.zero is None)
    if a.zero is not None:
        assert torch.equal(a.zero, b.zero)
    assert a.shape == b.shape and a.spec == b.spec


KERNEL_CASES = [(axis, symmetric, bits) for axis in ("key", "value") for symmetric in (True, False)
                for bits in (3, 4, 8) if not (bits == 3 and axis == "value" and not symmetric)]
"""The layouts the kernels take: 3-, 4- and 8-bit codes (3-bit zero points along the key axis only)."""


@pytest.mark.parametrize("axis,symmetric,bits", KERNEL_CASES)
def test_quantize_matches_reference(axis: str, symmetric: bool, bits: int) -> None:
    spec = quant.QuantSpec(bits, symmetric, axis, SIZES["GROUP"])
    x = _state(SIZES["QUANT_SHAPE"])
    hv = x.shape[1]
    ref = quant.quantize(x, spec)
    got = qp.quantize(x, spec)
    _assert_packed_equal(got, ref)
    assert got.nbytes() == ref.nbytes() == quant.packed_nbytes(x.shape, spec)
    poisoned = torch.full(x.shape, float("nan"))
    deq = qp.dequantize_heads(qp.quantize_heads(x, [bits] * hv, spec), out=poisoned)
    assert torch.equal(deq, quant.dequantize(ref))
    assert torch.equal(qp.dequantize(ref), quant.dequantize(ref))


@pytest.mark.parametrize("axis,symmetric,group,low", [
    ("key", False, 1, 4), ("value", True, 2, 4), ("value", False, 1, 4), ("key", False, 1, 3), ("value", True, 1, 3)])
@pytest.mark.parametrize("gamma", [2, 3])
def test_per_head_bits_one_launch(axis: str, symmetric: bool, group: int, low: int, gamma: int) -> None:
    """PACE-4/8 (PACE-3/8): a quarter of the heads at 8 bits, the rest at 4 (3), in one launch (group in GROUP
    units)."""
    spec = quant.QuantSpec(low, symmetric, axis, group * SIZES["GROUP"])
    num_heads = 2 * gamma if SIZES["B"] == 2 else 16 * gamma
    x = _state((SIZES["B"], num_heads, *SIZES["QUANT_SHAPE"][2:]))
    bits = [8 if h % 4 == 1 else low for h in range(num_heads)]
    ref = quant.quantize_heads(x, bits, spec)
    out = _poisoned_like(ref)
    got = qp.quantize_heads(x, bits, spec, out=out)
    assert got.parts[low] is out.parts[low]
    for b in (low, 8):
        _assert_packed_equal(got.parts[b], ref.parts[b])
        assert torch.equal(got.heads[b], ref.heads[b])
    for dtype in (torch.float32, torch.bfloat16):
        poisoned = torch.full(x.shape, float("nan"), dtype=dtype)
        assert torch.equal(qp.dequantize_heads(got, dtype, out=poisoned), ref.dequantize(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input(dtype: torch.dtype) -> None:
    spec = quant.QuantSpec(4, False, "key", SIZES["GROUP"])
    x = _state((1, 2, *SIZES["QUANT_SHAPE"][2:]), dtype)
    _assert_packed_equal(qp.quantize(x, spec), quant.quantize(x, spec))


def test_tiny_groups_like_reference_and_huge_ones_refused() -> None:
    """A group of tiny values takes the smallest normal fp16 scale, as in the reference; a group whose
    scale would overflow fp16 is refused by both with a message naming it (nothing stored)."""
    spec = quant.QuantSpec(4, True, "value", 8)
    x = torch.randn(1, 1, 16, 16)
    x[0, 0, 1, :8] = 1e-12
    ref = quant.quantize(x, spec)
    _assert_packed_equal(qp.quantize(x, spec), ref)
    x[0, 0, 0, :8] = 1e9
    for quantize in (quant.quantize, qp.quantize):
        with pytest.raises(PaceError, match=r"overflows .*key row 0, value columns 0\.\.7.*1e\+09"):
            quantize(x, spec, name="state")


def _at_rounding_boundaries(shape: tuple[int, ...], bits: int, symmetric: bool, group: int) -> torch.Tensor:
    """A state ``[..., K, V]`` whose key-axis groups have an exact fp16 scale ``s`` (the first rows set
    the group's range: ``±qmax s``, or ``-z s`` and ``(levels - z) s``) and whose other values lie
    on a rounding boundary ``(m + 1/2) s`` exactly (a tie) or one float32 ulp either side."""
    *lead, K, V = shape
    gshape = (*lead, K // group, 1, V)
    s = (torch.rand(gshape) + 0.5).half().float()
    levels = (1 << bits) - 1
    if symmetric:
        lo = -torch.full(gshape, float((1 << (bits - 1)) - 1))
        hi = -lo
    else:
        lo = -torch.randint(1, levels, gshape).float()
        hi = lo + levels
    m = lo + torch.floor(torch.rand((*lead, K // group, group, V)) * (hi - lo))
    x = (m + 0.5) * s
    side = torch.randint(-1, 2, x.shape)
    x = torch.where(side > 0, torch.nextafter(x, x + 1), torch.where(side < 0, torch.nextafter(x, x - 1), x))
    x[..., 0:1, :] = hi * s
    x[..., 1:2, :] = lo * s
    return x.reshape(shape)


@pytest.mark.parametrize("axis,symmetric,bits", KERNEL_CASES)
def test_rounding_boundaries_match_reference(axis: str, symmetric: bool, bits: int) -> None:
    """Ties (rounded to even) and their float32 neighbours: the kernels divide through the group's
    reciprocal with an fma correction, which must round exactly as IEEE division."""
    shape = SIZES["QUANT_SHAPE"]
    spec = quant.QuantSpec(bits, symmetric, axis, SIZES["GROUP"])
    if axis == "key":
        x = _at_rounding_boundaries(shape, bits, symmetric, spec.group_size)
    else:
        x = _at_rounding_boundaries(
            (*shape[:-2], shape[-1], shape[-2]), bits, symmetric, spec.group_size
        ).mT.contiguous()
    ref = quant.quantize(x, spec)
    assert (ref.codes != quant.quantize(torch.nextafter(x, x + 1), spec).codes).any()  # values on boundaries
    _assert_packed_equal(qp.quantize(x, spec), ref)


def test_bad_inputs_raise() -> None:
    spec = quant.QuantSpec(4, True, "key", 8)
    with pytest.raises(PaceError, match="float64"):
        qp.quantize(torch.randn(1, 16, 16, dtype=torch.float64), spec)
    with pytest.raises(PaceError, match="powers of two"):
        qp.quantize(torch.randn(1, 24, 24), spec)
    bad = torch.randn(1, 16, 16)
    bad[0, 3, 3] = float("inf")
    with pytest.raises(PaceError, match="non-finite"):
        qp.quantize(bad, spec)
    with pytest.raises(PaceError, match="at most 2"):
        qp.quantize_heads(torch.randn(1, 3, 16, 16), [3, 4, 8], spec)


@pytest.mark.parametrize("bits", [2, 5, 6, 7])
def test_other_widths_are_refused_with_the_reason(bits: int) -> None:
    """Densely packed 2-, 5-, 6- and 7-bit codes have no kernel: the kernels refuse them saying why, and a layer of
    such a configuration runs on the PyTorch reference (kernels.backend.TritonSteps.refusal)."""
    spec = quant.QuantSpec(bits, True, "key", 8)
    with pytest.raises(PaceError, match=rf"bits={bits} is not supported by the Triton kernels; allowed: 3, 4, 8 "
                                        r"\(the kernels read and write 3-, 4- and 8-bit codes only"):
        qp.quantize(torch.randn(1, 16, 16), spec)
    with pytest.raises(PaceError, match=rf"bits={bits} is not supported"):
        qp.quantize_heads(torch.randn(1, 4, 16, 16), [bits, 8, 8, 8], quant.QuantSpec(8, True, "key", 8))
    cfg = get_config(f"rtn-int{bits}").replace(group_size=8)
    fmt = state_format(cfg, cfg.head_bits(0, 4))
    assert "the PyTorch reference" in KERNELS["backend"].TritonSteps.refusal(fmt, None, 16, 16)
    assert KERNELS["backend"].TritonSteps.for_layer(fmt, None, 16, 16) is None
    for ok in ("rtn-int3", "rtn-int4", "rtn-int8"):
        cfg = get_config(ok).replace(group_size=8)
        fmt = state_format(cfg, cfg.head_bits(0, 4))
        assert KERNELS["backend"].TritonSteps.refusal(fmt, None, 16, 16) is None


def test_three_bit_zero_points_along_the_value_axis_are_refused() -> None:
    """A row of value-axis zero points is shorter than a 24-bit word: the kernels refuse it, saying so."""
    with pytest.raises(PaceError, match="3-bit zero points along the value axis are not supported"):
        qp.quantize(torch.randn(1, 16, 16), quant.QuantSpec(3, False, "value", 8))


def test_empty_states_and_fractional_widths_get_a_paceerror() -> None:
    """Before: a tensor without values made the reshape raise a RuntimeError, and 4.5 bits were truncated to 4."""
    spec = quant.QuantSpec(4, True, "key", 8)
    for empty, what in ((torch.empty(1, 0, 16), "K=0"), (torch.empty(1, 16, 0), "V=0"), (torch.empty(0, 0), "K=0")):
        with pytest.raises(PaceError, match=f"{what} is not supported by the Triton kernels"):
            qp.quantize(empty, spec)
    empty = torch.empty(0, 16, 16)
    assert qp.quantize(empty, spec).codes.shape == quant.quantize(empty, spec).codes.shape
    with pytest.raises(PaceError, match="at least one value head"):
        qp.quantize_heads(torch.empty(1, 0, 16, 16), [], spec)
    with pytest.raises(PaceError, match="bits_per_head holds 4.5; allowed: integers 2..8"):
        qp.quantize_heads(torch.randn(1, 2, 16, 16), [4.5, 4], spec)


@pytest.mark.parametrize("high_heads", [None, (1, 3)])
def test_backend_stores_and_loads_like_the_reference(high_heads) -> None:
    """The Triton backend's store and load of a layer's format (pace_core.checkpoint) are bit-identical to
    the reference's, with one bit width and with two."""
    x = _state((2, 4, *SIZES["QUANT_SHAPE"][2:]))
    cfg = get_config("pace-4-8" if high_heads else "pace-4").replace(group_size=SIZES["GROUP"], high_heads=(
        high_heads,) if high_heads else None)
    fmt = state_format(cfg, cfg.head_bits(0, 4))
    got, ref = steps.store(fmt, x)[0], REFERENCE.store(fmt, x)[0]
    assert type(got) is type(ref)
    for b, part in ({cfg.bits: ref} if high_heads is None else ref.parts).items():
        _assert_packed_equal(got if high_heads is None else got.parts[b], part)
    assert torch.equal(steps.load(fmt, got), REFERENCE.load(fmt, ref))


def test_head_tables_are_kept_and_their_maps_read_back_without_the_device():
    """A layer's head table is made once per bit pattern and device (every store and load reuses it); the
    bits of a head map that is a kept table's come from the table, those of any other map from its values."""
    from kernels.plan import bits_of_heads, head_table

    bits = [int(b) for b in torch.randint(0, 2, (6,)) * 4 + 4]
    widths, table = head_table(bits, torch.device("cpu"))
    again = head_table(bits, torch.device("cpu"))
    assert again[1] is table and again[0] == widths == sorted(set(bits))
    assert bits_of_heads(table.heads, len(bits)) == bits
    assert bits_of_heads({b: t.clone() for b, t in table.heads.items()}, len(bits)) == bits


def test_a_checkpoints_head_map_is_read_from_the_device_once(monkeypatch):
    """A checkpoint of two widths made by the reference quantisation, by the kernels, or from a pool's template
    (``with_stored``: the template's map) gives the decode kernels its bits with at most one device read of its map:
    later plans, e.g. inside a CUDA graph's capture, read nothing (a read of PACE-4/8's map per plan stopped an
    H100's graph test)."""
    from kernels.plan import bits_of_heads

    bits = [4, 8, 4, 4, 8]
    S = torch.randn(2, len(bits), 16, 32, generator=torch.Generator().manual_seed(11), device="cpu").to(DEVICE)
    spec = quant.QuantSpec(4, False, "key", 8)
    made = [quant.quantize_heads(S, bits, spec), KERNELS["quantize"].quantize_heads(S, bits, spec)]
    made += [m.with_stored({name: t[:1] for name, t in m.stored_tensors().items()}) for m in made]
    for m in made:
        bits_of_heads(m.heads, len(bits))  # the first plan of a checkpoint may read
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or real(t))
    assert all(bits_of_heads(m.heads, len(bits)) == bits for m in made) and not reads
    assert bits_of_heads({b: t.clone() for b, t in made[0].heads.items()}, len(bits)) == bits and len(reads) == 2


def test_a_single_width_checkpoint_maps_its_heads_by_the_kept_table():
    """A checkpoint of one bit width seen as a mixed one (kernels.plan.as_mixed) maps all its heads with the
    kept table's tensor, so the decode kernels read its bits without a device read."""
    from kernels.plan import as_mixed, head_table

    bits, hv = (3, 4, 8)[int(torch.randint(0, 3, ()))], int(torch.randint(1, 8, ()))
    p = quant.quantize(torch.randn(2, hv, 16, 32), quant.QuantSpec(bits, True, "key", 8))
    heads = as_mixed(p).heads
    assert list(heads) == [bits] and heads[bits] is head_table([bits] * hv, p.codes.device)[1].heads[bits]
    assert heads[bits].tolist() == list(range(hv))
