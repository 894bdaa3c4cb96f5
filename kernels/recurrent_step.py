"""The per-token step on a dense float32 / bfloat16 state, updated in place: the fp32 / bf16 baseline (the
whole state read and written every token) and method none's decode at dP = 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.plan import output_tensor, sm_count
from kernels.primitives import store_as
from pace_core.errors import PaceError


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
        block_v = 64 if S.device.type == "cuda" and B * HV > 4 * sm_count(S.device) else 32
    BV = min(block_v, V)
    q, k, v, g, beta = (t.to(torch.float32).contiguous() for t in (q_t, k_t, v_t, g_t, beta_t))
    o = output_tensor(out, (B, HV, V), S.device)
    _dense_step_kernel[(B * HV, V // BV)](q, k, v, g, beta, o, S, H=H, HV=HV, K=K, V=V, BV=BV,
                                          num_warps=num_warps)
    return o
