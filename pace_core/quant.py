"""The PACE state quantiser (PACE_SPEC §2): b-bit codes, fp16 group scales, real packed storage.

A state `x [..., K, V]` (K = key axis, V = value axis; transformers' `[B, HV, K, V]`) is split into
groups of `g` entries, either along the key axis (`x[..., k0:k0+g, j]`, scales `[..., K/g, V]`) or
along the value axis (`x[..., i, j0:j0+g]`, scales `[..., K, V/g]`).

Storage format (the kernels read and write exactly this):
- codes are unsigned: symmetric stores `q + 2^(b-1)` with `q` in `[-qmax, qmax]`,
  `qmax = 2^(b-1) - 1`; zero point stores `q` in `[0, 2^b - 1]`.
- every width 2..8 is packed densely along the last (V) dim (:func:`pack_codes`): a row of n b-bit codes is
  one little-endian bit stream, code i in bits `[i b, (i + 1) b)`, byte j holding bits `[8 j, 8 j + 8)`, so
  `ceil(n b / 8)` bytes (a row padded only to a whole byte, with zero bits). 4 bits: `byte[..., j] =
  code[..., 2j] | code[..., 2j+1] << 4`; 8 bits: one byte each; 3 bits: 8 codes in 3 bytes. (Before export
  schema 7, 2- and 3-bit codes took a nibble each and 5- to 7-bit codes a byte: :data:`PACKING`.)
- scales: float16. Zero points (zero-point mode): integers in `[0, 2^b - 1]`, shaped like the
  scales, packed like codes along the scales' last dim.
- Leading dims are kept as they are in codes, scales and zero points, so indexing them (a batch
  reorder, a head subset) is indexing the three tensors.

Arithmetic (exact, reproducible on CPU and CUDA and by an fp32 kernel):
- the "working dtype" is float64 for float64 input and float32 otherwise (fp32/bf16/fp16 values
  are exact in float32; for such inputs an fp32 quotient rounds to the same code as the exact one).
- symmetric: `scale = fp16(fl32(amax) / qmax)`; zero point: the group's min/max are first
  extended to include 0 **[ours: needed so that z fits in b bits; for a group that spans zero,
  which is the usual case, this is the spec's `(max - min) / (2^b - 1)`]**, then
  `scale = fp16((fl32(max) - fl32(min)) / (2^b - 1))` (fp32 arithmetic), `z = round(-min/scale)`
  clamped to `[0, 2^b - 1]`, `q = clamp(round(x/scale) + z, 0, 2^b - 1)`, dequant `(q - z) scale`.
  Codes use the STORED fp16 scale; rounding is half to even (torch.round); every division is a
  true IEEE division (`div_by_int`), also on CUDA.
- dequantised values `(q - z) * scale` are exact in float32 (an 8-bit integer times an fp16).
- all-zero group: scale 0, codes 0 (+ offset), dequantises to 0.
- fp16 range **[ours]**: a non-zero group's scale is raised to fp16's smallest normal `2^-14` before
  rounding, so tiny groups have an absolute resolution floor of `2^-15`. A group whose scale would
  exceed 65504 (values beyond `qmax * 65504`, symmetric, or a range beyond `(2^b - 1) * 65504`, zero
  point) is an error naming the group (:class:`~pace_core.errors.PaceError`; nothing is stored), not a
  saturated code. Resulting bounds per element: symmetric `|x - x̂| <= scale/2`; zero point
  `|x - x̂| <= scale * (1/2 + (2^b - 1) * 2^-11)` (the last term from rounding the scale to fp16).
- non-finite input raises PaceError naming the tensor.

Two variants the methods compose with (:mod:`pace_core.methods.groups`): **stochastic rounding** of the codes,
``floor(x/s + u)`` with ``u ~ U[0, 1)`` from a given generator (:func:`round_codes`; scales and zero points as
above), and **fixed scales**: each group's range calibrated once (:func:`group_ranges`), the scales and zero
points derived from it (:func:`static_scales`) and the codes of a state saturating where it lies beyond them
(:func:`quantize_fixed`, :func:`dequantize_fixed`; the codes stored alone).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from pace_core.deferred import defer
from pace_core.errors import PaceError

GroupAxis = Literal["key", "value"]
GROUP_AXES: tuple[str, ...] = ("key", "value")
BITS_RANGE = range(2, 9)
FP16_TINY = torch.finfo(torch.float16).tiny  # 2^-14, the smallest normal fp16
FP16_MAX = torch.finfo(torch.float16).max  # 65504


def check_bits(bits: int, field: str = "bits") -> None:
    """Raise PaceError unless `bits` is an int in 2..8."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS_RANGE:
        raise PaceError(f"{field}={bits!r} is not supported; allowed: integers 2..8")


