"""The decode step of packed key-axis checkpoints (PACE-4, PACE-4/8, PACE-3): two kernels per token, or one.

- the dots kernel (:func:`launch_dots`), one program per (sequence, value head, column block), reads the
  packed checkpoint once and forms ``Ŝᵀk_t`` and ``Ŝᵀq_t`` together on tensor cores (:func:`_ckpt_dots`:
  one ``[16, G] x [G, N]`` dot per key group, ``k`` and ``q`` split into three bfloat16 terms each, the
  codes turned into the exact integers ``c - z`` by bit operations, 4-bit codes as even / odd half tiles)
  into the plan's workspace;
- the record kernel (:func:`launch_records`), one small program per (sequence, value head), adds the
  buffered records' part, forms ``u_t`` and ``o_t`` and writes the record into the buffer in its precision;
- as one kernel (:func:`_ckpt_step_kernel`, or :mod:`kernels.gluon_step`; setting ``fused_step`` of
  :class:`kernels.settings.SplitSettings`);
- a window of tokens known at once (teacher forcing) runs that one-kernel step over its tokens in one launch
  (:func:`launch_window`).

The flush that follows the token that fills the buffer is :mod:`kernels.flush`. Tolerances against the
reference: :mod:`kernels.backend`. Under the Triton interpreter (CPU tensors) the tensor-core operands stay
fp32 holding the same bfloat16-exact values (:func:`kernels.primitives.operand`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pace_core.buffer import DecodeBuffer
from pace_core.errors import PaceError

from .plan import DecodePlan
from .primitives import (
    bf16_split,
    centred,
    load3,
    nibbles_bf16,
    operand,
    packed_head,
    pool_row,
    row_inputs,
    slot_parts,
    unpack3,
)
from .records import RECORD_COUNT, append_record, record_reads, records_held, slot_records, token_output


@triton.jit
def _ckpt_dots(codes, scale, zero, kx, qx, c0, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
               G: tl.constexpr, SYM: tl.constexpr, BITS: tl.constexpr, PACK_Z: tl.constexpr,
               BF16: tl.constexpr):
    """``Ŝᵀk`` and ``Ŝᵀq`` of one head's packed key-axis checkpoint, columns ``c0 .. c0+BV``; ``k, q [K]``
    at ``kx, qx``. Returns ``(yk_a, yq_a, yk_b, yq_b)``, each ``[NP]`` fp32: for 4-bit codes the even
    (``_a``) and odd (``_b``) columns, ``c0 + 2j`` and ``c0 + 2j + 1``; else ``_a`` all columns
    ``c0 + j`` and ``_b`` zeros. ``NP = max(N, 16)`` (``N`` = BV / 2 or BV): entries past N are padding.
    3-bit codes (and zero points) are read as the three byte planes of their 24-bit words and unpacked in
    registers (:func:`kernels.primitives.unpack3`) before the dot.

    Per key group one ``[16, G] x [G, N]`` dot on tensor cores with fp32 accumulation: rows 0-2 hold
    ``k`` and rows 3-5 ``q``, each split into three bfloat16 terms (:func:`bf16_split`), against the
    exact integers ``c - z`` (:func:`centred`; 4-bit codes on the GPU: :func:`nibbles_bf16`, four bytes at a
    time); every product is exact and the group adds ``s T`` per column (``T = Σ_i x_i (c_i - z)``).
    4-bit codes are taken as two half tiles, the low nibbles (even columns) and the high nibbles (odd
    columns), so no unpacking shuffle is needed. Against
    the reference, which rounds each ``s (c - z)`` to fp32 and sums in IEEE fp32, the differences are
    the summation order and the tensor cores' fp32 accumulation: float32-rounding level."""
    KB: tl.constexpr = G if G >= 16 else 16
    HALVES: tl.constexpr = BITS == 4
    N: tl.constexpr = BV // 2 if HALVES else BV
    NP: tl.constexpr = N if N >= 16 else 16  # a dot has at least 16 columns: pad with masked ones
    rr = tl.arange(0, 16)[:, None]
    rows = tl.arange(0, KB)
    m = rows < G
    j = tl.arange(0, NP)
    cm = j < N
    acc_a = tl.zeros((16, NP), tl.float32)  # even columns (4-bit) or all columns
    acc_b = tl.zeros((16, NP), tl.float32)  # odd columns (4-bit)
    for r0 in tl.static_range(0, K, G):
        k1, k2, k3 = bf16_split(tl.load(kx + r0 + rows, mask=m, other=0.0))
        q1, q2, q3 = bf16_split(tl.load(qx + r0 + rows, mask=m, other=0.0))
        a = tl.where(rr == 0, k1[None, :], tl.where(rr == 1, k2[None, :], tl.where(rr == 2, k3[None, :], 0.0)))
        a = operand(tl.where(rr == 3, q1[None, :], tl.where(rr == 4, q2[None, :], tl.where(rr == 5, q3[None, :], a))),
                     BF16)
        srow = scale + (r0 // G) * V
        if HALVES:
            raw = tl.load(codes + (r0 + rows[:, None]) * (V // 2) + c0 // 2 + j[None, :], mask=m[:, None] & cm[None, :],
                          other=0)
            if SYM:
                off_a = 1 << (BITS - 1)
                off_b = 1 << (BITS - 1)
            else:
                tl.static_assert(PACK_Z, "4-bit key-axis zero points are packed (pace_core.quant)")
                zp = tl.load(zero + (r0 // G) * (V // 2) + c0 // 2 + j, mask=cm, other=0).to(tl.int32)
                off_a = (zp & 15)[None, :]
                off_b = (zp >> 4)[None, :]
            s_a = tl.load(srow + c0 + 2 * j, mask=cm, other=0.0).to(tl.float32)
            s_b = tl.load(srow + c0 + 2 * j + 1, mask=cm, other=0.0).to(tl.float32)
            if BF16:  # 4 bytes per unpacking group, before the tile is laid out for the dot
                lo, hi = nibbles_bf16(raw)
                acc_a += s_a[None, :] * tl.dot(a, lo - (off_a + 128).to(tl.bfloat16))
                acc_b += s_b[None, :] * tl.dot(a, hi - (off_b + 128).to(tl.bfloat16))
            else:
                p = raw.to(tl.int32)
                acc_a += s_a[None, :] * tl.dot(a, centred(p & 15, off_a, BITS, BF16))
                acc_b += s_b[None, :] * tl.dot(a, centred(p >> 4, off_b, BITS, BF16))
        elif BITS == 3:
            w = tl.arange(0, NP // 8)
            wm = w < N // 8
            b0, b1, b2 = load3(codes + (r0 + rows[:, None]) * (V * 3 // 8) + (c0 // 8 + w[None, :]) * 3,
                               m[:, None] & wm[None, :])
            p = unpack3(b0, b1, b2, False)
            if SYM:
                off = 1 << (BITS - 1)
            else:
                z0, z1, z2 = load3(zero + (r0 // G) * (V * 3 // 8) + (c0 // 8 + w[None, :]) * 3, wm[None, :])
                off = unpack3(z0, z1, z2, False)
            s_a = tl.load(srow + c0 + j, mask=cm, other=0.0).to(tl.float32)
            acc_a += s_a[None, :] * tl.dot(a, centred(p, off, BITS, BF16))
        else:
            p = tl.load(codes + (r0 + rows[:, None]) * V + c0 + j[None, :], mask=m[:, None] & cm[None, :],
                        other=0).to(tl.int32)
            if SYM:
                off = 1 << (BITS - 1)
            else:
                tl.static_assert(not PACK_Z, "8-bit zero points are not packed (pace_core.quant)")
                off = tl.load(zero + (r0 // G) * V + c0 + j, mask=cm, other=0).to(tl.int32)[None, :]
            s_a = tl.load(srow + c0 + j, mask=cm, other=0.0).to(tl.float32)
            acc_a += s_a[None, :] * tl.dot(a, centred(p, off, BITS, BF16))
    yk_a, yq_a = _split_rows(acc_a)
    yk_b, yq_b = _split_rows(acc_b)
    return yk_a, yq_a, yk_b, yq_b


@triton.jit
def _split_rows(acc):
    """The sums of the three split rows of ``k`` (rows 0-2 of ``acc [16, N]``) and of ``q`` (rows 3-5)."""
    rr = tl.arange(0, 16)[:, None]
    return tl.sum(tl.where(rr < 3, acc, 0.0), axis=0), tl.sum(tl.where((rr >= 3) & (rr < 6), acc, 0.0), axis=0)


@triton.jit
def _dots_to(yx, codes, scale, zero, kx, qx, c0, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
             G: tl.constexpr, SYM: tl.constexpr, BITS: tl.constexpr, PZ: tl.constexpr, BF16: tl.constexpr):
    """:func:`_ckpt_dots` stored at ``yx`` (``[2, V]``: row 0 ``Ŝᵀk``, row 1 ``Ŝᵀq``)."""
    yk_a, yq_a, yk_b, yq_b = _ckpt_dots(codes, scale, zero, kx, qx, c0, K, V, BV, G, SYM, BITS, PZ, BF16)
    N: tl.constexpr = BV // 2 if BITS == 4 else BV
    j = tl.arange(0, yk_a.shape[0])
    cm = j < N
    cols = c0 + (2 * j if BITS == 4 else j)
    tl.store(yx + cols, yk_a, mask=cm)
    tl.store(yx + V + cols, yq_a, mask=cm)
    if BITS == 4:
        tl.store(yx + cols + 1, yk_b, mask=cm)
        tl.store(yx + V + cols + 1, yq_b, mask=cm)


@triton.jit
def _head_dots(codes, scale, zero, kx, qx, K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr,
               BITS: tl.constexpr, PZ: tl.constexpr, BF16: tl.constexpr):
    """``Ŝᵀk, Ŝᵀq [V]`` of the whole head (:func:`_ckpt_dots`, the 4-bit half tiles interleaved back);
    heads at least 32 values wide for 4-bit codes, 16 otherwise, so that nothing is padding."""
    yk_a, yq_a, yk_b, yq_b = _ckpt_dots(codes, scale, zero, kx, qx, 0, K, V, V, G, SYM, BITS, PZ, BF16)
    if BITS == 4:
        sk = tl.reshape(tl.join(yk_a, yk_b), (V,))
        sq = tl.reshape(tl.join(yq_a, yq_b), (V,))
    else:
        sk = yk_a
        sq = yq_a
    return sk, sq


@triton.jit
def _ckpt_dots_kernel(
    q_ptr, k_ptr, y_ptr, part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p, HV0: tl.constexpr, HV1: tl.constexpr,
    H: tl.constexpr, HV: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr,
    BITS0: tl.constexpr, PZ0: tl.constexpr, CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
    BITS1: tl.constexpr, PZ1: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr,
    TWO: tl.constexpr, MAPPED: tl.constexpr, BF16: tl.constexpr,
):
    """The split path's first kernel: ``y [B*HV, 2, V]`` = ``Ŝᵀk_t, Ŝᵀq_t`` per (sequence, value head),
    one program per column block; reads the packed checkpoint once and nothing else of the state."""
    pid = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * BV
    b, h, kh, part, a0, as0, az0, a1, as1, az1, row = packed_head(
        pid, H, HV, part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p, HV0, HV1, K, CC0, SS0, ZS0, CC1, SS1, ZS1, TWO,
        MAPPED)
    kx = k_ptr + (b * H + kh) * K
    qx = q_ptr + (b * H + kh) * K
    yx = y_ptr + row * 2 * V
    if TWO:
        if part == 1:
            _dots_to(yx, a1, as1, az1, kx, qx, c0, K, V, BV, G, SYM, BITS1, PZ1, BF16)
        else:
            _dots_to(yx, a0, as0, az0, kx, qx, c0, K, V, BV, G, SYM, BITS0, PZ0, BF16)
    else:
        _dots_to(yx, a0, as0, az0, kx, qx, c0, K, V, BV, G, SYM, BITS0, PZ0, BF16)


@triton.jit
def _record_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr,
                 bg_ptr, n, cap, H, HV, row, sk, sq, K: tl.constexpr, V: tl.constexpr, KBITS: tl.constexpr,
                 KG: tl.constexpr, KSYM: tl.constexpr, KPZ: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr,
                 VSYM: tl.constexpr, VPZ: tl.constexpr, K_BF16: tl.constexpr, V_BF16: tl.constexpr,
                 EXACT: tl.constexpr, NB: tl.constexpr, KEY_BY_ALL: tl.constexpr = False):
    """The step of (sequence, value head) row ``row = b HV + h`` given the checkpoint's ``Ŝᵀk_t, Ŝᵀq_t`` (``sk, sq
    [V]``): the buffered records' part of the two products, ``u_t``, ``o_t`` and the token's record
    written in the buffer's precision (``KEY_BY_ALL``: :func:`kernels.records.append_record`)."""
    b = row // HV
    h = row % HV
    kh = h // (HV // H)
    cols = tl.arange(0, V)
    kfull = tl.load(k_ptr + (b * H + kh) * K + tl.arange(0, K))
    qfull = tl.load(q_ptr + (b * H + kh) * K + tl.arange(0, K))
    g_t = tl.load(g_ptr + row)
    run, rk, rq = record_reads(bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, h, kh, H, HV,
                                0, kfull, qfull, g_t, K, V, V, KBITS, KG, KSYM, KPZ, VBITS, VG, VSYM, VPZ, NB)
    ucodes, uscale, uzero, uhat = token_output(
        beta_ptr, v_ptr, o_ptr, row, cols, g_t, run, sk, sq, rk, rq, kfull, qfull, K, V, V, KBITS, KG, KSYM,
        VBITS, VG, VSYM, K_BF16, V_BF16, EXACT)
    # the record is appended also on the token that fills the buffer: the flush kernel folds it
    append_record(bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, h, kh, H, HV, 0, g_t,
                   kfull, ucodes, uscale, uzero, uhat, K, V, V, KBITS, KG, KSYM, KPZ, VBITS, VG, VSYM, VPZ, K_BF16,
                   KEY_BY_ALL)


@triton.jit(do_not_specialize=RECORD_COUNT)
def _record_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, y_ptr,
    bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, H: tl.constexpr, HV: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr, KSYM: tl.constexpr, KPZ: tl.constexpr,
    VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr, VPZ: tl.constexpr, K_BF16: tl.constexpr,
    V_BF16: tl.constexpr, EXACT: tl.constexpr, NB: tl.constexpr,
):
    """The split path's second kernel, one program per (sequence, value head): the buffered records'
    part of the two products, ``u_t``, ``o_t`` from ``y`` (:func:`_ckpt_dots_kernel`), and the token's
    record written in the buffer's precision. Launched with few warps: its reductions are over
    vectors, so they stay within a warp or two."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, V)
    _record_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr,
                 bg_ptr, n, cap, H, HV, pid, tl.load(y_ptr + pid * 2 * V + cols),
                 tl.load(y_ptr + pid * 2 * V + V + cols), K, V, KBITS, KG, KSYM, KPZ, VBITS, VG, VSYM, VPZ, K_BF16,
                 V_BF16, EXACT, NB)


@triton.jit
def _head_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, part, a0, as0, az0, a1, as1, az1, bk_ptr, bks_ptr,
               bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, kh, H, HV, row,
               K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr,
               BITS0: tl.constexpr, PZ0: tl.constexpr, BITS1: tl.constexpr, PZ1: tl.constexpr,
               TWO: tl.constexpr, BF16: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr, KSYM: tl.constexpr,
               KPZ: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr, VPZ: tl.constexpr,
               K_BF16: tl.constexpr, V_BF16: tl.constexpr, EXACT: tl.constexpr, NB: tl.constexpr,
               KEY_BY_ALL: tl.constexpr):
    """One token of (sequence, value head) row ``row`` whose head is ``packed_head``'s: ``Ŝᵀk_t, Ŝᵀq_t`` of the
    whole head (:func:`_head_dots`) kept in registers, then the record kernel's work (:func:`_record_step`)
    with the ``n`` records before it."""
    kx = k_ptr + (b * H + kh) * K
    qx = q_ptr + (b * H + kh) * K
    if TWO:
        if part == 1:
            sk, sq = _head_dots(a1, as1, az1, kx, qx, K, V, G, SYM, BITS1, PZ1, BF16)
        else:
            sk, sq = _head_dots(a0, as0, az0, kx, qx, K, V, G, SYM, BITS0, PZ0, BF16)
    else:
        sk, sq = _head_dots(a0, as0, az0, kx, qx, K, V, G, SYM, BITS0, PZ0, BF16)
    _record_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr,
                 bg_ptr, n, cap, H, HV, row, sk, sq, K, V, KBITS, KG, KSYM, KPZ, VBITS, VG, VSYM, VPZ, K_BF16, V_BF16,
                 EXACT, NB, KEY_BY_ALL)


@triton.jit(do_not_specialize=RECORD_COUNT)
def _ckpt_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p,
    HV0: tl.constexpr, HV1: tl.constexpr,
    bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, rows_ptr, strides_ptr, H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr,
    BITS0: tl.constexpr, PZ0: tl.constexpr, CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
    BITS1: tl.constexpr, PZ1: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr,
    TWO: tl.constexpr, MAPPED: tl.constexpr, BF16: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr,
    KSYM: tl.constexpr, KPZ: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr,
    VPZ: tl.constexpr, K_BF16: tl.constexpr, V_BF16: tl.constexpr, EXACT: tl.constexpr, NB: tl.constexpr,
    POOL: tl.constexpr = False,
):
    """The split path's step as one kernel, one program per (sequence, value head) (:func:`_head_step`).
    One launch and no workspace round trip per token; its reductions span all the program's warps. ``POOL``: the
    programs step the slots ``rows_ptr`` of a state pool whose checkpoint and records lie ``strides_ptr`` apart (the
    parts' then the records' slot strides; the pointers are the first slot's), each with the records its slot holds
    (``n`` unused: :mod:`kernels.pool_step`)."""
    pid = tl.program_id(0).to(tl.int64)
    if POOL:  # the batch row's inputs and its slot's state, then the program within the row
        r, slot_i, pid = pool_row(pid, rows_ptr, HV)
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr = row_inputs(r, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, H, HV,
                                                                 K, V)
        c0p, s0p, z0p, c1p, s1p, z1p = slot_parts(slot_i, strides_ptr, c0p, s0p, z0p, c1p, s1p, z1p)
        bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr = slot_records(
            slot_i, strides_ptr + 6, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr)
    b, h, kh, part, a0, as0, az0, a1, as1, az1, row = packed_head(
        pid, H, HV, part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p, HV0, HV1, K, CC0, SS0, ZS0, CC1, SS1, ZS1, TWO,
        MAPPED)
    if POOL:
        n = records_held(bg_ptr, b, h, cap, HV, NB)
    _head_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, part, a0, as0, az0, a1, as1, az1, bk_ptr, bks_ptr,
               bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, kh, H, HV, row, K, V, G, SYM, BITS0, PZ0,
               BITS1, PZ1, TWO, BF16, KBITS, KG, KSYM, KPZ, VBITS, VG, VSYM, VPZ, K_BF16, V_BF16, EXACT, NB, False)


@triton.jit(do_not_specialize=RECORD_COUNT)
def _ckpt_window_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p,
    HV0: tl.constexpr, HV1: tl.constexpr,
    bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, H: tl.constexpr, HV: tl.constexpr, T,
    K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr,
    BITS0: tl.constexpr, PZ0: tl.constexpr, CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
    BITS1: tl.constexpr, PZ1: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr,
    TWO: tl.constexpr, MAPPED: tl.constexpr, BF16: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr,
    KSYM: tl.constexpr, KPZ: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr,
    VPZ: tl.constexpr, K_BF16: tl.constexpr, V_BF16: tl.constexpr, EXACT: tl.constexpr, NB: tl.constexpr,
):
    """``T`` buffered tokens known at once (a teacher-forced window) in one launch, one program per
    (sequence, value head): token ``t`` is :func:`_ckpt_step_kernel`'s step with the ``n + t`` records
    before it, the ones the program wrote for the earlier tokens included: every program writes its
    key head's record itself (the same bytes as its group's other value heads), so it reads only its own
    writes, which a barrier after each token makes visible to all its threads. Inputs and output
    token-major: ``q, k [T, B, H, K]``, ``v, o [T, B, HV, V]``, ``g, beta [T, B, HV]``."""
    pid = tl.program_id(0).to(tl.int64)
    B = tl.num_programs(0) // (HV0 if MAPPED else HV)
    b, h, kh, part, a0, as0, az0, a1, as1, az1, row = packed_head(
        pid, H, HV, part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p, HV0, HV1, K, CC0, SS0, ZS0, CC1, SS1, ZS1, TWO,
        MAPPED)
    for t in range(T):
        qk_at = t * B * H * K
        v_at = t * B * HV * V
        g_at = t * B * HV
        _head_step(q_ptr + qk_at, k_ptr + qk_at, v_ptr + v_at, g_ptr + g_at, beta_ptr + g_at, o_ptr + v_at, part,
                   a0, as0, az0, a1, as1, az1, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n + t, cap,
                   b, kh, H, HV, row, K, V, G, SYM, BITS0, PZ0, BITS1, PZ1, TWO, BF16, KBITS, KG, KSYM, KPZ, VBITS,
                   VG, VSYM, VPZ, K_BF16, V_BF16, EXACT, NB, True)
        tl.debug_barrier()


def _maxnreg(cap: int | None) -> dict:
    """The launch option of a register cap (:class:`kernels.settings.SplitSettings`' ``*_maxnreg``), none when None."""
    return {} if cap is None else {"maxnreg": cap}


def launch_dots(plan: DecodePlan, q: torch.Tensor, k: torch.Tensor) -> None:
    """The split path's first kernel: ``Ŝᵀk_t, Ŝᵀq_t`` into ``plan.workspace`` (``q, k [B, H, K]`` float32,
    contiguous); a launch of one 4-bit part on a GPU runs :mod:`kernels.gluon_dots` where it applies
    (:func:`kernels.plan.gluon_dots_apply`; setting ``gluon_dots`` False: never)."""
    B, H, HV, K, V = plan.shape
    sp = plan.split
    bv = min(sp.settings.dots_columns, V)
    for launch in sp.dots:
        if launch.gluon_dots:
            from . import gluon_dots  # GPU only: never imported under the interpreter
            gluon_dots.launch(plan, q, k, launch)
            continue
        _ckpt_dots_kernel[(B * launch.heads, V // bv)](q, k, plan.workspace, *launch.ckpt.args(), H, HV, BV=bv,
                                                       num_warps=sp.settings.dots_warps,
                                                       **_maxnreg(sp.settings.dots_maxnreg),
                                                       **sp.constexprs(launch, K, V))


def launch_records(plan: DecodePlan, buf: DecodeBuffer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor, o: torch.Tensor) -> None:
    """The split path's second kernel: ``o [B, HV, V]`` from ``plan.workspace`` and the buffer's
    ``len(buf)`` records; writes the token's record into slot ``len(buf)`` (the caller counts it)."""
    B, H, HV, K, V = plan.shape
    s = plan.split.settings
    _record_step_kernel[(B * HV,)](
        q, k, v, g, beta, o, plan.workspace, *plan.records.args(), len(buf), plan.capacity, H, HV, K=K, V=V,
        EXACT=plan.exact, **plan.records.layout.constexprs(), NB=plan.record_block, num_warps=s.record_warps,
        **_maxnreg(s.dots_maxnreg),
    )


def launch_packed_step(plan: DecodePlan, buf: DecodeBuffer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       g: torch.Tensor, beta: torch.Tensor, o: torch.Tensor, rows: torch.Tensor | None = None,
                       strides: torch.Tensor | None = None) -> None:
    """One buffered token on the split path: ``q, k [B, H, K]``, ``v [B, HV, V]``, ``g, beta [B, HV]`` float32
    contiguous -> ``o [B, HV, V]``, the token's record written into slot ``len(buf)`` (the caller counts it). As one
    kernel (setting ``fused_step``, where the heads are wide enough: ``plan.split.fusable``): :mod:`kernels.gluon_step`
    where it applies (``plan.split.gluon_step``), else :func:`_ckpt_step_kernel`; otherwise :func:`launch_dots` then
    :func:`launch_records`. ``rows`` (long, on the device; ``plan.split.fusable``): the inputs are of these slots of
    a state pool whose first slot ``plan`` is and whose slots lie ``strides`` apart (the one launch's
    :func:`kernels.pool_step.slot_strides`), each stepped with the records it holds by the one kernel."""
    sp = plan.split
    if rows is None and not (sp.settings.fused_step and sp.fusable):
        launch_dots(plan, q, k)
        launch_records(plan, buf, q, k, v, g, beta, o)
        return
    if sp.gluon_step:
        from . import gluon_step  # GPU only: never imported under the interpreter
        gluon_step.launch(plan, buf, q, k, v, g, beta, o, rows, strides)
        return
    B, H, HV, K, V = plan.shape
    launch = sp.launches[False][0]
    _ckpt_step_kernel[(B * HV if rows is None else rows.numel() * HV,)](
        q, k, v, g, beta, o, *launch.ckpt.args(), *plan.records.args(), 0 if rows is not None else len(buf),
        plan.capacity, rows, strides, H, HV, EXACT=plan.exact, **plan.records.layout.constexprs(), NB=plan.record_block,
        num_warps=sp.settings.step_warps, **_maxnreg(sp.settings.step_maxnreg), **sp.constexprs(launch, K, V),
        POOL=rows is not None,
    )


def launch_window(plan: DecodePlan, buf: DecodeBuffer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  g: torch.Tensor, beta: torch.Tensor, o: torch.Tensor) -> None:
    """``T`` buffered tokens in one :func:`_ckpt_window_kernel` launch (heads wide enough for the one-kernel
    step: ``plan.split.fusable``): ``q, k [T, B, H, K]``, ``v [T, B, HV, V]``, ``g, beta [T, B, HV]`` float32
    contiguous, token-major; writes ``o [T, B, HV, V]`` and the records into slots ``len(buf) ..
    len(buf) + T - 1`` (the caller counts them)."""
    B, H, HV, K, V = plan.shape
    if len(buf) + q.shape[0] > buf.capacity:
        raise PaceError(f"window: {q.shape[0]} tokens do not fit in the buffer's {buf.capacity - len(buf)} free "
                        "slots; allowed: at most the free slots (the schedule flushes before)")
    sp = plan.split
    for launch in sp.per_width:  # a program reads only its own records
        _ckpt_window_kernel[(B * launch.heads,)](
            q, k, v, g, beta, o, *launch.ckpt.args(), *plan.records.args(), len(buf), plan.capacity, H, HV,
            q.shape[0], EXACT=plan.exact, **plan.records.layout.constexprs(), NB=plan.record_block,
            num_warps=sp.settings.step_warps, **_maxnreg(sp.settings.step_maxnreg), **sp.constexprs(launch, K, V),
        )
