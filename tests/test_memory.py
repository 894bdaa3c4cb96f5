"""pace_core.memory: bytes held by objects and the peak bytes allocated in a block, on allocations whose sizes are
known."""

from dataclasses import dataclass

import torch

from pace_core.memory import PeakBytes, held_bytes, held_storages


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
    obj = Holder(base, {"view": base[2:5], "list": [other, (base.T,)], "slots": Slotted(torch.ones(2, dtype=torch.int16))})
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
