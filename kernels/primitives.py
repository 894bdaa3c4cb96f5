"""Shared Triton device functions of the kernels: exact rounding and division, bfloat16 splits, tiles of
:mod:`pace_core.quant`'s storage format (quantise + pack, unpack + dequantise), and the addressing of a
packed checkpoint's parts (per-head bit widths).

The kernels take the code widths of :data:`KERNEL_BITS`: 4 bits (two codes per byte, read and written as
two half tiles of nibbles), 8 bits (a byte each) and 3 bits (:mod:`pace_core.quant`'s dense packing: 8 codes
in one 24-bit little-endian word of 3 bytes, read and written as three byte planes, :func:`unpack3`,
:func:`pack3`). A tile's columns are whole words (8 codes at 3 bits).

Every function here is ``@triton.jit`` and follows pace_core's arithmetic step by step (fp32, IEEE
division, round half to even, fp16 scales clamped into ``[2^-14, 65504]``), so the kernels that use them
are bit-identical to :mod:`pace_core.quant` wherever they quantise.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP16_TINY = tl.constexpr(6.103515625e-05)  # 2^-14, pace_core.quant.FP16_TINY


FP16_MAX = tl.constexpr(65504.0)


KERNEL_BITS = (3, 4, 8)
"""The code widths the kernels read and write (module docstring); a configuration with another width runs on the
PyTorch reference (:func:`kernels.plan.check_kernel_shape` says why)."""


def zero_pairs(bits: int, n: int) -> bool:
    """Whether ``n`` zero points of ``bits`` bits along a row are read and written as nibble pairs (4 bits, an even
    count); a single 4-bit zero point in a row is its byte, as :mod:`pace_core.quant` stores it, and 3-bit ones
    are 24-bit words (:func:`unpack3`)."""
    return bits == 4 and n % 2 == 0


RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + RINT_MAGIC rounds x to an integer (|x| <= 2^22)


TWO23 = tl.constexpr(8388608.0)  # 2^23: fp32 spacing 1 in [2^23, 2^24)


@triton.jit
def biased(c):
    """``2^23 + c`` (fp32) for integers ``0 <= c < 2^22`` (int32): ``c`` or-ed into the bits of 2^23, no int -> float
    conversion; ``biased(c) - biased(z)`` (or ``- (TWO23 + z)``) is the exact ``c - z``."""
    return (c | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def sym_value(c, BITS: tl.constexpr):
    """Symmetric ``BITS``-bit codes ``c`` (unsigned, any integer type) as the exact fp32 ``c - 2^(BITS-1)``
    (:func:`biased`)."""
    return biased(c.to(tl.int32)) - (TWO23 + (1 << (BITS - 1)))


@triton.jit
def rint(x):
    """Round half to even for ``|x| <= 2^22`` (callers clamp first): the fp32 magic-number trick,
    which works the same in the interpreter and compiled (``libdevice.rint`` has no interpreter
    version)."""
    return (x + RINT_MAGIC) - RINT_MAGIC


@triton.jit
def rint_bits(t):
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
def groups(x, R: tl.constexpr, C: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr):
    """``[R, C]`` -> 3-D with each group on its own axis: key ``[R/G, G, C]``, value ``[R, C/G, G]``."""
    if KEY_AXIS:
        out = tl.reshape(x, (R // G, G, C))
    else:
        out = tl.reshape(x, (R, C // G, G))
    return out


@triton.jit
def expand(s, R: tl.constexpr, C: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr):
    """Per-group values (key ``[R/G, C]``, value ``[R, C/G]``) broadcast back to ``[R, C]``."""
    if KEY_AXIS:
        out = tl.reshape(tl.broadcast_to(s[:, None, :], (R // G, G, C)), (R, C))
    else:
        out = tl.reshape(tl.broadcast_to(s[:, :, None], (R, C // G, G)), (R, C))
    return out


@triton.jit
def div_rn(x, d, r):
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
def fp16_scale(ratio, nonzero):
    clamped = tl.minimum(tl.maximum(ratio, FP16_TINY), FP16_MAX)
    return tl.where(nonzero, clamped, 0.0).to(tl.float16)


@triton.jit
def sym_scale(amax, BITS: tl.constexpr):
    """Symmetric ``BITS``-bit groups of largest magnitude ``amax`` (fp32, one per group): the fp16 scale, the
    fp32 divisor (1 where the scale is 0) and its correctly rounded reciprocal (for :func:`sym_code_sum`)."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    scale = fp16_scale(tl.math.div_rn(amax, QMAX * 1.0), amax > 0)
    div = tl.where(scale == 0, 1.0, scale.to(tl.float32))
    return scale, div, tl.math.div_rn(1.0, div)


