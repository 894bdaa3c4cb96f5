"""A state pool's decode step on the GPU, in place: one token for the rows ``rows [B]`` of a
:class:`pace_core.pool.StatePool` whose slots sit at different positions of their schedules, with no read on the
host (so that a CUDA graph can record it) and no copy of the state.

- The inputs are staged at their slots' positions of pool-wide tensors (:func:`_staging`: shared by the pools of one
  device and shape, as the layers step one after another on a stream) and ``o`` is read back from there.
- Each program steps the slot its batch row names (:func:`kernels.primitives.pool_program`) and reads the records
  that slot holds from the slot's own log decays (:func:`kernels.records.records_held`).
- Buffered packed key-axis checkpoints (PACE, RTN at dP >= 2): the one-kernel step
  (:func:`kernels.packed_step.launch_packed_step`), then the flush over the same rows, in which only the slots whose
  buffer the token filled fold (:func:`kernels.flush.launch_flush`); those slots' records are then forgotten (their
  log decays :data:`pace_core.buffer.EMPTY`, on the device).
- A dense state at dP = 1 (fp32, bf16): the per-token recurrence (:func:`kernels.recurrent_step.recurrent_run`).

The Triton kernels only: the Gluon step and flush address whole batches. What this does not cover
(:meth:`PoolStep.refusal`) steps by count groups (:meth:`pace_core.pool.StatePool.decode`).
"""

from __future__ import annotations

import torch

from pace_core.buffer import EMPTY, DecodeBuffer, records_held
from pace_core.checkpoint import checkpoint_tensors

from .flush import launch_flush
from .packed_step import launch_packed_step
from .plan import DecodePlan, plan_decode
from .recurrent_step import RecurrentPlan, plan_recurrent, recurrent_run
from .settings import Launch

_STAGING: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _staging(device: torch.device, slots: int, dims: tuple[int, int, int, int]) -> tuple[torch.Tensor, ...]:
    """``q, k [slots, H, K]``, ``v, o [slots, HV, V]``, ``g, beta [slots, HV]`` float32 on ``device``, made once per
    device and shape (never reallocated: a CUDA graph that recorded a step keeps reading them)."""
    key = (torch.device(device), slots, dims)
    if key not in _STAGING:
        H, HV, K, V = dims
        shapes = ((slots, H, K), (slots, H, K), (slots, HV, V), (slots, HV), (slots, HV), (slots, HV, V))
        _STAGING[key] = tuple(torch.zeros(s, dtype=torch.float32, device=device) for s in shapes)
    return _STAGING[key]


class PoolStep:
    """The in-place step of one pool's layer (module docstring): the pool's checkpoint over every slot (``checkpoint``,
    of format ``fmt``: views of the pool's tensors) and its per-row decode buffer (``buffer``, None at dP = 1), heads
    ``dims = (H, HV, K, V)``, the exact current token or not, with the kernels' ``launch`` settings."""

    def __init__(self, fmt, checkpoint, buffer: DecodeBuffer | None, dims: tuple[int, int, int, int],
                 exact_current: bool, launch: Launch) -> None:
        self.checkpoint, self.buffer, self.dims = checkpoint, buffer, dims
        self.slots = checkpoint.shape[0]
        self.device = buffer.device if buffer is not None else checkpoint.device
        self.plan: DecodePlan | RecurrentPlan = (
            plan_recurrent(checkpoint, launch.recurrent) if buffer is None
            else plan_decode(checkpoint, buffer, exact_current, launch))

    @staticmethod
    def refusal(fmt, checkpoint, buffer: DecodeBuffer | None) -> str | None:
        """Why the kernels cannot step such a pool in place (then it steps by count groups), or None."""
        held = [*checkpoint_tensors(checkpoint).values(), *(buffer.storage().values() if buffer is not None else ())]
        if not all(t.is_contiguous() for t in held):
            return ("the pool's tensors are views with a slot stride (an engine's pages), and the kernels address "
                    "contiguous rows")
        if buffer is None:
            return None if isinstance(checkpoint, torch.Tensor) else \
                "a packed checkpoint at dP = 1 is rewritten to new storage by its kernel"
        if isinstance(checkpoint, torch.Tensor) or fmt.spec.axis != "key":
            return "buffered dense or value-axis checkpoints step in the whole-batch kernel"
        V = checkpoint.shape[-1]
        if any((V // 2 if bits == 4 else V) < 16 for bits in fmt.bits_per_head):
            return "heads too narrow for the one-kernel step"
        return None

    def decode(self, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor) -> torch.Tensor:
        """One token for the slots ``rows [B]`` (distinct, long, on the pool's device): ``q, k [B, H, K]``
        prepared, ``v [B, HV, V]``, ``g, beta [B, HV]`` -> ``o [B, HV, V]`` float32 (finite inputs: the caller
        checked them)."""
        plan = self.plan
        staged = _staging(self.device, self.slots, self.dims)
        for buf, x in zip(staged, (q, k, v, g, beta)):
            buf.index_copy_(0, rows, x.to(torch.float32))
        sq, sk, sv, sg, sbeta, so = staged
        if self.buffer is None:
            recurrent_run(self.checkpoint, *(x[:, None] for x in (sq, sk, sv, sg, sbeta)), out=so[:, None],
                          plan=plan, rows=rows)
            return so.index_select(0, rows)
        decays = plan.records.log_decays
        full = records_held(decays.index_select(0, rows)) + 1 == plan.capacity
        launch_packed_step(plan, self.buffer, sq, sk, sv, sg, sbeta, so, rows=rows)
        launch_flush(plan, self.buffer, rows=rows)
        kept = decays.index_select(0, rows)
        decays.index_copy_(0, rows, torch.where(full[:, None, None], torch.full_like(kept, EMPTY), kept))
        return so.index_select(0, rows)