def all_finite(*tensors: torch.Tensor) -> bool:
    """True when no tensor holds NaN or inf: one float64 sum per tensor and one read of their total (a NaN or
    an inf makes it non-finite; finite float32/bfloat16 values cannot overflow it). ``torch.isfinite`` over
    the tensors would launch several kernels each, on every decode token of every layer. While checks are
    deferred (:mod:`pace_core.deferred`) the total's check is recorded and this returns True."""
    total = sum(t.sum(dtype=torch.float64) for t in tensors)
    if defer(lambda: ~torch.isfinite(total)):
        return True
    return math.isfinite(float(total))


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise PaceError if the tensor `name` holds NaN or inf (:func:`all_finite`; the count is made only
    then)."""
    if x.numel() and not all_finite(x):
        bad = int((~torch.isfinite(x)).sum())
    else:
        return
    if bad:
        raise PaceError(
            f"{name} has {bad} non-finite value(s) (NaN or inf) of {x.numel()}; allowed: finite values"
        )


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 data, float32 for every other float dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fp16_scale(ratio: torch.Tensor, nonzero: torch.Tensor, floor: float = FP16_TINY) -> torch.Tensor:
    """Stored fp16 scale: `ratio` (float32) clamped into `[floor, 65504]` where `nonzero`, else 0. The floor
    is fp16's smallest normal 2^-14 unless a format says otherwise (STEPQuant: 2^-24, the smallest
    subnormal); callers that must not saturate check `ratio <= 65504` first."""
    return torch.where(nonzero, ratio.clamp(floor, FP16_MAX), 0.0).to(torch.float16)


def div_by_int(a: torch.Tensor, n: int) -> torch.Tensor:
    """`a / n` as a true IEEE division on every device (CUDA turns a division by a Python scalar
    into a multiplication by its reciprocal, which rounds differently). The divisor is filled on the device: a
    tensor made from a host number is a copy that a CUDA graph's capture cannot hold."""
    return a / torch.full((), n, dtype=a.dtype, device=a.device)


