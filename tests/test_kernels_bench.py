"""kernels/bench/bench.py's harness on the CPU (its timings come from the GPU machine): every variant's
layers compute the decode step they claim, run by the Triton interpreter at small shapes with the
CUDA-graph timer replaced by one direct call."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernels_support import kernel_modules

from kernels.settings import SplitSettings
from pace_core.provenance import measurement
from pace_core.recurrence import gdn_recurrent
from pace_core.version import code_commit

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def bench(monkeypatch):
    kernel_modules()
    import kernels.bench.bench as module

    module = importlib.reload(module)
    for name, value in (("LAYERS", 2), ("H", 2), ("HV", 4), ("K", 64), ("V", 32)):
        monkeypatch.setattr(module, name, value)
    # one direct call instead of the timed replays: 1 ms each, the one-kernel step alone 3 ms (slower than the dots and
    # record kernels together, so that the defaults are each kernel's fastest and no combination is timed besides)
    monkeypatch.setattr(module, "time_graph", lambda work, reps, layers: [work(), 3e-3 if work.__name__ == "step"
                                                                           else 1e-3][1:] * reps)
    every = module.configs
    monkeypatch.setattr(module, "configs", lambda variant: every(variant)[:2])  # two settings: the interpreter is slow
    return module


def _period_reference(S0, q, k, v, g, beta, period):
    S = S0.double()
    for _ in range(period):  # the bench feeds every layer the same token dP times
        o, S = gdn_recurrent(*(x[:, None].double() for x in (q, k, v, g, beta)), initial_state=S)
    return o[:, 0], S


@pytest.mark.parametrize("variant", ["fp32 per-token", "bf16 per-token", "fla fused_recurrent (fp32 state)"])
def test_per_token_variants_compute_the_recurrence(bench, variant):
    if variant == bench.FLA:
        _fla_in_a_fresh_interpreter(variant)
        return
    layers, nbytes = bench.build(variant, 2, torch.device("cpu"))
    state_of = (lambda st: st[0]) if variant == bench.FLA else (lambda st: st)
    _, state, x, out = layers[0]
    S0 = state_of(state).clone()
    bench.run_period(layers, bench.configs(variant)[0])
    o_ref, S_ref = _period_reference(S0.float(), *(t[:, 0] if variant == bench.FLA else t for t in x), bench.PERIOD)
    tol = 1e-5 if variant != "bf16 per-token" else 2e-2
    assert float((out.double() - o_ref).norm() / o_ref.norm()) < tol
    assert float((state_of(state).double() - S_ref).norm() / S_ref.norm()) < tol
    assert nbytes == bench.LAYERS * (2 * S0.numel() * S0.element_size() + bench._io_bytes(2))


def test_per_token_pace_variant_rounds_every_token(bench):
    """PACE-4 dP=1: each of the dP tokens from the checkpoint, the state stored in PACE-4's format after
    each (float64 recurrence, pace_core.quant's rounding). The kernel's float32 dots can put an entry one
    code away where a state lies within float32 rounding of a boundary, so the state is compared to 1e-2
    of its norm (a 4-bit code step of a group is about 1/7 of its max) and the rounding is shown to matter:
    the unrounded recurrence is further away."""
    from pace_core.quant import fake_quantize

    layers, nbytes = bench.build(bench.DP1, 2, torch.device("cpu"))
    _, st, x, out = layers[0]
    spec = bench.buffered_config(bench.DP1).quant_spec()
    S0 = st.loaded().double()
    bench.run_period(layers, bench.configs(bench.DP1)[0])
    S, S_plain = S0, S0
    for _ in range(bench.PERIOD):
        o, S = gdn_recurrent(*(t[:, None].double() for t in x), initial_state=S)
        S = fake_quantize(S, spec, torch.float64)
        _, S_plain = gdn_recurrent(*(t[:, None].double() for t in x), initial_state=S_plain)
    got = st.loaded().double()
    err = float((got - S).norm() / S.norm())
    assert err < 1e-2
    assert float((got - S_plain).norm() / S_plain.norm()) > 3 * err
    assert float((out.double() - o[:, 0]).norm() / o.norm()) < 1e-2
    assert st.buffer is None
    assert nbytes == bench.LAYERS * (2 * st.checkpoint.nbytes() + bench._io_bytes(2))


@pytest.mark.parametrize("variant", ["bf16 per-token", "PACE-4 dP=8", "PACE-4 dP=1"])
def test_each_replay_starts_from_the_kept_state(bench, variant):
    """keep_memory: after a period and the restore, a second period computes exactly the first one's output and
    state (the same kernels on the same inputs), where without the restore it starts from the state the first
    left (and a state rounded every token drifts on: the overflow the bench once stopped at)."""
    layers, _ = bench.build(variant, 2, torch.device("cpu"))
    _, state, _, out = layers[0]
    loaded = (lambda: state.clone()) if variant == "bf16 per-token" else state.loaded
    restore = bench.keep_memory(layers)
    config = bench.configs(variant)[0]
    bench.run_period(layers, config)
    first_out, first_state = out.clone(), loaded()
    restore()
    bench.run_period(layers, config)
    assert torch.equal(out, first_out) and torch.equal(loaded(), first_state)
    bench.run_period(layers, config)
    assert not torch.equal(loaded(), first_state)


def test_a_variant_that_cannot_run_gets_a_row_that_says_why(bench, monkeypatch):
    from pace_core.errors import PaceError

    def refuse(variant, B, device, reps):
        raise PaceError("a group's fp16 scale overflows (sequence 138)")

    monkeypatch.setattr(bench, "time_variant", refuse)
    row = bench.measure(bench.DP1, 16, torch.device("cpu"), 2, 1e12)
    assert row == {"variant": bench.DP1, "batch": 16,
                   "error": "PaceError: a group's fp16 scale overflows (sequence 138)"}
    assert "did not run: PaceError" in bench.row_line(row)


@pytest.mark.parametrize("variant", ["bf16 buffered dP=8", "PACE-4 dP=8", "PACE-3 dP=8"])
def test_buffered_period_is_the_schedules(bench, variant):
    """A buffered layer's period in the harness (the backend's step writing into the layer's output) is the
    schedule's decode of the same tokens: the same output and checkpoint (the same kernels on the same inputs),
    the buffer flushed after the period's last token."""
    import copy

    layers, _ = bench.build(variant, 2, torch.device("cpu"))
    _, st, (q, k, v, g, beta), out = layers[0]
    twin = copy.deepcopy(st)
    bench.run_period(layers, bench.configs(variant)[0])
    twin.steps = st.steps
    for _ in range(bench.PERIOD):
        o = twin.decode(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None])[:, 0]
    assert torch.equal(out, o)
    assert len(st.buffer) == len(twin.buffer) == 0
    assert torch.equal(st.loaded(), twin.loaded())


