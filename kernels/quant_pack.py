"""Triton quantise + pack and unpack + dequantise of recurrent states in pace_core.quant's storage
format (PACE_SPEC §2), with per-head bit widths (PACE-4/8) in one launch.

Results are bit-identical to :mod:`pace_core.quant` (codes, fp16 scales, zero points and the
dequantised values) for float32 / bfloat16 / float16 input: the kernels follow its fp32 arithmetic
step by step (IEEE division ``div_rn``, round half to even, fp16 scale clamped into
``[2^-14, 65504]``). Kernel limits (the reference has none): ``K``, ``V`` and the group size are
powers of two, ``V >= 2``; float64 input is not accepted here (its reference works in float64).

The ``@triton.jit`` helpers (``_quant_tile``, ``_store_tile``, ``_load_tile``) are shared with
:mod:`kernels.decode_step`, which requantises the folded state with the same arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pace_core import quant
from pace_core.errors import PaceError

FP16_TINY = tl.constexpr(6.103515625e-05)  # 2^-14, pace_core.quant.FP16_TINY
FP16_MAX = tl.constexpr(65504.0)


RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + RINT_MAGIC rounds x to an integer (|x| <= 2^22)


@triton.jit
def _rint(x):
    """Round half to even for ``|x| <= 2^22`` (callers clamp first): the fp32 magic-number trick,
    which works the same in the interpreter and compiled (``libdevice.rint`` has no interpreter
    version)."""
    return (x + RINT_MAGIC) - RINT_MAGIC


@triton.jit
def _rint_bits(t):
    """The integer ``m`` (int32, ``0 <= m < 2^22``) from ``t = RINT_MAGIC + m``, an fp32 that already
    holds an integer (a sum with ``RINT_MAGIC``, rounded half to even): its low mantissa bits, with no
    float -> int conversion."""
    return t.to(tl.int32, bitcast=True) & 0x3FFFFF


@triton.jit
def round_bf16(x):
    """fp32 ``x`` rounded to the nearest bfloat16 (ties to even), still as fp32, so that a later
    ``.to(tl.bfloat16)`` is exact: the interpreter's own fp32 -> bf16 cast truncates, the compiled
    one rounds; this gives torch's ``.to(torch.bfloat16)`` in both (finite inputs)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def store_as(ptr, x, mask=None):
    """Store fp32 ``x`` into ``ptr``'s element type with round-to-nearest-even (see :func:`round_bf16`)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        x = round_bf16(x)
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _groups(x, R: tl.constexpr, C: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr):
    """``[R, C]`` -> 3-D with each group on its own axis: key ``[R/G, G, C]``, value ``[R, C/G, G]``."""
    if KEY_AXIS:
        out = tl.reshape(x, (R // G, G, C))
    else:
        out = tl.reshape(x, (R, C // G, G))
    return out


@triton.jit
def _expand(s, R: tl.constexpr, C: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr):
    """Per-group values (key ``[R/G, C]``, value ``[R, C/G]``) broadcast back to ``[R, C]``."""
    if KEY_AXIS:
        out = tl.reshape(tl.broadcast_to(s[:, None, :], (R // G, G, C)), (R, C))
    else:
        out = tl.reshape(tl.broadcast_to(s[:, :, None], (R, C // G, G)), (R, C))
    return out


@triton.jit
def _div_rn(x, d, r):
    """``x / d`` correctly rounded (IEEE round to nearest even, as ``tl.math.div_rn``) for a divisor
    ``d`` that is an fp16 value (at most 11 significant bits: the groups' scales), from ``r``, the
    correctly rounded ``1 / d``. ``y = x r`` is within about 1.5 ulp of ``x / d``; the residual
    ``x - y d`` needs only about a dozen significant bits, so one fma gives it exactly; ``y`` plus
    residual times ``r`` is then within about 2^-23 ulp of ``x / d``, while a quotient by an 11-bit
    divisor is either exact or at least about 2^-12 ulp away from any rounding midpoint, so one more
    fma rounds it as IEEE division does (with a general fp32 divisor neither step holds). The residual
    is subnormal only for ``|x| < 2^-102``, whose code is 0 anyway (scales are at least 2^-14). Three
    instructions an element instead of ``div_rn``'s range check and slow-path call; the reciprocal is
    one per group."""
    y = x * r
    return tl.fma(tl.fma(-y, d, x), r, y)


@triton.jit
def _fp16_scale(ratio, nonzero):
    clamped = tl.minimum(tl.maximum(ratio, FP16_TINY), FP16_MAX)
    return tl.where(nonzero, clamped, 0.0).to(tl.float16)


@triton.jit
def _quant_tile(x, R: tl.constexpr, C: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr,
                SYM: tl.constexpr, BITS: tl.constexpr):
    """Quantise ``x [R, C]`` fp32 (whole groups) as pace_core.quant does.

    Returns unsigned codes int32 ``[R, C]``, fp16 scales and int32 zero points (0 when symmetric),
    both per group (key ``[R/G, C]``, value ``[R, C/G]``)."""
    AX: tl.constexpr = 1 if KEY_AXIS else 2
    xg = _groups(x, R, C, G, KEY_AXIS)
    if SYM:
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        amax = tl.max(tl.abs(xg), axis=AX)
        scale = _fp16_scale(tl.math.div_rn(amax, QMAX * 1.0), amax > 0)
        div = tl.where(scale == 0, 1.0, scale.to(tl.float32))
        y = _div_rn(x, _expand(div, R, C, G, KEY_AXIS), _expand(tl.math.div_rn(1.0, div), R, C, G, KEY_AXIS))
        codes = _rint_bits(tl.minimum(tl.maximum(y, -QMAX * 1.0), QMAX * 1.0) + (RINT_MAGIC + (QMAX + 1)))  # even offset
        zero = tl.zeros(div.shape, tl.int32)
    else:
        LEVELS: tl.constexpr = (1 << BITS) - 1
        lo = tl.minimum(tl.min(xg, axis=AX), 0.0)
        hi = tl.maximum(tl.max(xg, axis=AX), 0.0)
        scale = _fp16_scale(tl.math.div_rn(hi - lo, LEVELS * 1.0), hi > lo)
        div = tl.where(scale == 0, 1.0, scale.to(tl.float32))
        zf = _rint(tl.minimum(tl.maximum(tl.math.div_rn(-lo, div), 0.0), LEVELS * 1.0))
        y = _div_rn(x, _expand(div, R, C, G, KEY_AXIS), _expand(tl.math.div_rn(1.0, div), R, C, G, KEY_AXIS))
        q = (tl.minimum(tl.maximum(y, -LEVELS * 1.0), LEVELS * 1.0) + RINT_MAGIC) + _expand(zf, R, C, G, KEY_AXIS)
        codes = _rint_bits(tl.minimum(tl.maximum(q, RINT_MAGIC), RINT_MAGIC + LEVELS))
        zero = zf.to(tl.int32)
    return codes, scale, zero


@triton.jit
def _pack_pairs(c, R: tl.constexpr, C: tl.constexpr):
    """int32 codes ``[R, C]`` -> uint8 ``[R, C/2]``: ``c[2j] | c[2j+1] << 4``."""
    a, b = tl.split(tl.reshape(c, (R, C // 2, 2)))
    return (a | (b << 4)).to(tl.uint8)


@triton.jit
def _unpack_pairs(p, R: tl.constexpr, C: tl.constexpr):
    """uint8 ``[R, C/2]`` -> int32 codes ``[R, C]``."""
    p = p.to(tl.int32)
    return tl.reshape(tl.join(p & 15, p >> 4), (R, C))


@triton.jit
def _group_offsets(r0, c0, R: tl.constexpr, C: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, PACKED: tl.constexpr):
    """Offsets into one head's scale (PACKED False) or packed zero (PACKED True) array for the
    groups of the tile at rows ``r0``, columns ``c0`` (a ``[R, C]`` tile of whole groups)."""
    if KEY_AXIS:
        rows = r0 // G + tl.arange(0, R // G)
        ncols: tl.constexpr = C
        width: tl.constexpr = V
        cstart = c0
    else:
        rows = r0 + tl.arange(0, R)
        ncols: tl.constexpr = C // G
        width: tl.constexpr = V // G
        cstart = c0 // G
    if PACKED:
        cols = cstart // 2 + tl.arange(0, ncols // 2)
        offs = rows[:, None] * (width // 2) + cols[None, :]
    else:
        cols = cstart + tl.arange(0, ncols)
        offs = rows[:, None] * width + cols[None, :]
    return offs


@triton.jit
def _store_tile(x, codes_ptr, scale_ptr, zero_ptr, r0, c0, R: tl.constexpr, C: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr,
                SYM: tl.constexpr, BITS: tl.constexpr, PACK_Z: tl.constexpr):
    """Quantise the tile ``x [R, C]`` (rows ``r0``, columns ``c0`` of one head's ``[K, V]``) and store
    its codes, scales and zero points at the head's base pointers."""
    codes, scale, zero = _quant_tile(x, R, C, G, KEY_AXIS, SYM, BITS)
    rows = r0 + tl.arange(0, R)
    if BITS <= 4:
        cols = c0 // 2 + tl.arange(0, C // 2)
        tl.store(codes_ptr + rows[:, None] * (V // 2) + cols[None, :], _pack_pairs(codes, R, C))
    else:
        cols = c0 + tl.arange(0, C)
        tl.store(codes_ptr + rows[:, None] * V + cols[None, :], codes.to(tl.uint8))
    tl.store(scale_ptr + _group_offsets(r0, c0, R, C, G, KEY_AXIS, K, V, False), scale)
    if not SYM:
        if PACK_Z:
            if KEY_AXIS:
                zp = _pack_pairs(zero, R // G, C)
            else:
                zp = _pack_pairs(zero, R, C // G)
            tl.store(zero_ptr + _group_offsets(r0, c0, R, C, G, KEY_AXIS, K, V, True), zp)
        else:
            tl.store(zero_ptr + _group_offsets(r0, c0, R, C, G, KEY_AXIS, K, V, False), zero.to(tl.uint8))


@triton.jit
def _load_tile(codes_ptr, scale_ptr, zero_ptr, r0, c0, R: tl.constexpr, C: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr,
               SYM: tl.constexpr, BITS: tl.constexpr, PACK_Z: tl.constexpr):
    """Dequantised fp32 tile ``[R, C]`` (rows ``r0``, columns ``c0``) of one head: ``(q - z) * scale``."""
    rows = r0 + tl.arange(0, R)
    if BITS <= 4:
        cols = c0 // 2 + tl.arange(0, C // 2)
        codes = _unpack_pairs(tl.load(codes_ptr + rows[:, None] * (V // 2) + cols[None, :]), R, C)
    else:
        cols = c0 + tl.arange(0, C)
        codes = tl.load(codes_ptr + rows[:, None] * V + cols[None, :]).to(tl.int32)
    scale = tl.load(scale_ptr + _group_offsets(r0, c0, R, C, G, KEY_AXIS, K, V, False)).to(tl.float32)
    if SYM:
        q = codes.to(tl.float32) - (1 << (BITS - 1)) * 1.0
    else:
        if PACK_Z:
            zp = tl.load(zero_ptr + _group_offsets(r0, c0, R, C, G, KEY_AXIS, K, V, True))
            if KEY_AXIS:
                zero = _unpack_pairs(zp, R // G, C)
            else:
                zero = _unpack_pairs(zp, R, C // G)
        else:
            zero = tl.load(zero_ptr + _group_offsets(r0, c0, R, C, G, KEY_AXIS, K, V, False)).to(tl.int32)
        q = codes.to(tl.float32) - _expand(zero.to(tl.float32), R, C, G, KEY_AXIS)
    return q * _expand(scale, R, C, G, KEY_AXIS)


@dataclass(frozen=True)
class PartLayout:
    """Compile-time layout of one bit width's part of a state (shared with the decode kernel)."""

    bits: int
    pack_zero: bool
    code_cols: int   # bytes per row of codes
    scale_size: int  # fp16 scales per head
    zero_size: int   # bytes of zero points per head (0 when symmetric)


def part_layout(spec: quant.QuantSpec, K: int, V: int) -> PartLayout:
    """Sizes per head of ``spec``'s storage for a ``[K, V]`` state (pace_core.quant's format)."""
    sshape = quant.scale_shape((K, V), spec)
    n_scales = sshape[0] * sshape[1]
    pack_zero = spec.bits <= 4 and sshape[-1] % 2 == 0
    zero_size = 0 if spec.symmetric else (n_scales // 2 if pack_zero else n_scales)
    return PartLayout(spec.bits, pack_zero, quant.packed_last_dim(spec.bits, V), n_scales, zero_size)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


DECODE_MIN_K = 16
"""The decode kernels' narrowest keys (a tensor-core tile): the flush at K = 8 gave wrong PACE-4/8
checkpoints on the H200 (kernels/NOTES.md, run 5), so narrower heads decode on the reference."""


def check_kernel_shape(K: int, V: int, spec: quant.QuantSpec, name: str = "x", decode: bool = False) -> None:
    """Raise PaceError unless the kernels support a ``[K, V]`` state with ``spec``'s groups (``decode``:
    the buffered decode kernels, which also need ``K >= DECODE_MIN_K``)."""
    quant.check_divides(spec.group_size, K if spec.axis == "key" else V, spec.axis, name)
    for field, n in (("K", K), ("V", V), ("group_size", spec.group_size)):
        if not _is_pow2(n):
            raise PaceError(f"{name}: {field}={n} is not supported by the Triton kernels; allowed: powers of two")
    if V < 2:
        raise PaceError(f"{name}: V={V} is not supported by the Triton kernels; allowed: V >= 2")
    if decode and K < DECODE_MIN_K:
        raise PaceError(f"{name}: K={K} is not supported by the Triton decode kernels; allowed: K >= {DECODE_MIN_K} "
                        "(narrower heads decode on the PyTorch reference)")


def row_block(K: int, spec: quant.QuantSpec, V: int) -> int:
    """Rows per tile: whole key groups, about 4096 values per program."""
    rows = max(1, min(K, 4096 // V))
    if spec.axis == "key":
        rows = max(rows, spec.group_size)
    return rows


@dataclass
class HeadTable:
    """Which part (0 or 1) and which slot inside it each value head uses, as int32 device tensors."""

    part: torch.Tensor
    slot: torch.Tensor
    heads: dict[int, torch.Tensor]  # bits -> ascending LongTensor of head indices


def head_table(bits_per_head: list[int], device: torch.device) -> tuple[list[int], HeadTable]:
    """The distinct bit widths (ascending, at most two) and the head table for ``bits_per_head``."""
    for b in bits_per_head:
        quant.check_bits(b, "bits_per_head")
    widths = sorted(set(bits_per_head))
    if len(widths) > 2:
        raise PaceError(f"bits_per_head: {widths} distinct widths not supported in one launch; allowed: at most 2")
    part = [widths.index(b) for b in bits_per_head]
    slot = [sum(1 for p in part[:h] if p == part[h]) for h in range(len(part))]
    heads = {b: torch.tensor([h for h, x in enumerate(bits_per_head) if x == b], dtype=torch.long, device=device)
             for b in widths}
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return widths, HeadTable(as_i32(part), as_i32(slot), heads)


@triton.jit
def _quant_kernel(x_ptr, part_ptr, slot_ptr, c0_ptr, s0_ptr, z0_ptr, c1_ptr, s1_ptr, z1_ptr, HV, HV0, HV1,
                  K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, G: tl.constexpr,
                  KEY_AXIS: tl.constexpr, SYM: tl.constexpr,
                  BITS0: tl.constexpr, PZ0: tl.constexpr, CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
                  BITS1: tl.constexpr, PZ1: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr,
                  TWO: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    r0 = tl.program_id(1) * BK
    b = n // HV
    h = n % HV
    rows = r0 + tl.arange(0, BK)
    x = tl.load(x_ptr + n * K * V + rows[:, None] * V + tl.arange(0, V)[None, :]).to(tl.float32)
    part = tl.load(part_ptr + h)
    slot = tl.load(slot_ptr + h).to(tl.int64)
    if part == 0:
        i = b * HV0 + slot
        _store_tile(x, c0_ptr + i * K * CC0, s0_ptr + i * SS0, z0_ptr + i * ZS0, r0, 0, BK, V, K, V, G,
                    KEY_AXIS, SYM, BITS0, PZ0)
    if TWO:
        if part == 1:
            i = b * HV1 + slot
            _store_tile(x, c1_ptr + i * K * CC1, s1_ptr + i * SS1, z1_ptr + i * ZS1, r0, 0, BK, V, K, V, G,
                        KEY_AXIS, SYM, BITS1, PZ1)


@triton.jit
def _dequant_kernel(out_ptr, part_ptr, slot_ptr, c0_ptr, s0_ptr, z0_ptr, c1_ptr, s1_ptr, z1_ptr, HV, HV0, HV1,
                    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, G: tl.constexpr,
                    KEY_AXIS: tl.constexpr, SYM: tl.constexpr,
                    BITS0: tl.constexpr, PZ0: tl.constexpr, CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
                    BITS1: tl.constexpr, PZ1: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr,
                    TWO: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    r0 = tl.program_id(1) * BK
    b = n // HV
    h = n % HV
    rows = r0 + tl.arange(0, BK)
    offs = n * K * V + rows[:, None] * V + tl.arange(0, V)[None, :]
    part = tl.load(part_ptr + h)
    slot = tl.load(slot_ptr + h).to(tl.int64)
    if part == 0:
        i = b * HV0 + slot
        x = _load_tile(c0_ptr + i * K * CC0, s0_ptr + i * SS0, z0_ptr + i * ZS0, r0, 0, BK, V, K, V, G,
                       KEY_AXIS, SYM, BITS0, PZ0)
        store_as(out_ptr + offs, x)
    if TWO:
        if part == 1:
            i = b * HV1 + slot
            x = _load_tile(c1_ptr + i * K * CC1, s1_ptr + i * SS1, z1_ptr + i * ZS1, r0, 0, BK, V, K, V, G,
                           KEY_AXIS, SYM, BITS1, PZ1)
            store_as(out_ptr + offs, x)


def layout_args(layouts: list[PartLayout]) -> dict:
    """Kernel constexprs for one or two parts (the second repeats the first when absent)."""
    l1 = layouts[1] if len(layouts) == 2 else layouts[0]
    return dict(
        BITS0=layouts[0].bits, PZ0=layouts[0].pack_zero, CC0=layouts[0].code_cols,
        SS0=layouts[0].scale_size, ZS0=layouts[0].zero_size,
        BITS1=l1.bits, PZ1=l1.pack_zero, CC1=l1.code_cols, SS1=l1.scale_size, ZS1=l1.zero_size,
        TWO=len(layouts) == 2,
    )


def part_pointers(parts: list[quant.PackedTensor]) -> list[torch.Tensor]:
    """codes, scale, zero of part 0 and part 1 (part 0 again when there is one part; the scale
    stands in for an absent zero point, which symmetric kernels never touch)."""
    p1 = parts[1] if len(parts) == 2 else parts[0]
    out = []
    for p in (parts[0], p1):
        out += [p.codes, p.scale, p.scale if p.zero is None else p.zero]
    return out


def _check_state(S: torch.Tensor, name: str) -> None:
    if not isinstance(S, torch.Tensor) or S.dim() < 3:
        raise PaceError(f"{name}: must be a tensor [..., HV, K, V]; got shape {tuple(getattr(S, 'shape', ()))}")
    if S.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise PaceError(f"{name}: dtype {S.dtype} not supported by the kernels; allowed: float32, bfloat16, float16")


def _empty_part(lead: tuple[int, ...], hv: int, K: int, V: int, spec: quant.QuantSpec,
                device: torch.device) -> quant.PackedTensor:
    """Uninitialised storage of one part (filled by a kernel)."""
    lay = part_layout(spec, K, V)
    sshape = quant.scale_shape((K, V), spec)
    codes = torch.empty(*lead, hv, K, lay.code_cols, dtype=torch.uint8, device=device)
    scale = torch.empty(*lead, hv, *sshape, dtype=torch.float16, device=device)
    zero = None
    if not spec.symmetric:
        zshape = (sshape[0], sshape[1] // 2) if lay.pack_zero else sshape
        zero = torch.empty(*lead, hv, *zshape, dtype=torch.uint8, device=device)
    return quant.PackedTensor(codes, scale, zero, spec, (*lead, hv, K, V))


def _check_same_layout(out: quant.MixedPackedState, parts: list[quant.PackedTensor], widths: list[int]) -> None:
    if sorted(out.parts) != widths:
        raise PaceError(f"out: bit widths {sorted(out.parts)} not allowed; allowed: {widths}")
    for b, p in zip(widths, parts):
        o = out.parts[b]
        for name, a, r in (("codes", o.codes, p.codes), ("scale", o.scale, p.scale), ("zero", o.zero, p.zero)):
            if (a is None) != (r is None) or (a is not None and (a.shape != r.shape or a.dtype != r.dtype
                                                                 or not a.is_contiguous())):
                raise PaceError(f"out: {b}-bit {name} layout not allowed; allowed: contiguous like the result")


def quantize_heads(S: torch.Tensor, bits_per_head: list[int], spec: quant.QuantSpec, *,
                   name: str = "state", out: quant.MixedPackedState | None = None) -> quant.MixedPackedState:
    """One launch: quantise ``S [..., HV, K, V]`` with head ``h`` at ``bits_per_head[h]`` bits (at most two
    distinct widths; the rest of ``spec``). Bit-identical to :func:`pace_core.quant.quantize_heads`.
    ``out``: storage to write into (same layout as the result; reused, e.g. under CUDA graphs)."""
    _check_state(S, name)
    *lead, HV, K, V = S.shape
    bits_per_head = [int(b) for b in bits_per_head]
    if len(bits_per_head) != HV:
        raise PaceError(f"bits_per_head has {len(bits_per_head)} entries; allowed: one per value head ({HV})")
    check_kernel_shape(K, V, spec, name)
    quant.check_finite(S, name)
    widths, table = head_table(bits_per_head, S.device)
    specs = [quant.QuantSpec(b, spec.symmetric, spec.axis, spec.group_size) for b in widths]
    parts = [_empty_part(tuple(lead), len(table.heads[b]), K, V, s, S.device) for b, s in zip(widths, specs)]
    if out is not None:
        _check_same_layout(out, parts, widths)
        parts = [out.parts[b] for b in widths]
    x = S.contiguous()
    N = x.numel() // (K * V)
    BK = row_block(K, spec, V)
    hv1 = len(table.heads[widths[1]]) if len(widths) == 2 else 0
    if N:
        _quant_kernel[(N, K // BK)](
            x, table.part, table.slot, *part_pointers(parts), HV, len(table.heads[widths[0]]), hv1,
            K=K, V=V, BK=BK, G=spec.group_size, KEY_AXIS=spec.axis == "key", SYM=spec.symmetric,
            **layout_args([part_layout(s, K, V) for s in specs]),
        )
    return quant.MixedPackedState(dict(zip(widths, parts)), table.heads, tuple(S.shape))


def dequantize_heads(m: quant.MixedPackedState, dtype: torch.dtype = torch.float32,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One launch: the dequantised state ``[..., HV, K, V]`` of ``m`` in ``dtype`` (float32, bfloat16 or
    float16). Bit-identical to ``m.dequantize(dtype)``. ``out``: a contiguous tensor of that shape and
    dtype to write into."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise PaceError(f"dtype: {dtype} not supported by the kernels; allowed: float32, bfloat16, float16")
    widths = sorted(m.parts)
    if len(widths) > 2:
        raise PaceError(f"parts: {widths} distinct widths not supported in one launch; allowed: at most 2")
    *lead, HV, K, V = m.shape
    bits_per_head = [0] * HV
    for b in widths:
        for h in m.heads[b].tolist():
            bits_per_head[h] = b
    parts = [m.parts[b] for b in widths]
    spec = parts[0].spec
    check_kernel_shape(K, V, spec, "state")
    device = parts[0].codes.device
    _, table = head_table(bits_per_head, device)
    if out is None:
        out = torch.empty(m.shape, dtype=dtype, device=device)
    elif tuple(out.shape) != tuple(m.shape) or out.dtype != dtype or not out.is_contiguous():
        raise PaceError(f"out: {tuple(out.shape)} {out.dtype} not allowed; allowed: contiguous {m.shape} {dtype}")
    N = out.numel() // (K * V)
    BK = row_block(K, spec, V)
    hv1 = len(table.heads[widths[1]]) if len(widths) == 2 else 0
    if N:
        _dequant_kernel[(N, K // BK)](
            out, table.part, table.slot, *[t.contiguous() for t in part_pointers(parts)], HV,
            len(table.heads[widths[0]]), hv1,
            K=K, V=V, BK=BK, G=spec.group_size, KEY_AXIS=spec.axis == "key", SYM=spec.symmetric,
            **layout_args([part_layout(p.spec, K, V) for p in parts]),
        )
    return out


def quantize(x: torch.Tensor, spec: quant.QuantSpec, *, name: str = "x") -> quant.PackedTensor:
    """Quantise and pack ``x [..., K, V]`` (float32/bfloat16/float16). Bit-identical to
    :func:`pace_core.quant.quantize`."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise PaceError(f"{name}: must be a tensor [..., K, V]; got shape {tuple(getattr(x, 'shape', ()))}")
    m = quantize_heads(x.reshape(-1, 1, *x.shape[-2:]), [spec.bits], spec, name=name)
    p = m.parts[spec.bits]
    lead = tuple(x.shape[:-2])
    return quant.PackedTensor(
        p.codes.reshape(*lead, *p.codes.shape[-2:]), p.scale.reshape(*lead, *p.scale.shape[-2:]),
        None if p.zero is None else p.zero.reshape(*lead, *p.zero.shape[-2:]), spec, tuple(x.shape),
    )


def dequantize(p: quant.PackedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantised ``[..., K, V]`` of ``p`` in ``dtype``. Bit-identical to :func:`pace_core.quant.dequantize`."""
    *lead, K, V = p.shape
    n = 1
    for d in lead:
        n *= d
    flat = quant.PackedTensor(
        p.codes.reshape(n, 1, *p.codes.shape[-2:]), p.scale.reshape(n, 1, *p.scale.shape[-2:]),
        None if p.zero is None else p.zero.reshape(n, 1, *p.zero.shape[-2:]), p.spec, (n, 1, K, V),
    )
    heads = {p.spec.bits: torch.zeros(1, dtype=torch.long, device=p.codes.device)}
    out = dequantize_heads(quant.MixedPackedState({p.spec.bits: flat}, heads, (n, 1, K, V)), dtype)
    return out.reshape(p.shape)
