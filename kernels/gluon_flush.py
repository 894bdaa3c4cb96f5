"""The flush of 4-bit key-axis checkpoints in Gluon (explicit layouts, GPU only): fold the buffered records into the
checkpoint and requantise it in place, ``S = e^{G} Ŝ + Σ_i e^{G-G_i} k_i u_iᵀ`` (PACE_SPEC §3), as
:mod:`kernels.flush` does, with every value of the tile in the registers of one warp.

One warp per (sequence, value head, 32 value columns), ``G`` key rows (one key group) at a time. The tile is
the accumulator of ``mma.m16n8k16``, ``acc [G, 32]`` (key rows by value columns), whose thread holds, in each
of the four 8-column steps ``t``, the column pair ``2q, 2q + 1`` (``q``: the lane's place in its quad) of its
rows: one code byte. The columns are renumbered so that the thread's four bytes of a row are one 32-bit word
of the codes (accumulator column ``8t + 2q + e`` is value column ``8q + 2t + e`` of the tile): a word is
loaded, unpacked (:func:`_unpack`, ``prmt`` of each nibble into the bits of ``2^23 + c``) and rearranged into
the accumulator without data movement (``convert_layout(assert_trivial=True)``), dequantised, folded on tensor
cores (A: the keys, exact in one or two bfloat16 terms; B: ``e^{G-G_i} u_i`` with the scales, three bfloat16
terms: every product exact, fp32 sums), requantised with a key group's range a reduction along the accumulator's
rows, and packed back into words (:func:`_pack`) in the same places.

Takes the flush launches of PACE-4 (symmetric codes; int8 keys and values, one scale per vector, at most 16 records)
and of PACE-4/8's 4-bit heads (packed zero points; 4-bit keys in groups with zero points, bfloat16 values, at most 8)
(:func:`kernels.plan.gluon_flush_apply`); the Triton kernel stays the definition of the flush and runs everywhere
else. Within float32 rounding of the Triton kernel's fold (the sums in another order), then the same
requantisation (:mod:`kernels.primitives`' ``sym_scale`` / ``sym_code_sum`` and ``asym_scale`` /
``asym_code_sum``).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .gluon_dots import LA, LB, MMA
from .plan import DecodePlan, SplitLaunch
from .primitives import (
    TWO23,
    asym_code_sum,
    asym_scale,
    bf16_split,
    biased,
    code_clamp,
    part_head,
    slot_parts,
    sym_code_sum,
    sym_fits,
    sym_scale,
    sym_value,
)
from .records import full_row, slot_records

COLUMNS = gl.constexpr(32)
"""Value columns per program: four 8-column steps of the accumulator, one 32-bit word of codes per key row and
thread."""

_LANES_A = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]  # A's lanes: columns 2q, rows of the quad
_LANES_B = [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]]

_UNPACK = gl.constexpr("{\n.reg .b32 lo, hi;\nand.b32 lo, $8, 0x0F0F0F0F;\nshr.b32 hi, $8, 4;\n"
                       "and.b32 hi, hi, 0x0F0F0F0F;\n" + "".join(
                           f"prmt.b32 ${2 * t + e}, {('lo', 'hi')[e]}, 0x4B000000, 0x744{t};\n"
                           for t in range(4) for e in range(2)) + "}")
"""A word of 8 codes -> 8 fp32 ``2^23 + c``, code ``p = 2t + e`` (byte ``t``, low or high nibble): the low and the
high nibbles masked into their bytes, then one ``prmt`` per code puts its byte under the bits of ``2^23``."""

_PACK = gl.constexpr("{\n.reg .b32 a, b, l, h;\n"
                     "prmt.b32 a, $1, $3, 0x0040;\nprmt.b32 b, $5, $7, 0x0040;\nprmt.b32 l, a, b, 0x5410;\n"
                     "prmt.b32 a, $2, $4, 0x0040;\nprmt.b32 b, $6, $8, 0x0040;\nprmt.b32 h, a, b, 0x5410;\n"
                     "shl.b32 h, h, 4;\nor.b32 $0, l, h;\n}")
"""8 codes (the low byte of each input) -> a word, code ``2t`` in the low and ``2t + 1`` in the high nibble of
byte ``t``: ``prmt`` gathers the even and the odd codes into bytes, the odd ones shifted into the high nibbles."""


@gluon.jit
def _value_column(ct, n):
    """The value column of accumulator column ``n = 8t + 2q + e`` in column tile ``ct``: ``32 ct + 8q + 2t + e``
    (thread ``q``'s code bytes of a row are one word)."""
    return ct * COLUMNS + 8 * ((n >> 1) & 3) + 2 * (n >> 3) + (n & 1)


@gluon.jit
def _unpack(w):
    """The 8 codes of each word ``w`` (int32) as fp32 ``2^23 + c``, in code order."""
    return gl.inline_asm_elementwise(_UNPACK, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
                                     (gl.float32, gl.float32, gl.float32, gl.float32,
                                      gl.float32, gl.float32, gl.float32, gl.float32), True, 1)


@gluon.jit
def _pack(c0, c1, c2, c3, c4, c5, c6, c7):
    """Words of the 8 codes ``c0 .. c7`` (int32, each code in its low byte)."""
    return gl.inline_asm_elementwise(_PACK, "=r,r,r,r,r,r,r,r,r", [c0, c1, c2, c3, c4, c5, c6, c7], gl.int32,
                                     True, 1)


@gluon.jit
def _tile(f0, f1, f2, f3, f4, f5, f6, f7):
    """The accumulator ``[G, 32]`` from the 8 per-code tensors ``[G, 4]`` (word ``q`` of each row): code
    ``2t + e`` of word ``q`` is accumulator column ``8t + 2q + e``, already in the thread that holds it."""
    x = gl.join(gl.join(gl.join(f0, f1), gl.join(f2, f3)), gl.join(gl.join(f4, f5), gl.join(f6, f7)))
    G: gl.constexpr = f0.shape[0]
    x = gl.reshape(gl.permute(x, [0, 4, 3, 1, 2]), [G, 32])  # (row, q, e, t0, t1) -> (row, t1, t0, q, e)
    return gl.convert_layout(x, MMA, assert_trivial=True)


@gluon.jit
def _words(x, LW: gl.constexpr):
    """The inverse of :func:`_tile` for the int32 ``x [G, 32]``, packed: words ``[G, 4]``."""
    G: gl.constexpr = x.shape[0]
    x = gl.permute(gl.reshape(x, [G, 2, 2, 4, 2]), [0, 3, 4, 2, 1])  # (row, t1, t0, q, e) -> (row, q, e, t0, t1)
    lo, hi = gl.split(x)
    c0, c2 = gl.split(lo)
    c4, c6 = gl.split(hi)
    c0, c1 = gl.split(c0)
    c2, c3 = gl.split(c2)
    c4, c5 = gl.split(c4)
    c6, c7 = gl.split(c6)
    return _pack(gl.convert_layout(c0, LW, assert_trivial=True), gl.convert_layout(c1, LW, assert_trivial=True),
                 gl.convert_layout(c2, LW, assert_trivial=True), gl.convert_layout(c3, LW, assert_trivial=True),
                 gl.convert_layout(c4, LW, assert_trivial=True), gl.convert_layout(c5, LW, assert_trivial=True),
                 gl.convert_layout(c6, LW, assert_trivial=True), gl.convert_layout(c7, LW, assert_trivial=True))


@gluon.jit
def _kept(x):
    """``x`` (fp32) through a copy the compiler may not move or drop (impure): what is computed from it stays
    inside its branch instead of being hoisted and selected, which would run the branch for every tile."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], gl.float32, False, 1)


@gluon.jit
def _stack(x, y, L: gl.constexpr):
    """``[2R, C]``: ``x [R, C]`` above ``y`` (in ``x``'s registers, renumbered as layout ``L``)."""
    R: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1]
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(x, y), [2, 0, 1]), [2 * R, C]), L, assert_trivial=True)


