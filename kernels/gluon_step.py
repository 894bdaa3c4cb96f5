"""The split path's decode step as one Gluon kernel (explicit layouts, GPU only): :mod:`kernels.gluon_dots`'s
``Ŝᵀk_t, Ŝᵀq_t`` followed, in the same warp, by the record kernel's work (:mod:`kernels.records`): the buffered
records' part of the two products, ``u_t``, ``o_t`` and the token's record, with no workspace round trip and one
launch instead of two.

One warp per (sequence, value head). After the dots (the accumulators of :func:`kernels.gluon_dots.head_dots`),
the records are read in two layouts chosen for their reductions:

- the keys ``[NB, K]``, 16 consecutive bytes of one record per thread (one 128-bit load), so that the record's
  dot products with ``k_t`` and ``q_t`` are 16 fma in the thread and 3 shuffles;
- the values ``[NB, V]``, all the records of 4 consecutive columns per thread, so that
  ``Σ_i w_i u_i`` is in the thread; its result is in the layout of every ``[V]`` vector of the step.

Takes PACE-4's format (:func:`kernels.plan.gluon_step_apply`: 4-bit symmetric key-axis codes in one part, key groups
of whole 16-row steps, K = V = 128; int8 keys and values with one scale per vector in a block of 8 record slots; the
exact current token); the Triton kernels stay the definition of the step and run everywhere else. Its arithmetic is
the record kernel's (:func:`kernels.records.record_reads`, :func:`kernels.records.token_output`,
:func:`kernels.records.append_record`), the sums in another order; the records are quantised by the same
:mod:`kernels.primitives`, and the records' decays are :func:`kernels.gluon_flush.record_log_decays`.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from pace_core.buffer import EMPTY, DecodeBuffer

from .gluon_dots import head_dots, head_dots_split, products
from .gluon_flush import COLUMNS, flush_columns, layouts, record_log_decays, records_held
from .plan import DecodePlan
from .primitives import part_head, pool_row, rint_bits, row_inputs, slot_parts, sym_code_sum, sym_scale, sym_value
from .records import RECORD_COUNT, slot_records

_EMPTY = gl.constexpr(EMPTY)
_CTA_BARRIER = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # Triton 3.9's name, 3.6's


@gluon.jit
def _columns(f0, f1, f2, f3, f4, f5, f6, f7, L1: gl.constexpr):
    """``Ŝᵀk, Ŝᵀq [V]`` in layout ``L1`` from the accumulators (:func:`head_dots`: row ``i`` of ``f_m`` is value
    column ``8 i + m``; :func:`products` sums each product's terms)."""
    x = gl.join(gl.join(gl.join(products(f0), products(f1)), gl.join(products(f2), products(f3))),
                gl.join(gl.join(products(f4), products(f5)), gl.join(products(f6), products(f7))))
    x = gl.reshape(gl.permute(x, [0, 4, 3, 2, 1]), [128, 2])  # (i, product, m0, m1, m2) -> (i, m2, m1, m0, product)
    both: gl.constexpr = gl.BlockedLayout([4, 2], [32, 1], [1, 1], [1, 0])  # L1's columns, both products
    sk, sq = gl.split(gl.convert_layout(x, both))
    return gl.convert_layout(sk, L1, assert_trivial=True), gl.convert_layout(sq, L1, assert_trivial=True)


@gluon.jit
def _split_columns(f0, f1, f2, f3, L1: gl.constexpr, W: gl.constexpr):
    """``Ŝᵀk, Ŝᵀq [V]`` in layout ``L1`` from :func:`head_dots_split`'s accumulators (row ``16 w + i`` of ``f_p``
    is value column ``8 i + w P + p``, ``P = 8 / W``)."""
    P: gl.constexpr = 8 // W
    if P == 2:
        x = gl.permute(gl.join(products(f0), products(f1)), [0, 2, 1])  # (w i, p, product)
    else:
        x = gl.join(gl.join(products(f0), products(f1)), gl.join(products(f2), products(f3)))
        x = gl.reshape(gl.permute(x, [0, 3, 2, 1]), [16 * W, 4, 2])  # (w i, product, p0, p1) -> (w i, p, product)
    x = gl.reshape(gl.permute(gl.reshape(x, [W, 16, P, 2]), [1, 0, 2, 3]), [128, 2])  # column 8 i + w P + p
    both: gl.constexpr = gl.BlockedLayout([4 // W, 2], [32, 1], [W, 1], [1, 0])  # L1's columns, both products
    sk, sq = gl.split(gl.convert_layout(x, both))
    return gl.convert_layout(sk, L1), gl.convert_layout(sq, L1)


@gluon.jit
def _store_record(x, codes_at, scale_at, cols):
    """``x [V]`` stored as one int8 symmetric vector (pace_core.quant's layout, :func:`kernels.records.stored_vec`):
    codes at ``codes_at + cols``, its fp16 scale at ``scale_at``."""
    scale, div, rdiv = sym_scale(gl.max(gl.abs(x), axis=0), 8)
    gl.store(codes_at + cols, rint_bits(sym_code_sum(x, div, rdiv, 8)).to(gl.uint8))
    gl.store(scale_at, scale)


@gluon.jit(noinline=True)
def _fold(codes_ptr, scale_ptr, bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, cap, h, H: gl.constexpr, HV: gl.constexpr,
          K: gl.constexpr, V: gl.constexpr, G: gl.constexpr, SS: gl.constexpr, NB: gl.constexpr, LW: gl.constexpr,
          LK: gl.constexpr, LU: gl.constexpr):
    """A pool slot's full buffer (``cap`` records, pointers moved to the slot) folded into value head ``h``'s
    checkpoint (:func:`kernels.gluon_flush.flush_columns`, one column tile after another), then forgotten: the head's
    log decays :data:`pace_core.buffer.EMPTY`. A call, not inlined: the fold's registers stay out of the step's."""
    _CTA_BARRIER()  # every record stored by the program's threads before the fold reads them
    for ct in range(V // COLUMNS):
        flush_columns(codes_ptr, scale_ptr, codes_ptr, codes_ptr, bk_ptr, bks_ptr, bk_ptr, bv_ptr, bvs_ptr, bg_ptr,
                      cap, cap, h, ct, H, HV, HV, False, K, V, G, True, SS, 0, NB, 0, K, LW, LK, LU, K // G)
    _CTA_BARRIER()  # every read before forgetting
    i = gl.arange(0, NB, layout=gl.BlockedLayout([1], [32], [1], [0]))
    gl.store(bg_ptr + i * HV + h, gl.full([NB], _EMPTY, gl.float32, i.type.layout), mask=i < cap)


@gluon.jit(do_not_specialize=RECORD_COUNT)
def _step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, codes_ptr, scale_ptr, bk_ptr, bks_ptr, bv_ptr, bvs_ptr,
                 bg_ptr, n, cap, rows_ptr, strides_ptr, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                 V: gl.constexpr, G: gl.constexpr, SS: gl.constexpr, NB: gl.constexpr, W: gl.constexpr = 1,
                 AHEAD: gl.constexpr = 8, POOL: gl.constexpr = False, FOLD: gl.constexpr = False,
                 LW: gl.constexpr = None, LK: gl.constexpr = None, LU: gl.constexpr = None):
    """One token of (sequence, value head) ``pid`` (``W`` warps): ``o [B*HV, V]`` and the token's record in slot
    ``n`` of the buffer (``cap`` slots; keys ``bk [B*cap*H, K]`` uint8 with fp16 scales ``bks``, values
    ``bv [B*cap*HV, V]`` with ``bvs``, log decays ``bg [B*cap*HV]``), from the checkpoint's codes, its ``SS`` fp16
    scales per head, and the ``n <= NB`` records before it; ``q, k [B, H, K]``, ``v [B, HV, V]``, ``g, beta [B, HV]``
    fp32. With ``W`` 2 or 4 the dots are split over the value columns (:func:`head_dots_split`) and the records'
    vectors over the warps (more warps per head where a batch leaves SMs idle); ``AHEAD``: :func:`head_dots`' steps
    requested ahead (one warp). ``POOL``: the programs step the slots ``rows_ptr`` of a state pool whose checkpoint
    and records lie ``strides_ptr`` apart (:func:`kernels.pool_step.slot_strides`; the pointers are the first slot's),
    each with the records its slot holds (``n`` unused), as :func:`kernels.packed_step._ckpt_step_kernel` does.
    ``FOLD`` (``POOL``, one warp): a program whose token fills its slot's buffer then folds the records into the
    head's checkpoint (:func:`kernels.gluon_flush.flush_columns`, one column tile after another; ``LW, LK, LU``: its
    layouts, :func:`kernels.gluon_flush.layouts`) and forgets them (its head's log decays
    :data:`pace_core.buffer.EMPTY`)."""
    KL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [W, 1], [1, 0])  # record keys: 16 bytes per thread
    VL: gl.constexpr = gl.BlockedLayout([NB, 4 // W], [1, 32], [1, W], [1, 0])  # record values: all records of 4 / W
    L1: gl.constexpr = gl.SliceLayout(0, VL)  # [V] vectors: 4 / W consecutive columns per thread
    gl.static_assert(K == V, "keys and values of one length: the [V] layout serves both")
    gl.static_assert(NB == 8, "the record block of the GPU test: 8 slots (kernels.plan.gluon_step_apply)")

    pid = gl.program_id(0).to(gl.int64)
    if POOL:  # the batch row's inputs and its slot's state, then the program within the row
        r, slot_i, pid = pool_row(pid, rows_ptr, HV)
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr = row_inputs(r, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, H, HV,
                                                                 K, V)
        codes_ptr, scale_ptr, _, _, _, _ = slot_parts(slot_i, strides_ptr, codes_ptr, scale_ptr, codes_ptr, codes_ptr,
                                                      codes_ptr, codes_ptr)
        bk_ptr, bks_ptr, _, bv_ptr, bvs_ptr, _, bg_ptr = slot_records(slot_i, strides_ptr + 6, bk_ptr, bks_ptr, bk_ptr,
                                                                      bv_ptr, bvs_ptr, bv_ptr, bg_ptr)
        n = records_held(bg_ptr, pid, cap, HV, NB, W)
    b, _, h, kh = part_head(pid, q_ptr, H, HV, HV, False)  # all heads, unmapped: the pointer is not read
    row = b * HV + h
    k_at = k_ptr + (b * H + kh) * K
    q_at = q_ptr + (b * H + kh) * K
    if W == 1:
        f0, f1, f2, f3, f4, f5, f6, f7 = head_dots(k_at, q_at, codes_ptr + row * (K * V // 2), scale_ptr + row * SS,
                                                   scale_ptr, K, V, G, True, AHEAD)  # symmetric: no zero points
    else:
        f0, f1, f2, f3 = head_dots_split(k_at, q_at, codes_ptr + row * (K * V // 2), scale_ptr + row * SS, K, V, G, W)

    # the records' key dot products and decays (kernels.records.record_reads, all records in one block)
    r = gl.arange(0, NB, layout=gl.SliceLayout(1, KL))
    kc = gl.arange(0, K, layout=gl.SliceLayout(0, KL))
    held = r < n
    krec = (b * cap + r) * H + kh
    kx = sym_value(gl.load(bk_ptr + krec[:, None] * K + kc[None, :], mask=held[:, None], other=128), 8)
    ks = gl.load(bks_ptr + krec, mask=held, other=0.0).to(gl.float32)
    after, run = record_log_decays(bg_ptr, n, b * cap * HV + h, HV, NB, KL, W)  # Σ_{j>i} g_j, Σ g_j
    g_t = gl.load(g_ptr + row)
    wk = (gl.exp(after) * ks) * gl.sum(kx * gl.load(k_at + kc)[None, :], axis=1)
    wq = (gl.exp(after + g_t) * ks) * gl.sum(kx * gl.load(q_at + kc)[None, :], axis=1)

    # their values' part: Σ_i w_i s_i u_i
    rv = gl.arange(0, NB, layout=gl.SliceLayout(1, VL))
    cols = gl.arange(0, V, layout=L1)
    vrec = (b * cap + rv) * HV + h
    ux = sym_value(gl.load(bv_ptr + vrec[:, None] * V + cols[None, :], mask=(rv < n)[:, None], other=128), 8)
    us = gl.load(bvs_ptr + vrec, mask=rv < n, other=0.0).to(gl.float32)
    rk = gl.sum((gl.convert_layout(wk, gl.SliceLayout(1, VL)) * us)[:, None] * ux, axis=0)
    rq = gl.sum((gl.convert_layout(wq, gl.SliceLayout(1, VL)) * us)[:, None] * ux, axis=0)

    # u_t and o_t (kernels.records.token_output, the exact current token)
    if W == 1:
        sk, sq = _columns(f0, f1, f2, f3, f4, f5, f6, f7, L1)
    else:
        sk, sq = _split_columns(f0, f1, f2, f3, L1, W)
    kfull = gl.load(k_at + cols)
    u = gl.load(beta_ptr + row) * (gl.load(v_ptr + row * V + cols) - gl.exp(g_t) * (gl.exp(run) * sk + rk))
    o = gl.exp(run + g_t) * sq + rq + gl.sum(kfull * gl.load(q_at + cols), axis=0) * u
    gl.store(o_ptr + row * V + cols, o.to(o_ptr.dtype.element_ty))  # float32, or the caller's bfloat16

    # the token's record in slot n (kernels.records.append_record): the key by the group's first value head
    at = b * cap + n
    gl.store(bg_ptr + at * HV + h, g_t)
    _store_record(u, bv_ptr + (at * HV + h) * V, bvs_ptr + at * HV + h, cols)
    writes_key = h % (HV // H) == 0
    if FOLD:  # a folding program reads the key it wrote: the same bytes as its group's first head writes
        writes_key = writes_key or n == cap - 1
    if writes_key:
        _store_record(kfull, bk_ptr + (at * H + kh) * K, bks_ptr + at * H + kh, cols)
    if FOLD and n == cap - 1:
        _fold(codes_ptr, scale_ptr, bk_ptr, bks_ptr, bv_ptr, bvs_ptr, bg_ptr, cap, pid, H, HV, K, V, G, SS, NB, LW, LK,
              LU)


def launch(plan: DecodePlan, buf: DecodeBuffer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor, o: torch.Tensor, rows: torch.Tensor | None = None,
           strides: torch.Tensor | None = None) -> None:
    """One :func:`_step_kernel` launch over every (sequence, value head) of ``plan`` (one 4-bit part,
    :func:`kernels.plan.gluon_step_apply`) with ``len(buf)`` records held; writes the token's record into slot
    ``len(buf)`` (the caller counts it). Inputs as :func:`kernels.packed_step.launch_packed_step`'s, ``rows`` and
    ``strides`` too (a state pool's slots, each with the records it holds)."""
    B, H, HV, K, V = plan.shape
    if rows is not None:
        B = rows.numel()
    sp = plan.split
    part = sp.launches[False][0].ckpt.parts[0]
    r = plan.records
    cap = {} if sp.settings.step_maxnreg is None else {"maxnreg": sp.settings.step_maxnreg}
    W = sp.settings.gluon_step_warps
    split = ({} if W == 1 else {"W": W}) | ({} if sp.settings.dots_ahead == 8 else {"AHEAD": sp.settings.dots_ahead})
    fold = dict(FOLD=True, **layouts(sp.group, plan.record_block)) if rows is not None and sp.step_folds else {}
    _step_kernel[(B * HV,)](q, k, v, g, beta, o, part.codes, part.scale, r.keys, r.key_scale, r.values, r.value_scale,
                            r.log_decays, 0 if rows is not None else len(buf), plan.capacity, rows, strides, H=H,
                            HV=HV, K=K, V=V, G=sp.group, SS=part.layout.scale_size, NB=plan.record_block,
                            num_warps=W, **split, **cap, **fold, POOL=rows is not None)