@triton.jit
def sym_code_sum(x, div, rdiv, BITS: tl.constexpr, CLAMP: tl.constexpr = True):
    """``RINT_MAGIC + c`` (fp32) for the unsigned symmetric code ``c`` of ``x`` with divisor ``div`` and reciprocal
    ``rdiv`` (:func:`sym_scale`, broadcast to ``x``): its code in the low mantissa bits (:func:`rint_bits`).
    ``CLAMP`` False leaves the clamp to the caller (:func:`code_clamp`, needed only where a group's scale was clamped
    at fp16's largest, its ``amax`` above :func:`sym_fits`: otherwise the fp16 scale is within 2^-11 of
    ``amax / q_max``, so ``|x / div| < q_max + 1/2`` rounds into the range)."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    t = div_rn(x, div, rdiv) + (RINT_MAGIC + (QMAX + 1))  # even offset
    if CLAMP:
        t = code_clamp(t, BITS)
    return t


@triton.jit
def code_clamp(t, BITS: tl.constexpr):
    """``RINT_MAGIC + c`` clamped to the symmetric codes ``1 .. 2^BITS - 1``: the same codes as clamping ``x / div``
    to ``±q_max`` before rounding (rounding is monotonic and ``±q_max`` are integers), infinities included."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    return tl.minimum(tl.maximum(t, RINT_MAGIC + 1.0), RINT_MAGIC + (2 * QMAX + 1.0))


@triton.jit
def sym_fits(BITS: tl.constexpr):
    """The largest group magnitude whose symmetric ``BITS``-bit scale is not clamped at fp16's largest:
    ``q_max * 65504`` (exact in fp32)."""
    return ((1 << (BITS - 1)) - 1) * FP16_MAX


@triton.jit
def asym_scale(lo, hi, BITS: tl.constexpr):
    """Groups of ``BITS``-bit codes with zero points whose smallest and largest values are ``lo``, ``hi`` (fp32, one
    per group; the range is widened to hold 0): the fp16 scale, the fp32 divisor (1 where the scale is 0), its
    correctly rounded reciprocal and the zero point as an fp32 integer (for :func:`asym_code_sum`)."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    lo = tl.minimum(lo, 0.0)
    hi = tl.maximum(hi, 0.0)
    scale = fp16_scale(tl.math.div_rn(hi - lo, LEVELS * 1.0), hi > lo)
    div = tl.where(scale == 0, 1.0, scale.to(tl.float32))
    zf = rint(tl.minimum(tl.maximum(tl.math.div_rn(-lo, div), 0.0), LEVELS * 1.0))
    return scale, div, tl.math.div_rn(1.0, div), zf


@triton.jit
def asym_code_sum(x, div, rdiv, zf, BITS: tl.constexpr):
    """``RINT_MAGIC + c`` (fp32) for the code ``c = clamp(rint(x / div) + z, 0, 2^BITS - 1)`` of ``x`` with divisor
    ``div``, reciprocal ``rdiv`` and zero point ``zf`` (:func:`asym_scale`, broadcast to ``x``). pace_core.quant
    clamps ``x / div`` to ``±(2^BITS - 1)`` before rounding; with ``0 <= z <= 2^BITS - 1`` the clamp of the sum
    gives the same code for every input (a quotient past the range lands past the same end of the sum, and at
    ``|x / div| >= 2^22`` the magic sum still falls outside the range), so that clamp is left out."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    t = (div_rn(x, div, rdiv) + RINT_MAGIC) + zf
    return tl.minimum(tl.maximum(t, RINT_MAGIC), RINT_MAGIC + LEVELS)