@gluon.jit
def _beside(x, y, L: gl.constexpr):
    """``[R, 2C]``: ``x [R, C]`` left of ``y`` (in ``x``'s registers, renumbered as layout ``L``)."""
    R: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1]
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(x, y), [0, 2, 1]), [R, 2 * C]), L, assert_trivial=True)


@gluon.jit
def record_log_decays(bg_ptr, n, at, HV: gl.constexpr, RB: gl.constexpr, L: gl.constexpr, W: gl.constexpr = 1):
    """The log decays of the ``n`` held records (``RB`` slots; ``at``: the first record's decay, ``bg_ptr``'s index,
    a record's next one ``HV`` further): ``G - G_i`` of each slot (the sum of the newer records' log decays) in
    layout ``SliceLayout(1, L)``, and ``G``, the sum of all ``n`` (:func:`kernels.records.record_reads`); ``W``: the
    program's warps."""
    P: gl.constexpr = gl.BlockedLayout([1, RB], [32, 1], [W, 1], [1, 0])
    i = gl.arange(0, RB, layout=gl.SliceLayout(1, P))
    j = gl.arange(0, RB, layout=gl.SliceLayout(0, P))
    gj = gl.load(bg_ptr + at + j * HV, mask=j < n, other=0.0)
    later = gl.sum(gl.where(j[None, :] > i[:, None], gj[None, :], 0.0), axis=1)
    return gl.convert_layout(later, gl.SliceLayout(1, L)), gl.sum(gj, axis=0)


