"""The per-token recurrence (dP = 1): a run of ``T`` tokens in one launch, each program's state (one
sequence, one value head, ``BV`` columns, all ``K`` rows) held in registers from the first token to the
last and rounded after every token as storing it would round it: a float32 state not at all, a bfloat16
one to bfloat16, a packed checkpoint (rtn / pace, per-head bit widths) to its codes and back
(:func:`kernels.primitives.ckpt_round`, bit-identical to pace_core.quant). Each token's output is read from
its unrounded state, as the reference's step and store do (:func:`pace_core.recurrence.gdn_recurrent`,
then the store). One token is the fp32 / bf16 per-token baseline of the benchmarks (the whole state read
and written every token); ``T`` tokens save ``T - 1`` round trips of the state through memory and all but
one launch.

A dense state is updated in place; a packed one is written to new storage (the old checkpoint stays valid
until the caller takes the new one), with the largest magnitude any token's unrounded state reached (NaN
counted as infinite), so that the caller can refuse a state whose fp16 scales would overflow, as a store
would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pace_core import quant
from pace_core.errors import PaceError

from .plan import CkptArgs, PartLayout, PartStorage, as_mixed, output_tensor, packed_ckpt, sm_count, whole_groups
from .primitives import (
    ckpt_base,
    ckpt_round,
    ckpt_store,
    ckpt_tile,
    head_slot,
    pool_row,
    round_bf16,
    row_inputs,
    store_as,
)
from .quantize import empty_part
from .settings import RecurrentSettings


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, peak_ptr,
    dense_ptr, part_ptr, slot_ptr, c0p, s0p, z0p, c1p, s1p, z1p, HV0, HV1, d0p, t0p, y0p, d1p, t1p, y1p,
    T, H, HV, rows_ptr, strides_ptr,
    K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, G: tl.constexpr, KEY_AXIS: tl.constexpr,
    SYM: tl.constexpr,
    BITS0: tl.constexpr, PZ0: tl.constexpr, CC0: tl.constexpr, SS0: tl.constexpr, ZS0: tl.constexpr,
    BITS1: tl.constexpr, PZ1: tl.constexpr, CC1: tl.constexpr, SS1: tl.constexpr, ZS1: tl.constexpr,
    TWO: tl.constexpr, DENSE: tl.constexpr, BF16_STATE: tl.constexpr, POOL: tl.constexpr = False,
):
    """``POOL`` (a dense state, ``T = 1``): the programs step the slots ``rows_ptr`` of a state pool in place, the
    state's pointer the first slot's and ``strides_ptr[0]`` the slot stride (:mod:`kernels.pool_step`)."""
    pid = tl.program_id(0).to(tl.int64)
    if POOL:  # the batch row's inputs and output, its slot's state, then the program within the row
        r, slot_i, pid = pool_row(pid, rows_ptr, HV)
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr = row_inputs(r, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, H, HV,
                                                                 K, V)
        dense_ptr = dense_ptr + slot_i * tl.load(strides_ptr)
    c0 = tl.program_id(1) * BV
    b = pid // HV
    h = pid % HV
    kh = h // (HV // H)
    rows = tl.arange(0, K)
    cols = c0 + tl.arange(0, BV)
    dense_base = dense_ptr + pid * K * V
    if DENSE:
        part = 0
        slot = h
    else:
        part, slot = head_slot(part_ptr, slot_ptr, h, TWO)
    a0, as0, az0, a1, as1, az1 = ckpt_base(part, slot, b, HV0, HV1, K, c0p, s0p, z0p, c1p, s1p, z1p,
                                            CC0, SS0, ZS0, CC1, SS1, ZS1)
    S = ckpt_tile(dense_base, part, a0, as0, az0, a1, as1, az1, 0, c0, K, BV, K, V, G, KEY_AXIS, SYM,
                  BITS0, PZ0, BITS1, PZ1, TWO, DENSE)
    X = S
    peak = tl.max(tl.zeros((BV,), tl.float32), axis=0)
    for t in range(T):
        x = b * T + t
        k = tl.load(k_ptr + (x * H + kh) * K + rows)
        q = tl.load(q_ptr + (x * H + kh) * K + rows)
        alpha = tl.exp(tl.load(g_ptr + x * HV + h))
        beta = tl.load(beta_ptr + x * HV + h)
        X = S * alpha
        u = beta * (tl.load(v_ptr + (x * HV + h) * V + cols) - tl.sum(X * k[:, None], axis=0))
        X = X + k[:, None] * u[None, :]
        tl.store(o_ptr + (x * HV + h) * V + cols, tl.sum(X * q[:, None], axis=0).to(o_ptr.dtype.element_ty))
        if DENSE:
            if BF16_STATE:
                S = round_bf16(X)
            else:
                S = X
        else:
            peak = tl.maximum(peak, tl.max(tl.max(tl.where(X == X, tl.abs(X), float("inf")), axis=1), axis=0))
            S = ckpt_round(X, part, K, BV, G, KEY_AXIS, SYM, BITS0, BITS1, TWO)
    if DENSE:
        store_as(dense_base + rows[:, None] * V + cols[None, :], S)
    else:
        tl.atomic_max(peak_ptr, peak)
        o0, os0, oz0, o1, os1, oz1 = ckpt_base(part, slot, b, HV0, HV1, K, d0p, t0p, y0p, d1p, t1p, y1p,
                                                CC0, SS0, ZS0, CC1, SS1, ZS1)
        ckpt_store(X, dense_base, part, o0, os0, oz0, o1, os1, oz1, 0, c0, K, BV, K, V, G, KEY_AXIS, SYM,
                   BITS0, PZ0, BITS1, PZ1, TWO, DENSE)


Checkpoint = torch.Tensor | quant.PackedTensor | quant.MixedPackedState


def _columns(B: int, HV: int, V: int, device: torch.device, block_v: int | None) -> int:
    """``block_v``, else 64 when there are more than four (sequence, value head) pairs per SM and 32 below
    (the faster of the two on the H200 for one token, data/bench/bench.json: 32 up to batch 16, 64 from 32,
    with 32 value heads); at most ``V``."""
    if block_v is None:
        block_v = 64 if device.type == "cuda" and B * HV > 4 * sm_count(device) else 32
    return min(block_v, V)


@dataclass(frozen=True)
class RecurrentPlan:
    """What the launches of one state's recurrence share from run to run (the storage of a packed checkpoint is new
    after each run, its layout is not): the state's shape ``(B, HV, K, V)`` and device, the grid, ``columns`` value
    columns per program, the groups (``group`` entries, along the keys with ``key_axis``, ``symmetric``), whether
    the state is ``dense`` (in ``bf16_state`` or float32), the warps; for a packed checkpoint its bit widths
    (ascending), the head table (``table``, ``slot``: process-wide tensors, :func:`kernels.plan.head_table`), each
    part's value heads per sequence and layout, and each part's storage shape (``lead + heads``, spec)."""

    shape: tuple[int, int, int, int]
    device: torch.device
    grid: tuple[int, int]
    columns: int
    group: int
    key_axis: bool
    symmetric: bool
    dense: bool
    bf16_state: bool
    num_warps: int
    widths: tuple[int, ...] = ()
    table: torch.Tensor | None = None
    slot: torch.Tensor | None = None
    heads: tuple[int, int] = (0, 0)
    layouts: tuple[PartLayout, ...] = ()
    parts: tuple = ()

    def constexprs(self, ckpt: CkptArgs) -> dict:
        """The kernel's constexprs, the parts' layouts taken from ``ckpt``."""
        K, V = self.shape[2:]
        return dict(K=K, V=V, BV=self.columns, G=self.group, KEY_AXIS=self.key_axis, SYM=self.symmetric,
                    **ckpt.constexprs(), DENSE=self.dense, BF16_STATE=self.bf16_state, num_warps=self.num_warps)

    def ckpt(self, ckpt: quant.PackedTensor | quant.MixedPackedState) -> CkptArgs:
        """A packed checkpoint of this plan's layout as the kernel takes it (the plan's head table and layouts)."""
        parts = _parts_of(ckpt, self.widths)
        return CkptArgs.of_parts(self.table, self.slot, [PartStorage(p.codes, p.scale, p.scale if p.zero is None
                                                                     else p.zero, layout)
                                                         for p, layout in zip(parts, self.layouts)], self.heads)


def plan_recurrent(ckpt: Checkpoint, settings: RecurrentSettings | None = None, batch: int | None = None
                   ) -> RecurrentPlan:
    """Validate ``ckpt`` (as :func:`recurrent_run` takes it) and plan its launches (:class:`RecurrentPlan`) with the
    launch ``settings`` (:class:`kernels.settings.RecurrentSettings`: columns per program and warps); ``batch``: the
    sequences a launch steps, where not ``ckpt``'s (a state pool's first slot planned for the pool)."""
    settings = settings or RecurrentSettings()
    if isinstance(ckpt, torch.Tensor):
        if ckpt.dim() != 4 or ckpt.dtype not in (torch.float32, torch.bfloat16) or not ckpt.is_contiguous():
            raise PaceError(f"ckpt: {tuple(ckpt.shape)} {ckpt.dtype} not allowed; "
                            "allowed: contiguous float32/bfloat16 [B, HV, K, V]")
        B, HV, K, V = ckpt.shape
        BV = _columns(batch or B, HV, V, ckpt.device, settings.block_v)
        return RecurrentPlan((B, HV, K, V), ckpt.device, (B * HV, V // BV), BV, 1, True, True, True,
                             ckpt.dtype == torch.bfloat16, settings.num_warps)
    m = as_mixed(ckpt)
    B, HV, K, V = ckpt.shape
    widths = tuple(sorted(m.parts))
    device = m.parts[widths[0]].codes.device
    spec = m.parts[widths[0]].spec
    table, _ = packed_ckpt(m, (B, HV, K, V))
    BV = whole_groups(_columns(batch or B, HV, V, device, settings.block_v), V, spec.group_size, spec.axis == "key",
                      spec.symmetric, table.parts[0].layout.pack_zero)
    parts = tuple((m.parts[w].shape[:-2], m.parts[w].spec) for w in widths)
    return RecurrentPlan((B, HV, K, V), device, (B * HV, V // BV), BV, spec.group_size, spec.axis == "key",
                         spec.symmetric, False, False, settings.num_warps, widths, table.table, table.slot,
                         table.heads, tuple(p.layout for p in table.parts[:len(widths)]), parts)


def _parts_of(ckpt: quant.PackedTensor | quant.MixedPackedState, widths: tuple[int, ...]) -> list[quant.PackedTensor]:
    return [ckpt] if isinstance(ckpt, quant.PackedTensor) else [ckpt.parts[w] for w in widths]


def _empty_like(ckpt: quant.PackedTensor | quant.MixedPackedState, plan: RecurrentPlan
                ) -> quant.PackedTensor | quant.MixedPackedState:
    """Uninitialised storage of ``ckpt``'s layout (filled by the kernel)."""
    K, V = plan.shape[2:]
    new = [empty_part(lead[:-1], lead[-1], K, V, spec, plan.device) for lead, spec in plan.parts]
    if isinstance(ckpt, quant.PackedTensor):
        return new[0]
    return quant.MixedPackedState(dict(zip(plan.widths, new)), ckpt.heads, ckpt.shape)


