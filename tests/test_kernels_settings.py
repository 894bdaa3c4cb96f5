"""kernels.settings: each kernel family's launch settings are validated when made (a PaceError naming the setting and
what is allowed), resolve their "auto" choices as documented, and reach the launch plan."""

from __future__ import annotations

import pytest
import torch
from kernels_support import kernel_modules

from kernels.settings import AUTO, FusedSettings, Launch, RecurrentSettings, SplitSettings
from pace_core.backend import REFERENCE
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.methods import state_format
from pace_core.schedule import PeriodicState

plan_mod = kernel_modules()["plan"]


@pytest.mark.parametrize("make,field,bad", [
    (SplitSettings, "step_warps", 3), (SplitSettings, "dots_warps", 32), (SplitSettings, "record_warps", True),
    (SplitSettings, "dots_columns", 48), (SplitSettings, "flush_columns", 0), (SplitSettings, "fused_step", "yes"),
    (SplitSettings, "per_part", None), (SplitSettings, "gluon_dots", 1), (SplitSettings, "step_maxnreg", 300),
    (SplitSettings, "flush_maxnreg", 16), (SplitSettings, "flush_row_blocks", 3),
    (SplitSettings, "gluon_step_warps", 8), (SplitSettings, "dots_ahead", 3),
    (FusedSettings, "rows", 24), (FusedSettings, "num_warps", 5), (RecurrentSettings, "block_v", 12),
    (RecurrentSettings, "num_warps", 0)])
def test_a_setting_out_of_range_is_refused_by_name(make, field: str, bad) -> None:
    with pytest.raises(PaceError, match=rf"{make.__name__}\.{field}={bad!r} not allowed; allowed: "):
        make(**{field: bad})


def test_auto_settings_resolve_by_wave_and_gluon_step() -> None:
    auto = SplitSettings()
    assert (auto.fused_step, auto.dots_per_part, auto.per_part) == (AUTO, AUTO, AUTO)
    one = auto.resolved(one_wave=True, gluon_step=False)
    assert (one.fused_step, one.dots_per_part, one.per_part) == (True, False, False)
    many = auto.resolved(one_wave=False, gluon_step=False)
    assert (many.fused_step, many.dots_per_part, many.per_part) == (False, True, True)
    assert auto.resolved(one_wave=False, gluon_step=True).fused_step is True
    fixed = SplitSettings(fused_step=False, per_part=False, dots_per_part=True)
    assert fixed.resolved(one_wave=True, gluon_step=True) == fixed  # what is set stays


def test_launch_of_puts_a_familys_settings_in_its_place() -> None:
    split, fused, rec = SplitSettings(step_warps=8), FusedSettings(rows=64), RecurrentSettings(block_v=64)
    assert Launch.of(split) == Launch(split=split) and Launch.of(fused) == Launch(fused=fused)
    assert Launch.of(rec) == Launch(recurrent=rec) and Launch.of(None) == Launch()
    with pytest.raises(PaceError, match="allowed: SplitSettings, FusedSettings, RecurrentSettings"):
        Launch.of({"step_warps": 8})


def _state(name: str, **changes) -> PeriodicState:
    cfg = get_config(name).replace(group_size=8, decode_period=4, **changes)
    if cfg.high_share:
        cfg = cfg.replace(high_heads=((1,),))
    B, H, HV, K, V = 2, 2, 4, 16, 32
    fmt = state_format(cfg, cfg.head_bits(0, HV) if cfg.quantized else (cfg.bits,) * HV)
    st = PeriodicState(fmt, REFERENCE, (B, H, HV, K, V), torch.device("cpu"), prefill_period=8,
                       decode_period=cfg.decode_period, buffer=cfg.buffer_format, exact_current=cfg.exact_current_token)
    st.set_checkpoint(REFERENCE.store(fmt, torch.randn(B, HV, K, V))[0])
    return st


def test_plan_carries_typed_arguments() -> None:
    """The split plan's settings are the launch's, resolved; its launches' checkpoint arguments are the parts' storage
    (one launch over all heads through the head table, one per width over that width's heads), with the layouts'
    constexprs; the records are the buffer's live storage."""
    st = _state("pace-4-8")
    plan = plan_mod.plan_decode(st.checkpoint, st.buffer, True, Launch.of(SplitSettings(step_warps=2)))
    sp = plan.split
    assert sp.settings.step_warps == 2 and AUTO not in (sp.settings.fused_step, sp.settings.per_part)
    (one,), per_width = sp.launches
    assert one.ckpt.two and not one.ckpt.mapped and one.heads == 4 and one.ckpt.heads == (3, 1)
    assert [w.ckpt.parts[0].layout.bits for w in per_width] == [4, 8] and all(w.ckpt.mapped for w in per_width)
    assert [w.heads for w in per_width] == [3, 1]
    assert per_width[1].ckpt.parts[0].codes is st.checkpoint.parts[8].codes
    args = one.ckpt.args()
    assert len(args) == 10 and args[-2:] == (3, 1) and args[2] is st.checkpoint.parts[4].codes
    c = sp.constexprs(one, 16, 32)
    assert (c["TWO"], c["MAPPED"], c["BITS0"], c["BITS1"], c["G"], c["SYM"]) == (True, False, 4, 8, 8, False)
    live = st.buffer.storage()
    assert plan.records.keys is live["keys"] and plan.records.log_decays is live["log_decays"]
    assert plan.records.layout.constexprs()["KBITS"] == 4 and plan.fused is None
    dense = _state("bf16", buffer="bf16")
    fused = plan_mod.plan_decode(dense.checkpoint, dense.buffer, True, Launch.of(FusedSettings(rows=8, num_warps=2)))
    assert fused.split is None and (fused.fused.rows, fused.fused.num_warps, fused.fused.dense) == (8, 2, True)
