"""A state pool's decode step on the GPU, in place: one token for the rows ``rows [B]`` of a
:class:`pace_core.pool.StatePool` whose slots sit at different positions of their schedules, with no read on the
host (so that a CUDA graph can record it) and no copy of the state.

- The launches are planned on the pool's first slot and take each tensor's slot stride (:func:`slot_strides`): a
  pool's own rows, or an engine's pages (vLLM's, every field a view with the page as its stride) alike.
- Each program moves its pointers to the slot its batch row names (:func:`kernels.primitives.pool_row`,
  :func:`~kernels.primitives.slot_parts`, :func:`kernels.records.slot_records`) and reads the records that slot holds
  from the slot's own log decays (:func:`kernels.records.records_held`).
- The inputs come from the layer's projections in one launch (:mod:`kernels.step_inputs`, the backend's
  ``step_inputs``).
- Buffered packed key-axis checkpoints (PACE, RTN at dP >= 2): the one-kernel step
  (:func:`kernels.packed_step.launch_packed_step`: PACE-4's Gluon step on a GPU where it applies, else the Triton
  one); then the slots whose buffer the token filled, listed on the device (:func:`kernels.records.full_slots`),
  fold (:func:`kernels.flush.launch_flush`: the first rows' programs fold, the others exit) and their records are
  forgotten (their log decays :data:`pace_core.buffer.EMPTY`, one launch: :func:`kernels.records.forget_full`);
  with the setting ``step_folds`` (:func:`kernels.plan.step_folds_apply`) the Gluon step's programs fold and forget
  their own slots', one launch in all.
- A dense state at dP = 1 (fp32, bf16): the per-token recurrence (:func:`kernels.recurrent_step.pool_dense_step`).

The Gluon flush addresses whole batches only. What this does not cover
(:meth:`PoolStep.refusal`) steps by count groups (:meth:`pace_core.pool.StatePool.decode`).
"""

from __future__ import annotations

import torch

from pace_core.buffer import DecodeBuffer
from pace_core.checkpoint import checkpoint_tensors, with_tensors

from .flush import launch_flush
from .packed_step import launch_packed_step
from .plan import CkptArgs, DecodePlan, plan_decode
from .records import forget_full, full_slots
from .recurrent_step import RecurrentPlan, plan_recurrent, pool_dense_step
from .settings import Launch


def slot_strides(ckpt: CkptArgs, records: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """The slot strides (elements) of a launch's checkpoint parts (codes, scale, zero of part 0, then of part 1) and
    of its records (:meth:`kernels.records.Records.args`), as the pool kernels read them: int64 on their device."""
    held = (*ckpt.pointers()[2:], *records)
    return torch.tensor([t.stride(0) for t in held], dtype=torch.int64, device=held[0].device)


class PoolStep:
    """The in-place step of one pool's layer (module docstring): the pool's checkpoint over every slot (``checkpoint``,
    of format ``fmt``: views of the pool's tensors) and its per-row decode buffer (``buffer``, None at dP = 1), heads
    ``dims = (H, HV, K, V)``, the exact current token or not, with the kernels' ``launch`` settings."""

    def __init__(self, fmt, checkpoint, buffer: DecodeBuffer | None, dims: tuple[int, int, int, int],
                 exact_current: bool, launch: Launch) -> None:
        H, HV, K, V = self.dims = dims
        slots = checkpoint.shape[0]
        first = with_tensors(checkpoint, {n: t[:1] for n, t in checkpoint_tensors(checkpoint).items()})
        self.decays = None if buffer is None else buffer.storage()["log_decays"]
        self.plan: DecodePlan | RecurrentPlan
        if buffer is None:
            self.state = first
            self.plan = plan_recurrent(first, launch.recurrent, batch=slots)
            self.strides = slot_strides(CkptArgs.dense(first, first))[:1]
            return
        self.buffer = DecodeBuffer(1, H, HV, K, V, buffer.capacity, buffer.format, buffer.device,
                                   {n: t[:1] for n, t in buffer.storage().items()}, per_row=True)
        self.plan = plan_decode(first, self.buffer, exact_current, launch, batch=slots)
        sp, records = self.plan.split, self.plan.records.args()
        self.step_strides = slot_strides(sp.launches[False][0].ckpt, records)
        self.flush_strides = tuple(slot_strides(launch.ckpt, records) for launch in sp.per_width)

    @staticmethod
    def refusal(fmt, checkpoint, buffer: DecodeBuffer | None) -> str | None:
        """Why the kernels cannot step such a pool in place (then it steps by count groups), or None."""
        held = [*checkpoint_tensors(checkpoint).values(), *(buffer.storage().values() if buffer is not None else ())]
        if not all(t[:1].is_contiguous() for t in held):
            return "a slot's tensors are not contiguous in memory"
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
               beta: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """One token for the slots ``rows [B]`` (distinct, int32 or long, on the pool's device): ``q, k [B, H, K]``
        prepared, ``v [B, HV, V]``, ``g, beta [B, HV]`` -> ``o [B, HV, V]`` float32, or written into ``out`` and
        returned (float32 or bfloat16: the kernels round their float32 ``o`` to it as they store it) (finite inputs:
        the caller checked them)."""
        q, k, v, g, beta = (x.to(torch.float32).contiguous() for x in (q, k, v, g, beta))
        direct = out is not None and out.is_contiguous() and out.dtype in (torch.float32, torch.bfloat16)
        o = out if direct else torch.empty(v.shape, dtype=torch.float32, device=v.device)
        if self.decays is None:
            pool_dense_step(self.plan, self.state, rows, self.strides, q, k, v, g, beta, o)
        else:
            launch_packed_step(self.plan, self.buffer, q, k, v, g, beta, o, rows=rows, strides=self.step_strides)
            if not self.plan.split.step_folds:  # else the step's programs folded and forgot their own slots
                full = full_slots(self.decays, rows)
                launch_flush(self.plan, self.buffer, full=full, strides=self.flush_strides)
                forget_full(self.decays, full)  # their buffers were just folded
        return o if out is None or direct else out.copy_(o)
