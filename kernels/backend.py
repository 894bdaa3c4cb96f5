"""The Triton backend of :mod:`pace_core.backend`: the steps of a :class:`~pace_core.schedule.PeriodicState`
on the kernels of this package (CUDA tensors; CPU tensors only under ``TRITON_INTERPRET=1``).

- store / load: :mod:`kernels.quantize` for rtn / pace checkpoints (bit-identical to pace_core.quant), a
  cast for method none;
- a prefill chunk: :mod:`kernels.chunk`, a short one (a decode token of the fp32 reference)
  :mod:`kernels.recurrent_step`;
- a buffered token: packed key-axis checkpoints (PACE-4, PACE-4/8) run :mod:`kernels.packed_step` (a window
  of tokens in one launch) and, when the schedule asks, :mod:`kernels.flush`, both on the checkpoint in place;
  dense (method none) and value-axis checkpoints run :mod:`kernels.fused_step`, which flushes in the same
  launch;
- dP = 1: :mod:`kernels.recurrent_step`, the tokens of a call up to the next capture in one launch, the state
  in registers, rounded after every token;
- the fold of the buffer and a flush outside a token (before a prompt) of a fused-step checkpoint: the
  PyTorch reference.

The launch plan (:func:`kernels.plan.plan_decode`: the checkpoint's and the buffer's pointers, head table and
constexprs) is made once per layer: the layer's checkpoint storage is allocated once and every store, flush,
reset or reorder writes into it (:class:`pace_core.schedule.PeriodicState`). A dP = 1 run's kernel writes new
storage of the same layout, which is copied into the checkpoint; its plan
(:func:`kernels.recurrent_step.plan_recurrent`) is also made once per layer. A token then costs its
launches and little else on the host, which is what the Generations page pays per configuration, layer and
token.

Tolerances against the reference (float32 inputs): stores and loads are bit-identical; a token's output and
a folded state agree to a relative Frobenius error below 1e-5 given the same stored record (another
summation order; tensor-core products are exact, their fp32 accumulation is not IEEE round-to-nearest);
where ``u_t`` lies within float32 rounding of a bfloat16 / int8 rounding boundary its record may be stored
one step apart, and a requantised checkpoint entry may differ by one code where the folded value lies within
float32 rounding of a rounding boundary.
"""

from __future__ import annotations

import torch

from pace_core import quant
from pace_core.backend import REFERENCE, capturing, token_by_token
from pace_core.buffer import BufferFormat
from pace_core.deferred import defer
from pace_core.errors import PaceError
from pace_core.methods import method_of
from pace_core.recurrence import RECURRENT_BELOW, fold

from . import chunk as _chunk
from . import quantize as _quantize
from . import step_inputs as _inputs
from .flush import launch_flush
from .fused_step import launch_fused
from .packed_step import launch_packed_step, launch_window
from .plan import DecodePlan, check_kernel_shape, is_pow2, output_tensor, plan_decode
from .pool_step import PoolStep
from .recurrent_step import RecurrentPlan, plan_recurrent, recurrent_run
from .settings import Launch