def recurrent_run(ckpt: Checkpoint, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, settings: RecurrentSettings | None = None, out: torch.Tensor | None = None,
                  plan: RecurrentPlan | None = None) -> tuple[torch.Tensor, Checkpoint, torch.Tensor | None]:
    """``T`` tokens of the plain recurrence from ``ckpt``, rounded after each as it is stored (module
    docstring).

    ``ckpt``: a dense state ``[B, HV, K, V]`` float32 / bfloat16 contiguous (updated IN PLACE), or a packed
    checkpoint of that shape (pace_core.quant's format; key-axis or value-axis groups, at most two bit
    widths). ``q, k [B, T, H, K]`` (prepared), ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``, T >= 1;
    ``settings``: columns per program and warps (:class:`kernels.settings.RecurrentSettings`), ``out``: a contiguous
    float32 tensor for ``o``; ``plan``: :func:`plan_recurrent` of a checkpoint of ``ckpt``'s layout (then
    ``settings`` are the plan's; a caller that runs one state again and again makes it once). Returns
    ``o [B, T, HV, V]`` float32, the state after the last token (``ckpt`` itself when dense, else new
    storage) and, for a packed checkpoint, the largest ``|S_t|`` of the unrounded states as a float32 device
    tensor ``[1]`` (inf where one held NaN or inf), else None. Matches
    :func:`pace_core.recurrence.gdn_recurrent` token by token with a store after each to float32 rounding
    (dots of length K, another summation order), and a rounded entry one code apart where a state lies
    within that of a rounding boundary."""
    plan = plan if plan is not None else plan_recurrent(ckpt, settings)
    B, HV, K, V = plan.shape
    if q.dim() != 4:
        raise PaceError(f"q: shape {tuple(q.shape)} not allowed; allowed: [B, T, H, K]")
    T, H = q.shape[1], q.shape[2]
    if q.shape != (B, T, H, K) or k.shape != (B, T, H, K) or v.shape != (B, T, HV, V) or g.shape != (B, T, HV) \
            or beta.shape != (B, T, HV) or HV % H or T < 1:
        raise PaceError("q, k, v, g, beta: shapes not allowed; allowed: [B, T, H, K], [B, T, H, K], [B, T, HV, V], "
                        f"[B, T, HV], [B, T, HV] with T >= 1 and HV a multiple of H (the state is {(B, HV, K, V)})")
    q, k, v, g, beta = (t.to(torch.float32).contiguous() for t in (q, k, v, g, beta))
    o = output_tensor(out, (B, T, HV, V), plan.device)

    if plan.dense:  # a dense program reads no head table or part: the state stands in for every pointer
        src = dst = CkptArgs.dense(ckpt, ckpt)
        new, peak, state = ckpt, None, ckpt
    else:
        new = _empty_like(ckpt, plan)
        src, dst = plan.ckpt(ckpt), plan.ckpt(new)
        peak = torch.zeros(1, dtype=torch.float32, device=plan.device)
        state = src.parts[0].scale
    _recurrent_kernel[plan.grid](q, k, v, g, beta, o, o if peak is None else peak, state, *src.args(),
                                 *dst.pointers()[2:], T, H, HV, None, None, **plan.constexprs(src))
    return o, new, peak


