"""kernels/bench_e2e.py: the end-to-end TPOT harness, run small on the CPU (its numbers come from the
GPU machine), and the model it builds there."""

from __future__ import annotations

import json
import math

from kernels import bench_e2e
from pace_core.shapes import BUILTIN_SHAPES, shape_from_hf_config


def test_full_model_is_qwen35_4b_sized():
    shape = shape_from_hf_config(bench_e2e.model_config(tiny=False))
    want = BUILTIN_SHAPES["qwen3.5-4b"]
    for field in ("num_layers", "num_gdn_layers", "num_k_heads", "num_v_heads", "d_k", "d_v", "weight_params"):
        assert getattr(shape, field) == getattr(want, field), field


def test_tiny_run_writes_every_variant_and_batch(tmp_path, capsys):
    out = tmp_path / "e2e"
    assert bench_e2e.main(["--tiny", "--device", "cpu", "--batches", "1,3", "--context", "12", "--tokens", "8",
                           "--out", str(out)]) == 0
    rows = json.loads((out / "bench_e2e.json").read_text())["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [(v, b) for b in (1, 3) for v in bench_e2e.VARIANTS]
    for r in rows:
        assert r["outputs_finite"] and r["tokens"] == 8 and 0 < r["spread"][0] <= r["tpot_median_s"] <= r["spread"][1]
        assert math.isclose(r["speedup_vs_bf16_per_token"],
                            next(x for x in rows if x["batch"] == r["batch"] and x["config"] == "bf16")["tpot_mean_s"]
                            / r["tpot_mean_s"])
    assert "PACE-4 vs bf16" in capsys.readouterr().out
    assert bench_e2e.main(["--tiny", "--device", "cpu", "--tokens", "12", "--out", str(out)]) == 2


def test_profile_writes_tables_and_host_counts(tmp_path):
    out = tmp_path / "e2e"
    assert bench_e2e.main(["--tiny", "--device", "cpu", "--batches", "2", "--context", "8", "--tokens", "8",
                           "--profile", "--out", str(out)]) == 0
    rows = json.loads((out / "bench_e2e.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == list(bench_e2e.VARIANTS)
    tables = (out / "profile.txt").read_text()
    for r in rows:
        assert r["profiled_tpot_s"] > 0 and r["aten_calls_per_step"] > 10 and r["launches_per_step"] == 0  # CPU
        assert "gpu_busy_time_per_token_s" not in r  # no GPU, no busy time
        assert f"=== {r['variant']}, batch 2" in tables
    assert tables.count("Self CPU time total") == len(rows)