@triton.jit
def quant_tile(x, R: tl.constexpr, C: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr,
                SYM: tl.constexpr, BITS: tl.constexpr):
    """Quantise ``x [R, C]`` fp32 (whole groups) as pace_core.quant does.

    Returns unsigned codes int32 ``[R, C]``, fp16 scales and int32 zero points (0 when symmetric),
    both per group (key ``[R/G, C]``, value ``[R, C/G]``)."""
    AX: tl.constexpr = 1 if KEY_AXIS else 2
    xg = groups(x, R, C, G, KEY_AXIS)
    if SYM:
        scale, div, rdiv = sym_scale(tl.max(tl.abs(xg), axis=AX), BITS)
        codes = rint_bits(sym_code_sum(x, expand(div, R, C, G, KEY_AXIS), expand(rdiv, R, C, G, KEY_AXIS), BITS))
        zero = tl.zeros(div.shape, tl.int32)
    else:
        scale, div, rdiv, zf = asym_scale(tl.min(xg, axis=AX), tl.max(xg, axis=AX), BITS)
        codes = rint_bits(asym_code_sum(x, expand(div, R, C, G, KEY_AXIS), expand(rdiv, R, C, G, KEY_AXIS),
                                        expand(zf, R, C, G, KEY_AXIS), BITS))
        zero = zf.to(tl.int32)
    return codes, scale, zero