def pool_dense_step(plan: RecurrentPlan, state: torch.Tensor, rows: torch.Tensor, strides: torch.Tensor,
                    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    out: torch.Tensor) -> None:
    """One token for the slots ``rows [B]`` (long, on the device) of a state pool of a dense state, updated in place:
    ``state`` the first slot ``[1, HV, K, V]`` (``plan``: :func:`plan_recurrent` of it), the slots ``strides[0]``
    elements apart; ``q, k [B, H, K]`` prepared, ``v [B, HV, V]``, ``g, beta [B, HV]`` float32 contiguous, ``o``
    written into ``out [B, HV, V]`` contiguous, float32 or rounded to its dtype (:mod:`kernels.pool_step`)."""
    HV = plan.shape[1]
    args = CkptArgs.dense(state, state)
    _recurrent_kernel[(rows.numel() * HV, plan.grid[1])](q, k, v, g, beta, out, out, state, *args.args(),
                                                         *args.pointers()[2:], 1, q.shape[1], HV, rows, strides,
                                                         **plan.constexprs(args), POOL=True)


def dense_recurrent_step(S: torch.Tensor, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor,
                         g_t: torch.Tensor, beta_t: torch.Tensor, settings: RecurrentSettings | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """One token on a dense state updated IN PLACE (the fp32 / bf16 per-token baseline):
    ``S [B, HV, K, V]`` float32/bfloat16 contiguous, ``q_t, k_t [B, H, K]``, ``v_t [B, HV, V]``,
    ``g_t, beta_t [B, HV]``; ``settings``: columns per program and warps; ``out [B, HV, V]`` float32 contiguous or
    None. Returns ``o_t [B, HV, V]`` float32 (:func:`recurrent_run` with T = 1)."""
    if out is not None and (tuple(out.shape) != (S.shape[0], S.shape[1], S.shape[3]) or not out.is_contiguous()):
        raise PaceError(f"out: {tuple(out.shape)} not allowed; allowed: contiguous float32 "
                        f"{(S.shape[0], S.shape[1], S.shape[3])}")
    o, _, _ = recurrent_run(S, *(x[:, None] for x in (q_t, k_t, v_t, g_t, beta_t)), settings,
                            out=None if out is None else out[:, None])
    return o[:, 0] if out is None else out
