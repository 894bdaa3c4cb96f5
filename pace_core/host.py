"""How many CPU cores other processes leave free, for torch's intra-op threads.

Torch splits every CPU operator over its intra-op threads and waits for all of them at the end (an OpenMP
barrier). When another process keeps one of the cores busy, the thread placed there runs only in the slices
the scheduler gives it, and every operator waits for it (``data/bench/app_cpu_busy.json``: the app's views
on 2 cores with one taken). :func:`free_threads` counts the cores this process may run on that other processes
do not keep busy, from ``/proc/stat`` sampled by a daemon thread every :data:`SAMPLE_S` (so asking costs
nothing), and never asks for more threads than a caller's default (torch's own choice on a quiet machine).
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

PROC_STAT = Path("/proc/stat")
SAMPLE_S = 0.5
"""The sampling window: the kernel counts CPU time in ticks of 10 ms, so 50 ticks per CPU."""
TAKEN_SHARE = 0.25
"""A core counts as taken when other processes keep it busy more than this share of the time: a thread there
loses a quarter of its slices, and every operator's barrier waits for them."""

Ticks = dict[int, tuple[int, int]]
"""``{cpu: (busy ticks, all ticks)}`` since boot."""


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity; every CPU where the system has no affinity call)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def cpu_ticks(cpus: set[int], stat: str) -> Ticks:
    """The ticks of each of ``cpus`` in ``stat`` (the text of ``/proc/stat``: its ``cpuN`` lines; idle and iowait
    are not busy)."""
    found = {}
    for line in stat.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
            found[int(name[3:])] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))
    return found


def busy_of_others(before: Ticks, after: Ticks, own_s: float, wall_s: float) -> float:
    """CPUs' worth of time other processes kept busy between two samples: each CPU's busy share, summed, less this
    process's CPU time ``own_s`` over the ``wall_s`` seconds between them (at least 0)."""
    busy = sum((after[c][0] - before[c][0]) / max(after[c][1] - before[c][1], 1) for c in before if c in after)
    return max(busy - own_s / max(wall_s, 1e-9), 0.0)


def threads_for(busy: float, cpus: int, default: int) -> int:
    """Intra-op threads when other processes keep ``busy`` CPUs' worth of ``cpus`` busy: the cores not taken (one
    taken per :data:`TAKEN_SHARE` started), at least 1 and at most ``default``."""
    taken = max(math.ceil(busy - TAKEN_SHARE), 0)
    return max(1, min(default, cpus - taken))


class _Monitor(threading.Thread):
    """Samples ``/proc/stat`` and this process's CPU time every :data:`SAMPLE_S`; ``busy`` is the last window's
    :func:`busy_of_others`."""

    def __init__(self) -> None:
        super().__init__(name="pace-cpu-monitor", daemon=True)
        self.busy = self._window(0.1)  # the first answer at once, from a short window

    @staticmethod
    def _sample() -> tuple[Ticks, float, float]:
        return cpu_ticks(usable_cpus(), PROC_STAT.read_text()), time.process_time(), time.monotonic()

    def _window(self, seconds: float) -> float:
        before, own, start = self._sample()
        time.sleep(seconds)
        after, own_after, end = self._sample()
        return busy_of_others(before, after, own_after - own, end - start)

    def run(self) -> None:
        while True:
            self.busy = self._window(SAMPLE_S)


_MONITOR: _Monitor | None = None
_MONITOR_LOCK = threading.Lock()


def busy_cpus_of_others() -> float:
    """CPUs' worth of time other processes keep busy on the usable CPUs now (the last :data:`SAMPLE_S` window; the
    first call waits 0.1 s for its own); 0.0 where ``/proc/stat`` is absent (not Linux)."""
    global _MONITOR
    if not PROC_STAT.is_file():
        return 0.0
    with _MONITOR_LOCK:
        if _MONITOR is None:
            _MONITOR = _Monitor()
            _MONITOR.start()
    return _MONITOR.busy


def free_threads(default: int) -> int:
    """Intra-op threads for a computation starting now: :func:`threads_for` of :func:`busy_cpus_of_others` on the
    usable CPUs, at most ``default``."""
    return threads_for(busy_cpus_of_others(), len(usable_cpus()), default)