@triton.jit
def pack_pairs(c, R: tl.constexpr, C: tl.constexpr):
    """int32 codes ``[R, C]`` -> uint8 ``[R, C/2]``: ``c[2j] | c[2j+1] << 4``."""
    a, b = tl.split(tl.reshape(c, (R, C // 2, 2)))
    return (a | (b << 4)).to(tl.uint8)


@triton.jit
def unpack_pairs(p, R: tl.constexpr, C: tl.constexpr):
    """uint8 ``[R, C/2]`` -> int32 codes ``[R, C]``."""
    p = p.to(tl.int32)
    return tl.reshape(tl.join(p & 15, p >> 4), (R, C))


@triton.jit
def unpack3(b0, b1, b2, ALONG_ROWS: tl.constexpr):
    """3-bit codes int32 from the three byte planes of their 24-bit words (uint8, one word = 8 codes, byte 0 its
    low byte): planes ``[W, X]`` give codes ``[8 W, X]`` (``ALONG_ROWS``: the words run down the rows), planes
    ``[X, W]`` codes ``[X, 8 W]``; code ``i`` of a word is its bits ``3 i .. 3 i + 2``."""
    word = b0.to(tl.int32) | (b1.to(tl.int32) << 8) | (b2.to(tl.int32) << 16)
    if ALONG_ROWS:
        c = (word[:, None, :] >> (tl.arange(0, 8) * 3)[None, :, None]) & 7
        out = tl.reshape(c, (word.shape[0] * 8, word.shape[1]))
    else:
        c = (word[:, :, None] >> (tl.arange(0, 8) * 3)[None, None, :]) & 7
        out = tl.reshape(c, (word.shape[0], word.shape[1] * 8))
    return out


@triton.jit
def pack3(c, ALONG_ROWS: tl.constexpr):
    """The three byte planes (uint8) of 3-bit codes ``c`` (int32 ``0 .. 7``): the inverse of :func:`unpack3`
    (codes ``[8 W, X]`` -> planes ``[W, X]`` with ``ALONG_ROWS``, else ``[X, 8 W]`` -> ``[X, W]``)."""
    if ALONG_ROWS:
        c3 = tl.reshape(c, (c.shape[0] // 8, 8, c.shape[1]))
        word = tl.sum(c3 << (tl.arange(0, 8) * 3)[None, :, None], axis=1)
    else:
        c3 = tl.reshape(c, (c.shape[0], c.shape[1] // 8, 8))
        word = tl.sum(c3 << (tl.arange(0, 8) * 3)[None, None, :], axis=2)
    return (word & 255).to(tl.uint8), ((word >> 8) & 255).to(tl.uint8), (word >> 16).to(tl.uint8)


@triton.jit
def load3(at, mask=None):
    """The 3-bit codes of the words at byte offsets ``at`` (a pointer tile, one per word, ``[W, X]`` or
    ``[X, W]``), their three planes loaded (masked: 0)."""
    if mask is None:
        planes = tl.load(at), tl.load(at + 1), tl.load(at + 2)
    else:
        planes = (tl.load(at, mask=mask, other=0), tl.load(at + 1, mask=mask, other=0),
                  tl.load(at + 2, mask=mask, other=0))
    return planes


@triton.jit
def store3(at, planes, mask=None):
    """Store :func:`pack3`'s planes at the words' byte offsets ``at``."""
    b0, b1, b2 = planes
    tl.store(at, b0, mask=mask)
    tl.store(at + 1, b1, mask=mask)
    tl.store(at + 2, b2, mask=mask)


@triton.jit
def group_offsets(r0, c0, R: tl.constexpr, C: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr,
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
def store_tile(x, codes_ptr, scale_ptr, zero_ptr, r0, c0, R: tl.constexpr, C: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr,
                SYM: tl.constexpr, BITS: tl.constexpr, PACK_Z: tl.constexpr):
    """Quantise the tile ``x [R, C]`` (rows ``r0``, columns ``c0`` of one head's ``[K, V]``) and store
    its codes, scales and zero points at the head's base pointers."""
    codes, scale, zero = quant_tile(x, R, C, G, KEY_AXIS, SYM, BITS)
    rows = r0 + tl.arange(0, R)
    if BITS == 4:
        cols = c0 // 2 + tl.arange(0, C // 2)
        tl.store(codes_ptr + rows[:, None] * (V // 2) + cols[None, :], pack_pairs(codes, R, C))
    elif BITS == 3:
        words = c0 // 8 + tl.arange(0, C // 8)
        store3(codes_ptr + rows[:, None] * (V * 3 // 8) + words[None, :] * 3, pack3(codes, False))
    else:
        cols = c0 + tl.arange(0, C)
        tl.store(codes_ptr + rows[:, None] * V + cols[None, :], codes.to(tl.uint8))
    tl.store(scale_ptr + group_offsets(r0, c0, R, C, G, KEY_AXIS, K, V, False), scale)
    if not SYM:
        if BITS == 3:
            tl.static_assert(KEY_AXIS, "3-bit zero points are read along the key axis only (kernels.plan)")
            words = c0 // 8 + tl.arange(0, C // 8)
            store3(zero_ptr + (r0 // G + tl.arange(0, R // G))[:, None] * (V * 3 // 8) + words[None, :] * 3,
                   pack3(zero, False))
        elif PACK_Z:
            if KEY_AXIS:
                zp = pack_pairs(zero, R // G, C)
            else:
                zp = pack_pairs(zero, R, C // G)
            tl.store(zero_ptr + group_offsets(r0, c0, R, C, G, KEY_AXIS, K, V, True), zp)
        else:
            tl.store(zero_ptr + group_offsets(r0, c0, R, C, G, KEY_AXIS, K, V, False), zero.to(tl.uint8))


@triton.jit
def load_tile(codes_ptr, scale_ptr, zero_ptr, r0, c0, R: tl.constexpr, C: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr,
               SYM: tl.constexpr, BITS: tl.constexpr, PACK_Z: tl.constexpr):
    """Dequantised fp32 tile ``[R, C]`` (rows ``r0``, columns ``c0``) of one head: ``(q - z) * scale``."""
    rows = r0 + tl.arange(0, R)
    if BITS == 4:
        cols = c0 // 2 + tl.arange(0, C // 2)
        codes = unpack_pairs(tl.load(codes_ptr + rows[:, None] * (V // 2) + cols[None, :]), R, C)
    elif BITS == 3:
        words = c0 // 8 + tl.arange(0, C // 8)
        b0, b1, b2 = load3(codes_ptr + rows[:, None] * (V * 3 // 8) + words[None, :] * 3)
        codes = unpack3(b0, b1, b2, False)
    else:
        cols = c0 + tl.arange(0, C)
        codes = tl.load(codes_ptr + rows[:, None] * V + cols[None, :]).to(tl.int32)
    scale = tl.load(scale_ptr + group_offsets(r0, c0, R, C, G, KEY_AXIS, K, V, False))
    if SYM:
        zero = tl.zeros(scale.shape, tl.int32)
    elif BITS == 3:
        tl.static_assert(KEY_AXIS, "3-bit zero points are read along the key axis only (kernels.plan)")
        words = c0 // 8 + tl.arange(0, C // 8)
        z0, z1, z2 = load3(zero_ptr + (r0 // G + tl.arange(0, R // G))[:, None] * (V * 3 // 8) + words[None, :] * 3)
        zero = unpack3(z0, z1, z2, False)
    else:
        if PACK_Z:
            zp = tl.load(zero_ptr + group_offsets(r0, c0, R, C, G, KEY_AXIS, K, V, True))
            if KEY_AXIS:
                zero = unpack_pairs(zp, R // G, C)
            else:
                zero = unpack_pairs(zp, R, C // G)
        else:
            zero = tl.load(zero_ptr + group_offsets(r0, c0, R, C, G, KEY_AXIS, K, V, False)).to(tl.int32)
    return dequant_tile(codes, scale, zero, R, C, G, KEY_AXIS, SYM, BITS)


@triton.jit
def dequant_tile(codes, scale, zero, R: tl.constexpr, C: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr,
                 SYM: tl.constexpr, BITS: tl.constexpr):
    """``(q - z) * scale`` fp32 ``[R, C]`` from unsigned codes int32 ``[R, C]`` and the per-group fp16 scales
    and int32 zero points of :func:`quant_tile` (unused when symmetric: the offset is ``2^(BITS-1)``)."""
    if SYM:
        q = sym_value(codes, BITS)
    else:
        q = codes.to(tl.float32) - expand(zero.to(tl.float32), R, C, G, KEY_AXIS)
    return q * expand(scale.to(tl.float32), R, C, G, KEY_AXIS)


@triton.jit
def ckpt_tile(dense_base, part, a0, as0, az0, a1, as1, az1, r0, c0, BK: tl.constexpr, BV: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr, SYM: tl.constexpr,
               BITS0: tl.constexpr, PZ0: tl.constexpr, BITS1: tl.constexpr, PZ1: tl.constexpr,
               TWO: tl.constexpr, DENSE: tl.constexpr):
    """The checkpoint tile ``[BK, BV]`` at rows ``r0``, columns ``c0`` of this head as fp32: a dense state's
    (``dense_base``: this head's ``[K, V]``) or the head's part of a packed one (:func:`ckpt_base`)."""
    if DENSE:
        rows = r0 + tl.arange(0, BK)
        cols = c0 + tl.arange(0, BV)
        S = tl.load(dense_base + rows[:, None] * V + cols[None, :]).to(tl.float32)
    else:
        if TWO:
            if part == 1:
                S = load_tile(a1, as1, az1, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM, BITS1, PZ1)
            else:
                S = load_tile(a0, as0, az0, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM, BITS0, PZ0)
        else:
            S = load_tile(a0, as0, az0, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM, BITS0, PZ0)
    return S


@triton.jit
def ckpt_store(x, dense_base, part, a0, as0, az0, a1, as1, az1, r0, c0, BK: tl.constexpr, BV: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr, SYM: tl.constexpr,
                BITS0: tl.constexpr, PZ0: tl.constexpr, BITS1: tl.constexpr, PZ1: tl.constexpr,
                TWO: tl.constexpr, DENSE: tl.constexpr):
    """Store the folded tile ``x [BK, BV]``: cast (dense) or quantised in this head's bit width."""
    if DENSE:
        rows = r0 + tl.arange(0, BK)
        cols = c0 + tl.arange(0, BV)
        store_as(dense_base + rows[:, None] * V + cols[None, :], x)
    else:
        if TWO:
            if part == 1:
                store_tile(x, a1, as1, az1, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM, BITS1, PZ1)
            else:
                store_tile(x, a0, as0, az0, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM, BITS0, PZ0)
        else:
            store_tile(x, a0, as0, az0, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM, BITS0, PZ0)


@triton.jit
def round_tile(x, R: tl.constexpr, C: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr, SYM: tl.constexpr,
               BITS: tl.constexpr):
    """``x [R, C]`` (whole groups) quantised in ``BITS`` bits (:func:`quant_tile`) and dequantised again."""
    codes, scale, zero = quant_tile(x, R, C, G, KEY_AXIS, SYM, BITS)
    return dequant_tile(codes, scale, zero, R, C, G, KEY_AXIS, SYM, BITS)


@triton.jit
def ckpt_round(x, part, BK: tl.constexpr, BV: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr,
               SYM: tl.constexpr, BITS0: tl.constexpr, BITS1: tl.constexpr, TWO: tl.constexpr):
    """``x [BK, BV]`` (whole groups) rounded in registers to this head's bit width: the values
    :func:`ckpt_store` then :func:`ckpt_tile` would give."""
    if TWO:
        if part == 1:
            out = round_tile(x, BK, BV, G, KEY_AXIS, SYM, BITS1)
        else:
            out = round_tile(x, BK, BV, G, KEY_AXIS, SYM, BITS0)
    else:
        out = round_tile(x, BK, BV, G, KEY_AXIS, SYM, BITS0)
    return out


@triton.jit
def bf16_split(x):
    """fp32 ``x`` as three fp32 terms that bfloat16 holds exactly (each rounded to nearest even) and whose
    sum is exactly ``x``: the operands of an exact tensor-core product. bfloat16 keeps fp32's exponent
    range, so no scaling is needed (finite ``x``, ``|x| < 2^127``)."""
    hi = round_bf16(x)
    r = x - hi
    mid = round_bf16(r)
    return hi, mid, r - mid


@triton.jit
def operand(x, BF16: tl.constexpr):
    """fp32 ``x`` holding bfloat16-exact values as a dot operand: bfloat16 on the GPU; fp32 under the
    interpreter (``BF16`` False), whose bfloat16 ``tl.dot`` is not exact; the values are the same."""
    if BF16:
        out = x.to(tl.bfloat16)
    else:
        out = x
    return out


@triton.jit
def centred(c, off, BITS: tl.constexpr, BF16: tl.constexpr):
    """Codes ``c`` (int32, one per element, ``0 .. 2^BITS - 1``) minus ``off`` (int32, broadcast) as the
    exact integers ``c - off``, a dot operand (see :func:`operand`). 4-bit codes on the GPU become
    bfloat16 ``128 + c`` by or-ing them into the bits of 128.0 (no int -> float conversion); other codes
    become fp32 ``2^23 + c`` the same way; then ``128 + off`` or ``2^23 + off`` is subtracted (exact)."""
    if BF16 and BITS <= 4:
        out = (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - (off + 128).to(tl.bfloat16)
    else:
        f = biased(c) - (off + 8388608).to(tl.float32)
        out = operand(f, BF16)
    return out


@triton.jit
def nibbles_bf16(p):
    """Packed 4-bit codes ``p`` (uint8, two per byte) as two bfloat16 tensors of ``p``'s shape, ``128 + c`` of the
    low nibbles and of the high nibbles, four bytes per instruction group (GPU only: inline PTX, one ``prmt``
    spreading two bytes into the halves of a word, then a mask or-ed into the bits of 128.0 per nibble).
    Declared impure so that Triton keeps it where the bytes were loaded (4 per thread, contiguous) instead of
    moving a dot operand's layout change above it, which would read the bytes back one at a time (64
    ``LDS.U8`` per thread in the dots kernel; kernels/bench/sass.py)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, s0, s1;
        prmt.b32 t0, $4, 0, 0x4140;
        prmt.b32 t1, $4, 0, 0x4342;
        shr.b32 s0, t0, 4;
        shr.b32 s1, t1, 4;
        lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $2, s0, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $3, s1, 0x000F000F, 0x43004300, 0xEA;
        }""",
        constraints="=r,=r,=r,=r,r",
        args=[p],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=False,
        pack=4,
    )


@triton.jit
def head_slot(part_ptr, slot_ptr, h, TWO: tl.constexpr):
    """Which part (0 or 1) of the checkpoint holds value head ``h``, and its slot there: read from the
    head table for two bit widths; with one, head ``h`` is slot ``h`` of part 0 (no table read on the
    critical path)."""
    if TWO:
        part = tl.load(part_ptr + h)
        slot = tl.load(slot_ptr + h).to(tl.int64)
    else:
        part = 0
        slot = h
    return part, slot


@triton.jit
def ckpt_base(part, slot, b, HV0, HV1, K: tl.constexpr, c0p, s0p, z0p, c1p, s1p, z1p,
               CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
               CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr):
    """Base pointers (codes, scale, zero) of this head in part 0 and part 1."""
    i0 = b * HV0 + slot
    i1 = b * HV1 + slot
    return (c0p + i0 * K * CC0, s0p + i0 * SS0, z0p + i0 * ZS0, c1p + i1 * K * CC1, s1p + i1 * SS1, z1p + i1 * ZS1)


@triton.jit
def part_head(pid, map_ptr, H: tl.constexpr, HV: tl.constexpr, HP: tl.constexpr, MAPPED: tl.constexpr):
    """The (sequence, value head) of program ``pid`` of a launch over one checkpoint part of ``HP`` value heads per
    sequence: ``b``, its slot in the part (the head's index there is ``b HP + slot``), the value head ``h``
    (``MAPPED``: slot ``s`` is value head ``map_ptr[s]``, else the slot itself) and its key head."""
    b = pid // HP
    slot = pid % HP
    if MAPPED:
        h = tl.load(map_ptr + slot).to(tl.int64)
    else:
        h = slot
    return b, slot, h, h // (HV // H)


@triton.jit
def pool_row(pid, rows_ptr, HP):
    """Program ``pid`` of a launch over ``B`` rows of a state pool (``rows_ptr [B]``: their slots), ``HP`` programs per
    row: its batch row, that row's slot, and the program within the row (:mod:`kernels.pool_step`)."""
    r = pid // HP
    return r, tl.load(rows_ptr + r).to(tl.int64), pid % HP


@triton.jit
def row_inputs(r, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, H, HV, K: tl.constexpr, V: tl.constexpr):
    """The pointers of batch row ``r``'s token: ``q, k [H, K]``, ``v [HV, V]``, ``g, beta [HV]``, ``o [HV, V]``."""
    return (q_ptr + r * H * K, k_ptr + r * H * K, v_ptr + r * HV * V, g_ptr + r * HV, beta_ptr + r * HV,
            o_ptr + r * HV * V)


@triton.jit
def slot_parts(slot, strides_ptr, c0p, s0p, z0p, c1p, s1p, z1p):
    """The checkpoint parts' pointers (codes, scale, zero of part 0, then of part 1) moved to pool slot ``slot``
    (``strides_ptr[0..5]``: their slot strides in elements: a pool's rows, or an engine's pages)."""
    return (c0p + slot * tl.load(strides_ptr), s0p + slot * tl.load(strides_ptr + 1),
            z0p + slot * tl.load(strides_ptr + 2), c1p + slot * tl.load(strides_ptr + 3),
            s1p + slot * tl.load(strides_ptr + 4), z1p + slot * tl.load(strides_ptr + 5))


@triton.jit
def packed_head(pid, H, HV, part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p, HV0, HV1, K: tl.constexpr,
                 CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr,
                 ZS1: tl.constexpr, TWO: tl.constexpr, MAPPED: tl.constexpr):
    """The (sequence, value head) of program ``pid`` of a packed-checkpoint kernel: ``b, h``, the key head
    ``kh``, the head's part (bit width), its base pointers in both parts (:func:`ckpt_base`) and its row
    ``b HV + h`` of the per-head tensors. ``MAPPED``: a launch over one part's heads only
    (:func:`kernels.plan.ckpt_launches`), program ``pid`` is slot ``pid % HV0`` of sequence ``pid // HV0``
    and ``part_ptr`` maps slots to value heads."""
    if MAPPED:
        b, slot, h, _ = part_head(pid, part_ptr, H, HV, HV0, True)
        part = 0
    else:
        b = pid // HV
        h = pid % HV
        part, slot = head_slot(part_ptr, slot_ptr, h, TWO)
    a0, as0, az0, a1, as1, az1 = ckpt_base(part, slot, b, HV0, HV1, K, c0p, s0p, z0p, c1p, s1p, z1p,
                                            CC0, SS0, ZS0, CC1, SS1, ZS1)
    return b, h, h // (HV // H), part, a0, as0, az0, a1, as1, az1, b * HV + h
