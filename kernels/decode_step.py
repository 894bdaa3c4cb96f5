"""Buffered decode step (PACE_SPEC §3) for a batch of sequences and all value heads, and the per-token
dense step used as the fp32 / bf16 baseline.

:func:`buffered_decode_step` — one token for all sequences and value heads. Two paths:

- **split** (packed checkpoints with key-axis groups: PACE-4, PACE-4/8): per token
  :func:`_ckpt_dots_kernel` (:func:`launch_dots`), one program per (sequence, value head, column
  block), reads the packed checkpoint once and forms ``Ŝᵀk_t`` and ``Ŝᵀq_t`` together on tensor
  cores (:func:`_ckpt_dots`: one ``[16, G] x [G, N]`` dot per key group, ``k`` and ``q`` split into
  three bfloat16 terms each, the codes turned into the exact integers ``c - z`` by bit operations,
  4-bit codes as even / odd half tiles) into the plan's workspace; :func:`_record_step_kernel`
  (:func:`launch_records`), one small program per (sequence, value head), adds the buffered records'
  part, forms ``u_t`` and ``o_t`` and writes the record into the buffer in its precision. For a
  batch of at most one wave the two run as one kernel, :func:`_ckpt_step_kernel` (``SPLIT_DEFAULTS``).
  On the token that fills the buffer to ``period`` records :func:`_flush_kernel`
  (:func:`launch_flush`) folds ``S = e^{G} Ŝ + Σ_i e^{G-G_i} k_i u_iᵀ`` and requantises the
  checkpoint in place, transposed and ``T`` key rows at a time (:func:`_flush_head`: ``[N, 16] x [16, T]``
  dots on tensor cores onto the dequantised checkpoint, exact products: bfloat16 splits against
  integer key codes; each group's range a reduction along a row).
- **fused** (dense fp32 / bf16 checkpoints, value-axis groups): :func:`_decode_kernel`, one launch
  per token that also folds and requantises on the flush token (a second pass over ``Ŝ``).

Both compute ``u_t = β_t (v_t - e^{g_t} S_{t-1}ᵀ k_t)`` and ``o_t`` with the stored
(buffer-precision) ``k_t, u_t``, exactly as :func:`pace_core.recurrence.buffered_step`.

Tolerances against the reference (float32 in both): outputs and folded states agree to a relative
Frobenius error below 1e-5 given the same stored record (the summation order differs; the split
path's tensor-core products are exact, their fp32 accumulation is not IEEE round-to-nearest); where
the kernel's ``u_t`` lies within float32 rounding of a bfloat16 / int8 rounding boundary it may be
stored one step apart from the reference's, and ``o_t`` then differs by that step times
``k̂_t·q_t``. The records written to an int8 / 4-bit buffer and the requantised checkpoint are
bit-identical to quantising the kernel's own ``u_t`` / folded ``S``, so against the reference they
differ at most by one code where a value lies within float32 rounding of a rounding boundary.

Under the Triton interpreter (CPU tensors) the tensor-core operands stay fp32 holding the same
bfloat16-exact values (:func:`_operand`): the interpreter's bfloat16 ``tl.dot`` is not exact.

Speed on the H200: kernels/NOTES.md and data/bench/.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kernels.quant_pack import (
    _expand,
    _load_tile,
    _quant_tile,
    _rint,
    _store_tile,
    check_kernel_shape,
    head_table,
    layout_args,
    part_layout,
    part_pointers,
    round_bf16,
    store_as,
)
from pace_core import quant
from pace_core.buffer import BUFFER_LAYOUT, DecodeBuffer
from pace_core.errors import PaceError

Checkpoint = torch.Tensor | quant.PackedTensor | quant.MixedPackedState


def _buffer_tensors(buf: DecodeBuffer) -> dict:
    """The live storage of ``buf`` (:meth:`DecodeBuffer.storage`) and its record layout: for keys and
    values the tensor, its per-vector scale (the tensor itself for float storage, never read) and its
    bits (0 for float storage)."""
    live = buf.storage()
    key_kind, value_kind = BUFFER_LAYOUT[buf.precision]
    out = {"n": len(buf), "cap": buf.capacity, "log_decays": live["log_decays"]}
    for name, single, kind in (("keys", "key", key_kind), ("values", "value", value_kind)):
        bits = kind if isinstance(kind, int) else 0
        out[name], out[name + "_scale"], out[name + "_bits"] = live[name], live.get(single + "_scale", live[name]), bits
    return out


@triton.jit
def _vec_parts(ptr, scale_ptr, recs, valid, r0, R: tl.constexpr, L: tl.constexpr, BITS: tl.constexpr):
    """Elements ``r0 .. r0+R`` of the buffered vectors ``recs [NB]`` (flat record indices) as
    ``(x [NB, R], s [NB])`` fp32 with ``x * s`` the stored values: the codes minus ``2^(BITS-1)``
    (exact integers) and each vector's scale for integer storage, the values and 1 for float
    storage; rows where ``valid`` is False read as 0."""
    m = valid[:, None]
    if BITS == 0:
        x = tl.load(ptr + recs[:, None] * L + r0 + tl.arange(0, R)[None, :], mask=m, other=0.0).to(tl.float32)
        s = tl.where(valid, 1.0, 0.0)
    else:
        s = tl.load(scale_ptr + recs, mask=valid, other=0.0).to(tl.float32)
        if BITS <= 4:
            p = tl.load(ptr + recs[:, None] * (L // 2) + r0 // 2 + tl.arange(0, R // 2)[None, :], mask=m, other=0)
            p = p.to(tl.int32)
            c = tl.reshape(tl.join(p & 15, p >> 4), (recs.shape[0], R))
        else:
            c = tl.load(ptr + recs[:, None] * L + r0 + tl.arange(0, R)[None, :], mask=m, other=0).to(tl.int32)
        x = c.to(tl.float32) - (1 << (BITS - 1)) * 1.0
    return x, s


@triton.jit
def _load_vecs(ptr, scale_ptr, recs, valid, r0, R: tl.constexpr, L: tl.constexpr, BITS: tl.constexpr):
    """Elements ``r0 .. r0+R`` of the buffered vectors ``recs [NB]``, dequantised to fp32 ``[NB, R]``
    (see :func:`_vec_parts`)."""
    x, s = _vec_parts(ptr, scale_ptr, recs, valid, r0, R, L, BITS)
    return x * s[:, None]


@triton.jit
def _stored_vec(x, L: tl.constexpr, BITS: tl.constexpr, DT_BF16: tl.constexpr):
    """What the buffer stores for the fp32 vector ``x [L]``: codes int32 ``[1, L]``, fp16 scale ``[1, 1]``
    and the stored value dequantised ``[L]`` (for float storage the codes/scale are unused)."""
    if BITS == 0:
        codes = tl.zeros((1, L), tl.int32)
        scale = tl.zeros((1, 1), tl.float16)
        if DT_BF16:
            xs = round_bf16(x)
        else:
            xs = x
    else:
        codes, scale, _z = _quant_tile(tl.reshape(x, (1, L)), 1, L, L, False, True, BITS)
        xs = tl.reshape((codes.to(tl.float32) - (1 << (BITS - 1)) * 1.0) * scale.to(tl.float32), (L,))
    return codes, scale, xs


@triton.jit
def _store_vec(ptr, scale_ptr, rec, c0, codes, scale, x, R: tl.constexpr, L: tl.constexpr, BITS: tl.constexpr):
    """Store elements ``c0 .. c0+R`` of buffered vector ``rec`` of length ``L`` (codes + scale: the
    whole vector, R == L; or ``x`` in the storage's float dtype)."""
    if BITS == 0:
        store_as(ptr + rec * L + c0 + tl.arange(0, R), x)
    else:
        if BITS <= 4:
            a, b = tl.split(tl.reshape(codes, (L // 2, 2)))
            tl.store(ptr + rec * (L // 2) + tl.arange(0, L // 2), (a | (b << 4)).to(tl.uint8))
        else:
            tl.store(ptr + rec * L + tl.arange(0, L), tl.reshape(codes, (L,)).to(tl.uint8))
        tl.store(scale_ptr + rec + tl.arange(0, 1), tl.reshape(scale, (1,)))


@triton.jit
def _record_reads(bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV, c0, kfull, qfull, g_t,
                  K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                  NB: tl.constexpr):
    """The buffered records' part of ``S_{t-1}ᵀk_t`` and ``S_tᵀq_t`` (columns ``c0 .. c0+BV``), read NB
    records at a time (one load round trip for n <= NB), newest block first. Returns ``run`` (Σ of
    the held records' log decays), ``rk``, ``rq`` ``[BV]``."""
    ridx = tl.arange(0, NB)
    later = ridx[None, :] > ridx[:, None]
    run = g_t * 0.0  # Σ of the log decays of the records after the current block
    rk = tl.zeros((BV,), tl.float32)
    rq = tl.zeros((BV,), tl.float32)
    for blk in range(0, tl.cdiv(n, NB)):
        i = n - (blk + 1) * NB + ridx
        valid = i >= 0
        gb = tl.load(bg_ptr + (b * cap + i) * HV + h, mask=valid, other=0.0)
        kb = _load_vecs(bk_ptr, bks_ptr, (b * cap + i) * H + kh, valid, 0, K, K, KBITS)
        ub = _load_vecs(bv_ptr, bvs_ptr, (b * cap + i) * HV + h, valid, c0, BV, V, VBITS)
        after = run + tl.sum(tl.where(later, gb[None, :], 0.0), axis=1)  # Σ_{j>i} g_j over the held records
        wk = tl.exp(after) * tl.sum(kb * kfull[None, :], axis=1)
        wq = tl.exp(after + g_t) * tl.sum(kb * qfull[None, :], axis=1)
        rk += tl.sum(wk[:, None] * ub, axis=0)
        rq += tl.sum(wq[:, None] * ub, axis=0)
        run += tl.sum(gb)
    return run, rk, rq


@triton.jit
def _token_output(beta_ptr, v_ptr, o_ptr, pid, cols, g_t, run, sk, sq, rk, rq, kfull, qfull,
                  K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                  K_BF16: tl.constexpr, V_BF16: tl.constexpr):
    """``u_t = β_t (v_t - e^{g_t} S_{t-1}ᵀk_t)`` and ``o_t`` (stored) from the checkpoint's ``sk, sq`` and
    the records' ``run, rk, rq``, with the stored (buffer-precision) ``k_t, u_t``. Returns the stored
    key and value: codes, scale and value of each (see :func:`_stored_vec`)."""
    beta = tl.load(beta_ptr + pid)
    v = tl.load(v_ptr + pid * V + cols)
    u = beta * (v - tl.exp(g_t) * (tl.exp(run) * sk + rk))
    kcodes, kscale, khat = _stored_vec(kfull, K, KBITS, K_BF16)
    ucodes, uscale, uhat = _stored_vec(u, BV, VBITS, V_BF16)
    tl.store(o_ptr + pid * V + cols, tl.exp(run + g_t) * sq + rq + tl.sum(khat * qfull) * uhat)
    return kcodes, kscale, khat, ucodes, uscale, uhat


@triton.jit
def _append_record(bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV, c0, g_t,
                   kcodes, kscale, khat, ucodes, uscale, uhat, K: tl.constexpr, V: tl.constexpr,
                   BV: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr):
    """Write the token's record into slot ``n``: its log decay and key once per key head (by the
    first value head of the group, column block 0), its value columns by every program."""
    if c0 == 0:
        tl.store(bg_ptr + (b * cap + n) * HV + h, g_t)
        if h % (HV // H) == 0:
            _store_vec(bk_ptr, bks_ptr, (b * cap + n) * H + kh, 0, kcodes, kscale, khat, K, K, KBITS)
    _store_vec(bv_ptr, bvs_ptr, (b * cap + n) * HV + h, c0, ucodes, uscale, uhat, BV, V, VBITS)


@triton.jit
def _head_slot(part_ptr, slot_ptr, h, TWO: tl.constexpr):
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
def _ckpt_base(part, slot, b, HV0, HV1, K: tl.constexpr, c0p, s0p, z0p, c1p, s1p, z1p,
               CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
               CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr):
    """Base pointers (codes, scale, zero) of this head in part 0 and part 1."""
    i0 = b * HV0 + slot
    i1 = b * HV1 + slot
    return (c0p + i0 * K * CC0, s0p + i0 * SS0, z0p + i0 * ZS0, c1p + i1 * K * CC1, s1p + i1 * SS1, z1p + i1 * ZS1)


@triton.jit
def _packed_head(pid, H, HV, part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p, HV0, HV1, K: tl.constexpr,
                 CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr,
                 ZS1: tl.constexpr, TWO: tl.constexpr):
    """The (sequence, value head) of program ``pid`` of a packed-checkpoint kernel: ``b, h``, the key head
    ``kh``, the head's part (bit width) and its base pointers in both parts (:func:`_ckpt_base`)."""
    b = pid // HV
    h = pid % HV
    part, slot = _head_slot(part_ptr, slot_ptr, h, TWO)
    a0, as0, az0, a1, as1, az1 = _ckpt_base(part, slot, b, HV0, HV1, K, c0p, s0p, z0p, c1p, s1p, z1p,
                                            CC0, SS0, ZS0, CC1, SS1, ZS1)
    return b, h, h // (HV // H), part, a0, as0, az0, a1, as1, az1


@triton.jit
def _ckpt_tile(dense_base, part, a0, as0, az0, a1, as1, az1, r0, c0, BK: tl.constexpr, BV: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr, SYM: tl.constexpr,
               BITS0: tl.constexpr, PZ0: tl.constexpr, BITS1: tl.constexpr, PZ1: tl.constexpr,
               TWO: tl.constexpr, DENSE: tl.constexpr):
    """The checkpoint tile ``[BK, BV]`` at rows ``r0``, columns ``c0`` of this head, as fp32."""
    if DENSE:
        rows = r0 + tl.arange(0, BK)
        cols = c0 + tl.arange(0, BV)
        S = tl.load(dense_base + rows[:, None] * V + cols[None, :]).to(tl.float32)
    else:
        if TWO:
            if part == 1:
                S = _load_tile(a1, as1, az1, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM, BITS1, PZ1)
            else:
                S = _load_tile(a0, as0, az0, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM, BITS0, PZ0)
        else:
            S = _load_tile(a0, as0, az0, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM, BITS0, PZ0)
    return S


@triton.jit
def _ckpt_store(x, dense_base, part, a0, as0, az0, a1, as1, az1, r0, c0, BK: tl.constexpr, BV: tl.constexpr,
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
                _store_tile(x, a1, as1, az1, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM, BITS1, PZ1)
            else:
                _store_tile(x, a0, as0, az0, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM, BITS0, PZ0)
        else:
            _store_tile(x, a0, as0, az0, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM, BITS0, PZ0)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
    dense_ptr, part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p, HV0, HV1,
    bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, H, HV,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    G: tl.constexpr, KEY_AXIS: tl.constexpr, SYM: tl.constexpr,
    BITS0: tl.constexpr, PZ0: tl.constexpr, CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
    BITS1: tl.constexpr, PZ1: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr,
    TWO: tl.constexpr, DENSE: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    K_BF16: tl.constexpr, V_BF16: tl.constexpr, FLUSH: tl.constexpr, NB: tl.constexpr,
    NB2: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * BV
    b = pid // HV
    h = pid % HV
    kh = h // (HV // H)
    cols = c0 + tl.arange(0, BV)
    kfull = tl.load(k_ptr + (b * H + kh) * K + tl.arange(0, K))
    qfull = tl.load(q_ptr + (b * H + kh) * K + tl.arange(0, K))
    if DENSE:
        part = 0
        slot = 0
    else:
        part, slot = _head_slot(part_ptr, slot_ptr, h, TWO)
    a0, as0, az0, a1, as1, az1 = _ckpt_base(part, slot, b, HV0, HV1, K, c0p, s0p, z0p, c1p, s1p, z1p,
                                            CC0, SS0, ZS0, CC1, SS1, ZS1)
    dense_base = dense_ptr + pid * K * V

    # pass 1: Ŝᵀk and Ŝᵀq for this column block, one read of the checkpoint
    sk = tl.zeros((BV,), tl.float32)
    sq = tl.zeros((BV,), tl.float32)
    for r0 in tl.static_range(0, K, BK):
        rows = r0 + tl.arange(0, BK)
        S = _ckpt_tile(dense_base, part, a0, as0, az0, a1, as1, az1, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM,
                       BITS0, PZ0, BITS1, PZ1, TWO, DENSE)
        kc = tl.load(k_ptr + (b * H + kh) * K + rows)
        qc = tl.load(q_ptr + (b * H + kh) * K + rows)
        sk += tl.sum(S * kc[:, None], axis=0)
        sq += tl.sum(S * qc[:, None], axis=0)

    g_t = tl.load(g_ptr + pid)
    run, rk, rq = _record_reads(bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV, c0, kfull, qfull,
                                g_t, K, V, BV, KBITS, VBITS, NB)
    kcodes, kscale, khat, ucodes, uscale, uhat = _token_output(beta_ptr, v_ptr, o_ptr, pid, cols, g_t, run, sk, sq,
                                                               rk, rq, kfull, qfull, K, V, BV, KBITS, VBITS,
                                                               K_BF16, V_BF16)
    run_o = run + g_t

    if FLUSH:
        # fold every record (the new one included) into Ŝ and requantise this column block in place
        kdiv = tl.where(kscale == 0, 1.0, kscale.to(tl.float32))
        QK: tl.constexpr = (1 << KBITS) // 2 - 1  # the key codes' qmax (unused for float keys)
        ridx2 = tl.arange(0, NB2)  # 16 records per block: the fold is a [BK, 16] x [16, BV] product
        later2 = ridx2[None, :] > ridx2[:, None]
        for r0 in tl.static_range(0, K, BK):
            rows = r0 + tl.arange(0, BK)
            S = _ckpt_tile(dense_base, part, a0, as0, az0, a1, as1, az1, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM,
                           BITS0, PZ0, BITS1, PZ1, TWO, DENSE)
            kc = tl.load(k_ptr + (b * H + kh) * K + rows)
            if KBITS == 0:
                if K_BF16:
                    kc = round_bf16(kc)
            else:
                kq = _rint(tl.minimum(tl.maximum(tl.math.div_rn(kc[None, :], kdiv), -QK * 1.0), QK * 1.0))
                kc = tl.reshape(kq * kscale.to(tl.float32), (BK,))
            acc = tl.exp(run_o) * S + kc[:, None] * uhat[None, :]
            run = g_t * 0.0
            for blk in range(0, tl.cdiv(n, NB2)):
                i = n - (blk + 1) * NB2 + ridx2
                valid = i >= 0
                gb = tl.load(bg_ptr + (b * cap + i) * HV + h, mask=valid, other=0.0)
                kb = _load_vecs(bk_ptr, bks_ptr, (b * cap + i) * H + kh, valid, r0, BK, K, KBITS)
                ub = _load_vecs(bv_ptr, bvs_ptr, (b * cap + i) * HV + h, valid, c0, BV, V, VBITS)
                w = tl.exp(run + tl.sum(tl.where(later2, gb[None, :], 0.0), axis=1) + g_t)
                acc += tl.dot(tl.trans(kb), w[:, None] * ub, input_precision="ieee")
                run += tl.sum(gb)
            _ckpt_store(acc, dense_base, part, a0, as0, az0, a1, as1, az1, r0, c0, BK, BV, K, V, G, KEY_AXIS,
                        SYM, BITS0, PZ0, BITS1, PZ1, TWO, DENSE)
    else:
        _append_record(bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV, c0, g_t,
                       kcodes, kscale, khat, ucodes, uscale, uhat, K, V, BV, KBITS, VBITS)


@triton.jit
def _bf16_split(x):
    """fp32 ``x`` as three fp32 terms that bfloat16 holds exactly (each rounded to nearest even) and whose
    sum is exactly ``x``: the operands of an exact tensor-core product. bfloat16 keeps fp32's exponent
    range, so no scaling is needed (finite ``x``, ``|x| < 2^127``)."""
    hi = round_bf16(x)
    r = x - hi
    mid = round_bf16(r)
    return hi, mid, r - mid


@triton.jit
def _operand(x, BF16: tl.constexpr):
    """fp32 ``x`` holding bfloat16-exact values as a dot operand: bfloat16 on the GPU; fp32 under the
    interpreter (``BF16`` False), whose bfloat16 ``tl.dot`` is not exact; the values are the same."""
    if BF16:
        out = x.to(tl.bfloat16)
    else:
        out = x
    return out


@triton.jit
def _centred(c, off, BITS: tl.constexpr, BF16: tl.constexpr):
    """Codes ``c`` (int32, one per element, ``0 .. 2^BITS - 1``) minus ``off`` (int32, broadcast) as the
    exact integers ``c - off``, a dot operand (see :func:`_operand`). 4-bit codes on the GPU become
    bfloat16 ``128 + c`` by or-ing them into the bits of 128.0 (no int -> float conversion); other codes
    become fp32 ``2^23 + c`` the same way; then ``128 + off`` or ``2^23 + off`` is subtracted (exact)."""
    if BF16 and BITS <= 4:
        out = (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - (off + 128).to(tl.bfloat16)
    else:
        f = (c | 0x4B000000).to(tl.float32, bitcast=True) - (off + 8388608).to(tl.float32)
        out = _operand(f, BF16)
    return out


@triton.jit
def _ckpt_dots(codes, scale, zero, kx, qx, c0, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
               G: tl.constexpr, SYM: tl.constexpr, BITS: tl.constexpr, PACK_Z: tl.constexpr,
               BF16: tl.constexpr):
    """``Ŝᵀk`` and ``Ŝᵀq`` of one head's packed key-axis checkpoint, columns ``c0 .. c0+BV``; ``k, q [K]``
    at ``kx, qx``. Returns ``(yk_a, yq_a, yk_b, yq_b)``, each ``[NP]`` fp32: for 4-bit codes the even
    (``_a``) and odd (``_b``) columns, ``c0 + 2j`` and ``c0 + 2j + 1``; else ``_a`` all columns
    ``c0 + j`` and ``_b`` zeros. ``NP = max(N, 16)`` (``N`` = BV / 2 or BV): entries past N are padding.

    Per key group one ``[16, G] x [G, N]`` dot on tensor cores with fp32 accumulation: rows 0-2 hold
    ``k`` and rows 3-5 ``q``, each split into three bfloat16 terms (:func:`_bf16_split`), against the
    exact integers ``c - z`` (:func:`_centred`); every product is exact and the group adds ``s T``
    per column (``T = Σ_i x_i (c_i - z)``). 4-bit codes are taken as two half tiles, the low nibbles
    (even columns) and the high nibbles (odd columns), so no unpacking shuffle is needed. Against
    the reference, which rounds each ``s (c - z)`` to fp32 and sums in IEEE fp32, the differences are
    the summation order and the tensor cores' fp32 accumulation: float32-rounding level."""
    KB: tl.constexpr = G if G >= 16 else 16
    HALVES: tl.constexpr = BITS <= 4
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
        k1, k2, k3 = _bf16_split(tl.load(kx + r0 + rows, mask=m, other=0.0))
        q1, q2, q3 = _bf16_split(tl.load(qx + r0 + rows, mask=m, other=0.0))
        a = tl.where(rr == 0, k1[None, :], tl.where(rr == 1, k2[None, :], tl.where(rr == 2, k3[None, :], 0.0)))
        a = _operand(tl.where(rr == 3, q1[None, :], tl.where(rr == 4, q2[None, :], tl.where(rr == 5, q3[None, :], a))),
                     BF16)
        srow = scale + (r0 // G) * V
        if HALVES:
            p = tl.load(codes + (r0 + rows[:, None]) * (V // 2) + c0 // 2 + j[None, :], mask=m[:, None] & cm[None, :],
                        other=0).to(tl.int32)
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
            acc_a += s_a[None, :] * tl.dot(a, _centred(p & 15, off_a, BITS, BF16))
            acc_b += s_b[None, :] * tl.dot(a, _centred(p >> 4, off_b, BITS, BF16))
        else:
            p = tl.load(codes + (r0 + rows[:, None]) * V + c0 + j[None, :], mask=m[:, None] & cm[None, :],
                        other=0).to(tl.int32)
            if SYM:
                off = 1 << (BITS - 1)
            else:
                tl.static_assert(not PACK_Z, "8-bit zero points are not packed (pace_core.quant)")
                off = tl.load(zero + (r0 // G) * V + c0 + j, mask=cm, other=0).to(tl.int32)[None, :]
            s_a = tl.load(srow + c0 + j, mask=cm, other=0.0).to(tl.float32)
            acc_a += s_a[None, :] * tl.dot(a, _centred(p, off, BITS, BF16))
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
    N: tl.constexpr = BV // 2 if BITS <= 4 else BV
    j = tl.arange(0, yk_a.shape[0])
    cm = j < N
    cols = c0 + (2 * j if BITS <= 4 else j)
    tl.store(yx + cols, yk_a, mask=cm)
    tl.store(yx + V + cols, yq_a, mask=cm)
    if BITS <= 4:
        tl.store(yx + cols + 1, yk_b, mask=cm)
        tl.store(yx + V + cols + 1, yq_b, mask=cm)


@triton.jit
def _head_dots(codes, scale, zero, kx, qx, K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr,
               BITS: tl.constexpr, PZ: tl.constexpr, BF16: tl.constexpr):
    """``Ŝᵀk, Ŝᵀq [V]`` of the whole head (:func:`_ckpt_dots`, the 4-bit half tiles interleaved back);
    heads at least 32 values wide for 4-bit codes, 16 otherwise, so that nothing is padding."""
    yk_a, yq_a, yk_b, yq_b = _ckpt_dots(codes, scale, zero, kx, qx, 0, K, V, V, G, SYM, BITS, PZ, BF16)
    if BITS <= 4:
        sk = tl.reshape(tl.join(yk_a, yk_b), (V,))
        sq = tl.reshape(tl.join(yq_a, yq_b), (V,))
    else:
        sk = yk_a
        sq = yq_a
    return sk, sq


@triton.jit
def _ckpt_dots_kernel(
    q_ptr, k_ptr, y_ptr, part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p, HV0, HV1, H, HV,
    K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr,
    BITS0: tl.constexpr, PZ0: tl.constexpr, CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
    BITS1: tl.constexpr, PZ1: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr,
    TWO: tl.constexpr, BF16: tl.constexpr,
):
    """The split path's first kernel: ``y [B*HV, 2, V]`` = ``Ŝᵀk_t, Ŝᵀq_t`` per (sequence, value head),
    one program per column block; reads the packed checkpoint once and nothing else of the state."""
    pid = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * BV
    b, h, kh, part, a0, as0, az0, a1, as1, az1 = _packed_head(pid, H, HV, part_ptr, slot_ptr, c0p, s0p, z0p, c1p,
                                                              s1p, z1p, HV0, HV1, K, CC0, SS0, ZS0, CC1, SS1,
                                                              ZS1, TWO)
    kx = k_ptr + (b * H + kh) * K
    qx = q_ptr + (b * H + kh) * K
    yx = y_ptr + pid * 2 * V
    if TWO:
        if part == 1:
            _dots_to(yx, a1, as1, az1, kx, qx, c0, K, V, BV, G, SYM, BITS1, PZ1, BF16)
        else:
            _dots_to(yx, a0, as0, az0, kx, qx, c0, K, V, BV, G, SYM, BITS0, PZ0, BF16)
    else:
        _dots_to(yx, a0, as0, az0, kx, qx, c0, K, V, BV, G, SYM, BITS0, PZ0, BF16)


@triton.jit
def _record_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, y_ptr,
    bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, H, HV,
    K: tl.constexpr, V: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, K_BF16: tl.constexpr,
    V_BF16: tl.constexpr, NB: tl.constexpr,
):
    """The split path's second kernel, one program per (sequence, value head): the buffered records'
    part of the two products, ``u_t``, ``o_t`` from ``y`` (:func:`_ckpt_dots_kernel`), and the token's
    record written in the buffer's precision. Launched with few warps: its reductions are over
    vectors, so they stay within a warp or two."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, V)
    _record_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, H,
                 HV, pid, tl.load(y_ptr + pid * 2 * V + cols), tl.load(y_ptr + pid * 2 * V + V + cols),
                 K, V, KBITS, VBITS, K_BF16, V_BF16, NB)


@triton.jit
def _record_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, H,
                 HV, pid, sk, sq, K: tl.constexpr, V: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                 K_BF16: tl.constexpr, V_BF16: tl.constexpr, NB: tl.constexpr):
    """The step of (sequence, value head) ``pid`` given the checkpoint's ``Ŝᵀk_t, Ŝᵀq_t`` (``sk, sq
    [V]``): the buffered records' part of the two products, ``u_t``, ``o_t`` and the token's record
    written in the buffer's precision."""
    b = pid // HV
    h = pid % HV
    kh = h // (HV // H)
    cols = tl.arange(0, V)
    kfull = tl.load(k_ptr + (b * H + kh) * K + tl.arange(0, K))
    qfull = tl.load(q_ptr + (b * H + kh) * K + tl.arange(0, K))
    g_t = tl.load(g_ptr + pid)
    run, rk, rq = _record_reads(bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV, 0, kfull, qfull,
                                g_t, K, V, V, KBITS, VBITS, NB)
    kcodes, kscale, khat, ucodes, uscale, uhat = _token_output(beta_ptr, v_ptr, o_ptr, pid, cols, g_t, run, sk, sq,
                                                               rk, rq, kfull, qfull, K, V, V, KBITS, VBITS,
                                                               K_BF16, V_BF16)
    # the record is appended also on the token that fills the buffer: the flush kernel folds it
    _append_record(bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV, 0, g_t,
                   kcodes, kscale, khat, ucodes, uscale, uhat, K, V, V, KBITS, VBITS)


@triton.jit
def _ckpt_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p, HV0, HV1,
    bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, H, HV,
    K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr,
    BITS0: tl.constexpr, PZ0: tl.constexpr, CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
    BITS1: tl.constexpr, PZ1: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr,
    TWO: tl.constexpr, BF16: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, K_BF16: tl.constexpr,
    V_BF16: tl.constexpr, NB: tl.constexpr,
):
    """The split path's step as one kernel, one program per (sequence, value head): the dots kernel's
    ``Ŝᵀk_t, Ŝᵀq_t`` for the whole head (:func:`_head_dots`) kept in registers, then the record
    kernel's work (:func:`_record_step`). One launch and no workspace round trip per token; its
    reductions span all the program's warps."""
    pid = tl.program_id(0).to(tl.int64)
    b, h, kh, part, a0, as0, az0, a1, as1, az1 = _packed_head(pid, H, HV, part_ptr, slot_ptr, c0p, s0p, z0p, c1p,
                                                              s1p, z1p, HV0, HV1, K, CC0, SS0, ZS0, CC1, SS1,
                                                              ZS1, TWO)
    kx = k_ptr + (b * H + kh) * K
    qx = q_ptr + (b * H + kh) * K
    if TWO:
        if part == 1:
            sk, sq = _head_dots(a1, as1, az1, kx, qx, K, V, G, SYM, BITS1, PZ1, BF16)
        else:
            sk, sq = _head_dots(a0, as0, az0, kx, qx, K, V, G, SYM, BITS0, PZ0, BF16)
    else:
        sk, sq = _head_dots(a0, as0, az0, kx, qx, K, V, G, SYM, BITS0, PZ0, BF16)
    _record_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, H,
                 HV, pid, sk, sq, K, V, KBITS, VBITS, K_BF16, V_BF16, NB)


@triton.jit
def _fold(wu, kx, acc, EXACT: tl.constexpr, BF16: tl.constexpr):
    """``acc + wu [N, NB] x kx [NB, T]`` fp32 on tensor cores. ``EXACT``: ``kx`` is a dot operand holding
    bfloat16-exact values (integer key codes, bfloat16 keys) and ``wu`` is split into three bfloat16
    terms (:func:`_bf16_split`), so every product is exact; else an IEEE fp32 dot."""
    if EXACT:
        w1, w2, w3 = _bf16_split(wu)
        acc = tl.dot(_operand(w1, BF16), kx, acc)
        acc = tl.dot(_operand(w2, BF16), kx, acc)
        acc = tl.dot(_operand(w3, BF16), kx, acc)
    else:
        acc = tl.dot(wu, kx, acc, input_precision="ieee")
    return acc


@triton.jit
def _dequant_rows(c, z, s, G: tl.constexpr):
    """``(c - z) s`` fp32 ``[N, T]`` from codes ``c`` int32 ``[N, T]`` (``0 <= c < 2^22``) and per-group
    zero points ``z`` int32 and factors ``s`` fp32, both ``[N, T/G]`` (a transposed tile, see
    :func:`_flush_head`). ``c - z`` is formed exactly without an int -> float conversion: ``c`` or-ed
    into the bits of ``2^23``, then ``2^23 + z`` subtracted."""
    N: tl.constexpr = c.shape[0]
    T: tl.constexpr = c.shape[1]
    cz = (c | 0x4B000000).to(tl.float32, bitcast=True) - _expand((z + 8388608).to(tl.float32), N, T, G, False)
    return cz * _expand(s, N, T, G, False)


@triton.jit
def _fold_records(acc_a, acc_b, bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV, c0, r0,
                  K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, T: tl.constexpr, KBITS: tl.constexpr,
                  VBITS: tl.constexpr, K_BF16: tl.constexpr, NB: tl.constexpr, BF16: tl.constexpr,
                  HALVES: tl.constexpr):
    """``acc + Σ_i e^{G - G_i} u_i k_iᵀ`` over the ``n`` buffered records for key rows ``r0 .. r0+T``
    and value columns ``c0 .. c0+BV`` of one head, transposed: ``acc_a, acc_b [N, T]`` (the even and
    odd columns with ``HALVES``, else ``acc_a`` all ``N = BV`` columns and ``acc_b`` returned as is),
    NB records per ``[N, NB] x [NB, T]`` dot (:func:`_fold`), newest block first."""
    EXACT: tl.constexpr = KBITS > 0 or K_BF16
    N: tl.constexpr = acc_a.shape[0]
    ridx = tl.arange(0, NB)
    later = ridx[None, :] > ridx[:, None]
    run = tl.sum(tl.zeros((NB,), tl.float32))  # Σ of the log decays of the newer blocks
    for blk in range(0, tl.cdiv(n, NB)):
        i = n - (blk + 1) * NB + ridx
        valid = i >= 0
        gb = tl.load(bg_ptr + (b * cap + i) * HV + h, mask=valid, other=0.0)
        kc, ks = _vec_parts(bk_ptr, bks_ptr, (b * cap + i) * H + kh, valid, r0, T, K, KBITS)
        ub = _load_vecs(bv_ptr, bvs_ptr, (b * cap + i) * HV + h, valid, c0, BV, V, VBITS)
        w = (tl.exp(run + tl.sum(tl.where(later, gb[None, :], 0.0), axis=1)) * ks)[None, :]
        kx = _operand(kc, BF16) if EXACT else kc
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
    c, sc, zq = _quant_tile(x, N, T, G, False, SYM, BITS)
    tl.store(scale_at, sc)
    return c, zq


@triton.jit
def _flush_head(codes, scale, zero, bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV, cb,
                K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr,
                BITS: tl.constexpr, PZ: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                K_BF16: tl.constexpr, NB: tl.constexpr, BF16: tl.constexpr):
    """The flush of one head's columns ``c0 .. c0+BV``, ``c0 = cb BV`` (see :func:`_flush_kernel`),
    ``T = max(G, 16)`` key rows (whole groups) at a time and transposed: a tile is
    ``[N, T]``, value columns by key rows, so each group's range is a reduction along a row, inside a
    thread and its quad of the dot's layout (no shared memory). 4-bit codes are two half tiles, the low nibbles (even columns) and
    the high nibbles (odd columns), each folded, dequantised and requantised on its own (key-axis
    groups never mix columns) and packed back into the same bytes without any shuffle."""
    HALVES: tl.constexpr = BITS <= 4
    N: tl.constexpr = BV // 2 if HALVES else BV
    T: tl.constexpr = G if G >= 16 else 16  # whole groups; at most K, as K >= 16 (DECODE_MIN_K)
    CW: tl.constexpr = V // 2 if HALVES else V  # bytes per key row of codes (and of packed zero points)
    c0 = cb * BV
    cbyte = cb * (BV // 2) if HALVES else c0  # first byte of the columns in a row (alignment visible)
    ridx = tl.arange(0, NB)
    total = tl.sum(tl.zeros((NB,), tl.float32))  # Σ of the n records' log decays
    for blk in range(0, tl.cdiv(n, NB)):
        i = blk * NB + ridx
        total += tl.sum(tl.load(bg_ptr + (b * cap + i) * HV + h, mask=i < n, other=0.0))
    decay = tl.exp(total)
    j = tl.arange(0, N)
    cols = c0 + (2 * j if HALVES else j)  # the (even) value columns of the tile's rows
    for r0 in tl.static_range(0, K, T):
        grp = (r0 // G + tl.arange(0, T // G))[None, :]  # the tile's groups
        at = codes + (r0 + tl.arange(0, T))[None, :] * CW + cbyte + j[:, None]
        s_at = scale + grp * V + cols[:, None]
        p = tl.load(at).to(tl.int32)
        if HALVES:
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
            x_a, x_b = _fold_records(x_a, x_b, bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV,
                                     c0, r0, K, V, BV, T, KBITS, VBITS, K_BF16, NB, BF16, True)
            c_a, zq_a = _requant_rows(x_a, s_at, G, SYM, BITS)
            c_b, zq_b = _requant_rows(x_b, s_at + 1, G, SYM, BITS)
            tl.store(at, (c_a | (c_b << 4)).to(tl.uint8))
            if not SYM:
                tl.store(zero + grp * CW + cbyte + j[:, None], (zq_a | (zq_b << 4)).to(tl.uint8))
        else:
            if SYM:
                z = tl.full((N, T // G), 1 << (BITS - 1), tl.int32)
            else:
                z = tl.load(zero + grp * V + cols[:, None]).to(tl.int32)
            x = _dequant_rows(p, z, decay * tl.load(s_at).to(tl.float32), G)
            x, _ = _fold_records(x, x, bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV,
                                 c0, r0, K, V, BV, T, KBITS, VBITS, K_BF16, NB, BF16, False)
            c, zq = _requant_rows(x, s_at, G, SYM, BITS)
            tl.store(at, c.to(tl.uint8))
            if not SYM:
                tl.store(zero + grp * V + cols[:, None], zq.to(tl.uint8))


@triton.jit
def _flush_kernel(
    part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p, HV0, HV1,
    bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, H, HV,
    K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr,
    BITS0: tl.constexpr, PZ0: tl.constexpr, CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
    BITS1: tl.constexpr, PZ1: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr,
    TWO: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, K_BF16: tl.constexpr, NB: tl.constexpr,
    BF16: tl.constexpr,
):
    """Fold the ``n`` buffered records into the packed checkpoint and requantise it in place:
    ``S = e^{G} Ŝ + Σ_i e^{G - G_i} k_i u_iᵀ`` for the columns ``c0 .. c0+BV`` of one head.

    The fold is transposed, ``[N, NB] x [NB, T]`` on tensor cores for ``T`` key rows at a time
    (:func:`_flush_head`): ``e^{G - G_i} s_i u_i`` split into three bfloat16 terms (:func:`_bf16_split`)
    against the keys as the exact integers ``c - 2^(b-1)`` (integer storage; bfloat16 keys as they
    are), so every product is exact; float32 keys take an IEEE fp32 dot (:func:`_fold`)."""
    pid = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    b, h, kh, part, a0, as0, az0, a1, as1, az1 = _packed_head(pid, H, HV, part_ptr, slot_ptr, c0p, s0p, z0p, c1p,
                                                              s1p, z1p, HV0, HV1, K, CC0, SS0, ZS0, CC1, SS1,
                                                              ZS1, TWO)
    if TWO:
        if part == 1:
            _flush_head(a1, as1, az1, bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV, cb,
                        K, V, BV, G, SYM, BITS1, PZ1, KBITS, VBITS, K_BF16, NB, BF16)
        else:
            _flush_head(a0, as0, az0, bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV, cb,
                        K, V, BV, G, SYM, BITS0, PZ0, KBITS, VBITS, K_BF16, NB, BF16)
    else:
        _flush_head(a0, as0, az0, bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV, cb,
                    K, V, BV, G, SYM, BITS0, PZ0, KBITS, VBITS, K_BF16, NB, BF16)


def _as_mixed(ckpt: quant.PackedTensor | quant.MixedPackedState) -> quant.MixedPackedState:
    if isinstance(ckpt, quant.MixedPackedState):
        return ckpt
    hv = ckpt.shape[-3]
    heads = torch.arange(hv, device=ckpt.codes.device)
    return quant.MixedPackedState({ckpt.spec.bits: ckpt}, {ckpt.spec.bits: heads}, ckpt.shape)


def _output(out: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise PaceError(f"out: {tuple(out.shape)} {out.dtype} not allowed; allowed: contiguous float32 {shape}")
    return out


def _check_inputs(buf: DecodeBuffer, tensors: dict[str, torch.Tensor]) -> None:
    B, H, HV, K, V = buf.batch, buf.num_k_heads, buf.num_v_heads, buf.d_k, buf.d_v
    shapes = {"q_t": (B, H, K), "k_t": (B, H, K), "v_t": (B, HV, V), "g_t": (B, HV), "beta_t": (B, HV)}
    for name, t in tensors.items():
        if tuple(t.shape) != shapes[name]:
            raise PaceError(f"{name}: shape {tuple(t.shape)} not allowed; allowed: {shapes[name]} (from the buffer)")


def column_block(buf: DecodeBuffer) -> int:
    """Columns per program: all of V when the values are stored as integers (one scale per vector),
    else 64 (more programs at small batch)."""
    return buf.d_v if buf.precision == "int8" else min(buf.d_v, 64)


@dataclass
class DecodePlan:
    """Everything a decode launch needs that does not change from token to token: the checkpoint's
    storage pointers and head table, the tile sizes and compile-time layout. Built once per
    checkpoint/buffer pair (it reads the head map off the device), then reused, e.g. for every token
    of a CUDA graph; the checkpoint is updated in place, so the plan stays valid."""

    shape: tuple[int, int, int, int, int]  # B, H, HV, K, V
    precision: str
    capacity: int
    ckpt_args: list
    meta: dict = field(default_factory=dict)
    split: bool = False  # packed key-axis checkpoint: dots + record kernels, a separate flush kernel
    workspace: torch.Tensor | None = None  # split: ``Ŝᵀk_t, Ŝᵀq_t`` ``[B*HV, 2, V]`` float32, between the two
    # step kernels (allocated also when the step runs fused: the launch settings may change per plan)


SPLIT_DEFAULTS = {"fused_step": "auto", "step_warps": 4, "dots_columns": 128, "dots_warps": 4, "record_warps": 1,
                  "flush_warps": 4, "flush_columns": 128}
"""Launch settings of the split path (``DecodePlan.meta``; kernels/bench.py tries others, and these
are the fastest it measured on the H200 at batch 32 to 128, data/bench/bench.json): the step as one
kernel (``fused_step``, :func:`_ckpt_step_kernel`, with ``step_warps``) or as two (the dots kernel's
columns per program and warps, the record kernel's warps); ``"auto"`` fuses when there are at most
as many (sequence, value head) programs as the GPU has SMs: one wave, where the launch saved
outweighs the fused kernel's block-wide reductions (faster at batch 1-4 on the H200, slower from
8). Then warps of the flush kernel and columns per flush program (4-bit codes: two half tiles of
``flush_columns / 2`` rows; on the GPU at least 16 for tensor-core tiles)."""


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """SMs of CUDA ``device`` (read once per device: the dense step asks on every token)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_decode(ckpt: Checkpoint, buf: DecodeBuffer) -> DecodePlan:
    """Validate ``ckpt`` against ``buf`` and prepare the launch (see :class:`DecodePlan`)."""
    B, H, HV, K, V = buf.batch, buf.num_k_heads, buf.num_v_heads, buf.d_k, buf.d_v
    if buf.precision == "fp64":
        raise PaceError("buffer precision: 'fp64' not supported by the kernels; allowed: fp32, bf16, int8, mixed")
    if isinstance(ckpt, torch.Tensor):
        check_kernel_shape(K, V, quant.QuantSpec(8, True, "key", 1), "ckpt", decode=True)
        if ckpt.shape != (B, HV, K, V) or ckpt.dtype not in (torch.float32, torch.bfloat16) or not ckpt.is_contiguous():
            raise PaceError(f"ckpt: dense checkpoint {tuple(ckpt.shape)} {ckpt.dtype} not allowed; "
                            f"allowed: contiguous float32/bfloat16 {(B, HV, K, V)}")
        layouts = [part_layout(quant.QuantSpec(8, True, "key", 1), K, V)]
        table = torch.zeros(1, dtype=torch.int32, device=ckpt.device)
        ckpt_args = [ckpt, table, table, *([ckpt] * 6), 0, 0]
        G, key_axis, sym, BK = 1, True, True, min(K, 32)
    else:
        m = _as_mixed(ckpt)
        widths = sorted(m.parts)
        parts = [m.parts[w] for w in widths]
        spec = parts[0].spec
        if m.shape != (B, HV, K, V):
            raise PaceError(f"ckpt: shape {m.shape} not allowed; allowed: {(B, HV, K, V)}")
        check_kernel_shape(K, V, spec, "ckpt", decode=True)
        bits_per_head = [0] * HV
        for w in widths:
            for hh in m.heads[w].tolist():
                bits_per_head[hh] = w
        _, table = head_table(bits_per_head, parts[0].codes.device)
        layouts = [part_layout(p.spec, K, V) for p in parts]
        ptrs = part_pointers(parts)
        if not all(t.is_contiguous() for t in ptrs):
            raise PaceError("ckpt: packed tensors must be contiguous; allowed: contiguous codes/scale/zero")
        hv1 = len(m.heads[widths[1]]) if len(widths) == 2 else 0
        ckpt_args = [parts[0].scale, table.part, table.slot, *ptrs, len(m.heads[widths[0]]), hv1]
        G, key_axis, sym = spec.group_size, spec.axis == "key", spec.symmetric
        BK = min(max(G, 32) if key_axis else 32, K)
    BV = column_block(buf)
    if not key_axis and BV % (2 * G if not sym and layouts[0].pack_zero else G):
        BV = V
    st = _buffer_tensors(buf)
    meta = dict(K=K, V=V, BK=BK, BV=BV, G=G, KEY_AXIS=key_axis, SYM=sym, **layout_args(layouts),
                DENSE=isinstance(ckpt, torch.Tensor), KBITS=st["keys_bits"], VBITS=st["values_bits"],
                K_BF16=st["keys"].dtype == torch.bfloat16, V_BF16=st["values"].dtype == torch.bfloat16,
                num_warps=8 if BK * BV >= 8192 else 4)
    split = not meta["DENSE"] and key_axis
    workspace = None
    if split:  # bfloat16 tensor-core operands on a GPU (fp32 holding the same values under the interpreter)
        fusable = all((V // 2 if p.spec.bits <= 4 else V) >= 16 for p in parts)  # no padded dot columns
        meta = {**meta, **SPLIT_DEFAULTS, "BF16": buf.device.type == "cuda", "fusable": fusable}
        if meta["fused_step"] == "auto":
            meta["fused_step"] = buf.device.type == "cuda" and B * HV <= _sm_count(buf.device)
        workspace = torch.empty(B * HV * 2 * V, dtype=torch.float32, device=buf.device)
    return DecodePlan((B, H, HV, K, V), buf.precision, buf.capacity, ckpt_args, meta, split, workspace)


def _ckpt_common(m: dict) -> dict:
    """The packed checkpoint's compile-time layout (the split kernels' common constexpr arguments)."""
    return dict(K=m["K"], V=m["V"], G=m["G"], SYM=m["SYM"], TWO=m["TWO"], BF16=m["BF16"],
                **{f"{x}{i}": m[f"{x}{i}"] for x in ("BITS", "PZ", "CC", "SS", "ZS") for i in (0, 1)})


def _records(buf: DecodeBuffer) -> tuple[dict, tuple]:
    st = _buffer_tensors(buf)
    return st, (st["keys"], st["keys_scale"], st["values"], st["values_scale"], st["log_decays"])


def launch_dots(plan: DecodePlan, q, k) -> None:
    """The split path's first kernel: ``Ŝᵀk_t, Ŝᵀq_t`` into ``plan.workspace`` (``q, k [B, H, K]``
    float32, contiguous)."""
    B, H, HV, K, V = plan.shape
    m = plan.meta
    bv = min(m["dots_columns"], V)
    _ckpt_dots_kernel[(B * HV, V // bv)](q, k, plan.workspace, *plan.ckpt_args[1:], H, HV, BV=bv,
                                         num_warps=m["dots_warps"], **_ckpt_common(m))


def launch_records(plan: DecodePlan, buf: DecodeBuffer, q, k, v, g, beta, o) -> None:
    """The split path's second kernel: ``o [B, HV, V]`` from ``plan.workspace`` and the buffer's
    ``len(buf)`` records; writes the token's record into slot ``len(buf)`` (the caller counts it)."""
    B, H, HV, K, V = plan.shape
    m = plan.meta
    st, records = _records(buf)
    _record_step_kernel[(B * HV,)](
        q, k, v, g, beta, o, plan.workspace, *records, st["n"], st["cap"], H, HV, K=K, V=V, KBITS=m["KBITS"],
        VBITS=m["VBITS"], K_BF16=m["K_BF16"], V_BF16=m["V_BF16"], NB=min(triton.next_power_of_2(plan.capacity), 16),
        num_warps=m["record_warps"],
    )


def launch_packed_step(plan: DecodePlan, buf: DecodeBuffer, q, k, v, g, beta, o) -> None:
    """The split path's step: one :func:`_ckpt_step_kernel` launch (``meta["fused_step"]``, where the
    heads are wide enough: ``meta["fusable"]``), else :func:`launch_dots` then :func:`launch_records`.
    Inputs as in :func:`buffered_decode_step`, float32 and contiguous."""
    m = plan.meta
    if not (m["fused_step"] and m["fusable"]):
        launch_dots(plan, q, k)
        launch_records(plan, buf, q, k, v, g, beta, o)
        return
    B, H, HV, K, V = plan.shape
    st, records = _records(buf)
    _ckpt_step_kernel[(B * HV,)](
        q, k, v, g, beta, o, *plan.ckpt_args[1:], *records, st["n"], st["cap"], H, HV, KBITS=m["KBITS"],
        VBITS=m["VBITS"], K_BF16=m["K_BF16"], V_BF16=m["V_BF16"], NB=min(triton.next_power_of_2(plan.capacity), 16),
        num_warps=m["step_warps"], **_ckpt_common(m),
    )


def launch_flush(plan: DecodePlan, buf: DecodeBuffer) -> None:
    """The split path's flush kernel: fold the buffer's ``len(buf)`` records into the packed
    checkpoint and requantise it in place (the caller clears the buffer)."""
    B, H, HV, K, V = plan.shape
    m = plan.meta
    st, records = _records(buf)
    bv = min(m["flush_columns"], V)
    _flush_kernel[(B * HV, V // bv)](*plan.ckpt_args[1:], *records, st["n"], st["cap"], H, HV, BV=bv, NB=16,
                                     KBITS=m["KBITS"], VBITS=m["VBITS"], K_BF16=m["K_BF16"],
                                     num_warps=m["flush_warps"], num_stages=1, **_ckpt_common(m))


def buffered_decode_step(
    ckpt: Checkpoint,
    buf: DecodeBuffer,
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    g_t: torch.Tensor,
    beta_t: torch.Tensor,
    period: int,
    out: torch.Tensor | None = None,
    plan: DecodePlan | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """One decode token for all sequences and value heads, in one launch.

    ``ckpt``: the checkpoint ``Ŝ`` — a dense ``[B, HV, K, V]`` float32/bfloat16 tensor, a
    :class:`~pace_core.quant.PackedTensor` or a :class:`~pace_core.quant.MixedPackedState` (at most
    two bit widths); ``buf``: the decode buffer (precisions fp32, bf16, int8, mixed);
    ``q_t, k_t [B, H, K]`` (prepared), ``v_t [B, HV, V]``, ``g_t, beta_t [B, HV]``.
    Returns ``o_t [B, HV, V]`` float32 (written into ``out`` when given). If the record brings the
    buffer to ``period`` records, the checkpoint is folded and requantised IN PLACE and the buffer
    cleared; else the record is appended.

    ``plan``: from :func:`plan_decode` for this ``ckpt``/``buf`` (built here when None).
    ``check_finite``: raise PaceError for non-finite ``k_t, v_t, g_t`` (one device sync); pass False
    under CUDA-graph capture, where non-finite inputs then reach the stored state unreported.
    """
    B, H, HV, K, V = buf.batch, buf.num_k_heads, buf.num_v_heads, buf.d_k, buf.d_v
    _check_inputs(buf, {"q_t": q_t, "k_t": k_t, "v_t": v_t, "g_t": g_t, "beta_t": beta_t})
    if not isinstance(period, int) or not 1 <= period <= buf.capacity:
        raise PaceError(f"period: {period!r} not allowed; allowed: an integer in 1..{buf.capacity} (buffer capacity)")
    if len(buf) >= period:
        raise PaceError(f"buffer: holds {len(buf)} records; allowed: fewer than period={period}")
    if plan is None:
        plan = plan_decode(ckpt, buf)
    elif plan.shape != (B, H, HV, K, V) or plan.precision != buf.precision or plan.capacity != buf.capacity:
        raise PaceError("plan: made for another buffer; allowed: plan_decode(ckpt, buf) of this buffer")
    q, k, v, g, beta = (t.to(torch.float32).contiguous() for t in (q_t, k_t, v_t, g_t, beta_t))
    if check_finite:
        for name, t in (("k_t", k), ("v_t", v), ("g_t", g)):
            quant.check_finite(t, name)
    o = _output(out, (B, HV, V), q.device)
    flush = len(buf) + 1 == period
    if plan.split:
        launch_packed_step(plan, buf, q, k, v, g, beta, o)
        buf.mark_appended()
        if flush:
            launch_flush(plan, buf)
            buf.clear()
        return o
    meta = plan.meta
    if flush:  # the fold + requantise launch holds more live values: 8 warps, at most 64 rows per tile
        meta = {**meta, "BK": min(meta["BK"], max(64, meta["G"] if meta["KEY_AXIS"] else 1)), "num_warps": 8}
    st, records = _records(buf)
    _decode_kernel[(B * HV, V // meta["BV"])](
        q, k, v, g, beta, o, *plan.ckpt_args, *records, st["n"], st["cap"],
        H, HV, FLUSH=flush, NB=min(triton.next_power_of_2(buf.capacity), 16), NB2=16, **meta,
    )
    if flush:
        buf.clear()
    else:
        buf.mark_appended()
    return o


@triton.jit
def _dense_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, s_ptr,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * BV
    b = pid // HV
    h = pid % HV
    kh = h // (HV // H)
    rows = tl.arange(0, K)
    cols = c0 + tl.arange(0, BV)
    ptrs = s_ptr + pid * K * V + rows[:, None] * V + cols[None, :]
    S = tl.load(ptrs).to(tl.float32)
    k = tl.load(k_ptr + (b * H + kh) * K + rows)
    q = tl.load(q_ptr + (b * H + kh) * K + rows)
    alpha = tl.exp(tl.load(g_ptr + pid))
    beta = tl.load(beta_ptr + pid)
    S = S * alpha
    u = beta * (tl.load(v_ptr + pid * V + cols) - tl.sum(S * k[:, None], axis=0))
    S = S + k[:, None] * u[None, :]
    tl.store(o_ptr + pid * V + cols, tl.sum(S * q[:, None], axis=0))
    store_as(ptrs, S)


def dense_recurrent_step(S: torch.Tensor, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor,
                         g_t: torch.Tensor, beta_t: torch.Tensor, block_v: int | None = None,
                         out: torch.Tensor | None = None, num_warps: int = 4) -> torch.Tensor:
    """Per-token step on a dense state updated IN PLACE (the fp32 / bf16 baseline: the whole state is
    read and written every token; ``block_v`` columns and ``num_warps`` warps per program). ``block_v``
    None: 64 when there are more than four (sequence, value head) pairs per SM, else 32, the faster of
    the two on the H200 on each side (data/bench/bench.json: 32 up to batch 16, 64 from 32, with 32
    value heads).
    ``S [B, HV, K, V]`` float32/bfloat16 contiguous, ``q_t, k_t [B, H, K]``,
    ``v_t [B, HV, V]``, ``g_t, beta_t [B, HV]``. Returns ``o_t [B, HV, V]`` float32. Matches
    :func:`pace_core.recurrence.gdn_recurrent` with T = 1 to float32 rounding (relative error < 1e-5),
    and then the state's own rounding for bfloat16."""
    if S.dim() != 4 or S.dtype not in (torch.float32, torch.bfloat16) or not S.is_contiguous():
        raise PaceError(f"S: {tuple(S.shape)} {S.dtype} not allowed; allowed: contiguous float32/bfloat16 [B, HV, K, V]")
    B, HV, K, V = S.shape
    H = k_t.shape[1]
    if q_t.shape != (B, H, K) or k_t.shape != (B, H, K) or v_t.shape != (B, HV, V) or g_t.shape != (B, HV) \
            or beta_t.shape != (B, HV) or HV % H:
        raise PaceError("q_t, k_t, v_t, g_t, beta_t: shapes not allowed; allowed: [B, H, K], [B, H, K], "
                        f"[B, HV, V], [B, HV], [B, HV] with HV a multiple of H (S is {tuple(S.shape)})")
    if block_v is None:
        block_v = 64 if S.device.type == "cuda" and B * HV > 4 * _sm_count(S.device) else 32
    BV = min(block_v, V)
    q, k, v, g, beta = (t.to(torch.float32).contiguous() for t in (q_t, k_t, v_t, g_t, beta_t))
    o = _output(out, (B, HV, V), S.device)
    _dense_step_kernel[(B * HV, V // BV)](q, k, v, g, beta, o, S, H=H, HV=HV, K=K, V=V, BV=BV,
                                          num_warps=num_warps)
    return o