class TritonSteps:
    """The Triton backend of one layer (module docstring). ``launch``: the kernels' launch settings
    (:class:`kernels.settings.Launch`; the defaults when None, kernels/bench/bench.py tries others)."""

    name = "triton"

    def __init__(self, launch: Launch | None = None) -> None:
        self.launch = launch or Launch()
        self._plan: tuple[object, DecodePlan] | None = None
        self._recurrent: tuple[RecurrentPlan, float | None] | None = None
        self._chunk_plan: RecurrentPlan | None = None  # a short chunk's run on a float32 copy of its state

    @classmethod
    def for_layer(cls, fmt, buffer: BufferFormat | None, d_k: int, d_v: int, launch: Launch | None = None
                  ) -> TritonSteps | None:
        """A backend for a layer of format ``fmt`` with that buffer format (None at dP = 1) and head dims, with
        ``launch``'s settings, or None where the kernels do not cover it (:meth:`refusal` says why)."""
        return None if cls.refusal(fmt, buffer, d_k, d_v) else cls(launch)

    @staticmethod
    def refusal(fmt, buffer: BufferFormat | None, d_k: int, d_v: int) -> str | None:
        """Why the kernels do not run a layer of format ``fmt`` with that buffer format and head dims (then the
        PyTorch reference does), or None where they do: other methods (DSQ, DAMP, a rounding function), a
        configuration with a combination on (:attr:`pace_core.config.PaceConfig.combined`: stochastic rounding, the
        key rotation, static scales), the float64 test buffer, integer buffer groups that are not powers of two,
        code widths other than 3, 4 and 8 bits (:data:`kernels.plan.WIDTH_REASON`), heads that are not powers of
        two or narrower than :data:`kernels.plan.DECODE_MIN_K`."""
        cfg = getattr(fmt, "cfg", None)
        if cfg is None or not method_of(cfg).kernels:
            return f"method {getattr(cfg, 'method', 'of a rounding function')!r} has no kernels"
        if cfg.combined:
            return f"{', '.join(cfg.combined)} run on the reference"
        if buffer is not None and (buffer.precision == "fp64" or any(
                spec is not None and not is_pow2(spec.group_size)
                for spec in (buffer.spec("key", d_k), buffer.spec("value", d_v)))):
            return f"buffer {buffer.precision!r} with these groups has no kernels"
        if not cfg.quantized and fmt.dtype not in (torch.float32, torch.bfloat16):
            return f"a {fmt.dtype} reference state has no kernels"
        try:
            check_kernel_shape(d_k, d_v, fmt.spec or quant.QuantSpec(8, True, "key", 1), fmt.name, decode=True,
                               widths=tuple(fmt.bits_per_head) if fmt.spec is not None else ())
        except PaceError as e:
            return str(e)
        return None

    def store(self, fmt, S: torch.Tensor):
        """``S [B, HV, K, V]`` stored in ``fmt`` (a cast for method none; the kernels for rtn / pace), and None
        for its dequantised copy (made when needed)."""
        if fmt.spec is None:
            return fmt.store(S), None
        if len(set(fmt.bits_per_head)) == 1:
            return _quantize.quantize(S, fmt.cfg.quant_spec(fmt.bits_per_head[0]), name=fmt.name), None
        return _quantize.quantize_heads(S, list(fmt.bits_per_head), fmt.spec, name=fmt.name), None

    def load(self, fmt, c) -> torch.Tensor:
        """The checkpoint ``c`` dequantised, float32."""
        if isinstance(c, quant.PackedTensor):
            return _quantize.dequantize(c)
        if isinstance(c, quant.MixedPackedState):
            return _quantize.dequantize_heads(c)
        return fmt.load(c)

    def chunk(self, q, k, v, g, beta, S0, chunk_size):
        """A run of tokens from ``S0`` (exact): fewer than :data:`pace_core.recurrence.RECURRENT_BELOW` as the
        recurrence kernel on a float32 copy of ``S0`` (one launch, e.g. one decode token or a few between
        captures of the fp32 reference), longer ones :func:`kernels.chunk.chunk`."""
        if 0 < q.shape[1] < RECURRENT_BELOW:
            S = S0.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            if self._chunk_plan is None or self._chunk_plan.shape != tuple(S.shape):
                self._chunk_plan = plan_recurrent(S)
            o, S, _ = recurrent_run(S, q, k, v, g, beta, plan=self._chunk_plan)
            return o, S
        return _chunk.chunk(q, k, v, g, beta, S0, chunk_size)

    def plan(self, st) -> DecodePlan:
        """The launch plan of ``st``'s checkpoint and buffer, with this backend's launch settings."""
        if self._plan is None or self._plan[0] is not st.checkpoint:
            self._plan = (st.checkpoint, plan_decode(st.checkpoint, st.buffer, st.exact_current, self.launch))
        return self._plan[1]

    def step(self, st, q_t, k_t, v_t, g_t, beta_t, *, flush: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        """One buffered token ``o_t [B, HV, V]``; its record appended, then the flush when asked (in place).
        ``out``: the contiguous float32 ``[B, HV, V]`` to write ``o_t`` into (kernels/bench/bench.py's layer output,
        as the dense step writes its own), else a new tensor."""
        plan, buf = self.plan(st), st.buffer
        q, k, v, g, beta = (t.contiguous() for t in (q_t, k_t, v_t, g_t, beta_t))
        o = output_tensor(out, tuple(v.shape), v.device)
        if plan.split:
            launch_packed_step(plan, buf, q, k, v, g, beta, o)
            buf.mark_appended()
            if flush:
                launch_flush(plan, buf)
        else:
            launch_fused(plan, buf, q, k, v, g, beta, o, flush)
            if not flush:
                buf.mark_appended()
        if flush:
            buf.clear()
            st.set_checkpoint(st.checkpoint)  # updated in place: the dequantised copy is stale
        return o

    def window(self, st, q, k, v, g, beta, *, flush: bool) -> torch.Tensor:
        """Buffered tokens ``q, k [B, n, H, K]``, ``v [B, n, HV, V]``, ``g, beta [B, n, HV]`` that fit in
        ``st.buffer``: ``o [B, n, HV, V]``. Packed key-axis checkpoints with heads wide enough for the one-kernel
        step run all ``n`` in one launch (:func:`kernels.packed_step.launch_window`, each token exactly as
        :meth:`step` would with the one-kernel step), then the flush when asked; others token by token."""
        plan, buf, n = self.plan(st), st.buffer, q.shape[1]
        if n == 1 or not (plan.split and plan.split.fusable):
            return token_by_token(self, st, q, k, v, g, beta, flush=flush)
        q, k, v, g, beta = (t.transpose(0, 1).contiguous() for t in (q, k, v, g, beta))
        o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        launch_window(plan, buf, q, k, v, g, beta, o)
        buf.mark_appended(n)
        if flush:
            self.flush(st)
        return o.transpose(0, 1)

    def recurrent_run(self, st, q, k, v, g, beta) -> torch.Tensor:
        """dP = 1, tokens ``q, k [B, n, H, K]``, ``v [B, n, HV, V]``, ``g, beta [B, n, HV]``: ``o [B, n, HV, V]``
        from one launch (:func:`kernels.recurrent_step.recurrent_run`). A dense state (method none) is updated
        in place; a packed checkpoint is replaced by the kernel's, unless a token's state was not finite or
        would overflow a group's fp16 scale: then the reference runs the tokens again from the checkpoint
        (untouched), so that the state is refused at the token and with the message a store gives. That check
        reads the device: recorded while checks are deferred (:mod:`pace_core.deferred`), skipped while another
        CUDA graph is being captured (its replays do not check, as :func:`pace_core.state_store.refuse_non_finite`).
        The launch settings' ``recurrent`` reach the kernel; its plan and the overflow bound are made on the first
        run (the layer's layout does not change), the plan again when the batch does (a state pool steps rows of
        other batch sizes through the same layer)."""
        if self._recurrent is None or self._recurrent[0].shape != tuple(st.checkpoint.shape):
            bound = None if st.fmt.spec is None else _quantize.overflow_free(st.fmt.spec, list(st.fmt.bits_per_head))
            self._recurrent = (plan_recurrent(st.checkpoint, self.launch.recurrent), bound)
        plan, bound = self._recurrent
        o, new, peak = recurrent_run(st.checkpoint, q, k, v, g, beta, plan=plan)
        if (peak is not None and not defer(lambda: ~(peak <= bound)) and not capturing(q)
                and not float(peak) <= bound):
            return REFERENCE.recurrent_run(st, q, k, v, g, beta)
        st.set_checkpoint(new)
        return o

    def flush(self, st) -> None:
        """A flush outside a token: the flush kernel on a packed key-axis checkpoint, else the reference."""
        plan = self.plan(st)
        if plan.split:
            launch_flush(plan, st.buffer)
            st.set_checkpoint(st.checkpoint)
        else:
            st.store(fold(st.loaded(), st.buffer))
        st.buffer.clear()

    def fold(self, st) -> torch.Tensor:
        """Checkpoint plus folded buffer ``[B, HV, K, V]`` float32 (the reference's fold)."""
        return fold(st.loaded(), st.buffer)

    def pool_step(self, fmt, checkpoint, buffer, dims: tuple[int, int, int, int], exact_current: bool
                  ) -> PoolStep | str:
        """The in-place step of a state pool (:class:`kernels.pool_step.PoolStep`'s arguments), with this backend's
        launch settings, or why there is none."""
        return PoolStep.refusal(fmt, checkpoint, buffer) or PoolStep(fmt, checkpoint, buffer, dims, exact_current,
                                                                      self.launch)

    def step_inputs(self, q, k, v, a, b, A_log, dt_bias):
        """The step inputs from a GDN layer's projections (:meth:`pace_core.backend.ReferenceSteps.step_inputs`) in
        one launch (:func:`kernels.step_inputs.step_inputs`), or on the reference where it does not take them."""
        if _inputs.refusal(q, k, v, b):
            return REFERENCE.step_inputs(q, k, v, a, b, A_log, dt_bias)
        return _inputs.step_inputs(q, k, v, a, b, A_log, dt_bias)
