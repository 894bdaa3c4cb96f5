"""kernels.records: a state pool's full slots listed on the device and their records forgotten (interpreted on the
CPU, compiled with ``PACE_KERNEL_TESTS=cuda``), against pace_core.buffer's count of the records each slot holds."""

from __future__ import annotations

import pytest
import torch
from kernels_support import DEVICE, kernel_modules

from pace_core.buffer import EMPTY, records_held

pytestmark = pytest.mark.numerics

KERNELS = kernel_modules()


def _pool_decays(slots: int, cap: int, HV: int, page: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log decays ``[slots, cap, HV]`` as a view of pages of ``page`` floats (an engine's slot stride), each slot
    holding a random count of records (negative decays first, then EMPTY), a third of them full; and the pages."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):  # drawn on the CPU (the GPU run sets CUDA as the default device)
        held = torch.randint(0, cap, (slots,), generator=gen)
        held[torch.randperm(slots, generator=gen)[: slots // 3]] = cap
        decays = torch.full((slots, cap, HV), EMPTY)
        filled = torch.arange(cap)[None, :] < held[:, None]
        decays[filled] = -torch.rand(int(filled.sum()), HV, generator=gen)
        pages = torch.zeros(slots, page)
        pages[:, : cap * HV] = decays.reshape(slots, -1)
    pages = pages.to(DEVICE)
    return pages[:, : cap * HV].view(slots, cap, HV), pages


@pytest.mark.parametrize("slots,B", [(5, 1), (9, 6), (300, 290)])  # 290 rows: more than one 256-row block
def test_full_slots_are_listed_in_row_order_and_forgotten(slots: int, B: int) -> None:
    """``full_slots`` lists exactly the rows whose slots hold ``cap`` records, in the rows' order, with their count;
    ``forget_full`` sets those slots' decays (every head) to EMPTY and leaves every other float of the pages as it
    was (the same values: nothing else is written)."""
    cap, HV = 8, 3
    decays, pages = _pool_decays(slots, cap, HV, cap * HV + 5, seed=slots)
    rows = torch.randperm(slots, generator=torch.Generator().manual_seed(B), device="cpu")[:B].to(DEVICE)
    expected = [int(s) for s in rows.cpu() if records_held(decays.cpu()[s : s + 1]).item() == cap]
    assert 0 < len(expected) < B or B == 1
    full = KERNELS["records"].full_slots(decays, rows)
    assert full.shape == (1 + B,) and full.dtype == torch.int64
    assert int(full[0]) == len(expected)
    assert full[1 : 1 + len(expected)].tolist() == expected

    before = pages.to("cpu", copy=True)
    KERNELS["records"].forget_full(decays, full)
    forgotten = torch.zeros(slots, dtype=torch.bool, device="cpu")
    forgotten[expected] = True
    after = decays.cpu()
    assert bool((after[forgotten] == EMPTY).all())
    held_before = before[:, : cap * HV].view(slots, cap, HV)
    assert torch.equal(after[~forgotten], held_before[~forgotten])
    assert torch.equal(pages.cpu()[:, cap * HV :], before[:, cap * HV :])  # the rest of each page untouched
    assert records_held(after).tolist() == [0 if f else int(n) for f, n in zip(forgotten, records_held(held_before))]