def safe_divisor(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`scale` in `dtype` with zeros replaced by 1 (an all-zero group divides 0 by 1)."""
    s = scale.to(dtype)
    return torch.where(s == 0, torch.ones_like(s), s)


@dataclass(frozen=True)
class QuantSpec:
    """How a state is quantised: bit width 2..8, symmetric or zero point, group axis and size."""

    bits: int
    symmetric: bool
    axis: GroupAxis
    group_size: int

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if not isinstance(self.symmetric, bool):
            raise PaceError(f"symmetric={self.symmetric!r} is not supported; allowed: True, False")
        if self.axis not in GROUP_AXES:
            raise PaceError(f"axis={self.axis!r} is not supported; allowed: 'key', 'value'")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise PaceError(
                f"group_size={self.group_size!r} is not supported; allowed: a positive integer "
                "that divides the grouped axis"
            )

    @property
    def qmax(self) -> int:
        """Largest symmetric code magnitude `2^(b-1) - 1`."""
        return 2 ** (self.bits - 1) - 1

    @property
    def levels(self) -> int:
        """Largest zero-point code `2^b - 1`."""
        return 2**self.bits - 1


@dataclass
class PackedTensor:
    """A quantised `[..., K, V]` tensor as stored (see the module docstring for the format).

    codes uint8 [..., K, ceil(V b / 8)]; scale float16 [..., K/g, V] (key axis) or [..., K, V/g] (value
    axis); zero: uint8 packed like codes along the scales' last dim, or None (symmetric).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    spec: QuantSpec
    shape: tuple[int, ...]

    def nbytes(self) -> int:
        """Real bytes of codes + scale + zero points."""
        parts = [self.codes, self.scale] + ([] if self.zero is None else [self.zero])
        return sum(t.numel() * t.element_size() for t in parts)

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name (codes, scale, zero points), batch axis first."""
        return {name: t for name, t in (("codes", self.codes), ("scale", self.scale), ("zero", self.zero))
                if t is not None}

    def with_stored(self, tensors: dict[str, torch.Tensor]) -> PackedTensor:
        """This structure holding ``tensors`` (named as :meth:`stored_tensors`; any batch size)."""
        n = tensors["codes"].shape[0]
        return replace(self, codes=tensors["codes"], scale=tensors["scale"], zero=tensors.get("zero"),
                       shape=(n, *self.shape[1:]))

    def split_bytes(self) -> tuple[int, int]:
        """``(payload, metadata)`` bytes: the codes, the scales and zero points."""
        return _nb(self.codes), _nb(self.scale) + _nb(self.zero)


def _nb(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _group_dims(shape: Sequence[int], spec: QuantSpec) -> tuple[tuple[int, ...], int]:
    """Shape that puts each group on its own dim, and that dim (-2 key axis, -1 value axis)."""
    *lead, k, v = shape
    g = spec.group_size
    if spec.axis == "key":
        return (*lead, k // g, g, v), -2
    return (*lead, k, v // g, g), -1


def scale_shape(shape: Sequence[int], spec: QuantSpec) -> tuple[int, ...]:
    """Scale (and zero point) shape for a `[..., K, V]` tensor: `[..., K/g, V]` or `[..., K, V/g]`."""
    grouped, dim = _group_dims(shape, spec)
    return grouped[:dim] + grouped[len(grouped) + dim + 1 :]


def _check_input(x: torch.Tensor, spec: QuantSpec, name: str) -> None:
    if not isinstance(spec, QuantSpec):
        raise PaceError(f"spec={spec!r} is not supported; allowed: a QuantSpec")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
        raise PaceError(f"{name} must be a floating-point tensor [..., K, V]; got {type(x).__name__} "
                        f"{getattr(x, 'dtype', '')} {tuple(getattr(x, 'shape', ()))}")
    check_divides(spec.group_size, x.shape[-2] if spec.axis == "key" else x.shape[-1], spec.axis, name)
    check_finite(x, name)


def check_divides(group_size: int, length: int, axis: str, name: str) -> None:
    """Raise PaceError naming `group_size` and the divisors of `length` unless it divides it."""
    if length % group_size:
        divisors = [d for d in range(1, length + 1) if length % d == 0]
        raise PaceError(
            f"group_size={group_size} does not divide the {axis} axis of {name} (length {length}); "
            f"allowed: {', '.join(map(str, divisors))}"
        )


def _check_scale_range(ratio: torch.Tensor, span: torch.Tensor, shape: Sequence[int], spec: QuantSpec,
                       name: str) -> None:
    """PaceError naming the first group whose scale ``ratio`` (float32, one per group, grouped shape with
    the group's dim kept) exceeds fp16's largest value; ``span`` is the group's max |x| or range. Recorded
    instead while checks are deferred (:mod:`pace_core.deferred`)."""
    over = ratio > FP16_MAX
    if defer(lambda: over) or not bool(over.any()):
        return
    at = [int(i) for i in torch.nonzero(over)[0]]
    *lead, k, v = shape
    g = spec.group_size
    if spec.axis == "key":
        rows, cols = f"key rows {at[-3] * g}..{at[-3] * g + g - 1}", f"value column {at[-1]}"
    else:
        rows, cols = f"key row {at[-3]}", f"value columns {at[-2] * g}..{at[-2] * g + g - 1}"
    where = f"index {tuple(at[:len(lead)])}" if lead else "the matrix"
    if len(lead) == 2:
        where = f"sequence {at[0]}, value head {at[1]}"
    limit = (spec.qmax if spec.symmetric else spec.levels) * FP16_MAX
    kind = "|x| up to" if spec.symmetric else "a range of"
    raise PaceError(f"{name}: a group's fp16 scale overflows ({where}, {rows}, {cols}): {kind} "
                    f"{float(span.flatten()[torch.nonzero(over.flatten())[0]]):.4g} needs a scale of "
                    f"{float(ratio[over][0]):.4g} > 65504; allowed: {kind} at most {limit:.4g} in "
                    f"{spec.bits}-bit {'symmetric' if spec.symmetric else 'zero-point'} groups (more bits, "
                    "another quantiser, or inputs that keep the state in range)")


def round_codes(y: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Integer-valued ``y`` of the same shape and dtype: round half to even (``generator`` None), or stochastic
    rounding ``floor(y + u)``, ``u ~ U[0, 1)`` drawn from ``generator`` as one ``torch.rand`` of ``y``'s shape in
    its dtype (row-major order), so that ``E[code] = y`` up to the dtype's rounding of ``y + u``."""
    if generator is None:
        return torch.round(y)
    return torch.floor(y + torch.rand(y.shape, generator=generator, dtype=y.dtype, device=y.device))


def _quantize_codes(
    x: torch.Tensor,
    spec: QuantSpec,
    name: str = "x",
    values: torch.dtype | None = None,
    *,
    generator: torch.Generator | None = None,
    fixed: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Unpacked codes uint8 [..., K, V], fp16 scale and uint8 zero points (or None) of checked `x`, with `values`
    the dequantised values in that dtype (from the signed codes: no second pass over the uint8 codes), else None,
    and the number of saturated values (int64, 0-dim) under ``fixed`` scales, else None. ``generator``: stochastic
    rounding of the codes (:func:`round_codes`; zero points always round to nearest). ``fixed``: given fp16 scales
    and zero points (float, integer-valued; None when symmetric) shaped like :func:`scale_shape` or broadcasting to
    it, instead of each group's own (:func:`static_scales`); codes beyond the range saturate."""
    w = work_dtype(x.dtype)
    grouped, dim = _group_dims(x.shape, spec)
    xg = x.to(w).reshape(grouped)
    if fixed is not None:
        scale, z = fixed[0].unsqueeze(dim), None if fixed[1] is None else fixed[1].unsqueeze(dim).to(w)
    elif spec.symmetric:
        amax = xg.abs().amax(dim, keepdim=True)
        ratio = div_by_int(amax.float(), spec.qmax)
        _check_scale_range(ratio, amax, x.shape, spec, name)
        scale, z = fp16_scale(ratio, amax > 0), None
    else:
        lo = xg.amin(dim, keepdim=True).clamp(max=0)
        hi = xg.amax(dim, keepdim=True).clamp(min=0)
        ratio = div_by_int(hi.float() - lo.float(), spec.levels)
        _check_scale_range(ratio, hi - lo, x.shape, spec, name)
        scale = fp16_scale(ratio, hi > lo)
        z = torch.round(-lo / safe_divisor(scale, w)).clamp_(0, spec.levels)
    step = scale.to(w)
    q = round_codes(xg / torch.where(step == 0, 1.0, step), generator)
    low, high = (-spec.qmax, spec.qmax) if z is None else (0, spec.levels)
    if z is not None:
        q = q + z
    saturated = None if fixed is None else ((q < low) | (q > high)).sum()
    q.clamp_(low, high)
    if z is None:
        deq = None if values is None else (q * step).reshape(x.shape).to(values)
        codes, zero = (q + (spec.qmax + 1)).to(torch.uint8), None
    else:
        deq = None if values is None else ((q - z) * step).reshape(x.shape).to(values)
        codes, zero = q.to(torch.uint8), z.squeeze(dim).to(torch.uint8)
    return codes.reshape(x.shape), scale.squeeze(dim), zero, deq, saturated


def _dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                      spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """`(q - z) * scale` [..., K, V] from unpacked codes; exact in float32, then cast to `dtype`."""
    w = work_dtype(dtype)
    grouped, dim = _group_dims(codes.shape, spec)
    offset = spec.qmax + 1 if zero is None else zero.unsqueeze(dim).to(w)  # a number: no host-to-device copy
    q = codes.reshape(grouped).to(w) - offset
    return (q * scale.unsqueeze(dim).to(w)).reshape(codes.shape).to(dtype)


PACKING = "dense"
"""The packing of codes and zero points every path stores (:func:`pack_codes`); an export records it (its
``state_layout.packing``, :func:`packing_layout`). Before export schema 7 the packing was not recorded: 2- to 4-bit
codes were stored two per byte, 5- to 8-bit codes one per byte, zero points two per byte only at 2..4 bits with an
even count (the same bytes as the dense packing at 4 and 8 bits; :mod:`pace_core.export` reads such files)."""


def code_word(bits: int) -> tuple[int, int]:
    """``(codes, bytes)`` of the smallest whole-byte word of ``bits``-bit codes: ``8 / gcd(b, 8)`` codes in
    ``b / gcd(b, 8)`` bytes (2: 4 in 1, 3: 8 in 3, 4: 2 in 1, 6: 4 in 3, 8: 1 in 1)."""
    d = math.gcd(bits, 8)
    return 8 // d, bits // d


def packing_layout() -> str:
    """How codes lie in bytes (the export's description of :data:`PACKING`)."""
    return (f"{PACKING}: a row of b-bit codes along the last axis is one little-endian bit stream (code i in bits "
            "[b i, b i + b), byte j holding bits [8 j, 8 j + 8): 4 bits two per byte low nibble first, 3 bits 8 codes "
            "in 3 bytes, 8 bits one per byte), padded with zero bits to a whole byte; zero points packed the same way "
            "along their last axis")


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., n]`` (< 2^bits) -> uint8 ``[..., ceil(n bits / 8)]`` (module docstring)."""
    codes = codes.to(torch.uint8)
    n = codes.shape[-1]
    if bits == 8:
        return codes.contiguous()
    if bits == 4:  # the general packing below, in two operations
        if n % 2:
            codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], 1)], dim=-1)
        return codes[..., 0::2] | (codes[..., 1::2] << 4)
    per, nbytes = code_word(bits)
    words = -(-n // per)
    if words * per != n:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], words * per - n)], dim=-1)
    wide = torch.int32 if per * bits < 32 else torch.int64
    groups = codes.to(wide).unflatten(-1, (words, per))
    word = (groups << (torch.arange(per, device=codes.device, dtype=wide) * bits)).sum(-1)
    out = (word.unsqueeze(-1) >> (torch.arange(nbytes, device=codes.device, dtype=wide) * 8)) & 255
    return out.to(torch.uint8).flatten(-2)[..., :packed_last_dim(bits, n)]


def _unpack(packed: torch.Tensor, bits: int, last_dim: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: uint8 ``[..., ceil(last_dim bits / 8)]`` -> codes uint8 ``[..., last_dim]``."""
    if bits == 8:
        return packed
    if bits == 4:
        return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)[..., :last_dim]
    per, nbytes = code_word(bits)
    words = -(-last_dim // per)
    short = words * nbytes - packed.shape[-1]
    if short:
        packed = torch.cat([packed, packed.new_zeros(*packed.shape[:-1], short)], dim=-1)
    wide = torch.int32 if per * bits < 32 else torch.int64
    byte = packed.to(wide).unflatten(-1, (words, nbytes))
    word = (byte << (torch.arange(nbytes, device=packed.device, dtype=wide) * 8)).sum(-1)
    codes = (word.unsqueeze(-1) >> (torch.arange(per, device=packed.device, dtype=wide) * bits)) & ((1 << bits) - 1)
    return codes.to(torch.uint8).flatten(-2)[..., :last_dim]


def packed_last_dim(bits: int, last_dim: int) -> int:
    """Bytes along the last dim that `pack_codes` stores for `last_dim` codes of `bits` bits: ``ceil(n b / 8)``."""
    return -(-last_dim * bits // 8)


def pack_codes(codes: torch.Tensor, bits: int, *, checked: bool = False) -> torch.Tensor:
    """Pack unsigned codes [..., n] (values in [0, 2^bits - 1]) densely into uint8 [..., ceil(n bits / 8)]: one
    little-endian bit stream per row (module docstring; 4 bits: two per byte, low nibble first). ``checked``: the
    caller made the codes in range (a quantiser's own), so their range is not read back from the device."""
    check_bits(bits)
    if not isinstance(codes, torch.Tensor) or codes.is_floating_point() or codes.is_complex() or codes.dim() < 1:
        raise PaceError("codes must be an integer tensor [..., n]; allowed: integer dtypes")
    if (
        not checked
        and codes.numel()
        and not defer(lambda: (codes.min() < 0) | (codes.max() > 2**bits - 1))
        and (int(codes.min()) < 0 or int(codes.max()) > 2**bits - 1)
    ):
        raise PaceError(f"codes hold values outside [0, {2**bits - 1}] for bits={bits}; "
                        f"allowed: integers 0..{2**bits - 1}")
    return _pack(codes, bits)


def unpack_codes(packed: torch.Tensor, bits: int, last_dim: int) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 [..., ceil(n bits / 8)] -> codes uint8 [..., last_dim]."""
    check_bits(bits)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() < 1:
        raise PaceError("packed must be a uint8 tensor [..., m]; allowed: torch.uint8")
    expected = packed_last_dim(bits, last_dim)
    if packed.shape[-1] != expected:
        raise PaceError(f"last_dim={last_dim} does not match packed last dim {packed.shape[-1]} for "
                        f"bits={bits}; allowed: a last_dim whose packed size is {packed.shape[-1]}")
    return _unpack(packed, bits, last_dim)


def quantize(x: torch.Tensor, spec: QuantSpec, *, name: str = "x", checked: bool = False,
             generator: torch.Generator | None = None) -> PackedTensor:
    """Quantise and pack `x [..., K, V]` (any float dtype, any device). `name` is used in errors; ``checked`` and
    ``generator`` as :func:`quantize_with_values`."""
    if not checked:
        _check_input(x, spec, name)
    codes, scale, zero, _, _ = _quantize_codes(x, spec, name, generator=generator)
    zero = None if zero is None else _pack(zero, spec.bits)
    return PackedTensor(_pack(codes, spec.bits), scale, zero, spec, tuple(x.shape))


def quantize_with_values(x: torch.Tensor, spec: QuantSpec, *, name: str = "x", dtype: torch.dtype = torch.float32,
                         checked: bool = False, generator: torch.Generator | None = None
                         ) -> tuple[PackedTensor, torch.Tensor]:
    """:func:`quantize` and the dequantised values in `dtype` at once (bit-identical to
    ``dequantize(quantize(x, spec), dtype)``, without unpacking the codes again). ``checked``: the caller
    has validated `x` already (a float tensor, finite, `spec`'s groups divide it), e.g. once for a
    decode buffer's record; the scale range is checked in any case. ``generator``: stochastic rounding of the
    codes (:func:`round_codes`), else round half to even."""
    if not checked:
        _check_input(x, spec, name)
    codes, scale, zero, values, _ = _quantize_codes(x, spec, name, dtype, generator=generator)
    zero = None if zero is None else _pack(zero, spec.bits)
    return PackedTensor(_pack(codes, spec.bits), scale, zero, spec, tuple(x.shape)), values


def dequantize(p: PackedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantised values [..., K, V] of a PackedTensor, in `dtype` (exact for float32/float64)."""
    bits, v = p.spec.bits, p.shape[-1]
    zero = None if p.zero is None else _unpack(p.zero, bits, p.scale.shape[-1])
    return _dequantize_codes(_unpack(p.codes, bits, v), p.scale, zero, p.spec, dtype)


def fake_quantize(x: torch.Tensor, spec: QuantSpec, dtype: torch.dtype | None = None, *,
                  name: str = "x", checked: bool = False) -> torch.Tensor:
    """Quantise-dequantise `x [..., K, V]` without packing; bit-identical to
    `dequantize(quantize(x, spec), dtype)`. `dtype` defaults to `x.dtype`; ``checked`` as
    :func:`quantize_with_values`."""
    if not checked:
        _check_input(x, spec, name)
    return _quantize_codes(x, spec, name, x.dtype if dtype is None else dtype)[3]


RANGE_NAMES = {True: ("amax",), False: ("low", "high")}
"""The calibrated range of a group (:func:`group_ranges`), by ``symmetric``."""


def _fp16_outward(t: torch.Tensor) -> torch.Tensor:
    """``t >= 0`` (float) in fp16, rounded up (never below ``t``), at most 65504."""
    t = t.float().clamp(max=FP16_MAX)
    h = t.to(torch.float16)
    return torch.where(h.float() < t, torch.nextafter(h, torch.full_like(h, math.inf)), h)


def group_ranges(states: torch.Tensor, spec: QuantSpec, name: str = "states") -> dict[str, torch.Tensor]:
    """The range of each group of ``spec`` over ``states [N, ..., K, V]`` (N snapshots of one layer's state): symmetric
    ``{"amax": max |x|}``, zero point ``{"low": min(min x, 0), "high": max(max x, 0)}`` (0 included, as the
    per-checkpoint scales include it), each ``[..., K/g, V]`` or ``[..., K, V/g]`` float16 rounded outward (never
    inside the observed range; at most 65504 in magnitude)."""
    _check_input(states, spec, name)
    if states.shape[0] == 0:
        raise PaceError(f"{name} must hold at least one state [N >= 1, ..., K, V]; got shape {tuple(states.shape)}")
    grouped, dim = _group_dims(states.shape, spec)
    xg = states.to(work_dtype(states.dtype)).reshape(grouped)
    if spec.symmetric:
        return {"amax": _fp16_outward(xg.abs().amax(dim).amax(0))}
    return {"low": -_fp16_outward(-xg.amin(dim).amin(0).clamp(max=0)),
            "high": _fp16_outward(xg.amax(dim).amax(0).clamp(min=0))}


def static_scales(ranges: dict[str, torch.Tensor], spec: QuantSpec, margin: float
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fixed fp16 scales and zero points (float, integer-valued; None when symmetric) of groups whose range was
    calibrated (:func:`group_ranges`), widened by ``margin``: symmetric ``scale = fp16(fl32(margin · amax) / qmax)``;
    zero point ``scale = fp16((fl32(margin · high) − fl32(margin · low)) / (2^b − 1))`` and
    ``z = clamp(round(−fl32(margin · low) / scale), 0, 2^b − 1)``, as :func:`quantize` computes them from a
    group's own range. The scales are clamped into fp16's [2^-14, 65504]: a group calibrated at 0 keeps the finest
    step, and values beyond a scale's range saturate (:func:`quantize_fixed`)."""
    m = float(margin)  # a float32 tensor times a Python number multiplies in float32: fl32(margin · amax)
    if spec.symmetric:
        amax = ranges["amax"].float() * m
        return fp16_scale(div_by_int(amax, spec.qmax), torch.ones_like(amax, dtype=torch.bool)), None
    lo, hi = ranges["low"].float() * m, ranges["high"].float() * m
    scale = fp16_scale(div_by_int(hi - lo, spec.levels), torch.ones_like(hi, dtype=torch.bool))
    return scale, torch.round(-lo / scale.float()).clamp_(0, spec.levels)


def quantize_fixed(x: torch.Tensor, spec: QuantSpec, scale: torch.Tensor, zero: torch.Tensor | None, *,
                   name: str = "x", dtype: torch.dtype = torch.float32, checked: bool = False,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes of `x [..., K, V]` under fixed scales (:func:`static_scales`, shaped like :func:`scale_shape` or
    broadcasting to it): ``q = clamp(round(x / scale) (+ z))`` with round half to even (or ``generator``'s
    stochastic rounding), saturating where ``|x|`` lies beyond the range. Returns the packed codes (uint8, as
    :class:`PackedTensor`'s), the dequantised values in ``dtype`` and the number of saturated values (int64,
    0-dim, on ``x``'s device). ``checked`` as :func:`quantize_with_values`."""
    if not checked:
        _check_input(x, spec, name)
    codes, _, _, values, saturated = _quantize_codes(x, spec, name, dtype, generator=generator, fixed=(scale, zero))
    return _pack(codes, spec.bits), values, saturated


def dequantize_fixed(codes: torch.Tensor, spec: QuantSpec, scale: torch.Tensor, zero: torch.Tensor | None,
                     shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q − z) · scale`` [..., K, V] (``shape``) of packed codes under fixed scales (:func:`quantize_fixed`)."""
    grouped, dim = _group_dims(shape, spec)
    w = work_dtype(dtype)
    q = _unpack(codes, spec.bits, shape[-1]).reshape(grouped).to(w)
    q = q - (spec.qmax + 1 if zero is None else zero.unsqueeze(dim).to(w))
    return (q * scale.unsqueeze(dim).to(w)).reshape(shape).to(dtype)


def code_step(p: PackedTensor) -> torch.Tensor:
    """One code step of every entry of ``p`` (its group's scale) ``[..., K, V]``: the codes one level above the zero
    point, dequantised."""
    b = p.spec.bits
    code = torch.full(p.shape, 1 if p.zero is not None else (1 << (b - 1)) + 1, dtype=torch.uint8,
                      device=p.codes.device)
    zero = None if p.zero is None else pack_codes(torch.zeros(p.scale.shape, dtype=torch.uint8,
                                                              device=p.codes.device), b)
    return dequantize(PackedTensor(pack_codes(code, b), p.scale, zero, p.spec, p.shape)).abs()


def steps_apart(got: PackedTensor, ref: PackedTensor, slack: torch.Tensor | float = 0.0) -> torch.Tensor:
    """How far apart two requantisations of (nearly) the same values are, entry by entry, in units of what rounding
    alone allows: ``|got - ref|`` over ``(s_got + s_ref)(1/2 + L 2^-11)`` (``s``: each side's :func:`code_step`; each
    side's entry lies within half a step of its value, and with a zero point a value at its group's range end up to
    ``s (1/2 + L 2^-11)`` away: the range's top ``(L - z) s`` misses it by the rounded zero point and the fp16
    rounding of the scale over the ``L = 2^b - 1`` steps; symmetric groups miss by less than half a step). At most 1
    (times 1.01, the bound's own rounding) where the two sides differ only by rounding; 0 where they are equal.
    ``slack``: a difference of the values themselves that the bound adds (broadcast against ``[..., K, V]``)."""
    levels = 0 if ref.zero is None else (1 << ref.spec.bits) - 1
    bound = (code_step(got) + code_step(ref)) * (0.5 + levels * 2.0**-11) + slack + 1e-30
    return (dequantize(got) - dequantize(ref)).abs() / bound


def packed_nbytes(shape: Sequence[int], spec: QuantSpec) -> int:
    """Bytes that `quantize` stores for a tensor of `shape [..., K, V]` (codes + scales + zero points)."""
    *lead, k, v = shape
    check_divides(spec.group_size, k if spec.axis == "key" else v, spec.axis, "shape")
    sshape = scale_shape(shape, spec)
    n_scales = math.prod(sshape)
    code_bytes = math.prod(lead) * k * packed_last_dim(spec.bits, v)
    zero_bytes = 0 if spec.symmetric else n_scales // sshape[-1] * packed_last_dim(spec.bits, sshape[-1])
    return code_bytes + 2 * n_scales + zero_bytes


@dataclass
class MixedPackedState:
    """A state `[..., HV, K, V]` whose heads have different bit widths (PACE-4/8).

    parts[b] is the PackedTensor of the heads `heads[b]` (int16, ascending) at b bits. The head map is
    stored once, shared by every sequence of the batch: :meth:`nbytes` counts it with the parts
    (:meth:`map_nbytes`).
    """

    parts: dict[int, PackedTensor]
    heads: dict[int, torch.Tensor]
    shape: tuple[int, ...]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantised state [..., HV, K, V]."""
        first = next(iter(self.parts.values()))
        out = torch.empty(self.shape, dtype=dtype, device=first.codes.device)
        for b, part in self.parts.items():
            out.index_copy_(len(self.shape) - 3, self.heads[b].long(), dequantize(part, dtype))
        return out

    def map_nbytes(self) -> int:
        """Real bytes of the head map (one int16 per value head)."""
        return sum(h.numel() * h.element_size() for h in self.heads.values())

    def nbytes(self) -> int:
        """Real bytes of all parts and the head map."""
        return sum(p.nbytes() for p in self.parts.values()) + self.map_nbytes()

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """Each part's stored tensors, named ``<name>@<bits>`` (the head map is kept once, not per sequence)."""
        return {f"{name}@{bits}": t for bits, part in self.parts.items() for name, t in part.stored_tensors().items()}

    def with_stored(self, tensors: dict[str, torch.Tensor]) -> MixedPackedState:
        """This structure (and head map) holding ``tensors`` (named as :meth:`stored_tensors`)."""
        parts = {bits: part.with_stored({name.split("@")[0]: t for name, t in tensors.items()
                                         if name.endswith(f"@{bits}")})
                 for bits, part in self.parts.items()}
        n = next(iter(tensors.values())).shape[0]
        return replace(self, parts=parts, shape=(n, *self.shape[1:]))

    def split_bytes(self) -> tuple[int, int]:
        """``(payload, metadata)`` bytes: every part's codes; scales, zero points and the head map."""
        parts = [p.split_bytes() for p in self.parts.values()]
        return sum(p for p, _ in parts), sum(m for _, m in parts) + self.map_nbytes()


def check_head_bits(bits_per_head: Sequence[int] | torch.Tensor, hv: int) -> list[int]:
    """The per-head widths as a list of ints; PaceError unless there is one integer in 2..8 per value head (a
    fractional width is refused, never truncated)."""
    widths = bits_per_head.tolist() if isinstance(bits_per_head, torch.Tensor) else list(bits_per_head)
    for b in widths:
        if isinstance(b, bool) or not isinstance(b, numbers.Integral):
            raise PaceError(f"bits_per_head holds {b!r}; allowed: integers 2..8, one per value head")
    if len(widths) != hv:
        raise PaceError(f"bits_per_head has {len(widths)} entries; allowed: one per value head ({hv})")
    for b in widths:
        check_bits(int(b), "bits_per_head")
    return [int(b) for b in widths]


@functools.lru_cache(maxsize=256)
def heads_at(bits: tuple[int, ...], b: int, device: torch.device) -> torch.Tensor:
    """The ascending indices (int64, on ``device``) of the heads whose width in ``bits`` is ``b``: made once per
    device and kept, since a tensor made from host data inside a CUDA graph's capture is a host-to-device copy,
    which a capture cannot hold (:mod:`pace_core.graphs`). Callers never write into it."""
    return torch.tensor([h for h, x in enumerate(bits) if x == b], dtype=torch.long, device=device)


def quantize_heads(S: torch.Tensor, bits_per_head: Sequence[int] | torch.Tensor, spec: QuantSpec, *,
                   name: str = "state", generator: torch.Generator | None = None) -> MixedPackedState:
    """Quantise `S [..., HV, K, V]` with head h at `bits_per_head[h]` bits (2..8); the other
    settings come from `spec` (its own `bits` is not used). ``generator``: stochastic rounding
    (:func:`round_codes`), one draw per width, in ascending order of the widths."""
    if not isinstance(S, torch.Tensor) or S.dim() < 3 or S.shape[-3] == 0:
        raise PaceError(f"{name} must be a tensor [..., HV, K, V] with at least one value head; got shape "
                        f"{tuple(getattr(S, 'shape', ()))}")
    bits = tuple(check_head_bits(bits_per_head, S.shape[-3]))
    parts, heads = {}, {}
    for b in sorted(set(bits)):
        idx = heads_at(bits, b, S.device)
        heads[b] = idx.to(torch.int16)
        parts[b] = quantize(S.index_select(S.dim() - 3, idx), replace(spec, bits=b), name=name, generator=generator)
    return MixedPackedState(parts, heads, tuple(S.shape))


def check_state(x: torch.Tensor, name: str, min_dim: int) -> None:
    """PaceError unless ``x`` is a finite floating-point tensor of at least ``min_dim`` dims (a matrix
    ``[..., K, V]`` or a state ``[..., HV, K, V]``)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < min_dim:
        layout = "[..., K, V]" if min_dim == 2 else "[..., HV, K, V]"
        raise PaceError(f"{name} must be a floating-point tensor {layout}; got "
                        f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}")
    check_finite(x, name)


def check_fp16(amax: torch.Tensor, name: str, what: str) -> None:
    """PaceError naming the first entry of ``amax [..., n]`` (a row's max |x|, stored in fp16) beyond fp16's
    largest value 65504 (never saturated). Recorded instead while checks are deferred (:mod:`pace_core.deferred`)."""
    over = amax > FP16_MAX
    if not defer(lambda: over) and bool(over.any()):
        at = [int(i) for i in torch.nonzero(over)[0]]
        raise PaceError(f"{name}: a {what} scale overflows fp16 (index {tuple(at)}): |x| up to "
                        f"{float(amax[tuple(at)]):.4g} > 65504; allowed: values within fp16's range (another "
                        "quantiser, or inputs that keep the state in range)")
