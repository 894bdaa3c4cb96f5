"""kernels.pool_step: a state pool's in-place decode step on the kernels (interpreted on the CPU, compiled with
``PACE_KERNEL_TESTS=cuda``) against the pool's reference step over random schedules: random slot orders, rows at
every position of their buffer, flush boundaries, B = 1 to every slot (tests/pool_support.py, whose module docstring
derives the tolerances: the kernels compute in float32 in another order, as the fused CPU step does)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernels_support import DEVICE, ON_GPU, kernel_modules
from pool_support import SLOTS, pools, run_schedule, token

from kernels.settings import Launch, SplitSettings
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.pool import StatePool

pytestmark = pytest.mark.numerics

KERNELS = kernel_modules()
DIMS = (2, 4, 128, 128) if ON_GPU else (2, 4, 64, 32)
"""Key heads, value heads, K, V: PACE-4's key groups of 64 and 4-bit rows of 16 bytes at least (the one-kernel
step's narrowest) on the CPU; Qwen3.5's head width on the GPU."""


@pytest.mark.parametrize("name", ["pace-4", "pace-4-8", "pace-3", "fp32", "bf16"])
def test_in_place_step_is_the_reference_step(name: str) -> None:
    """The buffered packed checkpoints (the step, then the flush of the rows the token fills) and the dense states at
    dP = 1 (the per-token recurrence), two buffers' worth of random batches."""
    run_schedule(name, DIMS, 2 * 8 + 2, seed=5, backend="triton", device=DEVICE)


@pytest.mark.parametrize("name,settings", [
    ("pace-4", dict(step_warps=8, gluon_step=False, gluon_flush=False, flush_columns=DIMS[3] // 4, flush_warps=2)),
    ("pace-4", dict(gluon_step_warps=2)),
    ("pace-4", dict(step_folds=True)),
    ("pace-4-8", dict(step_warps=8, per_part=True)),
])
def test_the_step_takes_its_launch_settings(name: str, settings: dict) -> None:
    """Other launch settings reach the in-place step and step as the reference does: more warps per step program,
    PACE-4's Triton step and flush where a GPU would run its Gluon ones (kernels.gluon_step, kernels.gluon_flush; on
    the GPU by default) and more flush programs per head with fewer warps each, the Gluon step's value columns over 2
    warps, the Gluon step folding the slots it fills (kernels.plan.step_folds_apply); PACE-4/8's flush launched per
    bit width (its 4-bit heads on the Gluon flush on a GPU; one launch over both widths never is). PACE-4/8's other
    flush layouts are refused on the GPU (kernels.plan.check_flush_tile)."""
    split = SplitSettings(**settings)
    launch = Launch(split=split)
    fast, _ = pools(name, DIMS, "triton", DEVICE, launch=launch)
    plan = fast.in_place.plan.split
    assert plan.settings == dataclasses.replace(plan.settings, **settings)
    assert plan.gluon_step == (ON_GPU and name == "pace-4" and split.gluon_step)
    assert plan.per_width[0].gluon_flush == (ON_GPU and split.gluon_flush)  # PACE-4's part, PACE-4/8's 4-bit one
    assert plan.step_folds == (plan.gluon_step and split.step_folds)
    run_schedule(name, DIMS, 8 + 2, seed=7, backend="triton", device=DEVICE, launch=launch)
    if ON_GPU and name == "pace-4-8":
        with pytest.raises(PaceError, match="flush_warps=2 not allowed where key records come in groups of 16"):
            pools(name, DIMS, "triton", DEVICE, launch=Launch(split=SplitSettings(flush_warps=2)))


@pytest.mark.parametrize("name", ["rtn-int4", "pace-4-sr"])
def test_what_the_kernels_cannot_step_in_place_steps_by_count_groups(name: str) -> None:
    """A packed checkpoint at dP = 1 (its kernel writes new storage) and a configuration the kernels do not run at
    all: no in-place step, and the pool says why (on a GPU; on a CPU, why not the fused CPU step)."""
    pool = StatePool(get_config(name), (2, 4, 64, 64), SLOTS, DEVICE, backend="triton")
    assert pool.in_place is None
    why = "the reference has no in-place pool step" if name == "pace-4-sr" else \
        "a packed checkpoint at dP = 1 is rewritten to new storage by its kernel"
    assert pool.step == f"{pool.steps.name} ({why if ON_GPU else 'the backend setting is not auto'})"
    assert pool._in_place[1] == why


@pytest.mark.parametrize("name", ["pace-4-8", "bf16"])
def test_an_engines_pages_step_in_place(name: str) -> None:
    """A pool over an engine's rows of bytes (vLLM's pages: every field a view with the page as its slot stride)."""
    run_schedule(name, DIMS, 8 + 2, seed=6, backend="triton", device=DEVICE, pages=True)


def test_the_step_reads_nothing_on_the_host() -> None:
    """No device-to-host read (a CUDA graph's capture refuses one): the step's tensors stay on their device and no
    count is read with ``tolist``/``item``."""
    fast, _ = pools("pace-4", DIMS, "triton", DEVICE)
    slots = torch.tensor([3, 0, 5], device=DEVICE)
    x = [y.to(DEVICE) for y in token(DIMS, 3, torch.Generator().manual_seed(2))]
    reads = []
    original = torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__
    torch.Tensor.tolist = lambda t: reads.append("tolist") or original[0](t)
    torch.Tensor.item = lambda t: reads.append("item") or original[1](t)
    torch.Tensor.__bool__ = lambda t: reads.append("bool") or original[2](t)
    try:
        with torch.no_grad():
            fast.in_place.decode(slots, *x)
    finally:
        torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__ = original
    assert reads == []
    assert KERNELS["pool_step"].PoolStep is type(fast.in_place)
