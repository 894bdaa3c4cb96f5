"""Decode-buffer records inside the kernels: reading the buffered ``(k_i, u_i, g_i)``, the token's output
from the checkpoint's and the records' parts, and writing the token's record in the buffer's precision
(:mod:`pace_core.buffer`'s layout), shared by the packed and the fused decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pace_core.buffer import BUFFER_LAYOUT, EMPTY, DecodeBuffer

from .primitives import expand, quant_tile, round_bf16, store_as, sym_value, zero_pairs

RECORD_COUNT = ["n"]
"""``do_not_specialize`` of the kernels that take the buffered record count ``n``: it changes every token, and
Triton would compile a kernel apart for ``n == 1`` and for ``n % 16 == 0`` (0 included)."""


@dataclass(frozen=True)
class VectorLayout:
    """How the buffer stores one kind of vector (keys or values) of length ``L``: ``bits`` per entry (0: float
    storage), ``group`` entries per fp16 scale (``L``: one scale per vector), ``symmetric`` codes or zero points,
    ``packed_zero`` (zero points two per byte), ``bf16`` (float storage in bfloat16)."""

    bits: int
    group: int
    symmetric: bool
    packed_zero: bool
    bf16: bool


@dataclass(frozen=True)
class RecordLayout:
    """The records' compile-time layout (every decode kernel's constexprs ``KBITS .. V_BF16``)."""

    keys: VectorLayout
    values: VectorLayout

    def constexprs(self) -> dict:
        k, v = self.keys, self.values
        return dict(KBITS=k.bits, KG=k.group, KSYM=k.symmetric, KPZ=k.packed_zero, VBITS=v.bits, VG=v.group,
                    VSYM=v.symmetric, VPZ=v.packed_zero, K_BF16=k.bf16, V_BF16=v.bf16)


@dataclass(frozen=True)
class Records:
    """A decode buffer's live storage as the kernels take it (:meth:`DecodeBuffer.storage`, pace_core.buffer's
    layout): ``keys [B, cap, H, K']`` (codes, ``K' = K`` bytes, ``K / 2`` for 4-bit, or float), ``key_scale
    [B, cap, H, K / KG]`` fp16, ``key_zero`` (zero points; the scales, never read, where there are none),
    ``values [B, cap, HV, V']``, ``value_scale``, ``value_zero`` likewise, ``log_decays [B, cap, HV]`` fp32; with
    their layout and the capacity ``cap``. Made once per buffer: the storage stays allocated."""

    keys: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    values: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor
    log_decays: torch.Tensor
    layout: RecordLayout
    capacity: int

    @classmethod
    def of(cls, buf: DecodeBuffer) -> Records:
        live = buf.storage()
        key_kind, value_kind = BUFFER_LAYOUT[buf.precision]
        kinds = {}
        for single, kind, length in (("key", key_kind, buf.d_k), ("value", value_kind, buf.d_v)):
            spec = buf.format.spec(single, length)
            bits = kind if isinstance(kind, int) else 0
            group = spec.group_size if spec is not None else length
            sym = spec is None or spec.symmetric
            kinds[single] = VectorLayout(bits, group, sym, not sym and zero_pairs(bits, length // group),
                                         live[single + "s"].dtype == torch.bfloat16)
        scale = {s: live.get(s + "_scale", live[s + "s"]) for s in ("key", "value")}
        return cls(live["keys"], scale["key"], live.get("key_zero", scale["key"]), live["values"], scale["value"],
                   live.get("value_zero", scale["value"]), live["log_decays"],
                   RecordLayout(kinds["key"], kinds["value"]), buf.capacity)

    def args(self) -> tuple[torch.Tensor, ...]:
        """The record pointers every decode kernel takes, in its order: keys, their scales and zero points, values,
        theirs, log decays."""
        return (self.keys, self.key_scale, self.key_zero, self.values, self.value_scale, self.value_zero,
                self.log_decays)


@triton.jit
def vec_parts(ptr, scale_ptr, zero_ptr, recs, valid, r0, R: tl.constexpr, L: tl.constexpr, BITS: tl.constexpr,
              G: tl.constexpr, SYM: tl.constexpr, PZ: tl.constexpr):
    """Elements ``r0 .. r0+R`` of the buffered vectors ``recs [NB]`` (flat record indices) as ``(x [NB, R],
    s [NB, NG])`` fp32, ``NG = R / min(G, R)`` the groups of ``G`` entries the range covers (``r0`` a
    multiple of ``min(G, R)``): for integer storage ``x`` the codes minus their group's zero point (or
    ``2^(BITS-1)`` when symmetric), exact integers, and ``s`` the groups' scales, so ``x`` times its group's
    scale is the stored value; for float storage the values and 1. Rows where ``valid`` is False read as 0."""
    GR: tl.constexpr = G if G < R else R
    NG: tl.constexpr = R // GR
    NGL: tl.constexpr = L // G  # groups (scales) per vector
    m = valid[:, None]
    gidx = r0 // G + tl.arange(0, NG)[None, :]  # the covered groups
    if BITS == 0:
        x = tl.load(ptr + recs[:, None] * L + r0 + tl.arange(0, R)[None, :], mask=m, other=0.0).to(tl.float32)
        s = tl.where(m, 1.0, 0.0) + tl.zeros((1, NG), tl.float32)
    else:
        s = tl.load(scale_ptr + recs[:, None] * NGL + gidx, mask=m, other=0.0).to(tl.float32)
        if BITS <= 4:
            p = tl.load(ptr + recs[:, None] * (L // 2) + r0 // 2 + tl.arange(0, R // 2)[None, :], mask=m, other=0)
            p = p.to(tl.int32)
            c = tl.reshape(tl.join(p & 15, p >> 4), (recs.shape[0], R))
        else:
            c = tl.load(ptr + recs[:, None] * L + r0 + tl.arange(0, R)[None, :], mask=m, other=0).to(tl.int32)
        if SYM:
            x = sym_value(c, BITS)
        else:
            if PZ:
                zb = tl.load(zero_ptr + recs[:, None] * (NGL // 2) + gidx // 2, mask=m, other=0).to(tl.int32)
                z = (zb >> ((gidx % 2) * 4)) & 15
            else:
                z = tl.load(zero_ptr + recs[:, None] * NGL + gidx, mask=m, other=0).to(tl.int32)
            x = (c - expand(z, recs.shape[0], R, GR, False)).to(tl.float32)
    return x, s


@triton.jit
def load_vecs(ptr, scale_ptr, zero_ptr, recs, valid, r0, R: tl.constexpr, L: tl.constexpr, BITS: tl.constexpr,
              G: tl.constexpr, SYM: tl.constexpr, PZ: tl.constexpr):
    """Elements ``r0 .. r0+R`` of the buffered vectors ``recs [NB]``, dequantised to fp32 ``[NB, R]``
    (see :func:`vec_parts`)."""
    x, s = vec_parts(ptr, scale_ptr, zero_ptr, recs, valid, r0, R, L, BITS, G, SYM, PZ)
    GR: tl.constexpr = G if G < R else R
    return x * expand(s, recs.shape[0], R, GR, False)


@triton.jit
def stored_vec(x, L: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr, DT_BF16: tl.constexpr):
    """What the buffer stores for the fp32 vector ``x [L]``: codes int32 ``[1, L]``, fp16 scales and int32 zero
    points ``[1, L/G]`` (groups of ``G`` entries, pace_core.quant's value-axis groups), and the stored value
    dequantised ``[L]`` (for float storage the codes, scales and zero points are unused)."""
    if BITS == 0:
        codes = tl.zeros((1, L), tl.int32)
        scale = tl.zeros((1, L // G), tl.float16)
        zero = tl.zeros((1, L // G), tl.int32)
        if DT_BF16:
            xs = round_bf16(x)
        else:
            xs = x
    else:
        codes, scale, zero = quant_tile(tl.reshape(x, (1, L)), 1, L, G, False, SYM, BITS)
        if SYM:
            q = sym_value(codes, BITS)
        else:
            q = (codes - expand(zero, 1, L, G, False)).to(tl.float32)
        xs = tl.reshape(q * expand(scale.to(tl.float32), 1, L, G, False), (L,))
    return codes, scale, zero, xs


@triton.jit
def store_vec(ptr, scale_ptr, zero_ptr, rec, c0, codes, scale, zero, x, R: tl.constexpr, L: tl.constexpr,
              BITS: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr, PZ: tl.constexpr):
    """Store elements ``c0 .. c0+R`` of buffered vector ``rec`` of length ``L`` (codes, scales and zero points:
    the whole vector, R == L; or ``x`` in the storage's float dtype)."""
    NGL: tl.constexpr = L // G
    if BITS == 0:
        store_as(ptr + rec * L + c0 + tl.arange(0, R), x)
    else:
        if BITS <= 4:
            a, b = tl.split(tl.reshape(codes, (L // 2, 2)))
            tl.store(ptr + rec * (L // 2) + tl.arange(0, L // 2), (a | (b << 4)).to(tl.uint8))
        else:
            tl.store(ptr + rec * L + tl.arange(0, L), tl.reshape(codes, (L,)).to(tl.uint8))
        tl.store(scale_ptr + rec * NGL + tl.arange(0, NGL), tl.reshape(scale, (NGL,)))
        if not SYM:
            if PZ:
                za, zb = tl.split(tl.reshape(zero, (NGL // 2, 2)))
                tl.store(zero_ptr + rec * (NGL // 2) + tl.arange(0, NGL // 2), (za | (zb << 4)).to(tl.uint8))
            else:
                tl.store(zero_ptr + rec * NGL + tl.arange(0, NGL), tl.reshape(zero, (NGL,)).to(tl.uint8))


@triton.jit
def slot_records(slot, strides_ptr, bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr):
    """The records' pointers (:meth:`Records.args`' order) moved to pool slot ``slot`` (``strides_ptr[0..6]``: their
    slot strides in elements)."""
    return (bk_ptr + slot * tl.load(strides_ptr), bks_ptr + slot * tl.load(strides_ptr + 1),
            bkz_ptr + slot * tl.load(strides_ptr + 2), bv_ptr + slot * tl.load(strides_ptr + 3),
            bvs_ptr + slot * tl.load(strides_ptr + 4), bvz_ptr + slot * tl.load(strides_ptr + 5),
            bg_ptr + slot * tl.load(strides_ptr + 6))


@triton.jit
def is_record(log_decay_ptr, inside):
    """1 where the log decays at ``log_decay_ptr`` (any block of pointers) are a record's (<= 0; an empty slot's is
    :data:`pace_core.buffer.EMPTY`: :func:`pace_core.buffer.records_held`), 0 there and outside ``inside``."""
    return (tl.load(log_decay_ptr, mask=inside, other=1.0) <= 0).to(tl.int32)


@triton.jit
def records_held(bg_ptr, b, h, cap, HV, NB: tl.constexpr):
    """The records row ``b`` holds, read from its value head ``h``'s log decays (:func:`is_record`; every head of a
    row holds as many): a state pool's rows hold different counts, each read by its own programs."""
    held = tl.sum(tl.zeros((NB,), tl.int32))
    for blk in range(tl.cdiv(cap, NB)):
        i = blk * NB + tl.arange(0, NB)
        held += tl.sum(is_record(bg_ptr + (b * cap + i) * HV + h, i < cap))
    return held


@triton.jit
def _full_slots_kernel(bg_ptr, rows_ptr, full_ptr, B, slot_stride, cap, HV, BR: tl.constexpr, BC: tl.constexpr):
    """One program: of the pool slots ``rows [B]`` (log decays ``[cap, HV]`` at ``slot_stride`` elements per slot),
    those whose buffer is full (head 0's records counted: every head holds as many), in the rows' order, as
    ``full [1 + B]``: their count, then their slots."""
    i = tl.arange(0, BC)[None, :]
    held = tl.sum(tl.zeros((BR,), tl.int32))  # full slots found so far
    for r0 in range(0, B, BR):
        r = r0 + tl.arange(0, BR)
        inside = r < B
        slot = tl.load(rows_ptr + r, mask=inside, other=0).to(tl.int64)
        n = tl.sum(is_record(bg_ptr + slot[:, None] * slot_stride + i * HV, inside[:, None] & (i < cap)), axis=1)
        full = ((n == cap) & inside).to(tl.int32)
        tl.store(full_ptr + 1 + held + tl.cumsum(full, axis=0) - full, slot, mask=full == 1)
        held += tl.sum(full, axis=0)
    tl.store(full_ptr, held.to(tl.int64))


def full_slots(log_decays: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Of the pool slots ``rows [B]`` (long, on the device), those whose buffers are full, in one launch and without
    a read on the host: ``full [1 + B]`` int64, their count, then their slots in the rows' order (the rest unset).
    ``log_decays [slots, capacity, HV]``: float32, each slot's contiguous, a view at any slot stride. A state pool's
    flush folds these slots and then forgets their records (:func:`kernels.flush.launch_flush`,
    :func:`forget_full`)."""
    _, cap, HV = log_decays.shape
    B = rows.shape[0]
    full = torch.empty(1 + B, dtype=torch.int64, device=rows.device)
    _full_slots_kernel[(1,)](log_decays, rows, full, B, log_decays.stride(0), cap, HV,
                             BR=min(triton.next_power_of_2(B), 256), BC=triton.next_power_of_2(cap), num_warps=4)
    return full


@triton.jit
def full_row(pid, full_ptr, HP):
    """Program ``pid`` of a launch over a state pool's full slots (``full_ptr``: :func:`full_slots`), ``HP``
    programs per slot: whether its row is one of them, that slot (0 where not) and the program within the row."""
    r = pid // HP
    folds = r < tl.load(full_ptr)
    return folds, tl.load(full_ptr + 1 + r, mask=folds, other=0), pid % HP


@triton.jit
def _forget_full_kernel(bg_ptr, full_ptr, slot_stride, cap, HV, EMPTY: tl.constexpr, BC: tl.constexpr,
                        BHV: tl.constexpr):
    """Full slot ``program_id(0)`` of ``full_ptr`` (:func:`full_slots`), if there is one: its log decays ``[cap, HV]``
    (at ``slot_stride`` elements per slot) set to ``EMPTY``."""
    folds, slot, _ = full_row(tl.program_id(0), full_ptr, 1)
    if folds:
        i = tl.arange(0, BC)[:, None]
        h = tl.arange(0, BHV)[None, :]
        tl.store(bg_ptr + slot * slot_stride + i * HV + h, tl.full((BC, BHV), EMPTY, tl.float32),
                 mask=(i < cap) & (h < HV))


def forget_full(log_decays: torch.Tensor, full: torch.Tensor) -> None:
    """The records of the full pool slots ``full`` (:func:`full_slots`) forgotten, in place, in one launch: their
    ``log_decays [slots, capacity, HV]`` (float32, each slot's contiguous, a view at any slot stride) set to
    :data:`pace_core.buffer.EMPTY` (a state pool's step after it folded them: :mod:`kernels.pool_step`)."""
    _, cap, HV = log_decays.shape
    _forget_full_kernel[(full.shape[0] - 1,)](log_decays, full, log_decays.stride(0), cap, HV, EMPTY=EMPTY,
                                              BC=triton.next_power_of_2(cap), BHV=triton.next_power_of_2(HV),
                                              num_warps=1)


@triton.jit
def record_reads(bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, h, kh, H, HV, c0, kfull,
                  qfull, g_t, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, KBITS: tl.constexpr,
                  KG: tl.constexpr, KSYM: tl.constexpr, KPZ: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr,
                  VSYM: tl.constexpr, VPZ: tl.constexpr, NB: tl.constexpr):
    """The buffered records' part of ``S_{t-1}ᵀk_t`` and ``S_tᵀq_t`` (columns ``c0 .. c0+BV``), read NB
    records at a time (one load round trip for n <= NB), newest block first. Returns ``run`` (Σ of
    the held records' log decays), ``rk``, ``rq`` ``[BV]``."""
    ridx = tl.arange(0, NB)
    later = ridx[None, :] > ridx[:, None]
    run = g_t * 0.0  # Σ of the log decays of the records after the current block
    rk = tl.zeros((BV,), tl.float32)
    rq = tl.zeros((BV,), tl.float32)
    for blk in range(tl.cdiv(n, NB)):
        i = n - (blk + 1) * NB + ridx
        valid = i >= 0
        gb = tl.load(bg_ptr + (b * cap + i) * HV + h, mask=valid, other=0.0)
        after = run + tl.sum(tl.where(later, gb[None, :], 0.0), axis=1)  # Σ_{j>i} g_j over the held records
        if KG >= K:  # one scale per key: it multiplies the two dot products, not every entry
            kx, ks = vec_parts(bk_ptr, bks_ptr, bkz_ptr, (b * cap + i) * H + kh, valid, 0, K, K, KBITS, KG, KSYM, KPZ)
            wk = (tl.exp(after) * tl.sum(ks, axis=1)) * tl.sum(kx * kfull[None, :], axis=1)
            wq = (tl.exp(after + g_t) * tl.sum(ks, axis=1)) * tl.sum(kx * qfull[None, :], axis=1)
        else:
            kb = load_vecs(bk_ptr, bks_ptr, bkz_ptr, (b * cap + i) * H + kh, valid, 0, K, K, KBITS, KG, KSYM, KPZ)
            wk = tl.exp(after) * tl.sum(kb * kfull[None, :], axis=1)
            wq = tl.exp(after + g_t) * tl.sum(kb * qfull[None, :], axis=1)
        if VG >= BV:  # one scale per value block: it multiplies the record's weights
            ux, us = vec_parts(bv_ptr, bvs_ptr, bvz_ptr, (b * cap + i) * HV + h, valid, c0, BV, V, VBITS, VG, VSYM, VPZ)
            rk += tl.sum((wk * tl.sum(us, axis=1))[:, None] * ux, axis=0)
            rq += tl.sum((wq * tl.sum(us, axis=1))[:, None] * ux, axis=0)
        else:
            ub = load_vecs(bv_ptr, bvs_ptr, bvz_ptr, (b * cap + i) * HV + h, valid, c0, BV, V, VBITS, VG, VSYM, VPZ)
            rk += tl.sum(wk[:, None] * ub, axis=0)
            rq += tl.sum(wq[:, None] * ub, axis=0)
        run += tl.sum(gb)
    return run, rk, rq


@triton.jit
def token_output(beta_ptr, v_ptr, o_ptr, pid, cols, g_t, run, sk, sq, rk, rq, kfull, qfull,
                  K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr,
                  KSYM: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr,
                  K_BF16: tl.constexpr, V_BF16: tl.constexpr, EXACT: tl.constexpr):
    """``u_t = β_t (v_t - e^{g_t} S_{t-1}ᵀk_t)`` and ``o_t`` from the checkpoint's ``sk, sq`` and the
    records' ``run, rk, rq``: the current token's part of ``o_t`` from its exact ``k_t, u_t`` (``EXACT``,
    pace_core.recurrence.buffered_step's ``exact_current``) or from its stored record. Returns the stored
    value's codes, scales, zero points and values (see :func:`stored_vec`); the stored key is made where it is
    needed (:func:`append_record`, and here only without ``EXACT``)."""
    beta = tl.load(beta_ptr + pid)
    v = tl.load(v_ptr + pid * V + cols)
    u = beta * (v - tl.exp(g_t) * (tl.exp(run) * sk + rk))
    ucodes, uscale, uzero, uhat = stored_vec(u, BV, VBITS, VG if VG < BV else BV, VSYM, V_BF16)
    if EXACT:
        current = tl.sum(kfull * qfull) * u
    else:
        _, _, _, khat = stored_vec(kfull, K, KBITS, KG, KSYM, K_BF16)
        current = tl.sum(khat * qfull) * uhat
    tl.store(o_ptr + pid * V + cols, (tl.exp(run + g_t) * sq + rq + current).to(o_ptr.dtype.element_ty))
    return ucodes, uscale, uzero, uhat


@triton.jit
def append_record(bk_ptr, bks_ptr, bkz_ptr, bv_ptr, bvs_ptr, bvz_ptr, bg_ptr, n, cap, b, h, kh, H, HV, c0, g_t,
                   kfull, ucodes, uscale, uzero, uhat, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                   KBITS: tl.constexpr, KG: tl.constexpr, KSYM: tl.constexpr, KPZ: tl.constexpr, VBITS: tl.constexpr,
                   VG: tl.constexpr, VSYM: tl.constexpr, VPZ: tl.constexpr, K_BF16: tl.constexpr,
                   KEY_BY_ALL: tl.constexpr = False):
    """Write the token's record into slot ``n``: its log decay and its key ``kfull [K]`` stored in the buffer's
    precision once per key head (by the first value head of the group, column block 0, the only program that
    quantises it; ``KEY_BY_ALL``: by every value head of the group, the same bytes, so that a program that reads
    the key next in the same launch reads its own write), its value (:func:`token_output`'s) columns by every
    program."""
    if c0 == 0:
        tl.store(bg_ptr + (b * cap + n) * HV + h, g_t)
        if KEY_BY_ALL or h % (HV // H) == 0:
            kcodes, kscale, kzero, khat = stored_vec(kfull, K, KBITS, KG, KSYM, K_BF16)
            store_vec(bk_ptr, bks_ptr, bkz_ptr, (b * cap + n) * H + kh, 0, kcodes, kscale, kzero, khat, K, K,
                      KBITS, KG, KSYM, KPZ)
    store_vec(bv_ptr, bvs_ptr, bvz_ptr, (b * cap + n) * HV + h, c0, ucodes, uscale, uzero, uhat, BV, V,
              VBITS, VG, VSYM, VPZ)