@pytest.mark.parametrize("variant", ["bf16 buffered dP=8", "PACE-4 dP=8", "PACE-4/8 dP=8"])
def test_buffered_variants_run_and_report(bench, variant):
    row = bench.time_variant(variant, 2, torch.device("cpu"), 2)
    assert row["outputs_finite"] and row["seconds_per_token"] == pytest.approx(1e-3 / bench.PERIOD)
    tried = [t["config"] for t in row["tried"]]
    assert tried[:len(bench.configs(variant))] == bench.configs(variant) and all(t["agrees"] for t in row["tried"])
    if variant in bench.SPLIT_VARIANTS:  # and the combination of each kernel's fastest, where no configuration is it
        assert tried[len(bench.configs(variant)):] in ([], [bench.best_split_combination(row["tried"])])
        assert row["split_breakdown"] == {"step_seconds": 3e-3, "dots_seconds": 1e-3, "records_seconds": 1e-3,
                                          "flush_seconds": 1e-3, "records_at_step": bench.PERIOD // 2}
        assert all(t["split_breakdown"] == row["split_breakdown"] for t in row["tried"])
    else:
        assert row["split_breakdown"] is None


def _split_config(i: int) -> SplitSettings:
    """A split-path launch configuration whose every setting differs from another index's."""
    return SplitSettings(fused_step=i % 2 == 0, step_warps=2 << i, dots_columns=16 << i, dots_warps=1 << i,
                         record_warps=4 >> i, flush_warps=8 >> i, flush_columns=32 << i, dots_per_part=i == 1,
                         per_part=i == 2, gluon_dots=i != 1, gluon_flush=i == 2, gluon_step=i == 0,
                         gluon_step_warps=4 >> i, dots_ahead=2 << i, step_maxnreg=(None, 80, 96)[i],
                         dots_maxnreg=(128, None, 96)[i], flush_maxnreg=(96, 80, None)[i], flush_row_blocks=4 >> i)


def _breakdown(step, dots, records, flush) -> dict:
    return {"step_seconds": step, "dots_seconds": dots, "records_seconds": records, "flush_seconds": flush,
            "records_at_step": 4}


def test_best_split_combination_takes_each_kernels_fastest_options(bench):
    configs = [_split_config(i) for i in range(3)]
    times = [(5e-3, 3e-3, 1e-3, 9e-3), (4e-3, 1e-3, 2e-3, 8e-3), (6e-3, 2e-3, 3e-3, 7e-3)]
    tried = [{"config": c, "split_breakdown": _breakdown(*t)} for c, t in zip(configs, times)]
    assert bench.best_split_combination(tried) == SplitSettings(
        fused_step=False, step_warps=configs[1].step_warps, gluon_step=False,  # 4 ms > 1 + 1 ms
        gluon_step_warps=configs[1].gluon_step_warps, dots_ahead=configs[1].dots_ahead,
        step_maxnreg=configs[1].step_maxnreg, dots_columns=configs[1].dots_columns, dots_warps=configs[1].dots_warps,
        dots_per_part=True, gluon_dots=False, dots_maxnreg=configs[1].dots_maxnreg,
        record_warps=configs[0].record_warps, flush_warps=configs[2].flush_warps,
        flush_columns=configs[2].flush_columns, per_part=True, gluon_flush=True, flush_maxnreg=configs[2].flush_maxnreg,
        flush_row_blocks=configs[2].flush_row_blocks)
    tried[2]["split_breakdown"]["step_seconds"] = 1.5e-3
    best = bench.best_split_combination(tried)
    assert best.fused_step and best.step_warps == configs[2].step_warps and not best.gluon_step
    for r in tried:  # heads too narrow for the one-kernel step
        r["split_breakdown"]["step_seconds"] = None
    assert not bench.best_split_combination(tried).fused_step
    tried[1]["agrees"] = False  # a configuration whose outputs disagree gives no option
    assert bench.best_split_combination(tried).dots_columns == configs[2].dots_columns


def test_split_variant_also_times_the_combination(bench, monkeypatch):
    configs = [_split_config(i) for i in range(2)]
    times = {c.dots_warps: t for c, t in zip(configs, [(5e-3, 1e-3, 3e-3, 9e-3), (4e-3, 2e-3, 1e-3, 8e-3)])}
    monkeypatch.setattr(bench, "configs", lambda variant: configs)
    monkeypatch.setattr(bench, "split_breakdown", lambda layers, config, reps: _breakdown(*times.get(
        config.dots_warps, (4e-3, 1e-3, 1e-3, 8e-3))))
    monkeypatch.setattr(bench, "period_outputs", lambda layers, config, restore: [torch.ones(3), torch.ones(2)])
    row = bench.time_variant("PACE-4 dP=8", 2, torch.device("cpu"), 1)
    combined = bench.best_split_combination(row["tried"][:2])
    assert [t["config"] for t in row["tried"]] == [*configs, combined]
    assert combined.dots_warps == configs[0].dots_warps and combined.record_warps == configs[1].record_warps


def _fla_in_a_fresh_interpreter(variant: str) -> None:
    """The fla baseline checked like the others, in a child process that sets ``TRITON_INTERPRET``
    before anything imports flash-linear-attention (in this process transformers may already have
    compiled-mode fla kernels loaded)."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    script = f"""
import sys, torch
sys.path[:0] = {[str(ROOT), str(ROOT / "tests")]!r}
import kernels.bench.bench as bench
from test_kernels_bench import _period_reference
bench.LAYERS, bench.H, bench.HV, bench.K, bench.V = 2, 2, 4, 64, 32
layers, nbytes = bench.build({variant!r}, 2, torch.device("cpu"))
_, state, x, out = layers[0]
S0 = state[0].clone()
bench.run_period(layers, {{}})
o_ref, S_ref = _period_reference(S0, *(t[:, 0] for t in x), bench.PERIOD)
print(float((out.double() - o_ref).norm() / o_ref.norm()), float((state[0].double() - S_ref).norm() / S_ref.norm()))
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    rel_o, rel_s = map(float, run.stdout.split()[-2:])
    assert rel_o < 1e-5 and rel_s < 1e-5


def test_a_configuration_that_computes_something_else_is_left_out(bench, monkeypatch):
    """A configuration whose outputs (one period from the kept state) are off by more than the agreement bound is
    timed and kept in the row's tried list, marked, but never the row's fastest, nor an option of the combination."""
    configs = [_split_config(i) for i in range(3)]
    monkeypatch.setattr(bench, "configs", lambda variant: configs)
    wrong = configs[1]
    monkeypatch.setattr(bench, "period_outputs", lambda layers, config, restore: [torch.ones(4) * (
        1.5 if config == wrong else 1.0 + 1e-4 * (config == configs[2])), torch.ones(2)])
    fast = {c.dots_warps: t for c, t in zip(configs, [2e-3, 1e-3, 3e-3])}  # the wrong one is the fastest
    monkeypatch.setattr(bench, "time_config", lambda layers, config, reps: [fast.get(config.dots_warps, 4e-3)] * reps)
    monkeypatch.setattr(bench, "split_breakdown", lambda layers, config, reps: _breakdown(
        *(fast.get(config.dots_warps, 4e-3),) * 4))
    row = bench.time_variant("PACE-4 dP=8", 2, torch.device("cpu"), 1)
    assert [t["agrees"] for t in row["tried"][:3]] == [True, False, True]
    assert row["tried"][2]["distance"] == pytest.approx(1e-4, rel=1e-3)  # float32 outputs
    assert row["tried"][1]["distance"] == pytest.approx(0.5)
    assert row["config"] == configs[0] and row["seconds_per_token"] == 2e-3 and row["disagreeing"] == [wrong]
    assert bench.best_split_combination(row["tried"]).dots_warps != wrong.dots_warps
    assert "1 configuration(s) disagree, left out" in bench.row_line({**row, "hbm_fraction": 0.5})


def test_outputs_agree_within_the_bound_only():
    """Outputs and states each within the bound (a wrong flush shows in the states only)."""
    gen = torch.Generator().manual_seed(0)
    ref = [torch.randn(100, dtype=torch.float64, generator=gen), torch.randn(50, dtype=torch.float64, generator=gen)]
    agree = bench_module().outputs_agree
    assert agree([ref[0] * (1 + 1e-3), ref[1]], ref)[0]
    assert not agree([ref[0] * 1.1, ref[1]], ref)[0]
    assert not agree([ref[0], ref[1] * 1.1], ref)[0]
    assert agree([ref[0], ref[1] * 1.1], ref)[1] == pytest.approx(0.1)
    assert not agree([torch.full_like(ref[0], float("nan")), ref[1]], ref)[0]


def bench_module():
    kernel_modules()
    import kernels.bench.bench as module

    return module


def test_main_writes_the_rows_and_stops_at_its_deadline(bench, monkeypatch, tmp_path):
    """The command line on the CPU (interpreter, small shapes, the timer replaced): bench.json holds every row with its
    launch settings as their fields, the provenance, and the batches a deadline left out (the first batch always
    runs). The split variants' rows through the command line: tests/test_kernels_roofline.py."""
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 1e11)
    monkeypatch.setattr(bench, "plot", lambda results, path: path.write_text("figure"))
    rc = bench.main(["--out", str(tmp_path), "--batches", "2,4", "--variants", "bf16 per-token", "--deadline-s", "0"],
                    device=torch.device("cpu"))
    assert rc == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["not_run_batches"] == [4] and doc["device"] == "cpu" and doc["copy_bandwidth"] == 1e11
    assert set(measurement()) <= set(doc) and doc["code"] == code_commit()  # the provenance of every measurement
    assert (tmp_path / "bench.png").read_text() == "figure"
    (row,) = doc["rows"]
    assert (row["variant"], row["batch"], row["speedup_vs_bf16_per_token"]) == ("bf16 per-token", 2, 1.0)
    assert [t["config"] for t in row["tried"]] == [dataclasses.asdict(c) for c in bench.configs("bf16 per-token")]
    assert row["config"] in [t["config"] for t in row["tried"]] and all(t["agrees"] for t in row["tried"])


