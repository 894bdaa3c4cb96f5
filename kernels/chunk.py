"""The chunk step of a prefill: one P-token segment of the chunked GDN from a given state (PACE_SPEC §3).

fla's ``chunk_gated_delta_rule`` (flash-linear-attention) where it is installed, the tensors are on a GPU and
the segment has at least :data:`pace_core.recurrence.RECURRENT_BELOW` tokens, else the reference's
:func:`pace_core.recurrence.gdn_segment` (torch operations, so it runs on the GPU too). fla's
kernel computes its dot products in tf32 / bf16 on tensor cores, so its outputs agree with the reference
to about 1e-3, not to float32 rounding.
"""

from __future__ import annotations

import torch

from pace_core.recurrence import RECURRENT_BELOW, gdn_segment

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
except ImportError:  # optional
    fla_chunk = None

AGREEMENT = 2e-3
"""How closely fla's chunk agrees with the reference's float32 segment, as a share of a head's largest |value| (its
outputs and final state): fla rounds its inputs to tf32 (10 mantissa bits, 2^-11 relative each, 2^-10 a product)
and accumulates in float32 over a chunk's tokens, two matmul stages deep, so an entry moves by up to about 2^-9 of
the magnitudes it sums, which the head's largest value bounds. A checkpoint requantised after such a prefill may
differ from the reference's by this much more than one rounding (its group's range, and so its fp16 scale, moves
with it)."""


def runs_fla(q: torch.Tensor) -> bool:
    """Whether a prefill of ``q``'s device runs fla's chunk (:func:`chunk`, for segments of at least
    :data:`pace_core.recurrence.RECURRENT_BELOW` tokens)."""
    return fla_chunk is not None and q.is_cuda


def chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          S0: torch.Tensor, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``q, k [B, T, H, K]`` (prepared), ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``, ``S0 [B, HV, K, V]``
    float32 -> ``(o [B, T, HV, V], S_T [B, HV, K, V])`` float32. ``chunk_size`` is the reference's (fla
    uses its own, 64)."""
    if not runs_fla(q) or q.shape[1] < RECURRENT_BELOW:
        return gdn_segment(q, k, v, g, beta, S0, chunk_size)
    gamma = v.shape[2] // q.shape[2]
    if gamma > 1:  # fla takes one key head per value head
        q, k = q.repeat_interleave(gamma, dim=2), k.repeat_interleave(gamma, dim=2)
    o, S = fla_chunk(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), scale=1.0,
                     initial_state=S0.contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=False)
    return o.float(), S.float()
