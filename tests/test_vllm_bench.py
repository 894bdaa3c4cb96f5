"""pace_core.vllm.bench's arithmetic and its reading of stored figures (no vLLM needed; the benchmark itself
runs servers and is a measurement, not a test)."""

from __future__ import annotations

import json

import pytest

from pace_core.vllm import bench

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 21.0
pace_state_slots 8192.0
"""


def test_metric_reads_a_sample_with_or_without_labels():
    assert bench.metric(METRICS, "vllm:num_requests_running") == 21.0
    assert bench.metric(METRICS, "pace_state_slots") == 8192.0
    assert bench.metric(METRICS, "vllm:num_requests_waiting") is None


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted 1..4: rank 2.97 of 0..3 for the 99th
    assert bench.percentile(values, 99) == pytest.approx(1 + 3 * 0.99)
    assert bench.percentile(values, 0) == 1.0 and bench.percentile([5.0], 99) == 5.0


def _row(run, config, c, tok_s, peak, wall, shape=(24, 32)):
    return {"run": run, "config": config, "prompt_tokens": shape[0], "tokens": shape[1], "concurrency": c,
            "output_tokens_per_s": tok_s, "peak_running": peak, "wall_s": wall}


def test_a_shape_is_prompt_and_output_tokens():
    assert bench.shape("512x256") == (512, 256) and [bench.shape(s) for s in bench.SHAPES] == [(24, 32), (512, 256)]
    for bad in ("512", "0x4", "ax3", "3x-1"):
        with pytest.raises(ValueError, match="PROMPTxOUTPUT"):
            bench.shape(bad)


def test_ratios_compare_each_plugin_row_with_vllms_own_of_the_same_run():
    rows = [_row(1, "vllm-own", 64, 1000.0, 21, 10.0), _row(1, "pace-4", 64, 250.0, 64, 40.0),
            _row(2, "vllm-own", 64, 500.0, 20, 20.0), _row(2, "pace-4", 64, 250.0, 60, 30.0)]
    got = bench.ratios(rows)
    assert [(r["run"], r["config"]) for r in got] == [(1, "pace-4"), (2, "pace-4")]
    assert got[0]["tokens_per_s_ratio"] == 0.25 and got[0]["peak_running_ratio"] == 64 / 21
    assert got[0]["wall_ratio"] == 4.0 and got[1]["tokens_per_s_ratio"] == 0.5 and got[1]["wall_ratio"] == 1.5


def test_ratios_compare_rows_of_the_same_shape():
    long = (512, 256)
    rows = [_row(1, "vllm-own", 8, 400.0, 8, 5.0), _row(1, "vllm-own", 8, 100.0, 8, 20.0, long),
            _row(1, "fp32", 8, 380.0, 8, 5.2), _row(1, "fp32", 8, 99.0, 8, 20.2, long)]
    got = bench.ratios(rows)
    assert [(r["prompt_tokens"], r["tokens"], r["tokens_per_s_ratio"]) for r in got] == [(24, 32, 0.95),
                                                                                          (512, 256, 0.99)]


def test_the_stored_burst_is_read_as_a_short_table(tmp_path):
    path = tmp_path / "vllm_serve_cpu.json"
    rows = [
        _row(1, "vllm-own", 64, 1000.0, 21, 10.0),
        _row(1, "data/results/m/config-pace-4-8.json", 64, 250.0, 63, 40.0),
        _row(1, "data/results/m/config-pace-4-8.json", 8, 90.0, 8, 3.0),
        _row(1, "vllm-own", 8, 700.0, 8, 0.4),
    ]
    path.write_text(json.dumps({"rows": rows, "ratios": bench.ratios(rows)}))
    assert bench.shipped_table(path) == [{"configuration": "pace-4-8", "run": 1, "prompt + output tokens": "24 + 32",
                                          "output tok/s ×": 0.25, "peak running ×": 3.0, "burst wall time ×": 4.0}]
    path.write_text("{")
    assert bench.shipped_table(path) is None
    assert bench.shipped_table(tmp_path / "missing.json") is None
