"""Checks of device values, deferred while a CUDA graph is recorded.

A check of a tensor's values (a NaN, an fp16 scale that overflows) reads the device: a host synchronisation, which
a CUDA graph cannot record and which stalls the host once per check on every decode token. Inside
:func:`deferring` each such check records its failure as a boolean tensor instead (:func:`defer`); the recorder
(:class:`pace_core.graphs.DecodeGraphs`) folds them into one flag computed by the graph and read once per run, and a
run whose flag is set is computed again without graphs, where the same checks raise their own errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_FAILURES: ContextVar[list[torch.Tensor] | None] = ContextVar("pace_deferred_failures", default=None)


@contextmanager
def deferring() -> Iterator[list[torch.Tensor]]:
    """Inside the block, :func:`defer` records checks instead of reading the device: yields the list of their
    failure tensors (bool, any shape: a check fails where one is True)."""
    failures: list[torch.Tensor] = []
    token = _FAILURES.set(failures)
    try:
        yield failures
    finally:
        _FAILURES.reset(token)


def active() -> bool:
    """Whether checks are deferred here (inside :func:`deferring`)."""
    return _FAILURES.get() is not None


def defer(failed: Callable[[], torch.Tensor]) -> bool:
    """Inside :func:`deferring`: records ``failed()`` (a bool tensor on the device, True where the check fails)
    and returns True, so that the caller skips its device read; elsewhere False (the caller checks now)."""
    failures = _FAILURES.get()
    if failures is None:
        return False
    failures.append(failed())
    return True
