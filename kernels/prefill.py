"""Prefill with periodic rounding (PACE_SPEC §3, P): the prompt in P-token segments, each run by the
chunked GDN from the dequantised state, each segment's final state quantised by the Triton kernels.

The chunked GDN is :func:`pace_core.recurrence.gdn_chunked` (torch operations, so it runs on the GPU
too). fla's ``chunk_gated_delta_rule`` is not used: it is installed neither in the project's
environment nor on the GPU machine, and an untested alternative path is not kept. The rounding goes
through :func:`kernels.quant_pack.quantize_heads` / :func:`~kernels.quant_pack.dequantize_heads`,
which are bit-identical to pace_core.quant, so the result equals
:func:`pace_core.recurrence.gdn_prefill_segmented` with pace_core.quant's rounding exactly.
"""

from __future__ import annotations

import torch

from kernels import quant_pack
from pace_core import quant
from pace_core.errors import PaceError
from pace_core.recurrence import gdn_chunked

Storage = quant.QuantSpec | torch.dtype


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    period: int,
    storage: Storage,
    bits_per_head: list[int] | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | quant.PackedTensor | quant.MixedPackedState]:
    """Segmented prefill. ``q, k [B, T, H, K]`` (prepared), ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``,
    ``initial_state [B, HV, K, V]`` (dequantised, used as given) or None, ``period`` P >= 1.

    ``storage`` is a :class:`~pace_core.quant.QuantSpec` (the checkpoint is quantised; with
    ``bits_per_head`` [HV] the heads get their own widths) or a float dtype (method none: the
    checkpoint is the state cast to it). Returns ``o [B, T, HV, V]`` float32 and the checkpoint of the
    last segment's state (PackedTensor, MixedPackedState or a dense tensor); T == 0 gives the
    initial state (zeros if None) stored the same way.
    """
    if not isinstance(period, int) or period < 1:
        raise PaceError(f"period: {period!r} not allowed; allowed: an integer >= 1")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    S = torch.zeros(B, HV, K, V, dtype=torch.float32, device=q.device) if initial_state is None \
        else initial_state.to(torch.float32)
    if isinstance(storage, torch.dtype):
        if bits_per_head is not None:
            raise PaceError("bits_per_head: not allowed with a dense storage dtype; allowed: None")
        store = lambda S: S.to(storage)  # noqa: E731
        load = lambda c: c.to(torch.float32)  # noqa: E731
    elif isinstance(storage, quant.QuantSpec):
        if bits_per_head is None:
            store = lambda S: quant_pack.quantize(S, storage, name="state")  # noqa: E731
            load = quant_pack.dequantize
        else:
            store = lambda S: quant_pack.quantize_heads(S, bits_per_head, storage)  # noqa: E731
            load = quant_pack.dequantize_heads
    else:
        raise PaceError(f"storage: {storage!r} not allowed; allowed: a QuantSpec or a torch float dtype")
    outputs = []
    ckpt = None
    for start in range(0, T, period):
        part = slice(start, start + period)
        o, S = gdn_chunked(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], S, chunk_size)
        outputs.append(o)
        ckpt = store(S)
        S = load(ckpt)
    if ckpt is None:
        return torch.zeros(B, 0, HV, V, dtype=torch.float32, device=q.device), store(S)
    return torch.cat(outputs, dim=1), ckpt
