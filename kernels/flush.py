"""The flush of packed key-axis checkpoints: fold the buffered records into the checkpoint and requantise
it in place, ``S = e^{G} Ŝ + Σ_i e^{G-G_i} k_i u_iᵀ`` (PACE_SPEC §3).

Transposed and ``T`` key rows at a time (:func:`_flush_head`: ``[N, 16] x [16, T]`` dots on tensor cores
onto the dequantised checkpoint, exact products: bfloat16 splits against integer key codes; each group's
range a reduction along a row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pace_core.buffer import DecodeBuffer

from .plan import DecodePlan
from .primitives import (
    bf16_split,
    biased,
    expand,
    load3,
    operand,
    pack3,
    packed_head,
    quant_tile,
    slot_parts,
    store3,
    unpack3,
)
from .records import RECORD_COUNT, full_row, load_vecs, slot_records, vec_parts


@triton.jit
def _fold(wu, kx, acc, EXACT: tl.constexpr, BF16: tl.constexpr):
    """``acc + wu [N, NB] x kx [NB, T]`` fp32 on tensor cores. ``EXACT``: ``kx`` is a dot operand holding
    bfloat16-exact values (integer key codes, bfloat16 keys) and ``wu`` is split into three bfloat16
    terms (:func:`bf16_split`), so every product is exact; else an IEEE fp32 dot."""
    if EXACT:
        w1, w2, w3 = bf16_split(wu)
        acc = tl.dot(operand(w1, BF16), kx, acc)
        acc = tl.dot(operand(w2, BF16), kx, acc)
        acc = tl.dot(operand(w3, BF16), kx, acc)
    else:
        acc = tl.dot(wu, kx, acc, input_precision="ieee")
    return acc


@triton.jit
def _dequant_rows(c, z, s, G: tl.constexpr):
    """``(c - z) s`` fp32 ``[N, T]`` from codes ``c`` int32 ``[N, T]`` (``0 <= c < 2^22``) and per-group
    zero points ``z`` int32 and factors ``s`` fp32, both ``[N, T/G]`` (a transposed tile, see
    :func:`_flush_head`). ``c - z`` is formed exactly without an int -> float conversion: ``c`` or-ed
    into the bits of ``2^23``, then ``2^23 + z`` subtracted (:func:`kernels.primitives.biased`)."""
    N: tl.constexpr = c.shape[0]
    T: tl.constexpr = c.shape[1]
    cz = biased(c) - expand(biased(z), N, T, G, False)
    return cz * expand(s, N, T, G, False)


@triton.jit
def _fold_records(acc_a, acc_b, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, h, kh, H,
                  HV, c0, r0, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, T: tl.constexpr,
                  KBITS: tl.constexpr, KG: tl.constexpr, KSYM: tl.constexpr, KPZ: tl.constexpr,
                  VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr, VPZ: tl.constexpr,
                  K_BF16: tl.constexpr, NB: tl.constexpr, BF16: tl.constexpr, HALVES: tl.constexpr):
    """``acc + Σ_i e^{G - G_i} u_i k_iᵀ`` over the ``n`` buffered records for key rows ``r0 .. r0+T``
    and value columns ``c0 .. c0+BV`` of one head, transposed: ``acc_a, acc_b [N, T]`` (the even and
    odd columns with ``HALVES``, else ``acc_a`` all ``N = BV`` columns and ``acc_b`` returned as is),
    NB records per ``[N, NB] x [NB, T]`` dot (:func:`_fold`), newest block first. Integer keys enter as
    their exact integers (codes minus zero point); where the ``T`` rows span several key groups, one dot
    per group, each with the other groups' rows zeroed and its own scale in the weights."""
    EXACT: tl.constexpr = KBITS > 0 or K_BF16
    N: tl.constexpr = acc_a.shape[0]
    KGR: tl.constexpr = KG if KG < T else T  # key rows of one group inside the tile
    NKG: tl.constexpr = T // KGR
    ridx = tl.arange(0, NB)
    later = ridx[None, :] > ridx[:, None]
    in_group = (tl.arange(0, T) // KGR)[None, :]  # the key group (within the tile) of each row
    run = tl.sum(tl.zeros((NB,), tl.float32))  # Σ of the log decays of the newer blocks
    for blk in range(tl.cdiv(n, NB)):
        i = n - (blk + 1) * NB + ridx
        valid = i >= 0
        gb = tl.load(bg_ptr + (b * cap + i) * HV + h, mask=valid, other=0.0)
        kc, ks = vec_parts(bk_ptr, bks_ptr, bkz_ptr, (b * cap + i) * H + kh, valid, r0, T, K, KBITS, KG, KSYM, KPZ)
        ub = load_vecs(bv_ptr, bvs_ptr, bvz_ptr, (b * cap + i) * HV + h, valid, c0, BV, V, VBITS, VG, VSYM, VPZ)
        decay = tl.exp(run + tl.sum(tl.where(later, gb[None, :], 0.0), axis=1))
        for j in tl.static_range(NKG):
            if NKG == 1:
                kj = kc
                sj = tl.reshape(ks, (NB,))
            else:
                kj = tl.where(in_group == j, kc, 0.0)
                sj = tl.sum(tl.where(tl.arange(0, NKG)[None, :] == j, ks, 0.0), axis=1)
            w = (decay * sj)[None, :]
            kx = operand(kj, BF16) if EXACT else kj
            if HALVES:
                u_a, u_b = tl.split(tl.reshape(ub, (NB, N, 2)))
                acc_a = _fold(w * tl.trans(u_a), kx, acc_a, EXACT, BF16)
                acc_b = _fold(w * tl.trans(u_b), kx, acc_b, EXACT, BF16)
            else:
                acc_a = _fold(w * tl.trans(ub), kx, acc_a, EXACT, BF16)
        run += tl.sum(gb)
    return acc_a, acc_b


@triton.jit
def _requant_rows(x, scale_at, G: tl.constexpr, SYM: tl.constexpr, BITS: tl.constexpr):
    """Quantise ``x [N, T]`` (the key rows of ``T / G`` whole groups for N value columns, transposed:
    a group is part of a row), store its fp16 scales at ``scale_at [N, T/G]`` and return its codes
    int32 ``[N, T]`` and zero points int32 ``[N, T/G]`` (0 when symmetric) for the caller to pack."""
    N: tl.constexpr = x.shape[0]
    T: tl.constexpr = x.shape[1]
    c, sc, zq = quant_tile(x, N, T, G, False, SYM, BITS)
    tl.store(scale_at, sc)
    return c, zq


@triton.jit
def _flush_head(codes, scale, zero, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, h, kh,
                H, HV, cb, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr,
                BITS: tl.constexpr, PZ: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr, KSYM: tl.constexpr,
                KPZ: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr, VPZ: tl.constexpr,
                K_BF16: tl.constexpr, NB: tl.constexpr, BF16: tl.constexpr):
    """The flush of one head's columns ``c0 .. c0+BV``, ``c0 = cb BV`` (see :func:`_flush_kernel`),
    ``T = max(G, 16)`` key rows (whole groups) at a time and transposed: a tile is
    ``[N, T]``, value columns by key rows, so each group's range is a reduction along a row, inside a
    thread and its quad of the dot's layout (no shared memory). 4-bit codes are two half tiles, the low nibbles (even
    columns) and
    the high nibbles (odd columns), each folded, dequantised and requantised on its own (key-axis
    groups never mix columns) and packed back into the same bytes without any shuffle. 3-bit codes (and zero
    points) are the three byte planes of their 24-bit words ``[N/8, T]``, unpacked to the tile and packed back
    (:func:`kernels.primitives.unpack3`, :func:`kernels.primitives.pack3`)."""
    HALVES: tl.constexpr = BITS == 4
    N: tl.constexpr = BV // 2 if HALVES else BV
    T: tl.constexpr = G if G >= 16 else 16  # whole groups; at most K, as K >= 16 (DECODE_MIN_K)
    CW: tl.constexpr = V // 2 if HALVES else (V * 3 // 8 if BITS == 3 else V)  # bytes per key row of codes
    c0 = cb * BV
    cbyte = cb * (BV // 2) if HALVES else (cb * (BV * 3 // 8) if BITS == 3 else c0)  # first byte of the columns
    ridx = tl.arange(0, NB)
    total = tl.sum(tl.zeros((NB,), tl.float32))  # Σ of the n records' log decays
    for blk in range(tl.cdiv(n, NB)):
        i = blk * NB + ridx
        total += tl.sum(tl.load(bg_ptr + (b * cap + i) * HV + h, mask=i < n, other=0.0))
    decay = tl.exp(total)
    j = tl.arange(0, N)
    cols = c0 + (2 * j if HALVES else j)  # the (even) value columns of the tile's rows
    for r0 in tl.static_range(0, K, T):
        grp = (r0 // G + tl.arange(0, T // G))[None, :]  # the tile's groups
        at = codes + (r0 + tl.arange(0, T))[None, :] * CW + cbyte + j[:, None]
        s_at = scale + grp * V + cols[:, None]
        if BITS == 3:
            w3 = (cbyte + 3 * tl.arange(0, N // 8))[:, None]  # the words' first bytes in a row
            at3 = codes + (r0 + tl.arange(0, T))[None, :] * CW + w3
            b0, b1, b2 = load3(at3)
            p = unpack3(b0, b1, b2, True)
            if SYM:
                z = tl.full((N, T // G), 1 << (BITS - 1), tl.int32)
            else:
                z0, z1, z2 = load3(zero + grp * CW + w3)
                z = unpack3(z0, z1, z2, True)
            x = _dequant_rows(p, z, decay * tl.load(s_at).to(tl.float32), G)
            x, _ = _fold_records(x, x, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, h, kh,
                                 H, HV, c0, r0, K, V, BV, T, KBITS, KG, KSYM, KPZ, VBITS, VG, VSYM, VPZ, K_BF16, NB,
                                 BF16, False)
            c, zq = _requant_rows(x, s_at, G, SYM, BITS)
            store3(at3, pack3(c, True))
            if not SYM:
                store3(zero + grp * CW + w3, pack3(zq, True))
        elif HALVES:
            p = tl.load(at).to(tl.int32)
            if SYM:
                z_a = tl.full((N, T // G), 1 << (BITS - 1), tl.int32)
                z_b = z_a
            else:
                tl.static_assert(PZ, "4-bit key-axis zero points are packed (pace_core.quant)")
                zp = tl.load(zero + grp * CW + cbyte + j[:, None]).to(tl.int32)
                z_a = zp & 15
                z_b = zp >> 4
            x_a = _dequant_rows(p & 15, z_a, decay * tl.load(s_at).to(tl.float32), G)
            x_b = _dequant_rows(p >> 4, z_b, decay * tl.load(s_at + 1).to(tl.float32), G)
            x_a, x_b = _fold_records(x_a, x_b, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b,
                                     h, kh, H, HV, c0, r0, K, V, BV, T, KBITS, KG, KSYM, KPZ, VBITS, VG, VSYM, VPZ,
                                     K_BF16, NB, BF16, True)
            c_a, zq_a = _requant_rows(x_a, s_at, G, SYM, BITS)
            c_b, zq_b = _requant_rows(x_b, s_at + 1, G, SYM, BITS)
            tl.store(at, (c_a | (c_b << 4)).to(tl.uint8))
            if not SYM:
                tl.store(zero + grp * CW + cbyte + j[:, None], (zq_a | (zq_b << 4)).to(tl.uint8))
        else:
            p = tl.load(at).to(tl.int32)
            if SYM:
                z = tl.full((N, T // G), 1 << (BITS - 1), tl.int32)
            else:
                z = tl.load(zero + grp * V + cols[:, None]).to(tl.int32)
            x = _dequant_rows(p, z, decay * tl.load(s_at).to(tl.float32), G)
            x, _ = _fold_records(x, x, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, h, kh,
                                 H, HV, c0, r0, K, V, BV, T, KBITS, KG, KSYM, KPZ, VBITS, VG, VSYM, VPZ, K_BF16, NB,
                                 BF16, False)
            c, zq = _requant_rows(x, s_at, G, SYM, BITS)
            tl.store(at, c.to(tl.uint8))
            if not SYM:
                tl.store(zero + grp * V + cols[:, None], zq.to(tl.uint8))


@triton.jit(do_not_specialize=RECORD_COUNT)
def _flush_kernel(
    part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p, HV0: tl.constexpr, HV1: tl.constexpr,
    bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, full_ptr, strides_ptr, H: tl.constexpr,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr,
    BITS0: tl.constexpr, PZ0: tl.constexpr, CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
    BITS1: tl.constexpr, PZ1: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr,
    TWO: tl.constexpr, MAPPED: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr, KSYM: tl.constexpr,
    KPZ: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr, VPZ: tl.constexpr,
    K_BF16: tl.constexpr, V_BF16: tl.constexpr, NB: tl.constexpr, BF16: tl.constexpr, POOL: tl.constexpr = False,
):
    """Fold the ``n`` buffered records into the packed checkpoint and requantise it in place:
    ``S = e^{G} Ŝ + Σ_i e^{G - G_i} k_i u_iᵀ`` for the columns ``c0 .. c0+BV`` of one head.

    The fold is transposed, ``[N, NB] x [NB, T]`` on tensor cores for ``T`` key rows at a time
    (:func:`_flush_head`): ``e^{G - G_i} s_i u_i`` split into three bfloat16 terms (:func:`bf16_split`)
    against the keys as the exact integers ``c - 2^(b-1)`` (integer storage; bfloat16 keys as they
    are), so every product is exact; float32 keys take an IEEE fp32 dot (:func:`_fold`).

    ``POOL``: the programs fold the full slots ``full_ptr`` (:func:`kernels.records.full_slots`: ``cap`` records
    each) of a state pool laid out as :func:`kernels.packed_step._ckpt_step_kernel`'s, the first rows' programs; the
    others exit (``n`` unused: :mod:`kernels.pool_step`)."""
    pid = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    folds = True
    if POOL:  # the pool's full slots first (full_ptr: kernels.records.full_slots); the other programs exit
        folds, slot_i, pid = full_row(pid, full_ptr, HV0 if MAPPED else HV)
        n = cap
    if folds:
        if POOL:
            c0p, s0p, z0p, c1p, s1p, z1p = slot_parts(slot_i, strides_ptr, c0p, s0p, z0p, c1p, s1p, z1p)
            bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr = slot_records(
                slot_i, strides_ptr + 6, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr)
        b, h, kh, part, a0, as0, az0, a1, as1, az1, _ = packed_head(
            pid, H, HV, part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p, HV0, HV1, K, CC0, SS0, ZS0, CC1, SS1, ZS1,
            TWO, MAPPED)
        _flush_parts(part, a0, as0, az0, a1, as1, az1, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n,
                     cap, b, h, kh, H, HV, cb, K, V, BV, G, SYM, BITS0, PZ0, BITS1, PZ1, TWO, KBITS, KG, KSYM, KPZ,
                     VBITS, VG, VSYM, VPZ, K_BF16, NB, BF16)


@triton.jit
def _flush_parts(part, a0, as0, az0, a1, as1, az1, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap,
                 b, h, kh, H, HV, cb, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, G: tl.constexpr,
                 SYM: tl.constexpr, BITS0: tl.constexpr, PZ0: tl.constexpr, BITS1: tl.constexpr, PZ1: tl.constexpr,
                 TWO: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr, KSYM: tl.constexpr, KPZ: tl.constexpr,
                 VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr, VPZ: tl.constexpr, K_BF16: tl.constexpr,
                 NB: tl.constexpr, BF16: tl.constexpr):
    """:func:`_flush_head` of the head's part (its bit width)."""
    if TWO:
        if part == 1:
            _flush_head(a1, as1, az1, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, h, kh,
                        H, HV, cb, K, V, BV, G, SYM, BITS1, PZ1, KBITS, KG, KSYM, KPZ, VBITS, VG, VSYM, VPZ, K_BF16,
                        NB, BF16)
        else:
            _flush_head(a0, as0, az0, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, h, kh,
                        H, HV, cb, K, V, BV, G, SYM, BITS0, PZ0, KBITS, KG, KSYM, KPZ, VBITS, VG, VSYM, VPZ, K_BF16,
                        NB, BF16)
    else:
        _flush_head(a0, as0, az0, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, h, kh,
                    H, HV, cb, K, V, BV, G, SYM, BITS0, PZ0, KBITS, KG, KSYM, KPZ, VBITS, VG, VSYM, VPZ, K_BF16,
                    NB, BF16)


def launch_flush(plan: DecodePlan, buf: DecodeBuffer, full: torch.Tensor | None = None,
                 strides: tuple[torch.Tensor, ...] = ()) -> None:
    """The split path's flush kernel: fold the buffer's ``len(buf)`` records into the packed
    checkpoint and requantise it in place (the caller clears the buffer); launches that
    :func:`kernels.plan.gluon_flush_apply` takes run :mod:`kernels.gluon_flush`. ``full [1 + B]`` (on the device,
    :func:`kernels.records.full_slots`): the slots whose buffers are full of the ``B`` rows of a state pool whose
    first slot ``plan`` is (``strides``: each launch's slot strides, :func:`kernels.pool_step.slot_strides`)."""
    B, H, HV, K, V = plan.shape
    if full is not None:
        B = full.numel() - 1
    sp = plan.split
    s = sp.settings
    bv = min(s.flush_columns, V)
    cap = {} if s.flush_maxnreg is None else {"maxnreg": s.flush_maxnreg}
    n = len(buf) if full is None else 0  # a pool's slots are full
    for i, launch in enumerate(sp.per_width):
        launch_strides = strides[i] if full is not None else None
        if launch.gluon_flush:  # decided once per plan (kernels.plan.gluon_flush_apply); GPU only
            from . import gluon_flush

            gluon_flush.launch(plan, n, launch, full, launch_strides)
            continue
        _flush_kernel[(B * launch.heads, V // bv)](
            *launch.ckpt.args(), *plan.records.args(), n, plan.capacity, full, launch_strides, H, HV,
            BV=bv, NB=16, **plan.records.layout.constexprs(), num_warps=s.flush_warps, num_stages=1, **cap,
            **sp.constexprs(launch, K, V), POOL=full is not None)
