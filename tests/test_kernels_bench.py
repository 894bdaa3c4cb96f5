"""kernels/bench/bench.py's harness on the CPU (its timings come from the GPU machine): every variant's
layers compute the decode step they claim, run by the Triton interpreter at small shapes with the
CUDA-graph timer replaced by one direct call."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels_support import kernel_modules
from pace_core.recurrence import gdn_recurrent

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def bench(monkeypatch):
    kernel_modules()
    import kernels.bench.bench as module

    module = importlib.reload(module)
    for name, value in (("LAYERS", 2), ("H", 2), ("HV", 4), ("K", 64), ("V", 32)):
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(module, "time_graph", lambda work, reps: [work(), 1e-3][1:] * reps)
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
    assert [t["config"] for t in row["tried"]] == bench.configs(variant)
    if variant in bench.SPLIT_VARIANTS:
        assert row["split_breakdown"] == {"step_seconds": 1e-3, "dots_seconds": 1e-3, "records_seconds": 1e-3,
                                          "flush_seconds": 1e-3, "records_at_step": bench.PERIOD // 2}
        assert all(t["split_breakdown"] == row["split_breakdown"] for t in row["tried"])
    else:
        assert row["split_breakdown"] is None


def _split_config(i: int) -> dict:
    """A split-path launch configuration whose every setting differs from another index's."""
    return {"fused_step": i % 2 == 0, "step_warps": 2 + i, "dots_columns": 16 * (i + 1), "dots_warps": 4 + i,
            "record_warps": 1 + i, "flush_warps": 8 + i, "flush_columns": 32 * (i + 1), "dots_per_part": i == 1,
            "per_part": i == 2, "gluon_dots": i != 1, "gluon_flush": i == 2, "gluon_step": i == 0}


def _breakdown(step, dots, records, flush) -> dict:
    return {"step_seconds": step, "dots_seconds": dots, "records_seconds": records, "flush_seconds": flush,
            "records_at_step": 4}


def test_best_split_combination_takes_each_kernels_fastest_options(bench):
    configs = [_split_config(i) for i in range(3)]
    times = [(5e-3, 3e-3, 1e-3, 9e-3), (4e-3, 1e-3, 2e-3, 8e-3), (6e-3, 2e-3, 3e-3, 7e-3)]
    tried = [{"config": c, "split_breakdown": _breakdown(*t)} for c, t in zip(configs, times)]
    assert bench.best_split_combination(tried) == {
        "fused_step": False, "step_warps": configs[1]["step_warps"], "gluon_step": False,  # 4 ms > 1 + 1 ms
        "dots_columns": configs[1]["dots_columns"], "dots_warps": configs[1]["dots_warps"], "dots_per_part": True,
        "gluon_dots": False, "record_warps": configs[0]["record_warps"], "flush_warps": configs[2]["flush_warps"],
        "flush_columns": configs[2]["flush_columns"], "per_part": True, "gluon_flush": True}
    tried[2]["split_breakdown"]["step_seconds"] = 1.5e-3
    best = bench.best_split_combination(tried)
    assert best["fused_step"] and best["step_warps"] == configs[2]["step_warps"] and not best["gluon_step"]
    for r in tried:  # heads too narrow for the one-kernel step
        r["split_breakdown"]["step_seconds"] = None
    assert not bench.best_split_combination(tried)["fused_step"]


def test_split_variant_also_times_the_combination(bench, monkeypatch):
    configs = [_split_config(i) for i in range(2)]
    times = {c["dots_warps"]: t for c, t in zip(configs, [(5e-3, 1e-3, 3e-3, 9e-3), (4e-3, 2e-3, 1e-3, 8e-3)])}
    monkeypatch.setattr(bench, "configs", lambda variant: configs)
    monkeypatch.setattr(bench, "split_breakdown", lambda layers, config, reps: _breakdown(*times.get(
        config["dots_warps"], (4e-3, 1e-3, 1e-3, 8e-3))))
    row = bench.time_variant("PACE-4 dP=8", 2, torch.device("cpu"), 1)
    combined = bench.best_split_combination(row["tried"][:2])
    assert [t["config"] for t in row["tried"]] == [*configs, combined]
    assert combined["dots_warps"] == configs[0]["dots_warps"] and combined["record_warps"] == configs[1]["record_warps"]


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
    monkeypatch.setattr(bench, "configs", lambda variant: [{**tried(variant)[0], **{g: False for g in bench.GLUON}}])
    rows = [bench.time_variant(variant, 2, torch.device("cpu"), 1) for variant in widths_gpu.VARIANTS]
    (r,) = widths_gpu.ratios({"rows": rows})
    assert r["batch"] == 2 and r["time_ratio"] == r["triton_time_ratio"] == 1.0
    assert r["bytes_ratio"] == pytest.approx(rows[0]["bytes_per_token"] / rows[1]["bytes_per_token"])
    assert r["bytes_ratio"] < 1
    assert widths_gpu.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in (tmp_path / "widths_gpu_log.txt").read_text()