def test_warm_up_runs_every_configuration_in_parallel_processes(bench, monkeypatch, tmp_path):
    """warm_all: one process per (variant, configuration) of the compile-only mode, ``workers`` at a time; a process
    that fails or outlives its time is named (the timing then compiles what it did not), none is left running."""
    import time

    child = tmp_path / "child.py"
    seen = tmp_path / "seen"
    seen.mkdir()
    child.write_text("import sys, time, pathlib\n_, _, variant, index = sys.argv\n"
                     f"pathlib.Path({str(seen)!r}, variant.replace('/', '-') + index).write_text('')\n"
                     "if index == '1':\n    sys.exit('no kernel here')\n"
                     "if index == '2':\n    time.sleep(60)\n")
    monkeypatch.setattr(bench, "__file__", str(child))
    monkeypatch.setattr(bench, "configs", lambda variant: [None] * (3 if variant == "PACE-4 dP=8" else 1))
    monkeypatch.setattr(bench, "WARM_TIMEOUT_S", 2.0)
    start = time.monotonic()
    failed = bench.warm_all(["bf16 per-token", "PACE-4 dP=8"], 2)
    assert time.monotonic() - start < 30
    assert sorted(p.name for p in seen.iterdir()) == ["PACE-4 dP=80", "PACE-4 dP=81", "PACE-4 dP=82",
                                                       "bf16 per-token0"]
    assert failed[0] == "PACE-4 dP=8 #1: no kernel here" and failed[1].startswith("PACE-4 dP=8 #2: ")
    assert len(failed) == 2


