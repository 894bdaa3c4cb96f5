"""Bytes as held, counted from the objects themselves (the check of :mod:`pace_core.accounting`'s figures):

- :func:`held_storages`: the storage of every tensor reachable from an object (a
  :class:`~pace_core.state_store.StateStore`, a cache), each counted once, whatever views share it
  (:func:`reachable_tensors`: those tensors);
- :class:`PeakBytes`: while active, the bytes of the tensors that torch operations allocate and are still
  alive, and their peak (the transient workspace of a call: what it needs beyond the state it started with);
- :func:`keep_freed_memory`: the process's C allocator told to reuse freed memory (a CPU step's workspace).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import types
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_ATOMS = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType, str, bytes, int,
          float, bool, complex, type(None))


def reachable_tensors(root: Any) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through attributes, ``__slots__``, dataclass fields, dicts, lists,
    tuples and sets (not through modules, classes or functions), each object once."""
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    todo = [root]
    while todo:
        obj = todo.pop()
        if isinstance(obj, _ATOMS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        else:
            todo.extend(getattr(obj, "__dict__", {}).values())
            todo.extend(getattr(obj, name) for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())
                        if isinstance(name, str) and hasattr(obj, name))
    return found


def held_storages(root: Any, skip: frozenset[int] | set[int] = frozenset()) -> dict[int, int]:
    """``{storage address: bytes}`` of every tensor reachable from ``root`` (:func:`reachable_tensors`), each
    storage counted once whatever views share it, leaving out the storages at the addresses ``skip``."""
    storages = (t.untyped_storage() for t in reachable_tensors(root))
    return {st.data_ptr(): st.nbytes() for st in storages if st.data_ptr() not in skip}


def held_bytes(root: Any, skip: frozenset[int] | set[int] = frozenset()) -> int:
    """The bytes of :func:`held_storages`."""
    return sum(held_storages(root, skip).values())


class PeakBytes(TorchDispatchMode):
    """``with PeakBytes() as m: ...``: ``m.live`` bytes of the storages allocated by torch operations inside the
    block that are still referenced, ``m.peak`` the largest ``live`` seen (a storage counts from the operation
    that allocates it until its last tensor, views included, is gone). Storages that existed before the block
    are not counted, nor what an in-place or ``out=`` operation writes into them."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}  # storage address -> live tensors on it
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for i, t in enumerate(tree_leaves(out)):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            fresh = i < len(returns) and returns[i].alias_info is None
            if key in self._refs or (fresh and key not in self._sizes):
                self._hold(t, key)
        return out

    def _hold(self, t: torch.Tensor, key: int) -> None:
        if key not in self._refs:
            self._refs[key] = 0
            self._sizes[key] = t.untyped_storage().nbytes()
            self.live += self._sizes[key]
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._sizes.pop(key)


MALLOC_SETTINGS = {"M_MMAP_THRESHOLD": (-3, 32 << 20), "M_TRIM_THRESHOLD": (-1, 512 << 20), "M_TOP_PAD": (-2, 64 << 20)}
"""glibc ``mallopt`` parameters (number, value) of :func:`keep_freed_memory`: blocks up to 32 MiB (glibc's largest
mmap threshold) from the heap, freed memory kept until 512 MiB of it sit unused at the heap's top, the heap grown
64 MiB beyond a request."""
_KEPT: list[bool] = []


def keep_freed_memory() -> bool:
    """Make glibc's ``malloc`` keep freed memory for the next allocation instead of returning it to the kernel
    (:data:`MALLOC_SETTINGS`), once per process; True when set (False off glibc, e.g. macOS, or where ``mallopt``
    refuses).

    By default glibc serves every block above a dynamic threshold (128 KiB at first) with a fresh ``mmap`` and
    returns it on ``free``, and trims the heap's top beyond twice that: on the CPU, a PACE step's float32
    temporaries (a layer's dequantised state for the batch: megabytes) then cost a page fault per 4 KiB page on
    every step, more than their arithmetic. tcmalloc, which vLLM preloads where it finds it, keeps them; this is
    the same for processes that run without it. The memory kept is bounded by the largest workspace a step needs
    plus the trim threshold."""
    if _KEPT:
        return _KEPT[0]
    ok = False
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = all(libc.mallopt(number, value) == 1 for number, value in MALLOC_SETTINGS.values())
    _KEPT.append(ok)
    return ok
