"""pace_core.host: the CPUs other processes keep busy, from /proc/stat's ticks, and the intra-op threads left."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pace_core import host

STAT = """cpu  {total}
cpu0 {cpu0} 0 0 0 0
cpu1 {cpu1} 0 0 0 0
intr 1 2 3
"""


def _stat(user0: int, idle0: int, user1: int, idle1: int) -> str:
    """A /proc/stat with user and idle ticks for two CPUs (the fields after them zero)."""
    return STAT.format(total=f"{user0 + user1} 0 0 {idle0 + idle1}", cpu0=f"{user0} 0 0 {idle0}",
                       cpu1=f"{user1} 0 0 {idle1}")


def test_ticks_and_the_busy_share_of_other_processes():
    """One CPU busy the whole window and the other a quarter of it: 1.25 CPUs' worth, less this process's own
    CPU time over the window (here 0.5 s of 2 s: 0.25 CPU)."""
    before = host.cpu_ticks({0, 1}, _stat(100, 900, 50, 950))
    assert before == {0: (100, 1000), 1: (50, 1000)}
    after = host.cpu_ticks({0, 1}, _stat(300, 900, 100, 1100))
    assert host.busy_of_others(before, after, own_s=0.0, wall_s=2.0) == pytest.approx(1.25)
    assert host.busy_of_others(before, after, own_s=0.5, wall_s=2.0) == pytest.approx(1.0)
    assert host.busy_of_others(before, after, own_s=5.0, wall_s=2.0) == 0.0
    assert host.cpu_ticks({1}, _stat(1, 2, 3, 4)) == {1: (3, 7)}  # only the CPUs asked for


@pytest.mark.parametrize("busy, cpus, default, threads", [
    (0.0, 2, 2, 2), (0.25, 2, 2, 2),           # quiet, or a core busy a quarter of the time: torch's default
    (0.26, 2, 2, 1), (1.0, 2, 2, 1),           # a core taken: one thread
    (2.0, 2, 2, 1), (5.0, 2, 2, 1),            # every core taken: still one
    (1.1, 8, 8, 7), (1.3, 8, 8, 6),            # a second core busy a tenth: free; three tenths: taken
    (0.0, 8, 4, 4),                             # never more than the default
])
def test_threads_for_the_cores_left(busy, cpus, default, threads):
    assert host.threads_for(busy, cpus, default) == threads


@pytest.mark.skipif(not host.PROC_STAT.is_file(), reason="no /proc/stat (not Linux)")
def test_a_busy_loop_in_another_process_is_seen():
    """A Python busy loop in another process keeps one CPU busy: at least 3/4 of one counted after a window,
    whatever else runs on the host (more only adds)."""
    host.busy_cpus_of_others()
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(3 * host.SAMPLE_S)
        assert host.busy_cpus_of_others() >= 0.75
    finally:
        loop.kill()
