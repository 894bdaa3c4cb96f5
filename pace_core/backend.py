"""Backends: who computes the steps of a :class:`~pace_core.schedule.PeriodicState` (the schedule says
when; a backend says how).

A backend (:class:`Steps`) stores (returning the checkpoint and, where it comes for free, its dequantised
copy) and loads checkpoints, runs a chunk of the chunked GDN (a prefill
segment), one buffered decode token or a window of them that fits in the buffer (optionally followed by the
flush that the schedule asked for), a run of per-token recurrence steps (dP = 1) and the fold of the buffer. Two exist:

- :class:`ReferenceSteps` here, pure PyTorch on any device: :mod:`pace_core.recurrence` and the
  checkpoint's format; the definition of correct.
- ``kernels.backend.TritonSteps``: the Triton kernels of ``kernels/`` for CUDA tensors (on a CPU only under
  ``TRITON_INTERPRET=1``, as the tests do), matching the reference to float32 rounding. The folder is the
  package ``kernels`` in a source tree and is installed as ``pace_kernels`` (the name ``kernels`` belongs to
  Hugging Face's kernel hub): :func:`kernels_module` finds it either way.

:func:`select_steps` picks one per layer, once, from the setting (``backend`` or ``$PACE_KERNELS``):
``auto`` (the default: the kernels for CUDA tensors where they support the configuration and shapes),
``reference`` (never the kernels, e.g. to compare) or ``triton`` (the kernels wherever they support it).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import torch

from pace_core import deferred
from pace_core.errors import PaceError
from pace_core.quant import all_finite
from pace_core.recurrence import (
    buffered_step,
    buffered_window,
    fold,
    gdn_gates,
    gdn_recurrent,
    gdn_segment,
    prepare_qk,
)

if TYPE_CHECKING:
    from kernels.settings import Launch
    from pace_core.buffer import BufferFormat, DecodeBuffer
    from pace_core.checkpoint import Checkpoint, RoundingFormat, StateFormat

KERNELS_ENV = "PACE_KERNELS"
KERNELS_SOURCE = Path(__file__).resolve().parents[1] / "kernels"
"""The kernels' folder beside ``pace_core`` in a source tree (installed, it is the package ``pace_kernels``)."""
BACKEND_SETTINGS = ("auto", "reference", "triton")


def backend_setting(setting: str | None = None) -> str:
    """``setting``, else ``$PACE_KERNELS``, else ``auto``; PaceError for another value."""
    value = os.environ.get(KERNELS_ENV, "auto") if setting is None else setting
    value = value.strip().lower() or "auto"
    if value not in BACKEND_SETTINGS:
        source = "backend" if setting is not None else KERNELS_ENV
        raise PaceError(f"{source}={value!r} not allowed; allowed: {', '.join(BACKEND_SETTINGS)}")
    return value


class PeriodicState(Protocol):
    """What a backend reads and writes of the schedule it steps (:class:`pace_core.schedule.PeriodicState`, which
    calls it): the format, the stored checkpoint and the decode buffer."""

    fmt: StateFormat | RoundingFormat
    checkpoint: Checkpoint
    buffer: DecodeBuffer
    exact_current: bool

    def loaded(self) -> torch.Tensor: ...

    def store(self, S: torch.Tensor) -> None: ...

    def set_checkpoint(self, checkpoint: Checkpoint, loaded: torch.Tensor | None = None) -> None: ...


class Steps(Protocol):
    """The arithmetic of a :class:`~pace_core.schedule.PeriodicState` (module docstring)."""

    name: str

    def store(self, fmt: StateFormat | RoundingFormat, S: torch.Tensor) -> tuple[Checkpoint, torch.Tensor | None]: ...

    def load(self, fmt: StateFormat | RoundingFormat, c: Checkpoint) -> torch.Tensor: ...

    def chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              S0: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def step(self, st: PeriodicState, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, g_t: torch.Tensor,
             beta_t: torch.Tensor, *, flush: bool) -> torch.Tensor: ...

    def window(self, st: PeriodicState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, *, flush: bool) -> torch.Tensor: ...

    def recurrent_run(self, st: PeriodicState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor) -> torch.Tensor: ...

    def flush(self, st: PeriodicState) -> None: ...

    def fold(self, st: PeriodicState) -> torch.Tensor: ...

    def pool_step(self, fmt: StateFormat | RoundingFormat, checkpoint: Checkpoint, buffer: DecodeBuffer | None,
                  dims: tuple[int, int, int, int], exact_current: bool) -> PoolStep | str: ...

    def step_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, ...]: ...