@gluon.jit
def records_held(bg_ptr, h, cap, HV: gl.constexpr, NB: gl.constexpr, W: gl.constexpr):
    """The records a pool slot holds (``cap <= NB`` slots), counted from its value head ``h``'s log decays as
    :func:`kernels.records.records_held` counts them (a record's is <= 0, an empty slot's
    :data:`pace_core.buffer.EMPTY`)."""
    i = gl.arange(0, NB, layout=gl.BlockedLayout([1], [32], [W], [0]))
    return gl.sum((gl.load(bg_ptr + i * HV + h, mask=i < cap, other=1.0) <= 0).to(gl.int32), axis=0)


@gluon.jit
def _weights(bv_ptr, bvs_ptr, bg_ptr, bks_ptr, n, cap, b, h, kh, ct, H: gl.constexpr, HV: gl.constexpr,
             V: gl.constexpr, RB: gl.constexpr, REC: gl.constexpr, LU: gl.constexpr):
    """The B operands of the fold (:func:`_flush_kernel`) and ``e^{G}``: the records' ``e^{G - G_i} u_i`` (times
    the int8 key's and value's scales with ``REC`` 0) over the tile's columns, renumbered (accumulator column ``n`` is
    value column ``8q + 2t + e``), as three bfloat16 terms ``[RB, 32]``; zero past ``n``. With 8 slots the terms are
    stacked for dots of 16 (``REC`` 0: hi over mid, then lo over 0, against the keys beside themselves; ``REC`` 1:
    each term over itself, against a key's two terms)."""
    rec = gl.arange(0, RB, layout=gl.SliceLayout(1, LU))
    valid = rec < n
    later, run = record_log_decays(bg_ptr, n, b * cap * HV + h, HV, RB, LU)
    decay = gl.where(valid, gl.exp(later), 0.0)  # e^{G - G_i}, 0 past n
    nb = gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, LU))
    vb = _value_column(ct, nb)[None, :]
    if REC == 0:  # int8 values, one scale per vector; code bytes of slots past n (inside the capacity, finite)
        kscale = gl.load(bks_ptr + (b * cap + rec) * H + kh, mask=valid, other=0.0).to(gl.float32)
        uscale = gl.load(bvs_ptr + (b * cap + rec) * HV + h, mask=valid, other=0.0).to(gl.float32)
        uc = gl.load(bv_ptr + ((b * cap + gl.minimum(rec, cap - 1)) * HV + h)[:, None] * V + vb)
        u = sym_value(uc, 8) * uscale[:, None]
        w = (decay * kscale)[:, None] * u
    else:  # bfloat16 values
        u = gl.load(bv_ptr + ((b * cap + rec) * HV + h)[:, None] * V + vb, mask=valid[:, None], other=0.0)
        w = decay[:, None] * u.to(gl.float32)
    w_hi, w_mid, w_lo = bf16_split(w)
    w_hi, w_mid, w_lo = w_hi.to(gl.bfloat16), w_mid.to(gl.bfloat16), w_lo.to(gl.bfloat16)
    if RB == 8:
        if REC == 0:
            w_hi, w_mid, w_lo = _stack(w_hi, w_mid, LB), _stack(w_lo, gl.zeros_like(w_lo), LB), w_lo
        else:
            w_hi, w_mid, w_lo = _stack(w_hi, w_hi, LB), _stack(w_mid, w_mid, LB), _stack(w_lo, w_lo, LB)
    return w_hi, w_mid, w_lo, gl.exp(run)