def test_a_configuration_that_fails_is_named_and_left_out(bench, monkeypatch):
    """A configuration whose kernels fail (e.g. one that this Triton cannot compile) does not cost the variant its row:
    it is kept in the tried list with its error, and the row is the fastest of the others."""
    configs = [_split_config(i) for i in range(3)]
    monkeypatch.setattr(bench, "configs", lambda variant: configs)
    monkeypatch.setattr(bench, "period_outputs", lambda layers, config, restore: torch.ones(4))

    def timed(layers, config, reps):
        if config == configs[2]:
            raise RuntimeError("CompilationError: unsupported AST node")
        return [1e-3 * (1 + configs.index(config))] * reps

    monkeypatch.setattr(bench, "time_config", timed)
    monkeypatch.setattr(bench, "split_breakdown", lambda layers, config, reps: _breakdown(*(1e-3,) * 4))
    row = bench.time_variant("PACE-4 dP=8", 2, torch.device("cpu"), 1)
    assert row["tried"][2] == {"config": configs[2], "error": "RuntimeError: CompilationError: unsupported AST node",
                               "agrees": False}
    assert row["config"] == configs[0] and row["failed"] == [configs[2]] and row["disagreeing"] == []
    assert "1 configuration(s) failed, left out" in bench.row_line({**row, "hbm_fraction": 0.5})


