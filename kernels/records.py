"""Decode-buffer records inside the kernels: reading the buffered ``(k_i, u_i, g_i)``, the token's output
from the checkpoint's and the records' parts, and writing the token's record in the buffer's precision
(:mod:`pace_core.buffer`'s layout), shared by the packed and the fused decode steps.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.primitives import quant_tile, round_bf16, store_as
from pace_core.buffer import BUFFER_LAYOUT, DecodeBuffer


def buffer_tensors(buf: DecodeBuffer) -> dict:
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


def record_args(buf: DecodeBuffer) -> tuple[dict, tuple]:
    st = buffer_tensors(buf)
    return st, (st["keys"], st["keys_scale"], st["values"], st["values_scale"], st["log_decays"])


@triton.jit
def vec_parts(ptr, scale_ptr, recs, valid, r0, R: tl.constexpr, L: tl.constexpr, BITS: tl.constexpr):
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
def load_vecs(ptr, scale_ptr, recs, valid, r0, R: tl.constexpr, L: tl.constexpr, BITS: tl.constexpr):
    """Elements ``r0 .. r0+R`` of the buffered vectors ``recs [NB]``, dequantised to fp32 ``[NB, R]``
    (see :func:`vec_parts`)."""
    x, s = vec_parts(ptr, scale_ptr, recs, valid, r0, R, L, BITS)
    return x * s[:, None]


@triton.jit
def stored_vec(x, L: tl.constexpr, BITS: tl.constexpr, DT_BF16: tl.constexpr):
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
        codes, scale, _z = quant_tile(tl.reshape(x, (1, L)), 1, L, L, False, True, BITS)
        xs = tl.reshape((codes.to(tl.float32) - (1 << (BITS - 1)) * 1.0) * scale.to(tl.float32), (L,))
    return codes, scale, xs


@triton.jit
def store_vec(ptr, scale_ptr, rec, c0, codes, scale, x, R: tl.constexpr, L: tl.constexpr, BITS: tl.constexpr):
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
def record_reads(bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV, c0, kfull, qfull, g_t,
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
        kb = load_vecs(bk_ptr, bks_ptr, (b * cap + i) * H + kh, valid, 0, K, K, KBITS)
        ub = load_vecs(bv_ptr, bvs_ptr, (b * cap + i) * HV + h, valid, c0, BV, V, VBITS)
        after = run + tl.sum(tl.where(later, gb[None, :], 0.0), axis=1)  # Σ_{j>i} g_j over the held records
        wk = tl.exp(after) * tl.sum(kb * kfull[None, :], axis=1)
        wq = tl.exp(after + g_t) * tl.sum(kb * qfull[None, :], axis=1)
        rk += tl.sum(wk[:, None] * ub, axis=0)
        rq += tl.sum(wq[:, None] * ub, axis=0)
        run += tl.sum(gb)
    return run, rk, rq


@triton.jit
def token_output(beta_ptr, v_ptr, o_ptr, pid, cols, g_t, run, sk, sq, rk, rq, kfull, qfull,
                  K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                  K_BF16: tl.constexpr, V_BF16: tl.constexpr):
    """``u_t = β_t (v_t - e^{g_t} S_{t-1}ᵀk_t)`` and ``o_t`` (stored) from the checkpoint's ``sk, sq`` and
    the records' ``run, rk, rq``, with the stored (buffer-precision) ``k_t, u_t``. Returns the stored
    key and value: codes, scale and value of each (see :func:`stored_vec`)."""
    beta = tl.load(beta_ptr + pid)
    v = tl.load(v_ptr + pid * V + cols)
    u = beta * (v - tl.exp(g_t) * (tl.exp(run) * sk + rk))
    kcodes, kscale, khat = stored_vec(kfull, K, KBITS, K_BF16)
    ucodes, uscale, uhat = stored_vec(u, BV, VBITS, V_BF16)
    tl.store(o_ptr + pid * V + cols, tl.exp(run + g_t) * sq + rq + tl.sum(khat * qfull) * uhat)
    return kcodes, kscale, khat, ucodes, uscale, uhat


@triton.jit
def append_record(bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, n, cap, b, h, kh, H, HV, c0, g_t,
                   kcodes, kscale, khat, ucodes, uscale, uhat, K: tl.constexpr, V: tl.constexpr,
                   BV: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr):
    """Write the token's record into slot ``n``: its log decay and key once per key head (by the
    first value head of the group, column block 0), its value columns by every program."""
    if c0 == 0:
        tl.store(bg_ptr + (b * cap + n) * HV + h, g_t)
        if h % (HV // H) == 0:
            store_vec(bk_ptr, bks_ptr, (b * cap + n) * H + kh, 0, kcodes, kscale, khat, K, K, KBITS)
    store_vec(bv_ptr, bvs_ptr, (b * cap + n) * HV + h, c0, ucodes, uscale, uhat, BV, V, VBITS)
