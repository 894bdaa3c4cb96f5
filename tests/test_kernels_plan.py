"""kernels.plan's choice of the Gluon kernels, on CPU: plans are built for the GPU's bfloat16 operands (as
kernels/bench/sass.py builds them) at Qwen3.5's head size K = V = 128, and the launches that take
kernels.gluon_dots / kernels.gluon_flush / kernels.gluon_step are exactly those of the formats the GPU tests check
against the Triton kernels (tests/test_kernels_decode.py); every other launch keeps the Triton kernel."""

from __future__ import annotations

import pytest
import torch
from kernels_support import kernel_modules

from kernels.settings import Launch, SplitSettings
from pace_core.backend import REFERENCE
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.methods import state_format
from pace_core.schedule import PeriodicState

plan_mod = kernel_modules()["plan"]
B, H, HV, K = 2, 2, 8, 128


def _state(name: str, **changes) -> PeriodicState:
    """One layer's state of configuration ``name`` (PACE-4/8: every fourth head at 8 bits), K = V = 128."""
    cfg = get_config(name).replace(**changes)
    if cfg.high_share:
        cfg = cfg.replace(high_heads=(tuple(range(1, HV, 4)),))
    fmt = state_format(cfg, cfg.head_bits(0, HV))
    st = PeriodicState(fmt, REFERENCE, (B, H, HV, K, K), torch.device("cpu"), prefill_period=256,
                       decode_period=cfg.decode_period, buffer=cfg.buffer_format, exact_current=cfg.exact_current_token)
    st.set_checkpoint(REFERENCE.store(fmt, torch.randn(B, HV, K, K) * 0.1)[0])
    return st


def _plan(st: PeriodicState, **settings) -> plan_mod.DecodePlan:
    return plan_mod.plan_decode(st.checkpoint, st.buffer, st.exact_current, Launch.of(SplitSettings(**settings)),
                                bf16=True)


def _gluon(plan: plan_mod.DecodePlan, per_part: bool, kernel: str) -> list[bool]:
    """Whether each launch (one, or per width) of the dots or the flush runs the Gluon kernel."""
    return [getattr(launch, kernel) for launch in plan.split.launches[per_part]]


@pytest.mark.parametrize("name,per_part,flush,dots", [
    ("pace-4", True, [True], [True]), ("pace-4", False, [True], [True]),
    ("pace-4-8", True, [True, False], [True, False]),  # per width: the 4-bit heads on Gluon, the 8-bit on Triton
    ("pace-4-8", False, [False], [False]),  # one launch for both widths
])
def test_gluon_kernels_take_the_checked_formats(name: str, per_part: bool, flush: list, dots: list) -> None:
    plan = _plan(_state(name), per_part=per_part, dots_per_part=per_part)
    assert _gluon(plan, per_part, "gluon_flush") == flush and _gluon(plan, per_part, "gluon_dots") == dots
    off = _plan(_state(name), per_part=per_part, dots_per_part=per_part, gluon_flush=False, gluon_dots=False)
    assert not any(_gluon(off, per_part, "gluon_flush")) and not any(_gluon(off, per_part, "gluon_dots"))
    cpu = plan_mod.plan_decode(_state(name).checkpoint, _state(name).buffer, True,
                               Launch.of(SplitSettings(per_part=per_part)))
    assert not any(_gluon(cpu, per_part, "gluon_flush"))  # float32 operands (the interpreter): the Triton kernels


@pytest.mark.parametrize("name,changes,gluon", [
    ("pace-4", {}, True), ("pace-4", {"group_size": 16}, True), ("pace-4", {"decode_period": 6}, True),
    ("pace-4", {"decode_period": 4}, False),  # another record block than the GPU test's 8 slots
    ("pace-4", {"decode_period": 16}, False),
    ("pace-4", {"exact_current_token": False}, False),  # the current token from its stored record
    ("pace-4", {"buffer": "bf16"}, False), ("pace-4", {"symmetric": False}, False),
    ("pace-4-8", {}, False),  # two widths: the dots per width, the records over all heads
])
def test_gluon_step_takes_the_checked_format(name: str, changes: dict, gluon: bool) -> None:
    """The one-kernel Gluon step takes PACE-4's format (the GPU test's) and is then the step's default; elsewhere
    the step stays on the Triton kernels, and on the dots and record kernels unless in one wave."""
    plan = _plan(_state(name, **changes))
    assert plan.split.gluon_step == gluon and plan.split.settings.fused_step == gluon
    assert not _plan(_state(name, **changes), gluon_step=False).split.gluon_step
    cpu = plan_mod.plan_decode(_state(name).checkpoint, _state(name).buffer, True)
    assert not cpu.split.gluon_step and not cpu.split.settings.fused_step


@pytest.mark.parametrize("name,changes", [
    ("pace-4", {"buffer": "fp32"}),  # float records
    ("pace-4", {"buffer": "bf16"}),
    ("pace-4", {"decode_period": 20}),  # more records than 16 slots
    ("pace-4", {"group_size": 128}),  # a key group wider than the 64-row tile
    ("pace-4", {"symmetric": False}),  # zero points with int8 records: not checked on the GPU
    ("pace-4-8", {"buffer_key_group": 32}),  # PACE-4/8's keys in other groups than 16
    ("pace-4-8", {"decode_period": 12}),  # more than 8 records of 4-bit keys
])
def test_other_formats_keep_the_triton_flush(name: str, changes: dict) -> None:
    plan = _plan(_state(name, **changes), per_part=True)
    assert not any(_gluon(plan, True, "gluon_flush"))


@pytest.mark.parametrize("name,settings,refused", [
    ("pace-4-8", {"flush_columns": 64}, True), ("pace-4-8", {"flush_columns": 32}, True),  # key records in groups of 16
    ("pace-4-8", {"flush_warps": 2}, True), ("pace-4-8", {}, False), ("pace-4-8", {"step_warps": 8}, False),
    ("pace-4", {"flush_columns": 32, "flush_warps": 2}, False), ("pace-4", {"flush_columns": 64}, False),  # one group
])
def test_flush_tiles_that_fold_wrong_on_the_gpu_are_refused(name: str, settings: dict, refused: bool) -> None:
    """plan_decode refuses a flush layout other than the default where key records come in groups narrower than its
    tile, with tensor-core operands (kernels.plan.check_flush_tile: wrong checkpoints on an H100); float32 operands
    (the interpreter) and the other formats plan as asked."""
    st = _state(name)
    given = SplitSettings(**settings)
    if refused:
        asked = f"flush_columns={given.flush_columns}, flush_warps={given.flush_warps}"
        with pytest.raises(PaceError, match=rf"{asked} not allowed where key records come in groups of 16 rows.*"
                                            r"allowed: flush_columns >= 128 with flush_warps=4"):
            _plan(st, **settings)
    else:
        assert _plan(st, **settings).split.settings.flush_columns == given.flush_columns
    cpu = plan_mod.plan_decode(st.checkpoint, st.buffer, True, Launch.of(given))
    assert (cpu.split.settings.flush_columns, cpu.split.settings.flush_warps) == (given.flush_columns,
                                                                                   given.flush_warps)
