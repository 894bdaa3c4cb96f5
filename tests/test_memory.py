"""pace_core.memory: bytes held by objects and the peak bytes allocated in a block, on allocations whose sizes are
known."""

import os
import platform
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from pace_core.memory import PeakBytes, held_bytes, held_storages
from pace_core.results import REPO_ROOT


@dataclass
class Holder:
    a: torch.Tensor
    more: dict


class Slotted:
    __slots__ = ("x",)

    def __init__(self, x):
        self.x = x


def test_held_storages_count_each_storage_once_through_every_container():
    base = torch.zeros(10, 10)  # 400 bytes
    other = torch.zeros(3, dtype=torch.float64)  # 24 bytes
    obj = Holder(
        base, {"view": base[2:5], "list": [other, (base.T,)], "slots": Slotted(torch.ones(2, dtype=torch.int16))}
    )
    assert held_bytes(obj) == 400 + 24 + 4
    assert held_bytes(obj, skip={base.untyped_storage().data_ptr()}) == 24 + 4
    assert set(held_storages([base, base[1]])) == {base.untyped_storage().data_ptr()}


def test_peak_bytes_follows_allocations_and_frees():
    keep = torch.ones(100)  # before the block: not counted
    with PeakBytes() as m:
        a = torch.zeros(1000)  # 4000
        b = a[10:]  # a view: the same storage
        c = a * 2  # 4000 more
        del c
        keep.mul_(3)  # in place: nothing allocated
        d = torch.empty(250, dtype=torch.float64)  # 2000
        del a
        assert m.live == 4000 + 2000  # b still holds a's storage
        del b
        assert m.live == 2000
    assert m.peak == 8000
    del d
    assert m.live == 0


_BLOCKS = """
import ctypes, sys, torch
from pace_core.memory import keep_freed_memory

class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
print(keep_freed_memory() if sys.argv[1] == "keep" else None)
block = torch.empty(24 << 20, dtype=torch.uint8).fill_(1)  # a step's temporary: a batch's dequantised state, about
mapped = libc.mallinfo2().hblkhd  # bytes in blocks mmapped apart from the heap
del block
print(mapped, libc.mallinfo2().arena)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
                    or not hasattr(__import__("ctypes").CDLL("libc.so.6"), "mallinfo2"), reason="glibc's mallopt")
def test_freed_memory_is_kept_for_the_next_step():
    """Default glibc maps a 24 MiB block apart from the heap (its first mmap threshold is 128 KiB) and unmaps it
    when it is freed, so the next step's block is faulted in again page by page. Kept (pace_core.memory.
    MALLOC_SETTINGS), the block comes from the heap and, freed, stays in it for the next step."""
    def blocks(mode: str) -> tuple[str, int, int]:
        done = subprocess.run([sys.executable, "-c", _BLOCKS, mode], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        flag, mapped, arena = done.stdout.split()
        return flag, int(mapped), int(arena)

    (flag, mapped, _), (kept, kept_mapped, kept_arena) = blocks("default"), blocks("keep")
    assert flag == "None" and mapped >= 24 << 20  # the default: mapped apart
    assert kept == "True" and kept_mapped < 24 << 20 and kept_arena >= 24 << 20  # kept: from the heap, and kept
