"""CUDA graphs of the analyses' decode calls: the host out of the teacher-forced loop on a GPU.

A teacher-forced forward (:mod:`pace_core.model.teacher`) hands every GDN layer a chunk of tokens that the layer's
state decodes one at a time: per token a few to a few hundred small launches, each waiting for the host, and a
device read per rounding check. A :class:`DecodeGraphs` records such a call (all members of a
:class:`~pace_core.state_store.StoreStack`, one layer, ``T`` tokens, from a given position of the schedule) once
as a CUDA graph and replays it for every later call with the same key: the windows of the next batches, the next
chunks of a window. What the host keeps of a state (the decode buffers' record counts) is part of the key and is
set to what the recorded call left after each replay.

- A key is run as it is the first time it is seen (it compiles kernels, makes launch plans, warms the
  allocator), recorded the second time, then replayed.
- Inputs are copied into the graph's own tensors; its output tensor is the same at every replay (read it before
  the key runs again: the next layer call of the forward does).
- Rounding checks inside the graph are deferred (:mod:`pace_core.deferred`): the graph ORs their failures into
  :attr:`DecodeGraphs.failed`, which :meth:`DecodeGraphs.check` reads once per run; a run that failed is computed
  again without graphs, where the checks raise their own errors (:func:`pace_core.model.teacher.teacher_forced`).
- A call that cannot be recorded (an operation a graph does not allow: a host read, a tensor made from host
  data) runs as it is from then on, as does every later key (:attr:`DecodeGraphs.broken`), and
  :attr:`DecodeGraphs.refused` says why, as does a warning (once per stack: the run is slower, not
  different). ``tests/test_graphs.py`` checks on the CPU that no recordable call holds such an operation.

- Stochastic rounding's generators are registered with each graph that draws from them: a replay advances them as
  the call would (the same draws as without graphs), and a state's restart seeds the same generator again.
  Static scales count their saturated values in a device tensor, which a replay adds to in place.

Graphs are used on CUDA devices unless :data:`GRAPHS_ENV` is ``off``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from pace_core import deferred
from pace_core.errors import PaceError

GRAPHS_ENV = "PACE_DECODE_GRAPHS"
GRAPHS_SETTINGS = ("auto", "off")


def graphs_setting() -> str:
    """``$PACE_DECODE_GRAPHS`` (default ``auto``: on CUDA devices); PaceError for another value."""
    value = os.environ.get(GRAPHS_ENV, "auto").strip().lower() or "auto"
    if value not in GRAPHS_SETTINGS:
        raise PaceError(f"{GRAPHS_ENV}={value!r} not allowed; allowed: {', '.join(GRAPHS_SETTINGS)}")
    return value


@dataclass
class _Recorded:
    """One recorded call: its graph, input and output tensors, and the host state it leaves."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor
    after: Hashable


class DecodeGraphs:
    """The recorded calls of one store stack on one CUDA ``device`` (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.failed = torch.zeros((), dtype=torch.bool, device=device)
        """True once a deferred check failed in a replay since the last :meth:`check`."""
        self.refused: dict[Hashable, str] = {}
        """Keys that run without a graph, and why."""
        self._recorded: dict[Hashable, _Recorded] = {}
        self._seen: set[Hashable] = set()
        self.broken: str | None = None
        """Why a capture failed: none is tried after one did (a failed capture can leave the memory pool allocating
        for it, and every later capture into that pool then fails as well), so each later key runs as it is."""

    def _release_pool(self) -> None:
        """End the allocation to the pool of a capture that failed before its end (PyTorch leaves it open when
        ending the capture raises); nothing where it was ended."""
        with contextlib.suppress(RuntimeError):
            torch._C._cuda_endAllocateToPool(self.device.index or 0, self.pool)

    def run(self, key: Hashable, call: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
            host_state: Callable[[], Hashable], set_host_state: Callable[[Hashable], None],
            generators: Callable[[], Sequence[torch.Generator]] = tuple) -> torch.Tensor:
        """``call(*inputs)``, recorded or replayed under ``key`` (which must hold ``host_state()``, the host's
        part of the state the call starts from; ``set_host_state`` restores one); ``generators()``: the random
        generators ``call`` draws from (module docstring), asked for when the call is recorded."""
        recorded = self._recorded.get(key)
        if recorded is None:
            if key in self.refused or key not in self._seen:
                self._seen.add(key)
                return call(*inputs)
            recorded = self._record(key, call, inputs, host_state, set_host_state, generators)
            if recorded is None:
                return call(*inputs)
        for static, given in zip(recorded.inputs, inputs):
            static.copy_(given)
        recorded.graph.replay()
        set_host_state(recorded.after)
        return recorded.output

    def _record(self, key: Hashable, call: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                host_state: Callable[[], Hashable], set_host_state: Callable[[Hashable], None],
                generators: Callable[[], Sequence[torch.Generator]]) -> _Recorded | None:
        """Record ``call`` on copies of ``inputs`` (the host state restored afterwards: recording runs nothing on
        the device, and advances no generator); None where it cannot be recorded (:attr:`refused`)."""
        if self.broken is not None:
            self.refused[key] = self.broken
            return None
        before = host_state()
        static = tuple(t.clone() for t in inputs)
        graph = torch.cuda.CUDAGraph()
        try:  # thread-local: the app's background kernel compilation may use the device meanwhile
            for generator in generators():
                graph.register_generator_state(generator)
            with (deferred.deferring() as failures,
                  torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local")):
                output = call(*static)
                if failures:
                    self.failed.logical_or_(torch.stack([f.any() for f in failures]).any())
        except (RuntimeError, PaceError) as err:  # an operation the graph cannot hold: run as it is from now
            set_host_state(before)
            self.broken = self.refused[key] = f"{type(err).__name__}: {err}"
            self._release_pool()
            warnings.warn(f"PACE: a decode call could not be recorded as a CUDA graph ({self.broken}); this run's "
                          f"later calls run without graphs: the same results, more slowly. Please report it; "
                          f"{GRAPHS_ENV}=off turns graphs off", RuntimeWarning, stacklevel=2)
            return None
        recorded = _Recorded(graph, static, output, host_state())
        set_host_state(before)
        self._recorded[key] = recorded
        return recorded

    def check(self) -> bool:
        """Whether a deferred check failed in a replay since the last check (one device read); clears it."""
        failed = bool(self.failed)
        self.failed.zero_()
        return failed