@gluon.jit
def _key_rows(n, cap, b, kh, H: gl.constexpr, G: gl.constexpr, RB: gl.constexpr, LK: gl.constexpr):
    """What :func:`_keys` addresses, the same in every key group: the ``RB`` record slots' key vectors ``[1, RB]``
    (slots past ``n`` inside the capacity: finite codes), a group's rows ``[G, 1]`` and whether a slot is held."""
    r = gl.arange(0, G, layout=gl.SliceLayout(1, LK))[:, None]
    i = gl.arange(0, RB, layout=gl.SliceLayout(0, LK))[None, :]
    return (b * cap + gl.minimum(i, cap - 1)) * H + kh, r, i < n


@gluon.jit
def _keys(bk_ptr, bks_ptr, bkz_ptr, vec, r, held, r0: gl.constexpr, K: gl.constexpr, REC: gl.constexpr,
          RB: gl.constexpr, KG: gl.constexpr):
    """The A operand of the fold for key rows ``r0 + r`` (:func:`_key_rows`; ``r0`` a constant, so that a group's
    addresses are the first group's plus an immediate offset): ``REC`` 0, the int8 key codes minus 128, exact (with
    8 slots beside themselves); ``REC`` 1, 4-bit key codes in groups of ``KG`` rows, ``(c - z) s`` exact in two
    bfloat16 terms (at most 15 significant bits), the hi terms beside the lo terms of the 8 slots; zero past ``n``."""
    if REC == 0:
        kc = gl.load(bk_ptr + vec * K + r + r0)
        a = sym_value(kc, 8).to(gl.bfloat16)
        if RB == 8:
            a = _beside(a, a, LA)
    else:
        NKG: gl.constexpr = K // KG
        kc = (gl.load(bk_ptr + vec * (K // 2) + r // 2 + r0 // 2).to(gl.int32) >> ((r & 1) * 4)) & 15
        grp = (r + r0) // KG
        ks = gl.load(bks_ptr + vec * NKG + grp, mask=held, other=0.0).to(gl.float32)
        kz = (gl.load(bkz_ptr + vec * (NKG // 2) + grp // 2).to(gl.int32) >> ((grp & 1) * 4)) & 15
        a_hi, a_lo, _ = bf16_split((biased(kc) - biased(kz)) * ks)
        a = _beside(a_hi.to(gl.bfloat16), a_lo.to(gl.bfloat16), LA)
    return a


@gluon.jit
def _flush_kernel(codes_ptr, scale_ptr, zero_ptr, map_ptr, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap,
                  full_ptr, strides_ptr, H: gl.constexpr, HV: gl.constexpr, HP: gl.constexpr, MAPPED: gl.constexpr,
                  K: gl.constexpr, V: gl.constexpr, G: gl.constexpr, SYM: gl.constexpr, SS: gl.constexpr,
                  ZS: gl.constexpr, RB: gl.constexpr, REC: gl.constexpr, KG: gl.constexpr, LW: gl.constexpr,
                  LK: gl.constexpr, LU: gl.constexpr, GROUPS: gl.constexpr, POOL: gl.constexpr = False):
    """Fold the ``n`` buffered records into columns ``32 c .. 32 c + 31`` (``c``: program axis 1) of one (sequence,
    value head)'s 4-bit key-axis checkpoint (codes ``[K, V/2]`` bytes, fp16 scales ``[K/G, V]``, with ``SYM`` False
    zero points ``[K/G, V/2]`` bytes packed like the codes; the part holds ``HP`` heads per sequence, ``MAPPED``: slot
    ``s`` is value head ``map_ptr[s]``; ``SS`` scales and ``ZS`` zero-point bytes per head) and requantise them in
    place. Records (``RB`` slots, 8 or 16, at least ``n``; fp32 log decays ``[B, cap, HV]``): ``REC`` 0, int8 keys
    ``[B, cap, H, K]`` and values ``[B, cap, HV, V]`` with one fp16 scale per vector (PACE-4's buffer); ``REC`` 1 (8
    slots), 4-bit keys ``[B, cap, H, K/2]`` in groups of ``KG`` rows with fp16 scales and packed zero points,
    bfloat16 values (PACE-4/8's). ``LW``: a ``[G, 4]`` block of code words, word ``q`` of row ``r`` in lane
    ``4 (r % 8) + q``; ``LK``, ``LU``: the keys ``[G, RB]`` and weights ``[RB, 32]`` (:func:`layouts`). ``GROUPS``: the
    key groups of a program, ``K / G`` (all) or fewer: program axis 2 then picks the block of groups (more programs
    at small batch, each computing the records' weights again). ``POOL``: the programs fold the full slots ``full_ptr``
    of a state pool (:func:`kernels.records.full_slots`: ``cap`` records each; the pointers are the first slot's,
    ``strides_ptr`` the slot strides of :func:`kernels.pool_step.slot_strides`), the first rows' programs; the others
    exit (``n`` unused), as :func:`kernels.flush._flush_kernel` does."""
    gl.static_assert(G % 16 == 0 and G <= 64, "key groups of 16 to 64 rows")
    pid = gl.program_id(0).to(gl.int64)
    ct = gl.program_id(1)
    if POOL:  # the pool's full slots first (full_ptr: kernels.records.full_slots); the other programs exit
        folds, slot_i, pid = full_row(pid, full_ptr, HP)
        if folds:
            codes_ptr, scale_ptr, zero_ptr, _, _, _ = slot_parts(slot_i, strides_ptr, codes_ptr, scale_ptr, zero_ptr,
                                                                 codes_ptr, codes_ptr, codes_ptr)
            bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, _, bg_ptr = slot_records(
                slot_i, strides_ptr + 6, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bv_ptr, bg_ptr)
            flush_columns(codes_ptr, scale_ptr, zero_ptr, map_ptr, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bg_ptr,
                          cap, cap, pid, ct, H, HV, HP, MAPPED, K, V, G, SYM, SS, ZS, RB, REC, KG, LW, LK, LU, GROUPS)
    else:
        flush_columns(codes_ptr, scale_ptr, zero_ptr, map_ptr, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bg_ptr, n,
                      cap, pid, ct, H, HV, HP, MAPPED, K, V, G, SYM, SS, ZS, RB, REC, KG, LW, LK, LU, GROUPS)


@gluon.jit
def flush_columns(codes_ptr, scale_ptr, zero_ptr, map_ptr, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap,
                  pid, ct, H: gl.constexpr, HV: gl.constexpr, HP: gl.constexpr, MAPPED: gl.constexpr, K: gl.constexpr,
                  V: gl.constexpr, G: gl.constexpr, SYM: gl.constexpr, SS: gl.constexpr, ZS: gl.constexpr,
                  RB: gl.constexpr, REC: gl.constexpr, KG: gl.constexpr, LW: gl.constexpr, LK: gl.constexpr,
                  LU: gl.constexpr, GROUPS: gl.constexpr):
    """The fold and requantisation of program ``(pid, ct)`` of :func:`_flush_kernel` (its arguments; also the fold of
    :mod:`kernels.gluon_step`'s programs, one warp, ``ct`` each column tile in turn)."""
    # the columns' scales (and zero points) once per lane: one column, or with zero points a pair (one byte)
    LC: gl.constexpr = gl.BlockedLayout([1 if SYM else 2], [32], [1], [0])
    NW: gl.constexpr = V // 8  # 32-bit words per key row
    b, slot, h, kh = part_head(pid, map_ptr, H, HV, HP, MAPPED)
    head = b * HP + slot
    w_hi, w_mid, w_lo, total = _weights(bv_ptr, bvs_ptr, bg_ptr, bks_ptr, n, cap, b, h, kh, ct, H, HV, V, RB, REC, LU)

    n_col = gl.arange(0, COLUMNS, layout=LC)
    v_col = _value_column(ct, n_col)
    n_acc = gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, MMA))
    v_acc = _value_column(ct, n_acc)
    rw = gl.arange(0, G, layout=gl.SliceLayout(1, LW))[:, None]
    qw = gl.arange(0, 4, layout=gl.SliceLayout(0, LW))[None, :]
    words = codes_ptr.to(gl.pointer_type(gl.int32)) + head * (K * NW) + ct * 4 + qw
    vec, r, held = _key_rows(n, cap, b, kh, H, G, RB, LK)
    if GROUPS < K // G:  # this program's block of key groups: every row address moves by its first row
        first = gl.program_id(2) * GROUPS
        words = words + first * (G * NW)
        scale_ptr = scale_ptr + first * V
        zero_ptr = zero_ptr + first * (NW * 4)
        r = r + first * G
    for g in gl.static_range(GROUPS):
        at = words + (g * G + rw) * NW
        f0, f1, f2, f3, f4, f5, f6, f7 = _unpack(gl.load(at))
        s_at = scale_ptr + head * SS + g * V
        if SYM:
            off = TWO23 + 8
        else:  # the column's zero point: byte v // 2 of the group's row, low nibble for even v
            zb = gl.load(zero_ptr + head * ZS + g * NW * 4 + v_acc // 2).to(gl.int32)
            off = biased((zb >> ((v_acc & 1) * 4)) & 15)[None, :]
        x = (_tile(f0, f1, f2, f3, f4, f5, f6, f7) - off) * (total * gl.load(s_at + v_acc).to(gl.float32))[None, :]
        a = _keys(bk_ptr, bks_ptr, bkz_ptr, vec, r, held, g * G, K, REC, RB, KG)
        x = mma_v2(a, w_hi, x)
        x = mma_v2(a, w_mid, x)
        if REC == 1 or RB == 16:
            x = mma_v2(a, w_lo, x)
        # each column's scale computed once (the accumulator's rows hold 8 copies of each column)
        if SYM:
            amax = gl.convert_layout(gl.max(gl.abs(x), axis=0), LC)
            scale, div, rdiv = sym_scale(amax, 4)
            div = gl.convert_layout(div, gl.SliceLayout(0, MMA))[None, :]
            rdiv = gl.convert_layout(rdiv, gl.SliceLayout(0, MMA))[None, :]
            c = sym_code_sum(x, div, rdiv, 4, False)
            if gl.max(amax, axis=0) > sym_fits(4):  # a scale clamped at fp16's largest: clamp the codes
                c = code_clamp(_kept(c), 4)
        else:
            lo = gl.convert_layout(gl.min(x, axis=0), LC)
            hi = gl.convert_layout(gl.max(x, axis=0), LC)
            scale, div, rdiv, zf = asym_scale(lo, hi, 4)
            zl, zh = gl.split(gl.reshape(zf.to(gl.int32), [COLUMNS // 2, 2]))
            jz = gl.arange(0, COLUMNS // 2, layout=gl.SliceLayout(1, gl.BlockedLayout([1, 2], [32, 1], [1, 1], [1, 0])))
            gl.store(zero_ptr + head * ZS + g * NW * 4 + _value_column(ct, 2 * jz) // 2,
                     gl.convert_layout(zl | (zh << 4), jz.type.layout).to(gl.uint8))
            c = asym_code_sum(x, gl.convert_layout(div, gl.SliceLayout(0, MMA))[None, :],
                              gl.convert_layout(rdiv, gl.SliceLayout(0, MMA))[None, :],
                              gl.convert_layout(zf, gl.SliceLayout(0, MMA))[None, :], 4)
        gl.store(s_at + v_col, scale)
        gl.store(at, _words(c.to(gl.int32, bitcast=True), LW))


@functools.cache
def layouts(G: int, RB: int) -> dict:
    """The host-built layouts of :func:`_flush_kernel` for key groups of ``G`` rows and ``RB`` record slots: ``LW``,
    a ``[G, 4]`` block of code words as the threads of the ``[G, 32]`` accumulator hold them (row ``r``: lanes
    ``4 (r % 8) ..``, register ``r // 8``); ``LK``, ``LU``: the keys ``[G, RB]`` and weights ``[RB, 32]``, the
    tensor-core operands' layouts for 16 slots, for 8 the first halves of them (registers and lanes of the records
    0-7). Made once per (G, RB): a flush launch reads them from the cache."""
    rows = [[8 << i, 0] for i in range((G // 8).bit_length() - 1)]
    lw = gl.DistributedLinearLayout(rows, [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], [], [], [G, 4])
    if RB == 16:
        return dict(LW=lw, LK=LA.value, LU=LB.value)
    return dict(LW=lw, LK=gl.DistributedLinearLayout([[0, 1]] + rows, _LANES_A, [], [], [G, 8]),
                LU=gl.DistributedLinearLayout([[1, 0], [0, 8], [0, 16]], _LANES_B, [], [], [8, COLUMNS.value]))


def launch(plan: DecodePlan, n: int, launch: SplitLaunch, full: torch.Tensor | None = None,
           strides: torch.Tensor | None = None) -> None:
    """One :func:`_flush_kernel` launch over the value heads of one 4-bit part (``launch``, one of
    ``plan.split.per_width``), folding the buffer's ``n`` records (``plan.records``); ``full [1 + B]`` (on the
    device, :func:`kernels.records.full_slots`): the full slots of ``B`` rows of a state pool whose first slot
    ``plan`` is (slot strides ``strides``; ``n`` unused)."""
    B, H, HV, K, V = plan.shape
    if full is not None:
        B = full.numel() - 1
    sp = plan.split
    part = launch.ckpt.parts[0]
    r = plan.records
    RB = max(plan.record_block, 8)  # the layouts' 8 or 16 slots
    cap = {} if sp.settings.flush_maxnreg is None else {"maxnreg": sp.settings.flush_maxnreg}
    blocks = min(sp.settings.flush_row_blocks, K // sp.group)
    _flush_kernel[(B * launch.heads, V // COLUMNS.value, blocks)](
        part.codes, part.scale, part.zero, launch.ckpt.table, r.keys, r.key_scale, r.key_zero, r.values, r.value_scale,
        r.log_decays, n, plan.capacity, full, strides, H=H, HV=HV, HP=launch.heads,
        MAPPED=launch.ckpt.mapped, K=K, V=V, G=sp.group, SYM=sp.symmetric, SS=part.layout.scale_size,
        ZS=part.layout.zero_size, RB=RB,
        REC=0 if r.layout.keys.bits == 8 else 1, KG=r.layout.keys.group, **layouts(sp.group, RB),
        GROUPS=K // sp.group // blocks, num_warps=1, **cap, POOL=full is not None)
