"""The decode step of dense (fp32 / bf16) and value-axis checkpoints as one kernel per token: ``Ŝᵀk_t``,
``Ŝᵀq_t`` from one read of the checkpoint, the buffered records' part, ``u_t``, ``o_t`` and the record;
on the token that fills the buffer it folds every record (the new one included) into ``Ŝ`` and
requantises it in a second pass (``FLUSH``) instead of appending the record.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pace_core.buffer import DecodeBuffer

from .plan import DecodePlan
from .primitives import ckpt_base, ckpt_store, ckpt_tile, head_slot
from .records import RECORD_COUNT, append_record, load_vecs, record_reads, stored_vec, token_output


@triton.jit(do_not_specialize=RECORD_COUNT)
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
    dense_ptr, part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p, HV0, HV1,
    bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, H, HV,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    G: tl.constexpr, KEY_AXIS: tl.constexpr, SYM: tl.constexpr,
    BITS0: tl.constexpr, PZ0: tl.constexpr, CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
    BITS1: tl.constexpr, PZ1: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr,
    TWO: tl.constexpr, DENSE: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr, KSYM: tl.constexpr,
    KPZ: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr, VPZ: tl.constexpr,
    K_BF16: tl.constexpr, V_BF16: tl.constexpr, EXACT: tl.constexpr, FLUSH: tl.constexpr, NB: tl.constexpr,
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
        part, slot = head_slot(part_ptr, slot_ptr, h, TWO)
    a0, as0, az0, a1, as1, az1 = ckpt_base(part, slot, b, HV0, HV1, K, c0p, s0p, z0p, c1p, s1p, z1p,
                                            CC0, SS0, ZS0, CC1, SS1, ZS1)
    dense_base = dense_ptr + pid * K * V

    # pass 1: Ŝᵀk and Ŝᵀq for this column block, one read of the checkpoint
    sk = tl.zeros((BV,), tl.float32)
    sq = tl.zeros((BV,), tl.float32)
    for r0 in tl.static_range(0, K, BK):
        rows = r0 + tl.arange(0, BK)
        S = ckpt_tile(dense_base, part, a0, as0, az0, a1, as1, az1, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM,
                       BITS0, PZ0, BITS1, PZ1, TWO, DENSE)
        kc = tl.load(k_ptr + (b * H + kh) * K + rows)
        qc = tl.load(q_ptr + (b * H + kh) * K + rows)
        sk += tl.sum(S * kc[:, None], axis=0)
        sq += tl.sum(S * qc[:, None], axis=0)

    g_t = tl.load(g_ptr + pid)
    run, rk, rq = record_reads(bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, h, kh, H, HV,
                                c0, kfull, qfull, g_t, K, V, BV, KBITS, KG, KSYM, KPZ, VBITS, VG, VSYM, VPZ, NB)
    ucodes, uscale, uzero, uhat = token_output(
        beta_ptr, v_ptr, o_ptr, pid, cols, g_t, run, sk, sq, rk, rq, kfull, qfull, K, V, BV, KBITS, KG, KSYM,
        VBITS, VG, VSYM, K_BF16, V_BF16, EXACT)
    run_o = run + g_t

    if FLUSH:
        # fold every record (the new one included) into Ŝ and requantise this column block in place
        _, _, _, khat = stored_vec(kfull, K, KBITS, KG, KSYM, K_BF16)
        ridx2 = tl.arange(0, NB2)  # 16 records per block: the fold is a [BK, 16] x [16, BV] product
        later2 = ridx2[None, :] > ridx2[:, None]
        kidx = tl.arange(0, K)
        for r0 in tl.static_range(0, K, BK):
            rows = r0 + tl.arange(0, BK)
            S = ckpt_tile(dense_base, part, a0, as0, az0, a1, as1, az1, r0, c0, BK, BV, K, V, G, KEY_AXIS, SYM,
                           BITS0, PZ0, BITS1, PZ1, TWO, DENSE)
            kc = tl.sum(tl.where(rows[:, None] == kidx[None, :], khat[None, :], 0.0), axis=1)  # the stored key's rows
            acc = tl.exp(run_o) * S + kc[:, None] * uhat[None, :]
            run = g_t * 0.0
            for blk in range(tl.cdiv(n, NB2)):
                i = n - (blk + 1) * NB2 + ridx2
                valid = i >= 0
                gb = tl.load(bg_ptr + (b * cap + i) * HV + h, mask=valid, other=0.0)
                kb = load_vecs(bk_ptr, bks_ptr, bkz_ptr, (b * cap + i) * H + kh, valid, r0, BK, K, KBITS, KG, KSYM,
                               KPZ)
                ub = load_vecs(bv_ptr, bvs_ptr, bvz_ptr, (b * cap + i) * HV + h, valid, c0, BV, V, VBITS, VG, VSYM,
                               VPZ)
                w = tl.exp(run + tl.sum(tl.where(later2, gb[None, :], 0.0), axis=1) + g_t)
                acc += tl.dot(tl.trans(kb), w[:, None] * ub, input_precision="ieee")
                run += tl.sum(gb)
            ckpt_store(acc, dense_base, part, a0, as0, az0, a1, as1, az1, r0, c0, BK, BV, K, V, G, KEY_AXIS,
                        SYM, BITS0, PZ0, BITS1, PZ1, TWO, DENSE)
    else:
        append_record(bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, h, kh, H, HV, c0, g_t,
                       kfull, ucodes, uscale, uzero, uhat, K, V, BV, KBITS, KG, KSYM, KPZ, VBITS, VG, VSYM, VPZ,
                       K_BF16)


def launch_fused(plan: DecodePlan, buf: DecodeBuffer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 g: torch.Tensor, beta: torch.Tensor, o: torch.Tensor, flush: bool) -> None:
    """One token on a dense or value-axis checkpoint: ``q, k [B, H, K]``, ``v [B, HV, V]``, ``g, beta [B, HV]``
    float32 contiguous -> ``o [B, HV, V]``; the record goes into slot ``len(buf)``, or, with ``flush``, every record
    is folded into the checkpoint, which is requantised in place (the caller counts the record or clears the
    buffer)."""
    B, H, HV, K, V = plan.shape
    f = plan.fused
    rows, warps = f.rows, f.num_warps
    if flush:  # the fold + requantise launch holds more live values: 8 warps, at most 64 rows per tile
        rows, warps = min(rows, max(64, f.group if f.key_axis else 1)), 8
    _decode_kernel[(B * HV, V // f.columns)](
        q, k, v, g, beta, o, f.state, *f.ckpt.args(), *plan.records.args(), len(buf), plan.capacity, H, HV,
        FLUSH=flush, NB=min(triton.next_power_of_2(buf.capacity), 16), NB2=16, K=K, V=V, BK=rows, BV=f.columns,
        G=f.group, KEY_AXIS=f.key_axis, SYM=f.symmetric, **f.ckpt.constexprs(), DENSE=f.dense,
        **plan.records.layout.constexprs(), EXACT=plan.exact, num_warps=warps,
    )