class PoolStep(Protocol):
    """A state pool's decode step in place (:meth:`Steps.pool_step`; :mod:`kernels.pool_step`)."""

    def decode(self, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...


def capturing(t: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured on the stream of ``t``'s GPU (checks that read the device
    are skipped then: a graph's replays do not run them)."""
    if t.device.type != "cuda":
        return False
    with torch.cuda.device(t.device):
        return torch.cuda.is_current_stream_capturing()


def refuse_non_finite(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, name: str) -> None:
    """PaceError when decode inputs ``k, v, g`` hold NaN or inf: one check (:func:`pace_core.quant.all_finite`,
    a device read; recorded while checks are deferred), skipped while another CUDA graph is being captured (its
    replays do not check their inputs)."""
    if capturing(k) and not deferred.active():
        return
    if not all_finite(k, v, g):
        raise PaceError(f"k, v, g of {name}: non-finite values; allowed: finite inputs")


def token_by_token(steps: Steps, st: PeriodicState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor, *, flush: bool) -> torch.Tensor:
    """A window of buffered tokens (shapes as :meth:`ReferenceSteps.window`) through ``steps.step``, one token
    at a time, the flush after the last when asked: ``o [B, n, HV, V]``."""
    n = q.shape[1]
    outs = [steps.step(st, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], flush=flush and t == n - 1)
            for t in range(n)]
    return outs[0][:, None] if n == 1 else torch.stack(outs, 1)  # one token: a view, not a copy kernel per layer


class ReferenceSteps:
    """The PyTorch reference (any device). Shapes: ``q_t, k_t [B, H, K]`` (prepared), ``v_t [B, HV, V]``,
    ``g_t, beta_t [B, HV]``; chunks ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``,
    ``S0 [B, HV, K, V]``; outputs float32."""

    name = "reference"

    def store(self, fmt, S):
        """``S`` stored in ``fmt``, and its dequantised copy where it comes for free (else None)."""
        return fmt.store_loaded(S)

    def load(self, fmt, c):
        """The checkpoint ``c`` dequantised, float32."""
        return fmt.load(c)

    def chunk(self, q, k, v, g, beta, S0, chunk_size):
        """``(o [B, T, HV, V], S_T)`` of the GDN from ``S0`` (:func:`pace_core.recurrence.gdn_segment`)."""
        return gdn_segment(q, k, v, g, beta, S0, chunk_size)

    def step(self, st, q_t, k_t, v_t, g_t, beta_t, *, flush):
        """One buffered token: its record appended to ``st.buffer``; then the flush when asked. ``o_t``."""
        o = buffered_step(st.loaded(), st.buffer, q_t, k_t, v_t, g_t, beta_t, st.exact_current)
        if flush:
            self.flush(st)
        return o

    def window(self, st, q, k, v, g, beta, *, flush):
        """Buffered tokens ``q, k [B, n, H, K]``, ``v [B, n, HV, V]``, ``g, beta [B, n, HV]`` that fit in
        ``st.buffer``: :func:`pace_core.recurrence.buffered_window` (one token: :meth:`step`, fewer operations);
        then the flush when asked. ``o [B, n, HV, V]``."""
        if q.shape[1] == 1:
            return token_by_token(self, st, q, k, v, g, beta, flush=flush)
        o = buffered_window(st.loaded(), st.buffer, q, k, v, g, beta, st.exact_current)
        if flush:
            self.flush(st)
        return o

    def recurrent_run(self, st, q, k, v, g, beta):
        """dP = 1, tokens ``q, k [B, n, H, K]``, ``v [B, n, HV, V]``, ``g, beta [B, n, HV]``: each a plain
        recurrence step from the checkpoint, whose result is stored before the next. ``o [B, n, HV, V]``."""
        outputs = []
        for t in range(q.shape[1]):
            o, S = gdn_recurrent(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1],
                                 st.loaded())
            st.store(S)
            outputs.append(o)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def flush(self, st):
        """``Ŝ ← store(fold(Ŝ, buffer))``, buffer cleared."""
        st.store(fold(st.loaded(), st.buffer))
        st.buffer.clear()

    def fold(self, st):
        """Checkpoint plus folded buffer ``[B, HV, K, V]`` float32."""
        return fold(st.loaded(), st.buffer)

    def pool_step(self, fmt, checkpoint, buffer, dims, exact_current):
        """Why a state pool steps by count groups (or all rows at once) on the reference: it has no in-place step."""
        return "the reference has no in-place pool step"

    def step_inputs(self, q, k, v, a, b, A_log, dt_bias):
        """A GDN layer's step inputs from its projections, one row per token: ``q, k [T, H, K]``, ``v [T, HV, V]``,
        ``a, b [T, HV]``, ``A_log, dt_bias [HV]`` -> ``(q, k, v, g, beta)`` (:func:`pace_core.recurrence.prepare_qk`,
        :func:`pace_core.recurrence.gdn_gates`, ``v`` float32)."""
        q, k = prepare_qk(q, k)
        return (q, k, v.float(), *gdn_gates(a, b, A_log, dt_bias))


REFERENCE = ReferenceSteps()


def select_steps(fmt: StateFormat | RoundingFormat, buffer: BufferFormat | None, d_k: int, d_v: int,
                 device: torch.device, setting: str | None = None, launch: Launch | None = None) -> Steps:
    """The backend of one layer: the Triton kernels where ``setting`` (module docstring) asks for them and
    they support the format, the buffer's format (``None`` at dP = 1) and the head dims on ``device``, with
    ``launch``'s settings (the defaults when None), else the reference."""
    setting = backend_setting(setting)
    if setting == "reference" or (setting == "auto" and torch.device(device).type != "cuda"):
        return REFERENCE
    return kernels_module("backend").TritonSteps.for_layer(fmt, buffer, d_k, d_v, launch) or REFERENCE


def kernels_module(name: str) -> ModuleType:
    """The module ``name`` (e.g. ``backend``) of the project's Triton kernels: ``kernels.<name>`` where the
    name ``kernels`` finds the folder beside ``pace_core`` and no installed ``pace_kernels`` is elsewhere (a
    source tree, editable or not: the tests and the app run from the repository root and load the kernels
    under that name), else ``pace_kernels.<name>`` (a wheel, beside which ``kernels`` may be Hugging Face's)."""
    def folder(package: str) -> Path | None:
        spec = importlib.util.find_spec(package)
        return None if spec is None or spec.origin is None else Path(spec.origin).resolve().parent

    installed = folder("pace_kernels")
    source = folder("kernels") == KERNELS_SOURCE and installed in (None, KERNELS_SOURCE)
    return importlib.import_module(f"{'kernels' if source else 'pace_kernels'}.{name}")