def test_three_bit_rows_move_fewer_bytes_than_four(bench):
    """The bytes model of PACE-3 against PACE-4 (the same scales, buffer and inputs; codes 3/4): what the GPU run's
    time ratio is read against."""
    _, three = bench.build(bench.PACE3, 2, torch.device("cpu"))
    _, four = bench.build("PACE-4 dP=8", 2, torch.device("cpu"))
    codes = bench.LAYERS * 2 * bench.HV * bench.K * bench.V // 8  # one bit per value, B = 2
    assert four - three == pytest.approx(codes * (1 + 1 / bench.PERIOD))  # read every token, written once per dP


def test_the_widths_gpu_call_sets_pace3_against_pace4(bench, tmp_path, monkeypatch):
    """kernels/bench/widths_gpu.py (issue 48's GPU call): PACE-3's rows against PACE-4's at each batch (here with the
    CUDA-graph timer replaced, so the times are equal and the bytes model's ratio is the one figure that differs),
    and the script refuses to run without a GPU, saying so in its log."""
    from kernels.bench import widths_gpu

    tried = bench.configs  # one setting each, the Gluon kernels off (PACE-4's Triton-only time is one of the ratios)
    monkeypatch.setattr(bench, "configs",
                        lambda variant: [dataclasses.replace(tried(variant)[0], **dict.fromkeys(bench.GLUON, False))])
    rows = [bench.time_variant(variant, 2, torch.device("cpu"), 1) for variant in widths_gpu.VARIANTS]
    (r,) = widths_gpu.ratios({"rows": rows})
    assert r["batch"] == 2 and r["time_ratio"] == r["triton_time_ratio"] == 1.0
    read_back = json.loads(json.dumps({"rows": rows}, default=bench.jsonable))  # as main() reads bench.json
    failed = {"variant": widths_gpu.VARIANTS[0], "batch": 4, "error": "PaceError: refused"}  # no timing, no ratio
    assert widths_gpu.ratios({"rows": [*read_back["rows"], failed]}) == [r]
    assert r["bytes_ratio"] == pytest.approx(rows[0]["bytes_per_token"] / rows[1]["bytes_per_token"])
    assert r["bytes_ratio"] < 1
    assert widths_gpu.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in (tmp_path / "widths_gpu_log.txt").read_text()
