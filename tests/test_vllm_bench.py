"""pace_core.vllm.bench's arithmetic and its reading of stored figures (no vLLM needed; the benchmark itself
runs servers and is a measurement, not a test)."""

from __future__ import annotations

import asyncio
import json
import sys
import types

import pytest

from pace_core.accounting import state_bytes_per_sequence
from pace_core.config import NAMED_CONFIGS
from pace_core.shapes import shape_from_hf_config
from pace_core.vllm import bench

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 21.0
pace_state_slots 8192.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 4.0
"""


def test_metric_reads_a_sample_with_or_without_labels():
    assert bench.metric(METRICS, "vllm:num_requests_running") == 21.0
    assert bench.metric(METRICS, "pace_state_slots") == 8192.0
    assert bench.metric(METRICS, "vllm:num_requests_waiting") is None


def test_preemptions_are_read_from_vllms_counter():
    assert bench.preemptions(METRICS) == 4 and bench.preemptions("") == 0


def test_even_runs_serve_the_configurations_in_reverse():
    configs = ["vllm-own", "fp32", "pace-4"]
    assert [bench.serving_order(configs, run) for run in (1, 2, 3)] == [configs, configs[::-1], configs]


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


def test_ratios_compare_what_the_engines_said_they_hold():
    rows = [{**_row(1, "vllm-own", 64, 1000.0, 16, 10.0), "max_concurrency": 17.0},
            {**_row(1, "pace-4", 64, 1000.0, 42, 10.0), "max_concurrency": 34.13},
            {**_row(1, "fp32", 64, 1000.0, 16, 10.0), "max_concurrency": None}]
    got = {r["config"]: r["max_concurrency_ratio"] for r in bench.ratios(rows)}
    assert got == {"pace-4": 34.13 / 17.0, "fp32": None}


# vLLM 0.32's start-up lines, as a server on the embedded model printed them (PACE-4, 64 MiB, 768 tokens)
STARTUP = """(Worker pid=1) INFO 12-07 00:07:07 [interface.py:1096] Setting attention block size to 64 tokens to \
ensure that attention page size is >= mamba page size.
(Worker pid=1) INFO 12-07 00:07:07 [interface.py:1120] Padding mamba page size by 38.47% to ensure that mamba page \
size and attention page size are exactly equal.
(EngineCore pid=2) INFO 12-07 00:07:07 [kv_cache_utils.py:2327] CPU KV cache size: 26,214 tokens, Maximum \
concurrency for 768 tokens per request: 34.13x
"""


def test_the_engine_report_reads_vllms_start_up_lines():
    assert bench.engine_report(STARTUP) == {"max_concurrency": 34.13, "state_page_padding_pct": 38.47,
                                            "attention_block_tokens": 64.0}
    assert bench.engine_report("no such lines") == dict.fromkeys(bench.ENGINE_LINES)


def test_request_bytes_are_the_states_and_the_attention_cache_at_full_length(tiny_checkpoints):
    hf = (tiny_checkpoints["qwen3_5_text"] / "config.json").read_text()
    rows = bench.request_bytes(hf, ["vllm-own", "pace-4"], [(24, 32), (512, 256)])
    # the tiny model: 3 GDN layers of HV = 4 heads of 64 x 32 values, 1 attention layer of 1 KV head of 32
    own, kv_token = 4 * 3 * 4 * 64 * 32, 2 * 2 * 1 * 32 * 1
    assert [(r["config"], r["prompt_tokens"], r["kv_bytes"]) for r in rows] == [
        ("vllm-own", 24, 56 * kv_token), ("vllm-own", 512, 768 * kv_token),
        ("pace-4", 24, 56 * kv_token), ("pace-4", 512, 768 * kv_token)]
    assert rows[0]["state_bytes"] == own and rows[0]["sequences_bound"] == 1.0
    # the pool rows the plugin lays out hold what the accounting counts for one sequence
    shape = shape_from_hf_config(json.loads(hf))
    pace = state_bytes_per_sequence(NAMED_CONFIGS["pace-4"], shape)
    assert rows[2]["state_bytes"] == pace
    for r in rows:
        kv = r["kv_bytes"]
        assert r["sequences_bound"] == pytest.approx((own + kv) / (r["state_bytes"] + kv), rel=1e-15)
        assert r["zero_state_bound"] == pytest.approx((own + kv) / kv, rel=1e-15)
    assert rows[3]["sequences_bound"] < rows[2]["sequences_bound"] < rows[2]["zero_state_bound"]


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
    memory = [{"config": "data/results/m/config-pace-4-8.json", "prompt_tokens": 24, "tokens": 32,
               "sequences_bound": 3.7444}]
    path.write_text(json.dumps({"rows": rows, "ratios": bench.ratios(rows), "memory": memory}))
    assert bench.shipped_table(path)[0]["fits at full length ×"] == 3.74
    path.write_text("{")
    assert bench.shipped_table(path) is None
    assert bench.shipped_table(tmp_path / "missing.json") is None


class _FakeServer:
    """A server whose /metrics counts the preemptions so far (three more on every read after the first)."""

    url = "http://fake"

    def __init__(self):
        self.reads = 0

    def get(self, path: str) -> str:
        self.reads += 1
        return f"vllm:num_requests_running 1.0\nvllm:num_preemptions_total {3.0 * (self.reads > 1)}\n"


def _fake_openai(monkeypatch, seconds: float) -> dict:
    """An ``openai`` module whose completions take ``seconds`` each and answer 32 tokens; counts what was sent."""
    seen = {"sent": 0, "in_flight": 0, "most_in_flight": 0}

    class Completions:
        async def create(self, **kwargs):
            seen["sent"] += 1
            seen["in_flight"] += 1
            seen["most_in_flight"] = max(seen["most_in_flight"], seen["in_flight"])
            await asyncio.sleep(seconds)
            seen["in_flight"] -= 1
            return types.SimpleNamespace(usage=types.SimpleNamespace(completion_tokens=kwargs["max_tokens"]))

    class AsyncOpenAI:
        def __init__(self, **kwargs):
            self.completions = Completions()

        async def close(self):
            pass

    monkeypatch.setitem(sys.modules, "openai", types.SimpleNamespace(AsyncOpenAI=AsyncOpenAI))
    return seen


def test_a_level_runs_until_its_least_requests_and_wall_time(monkeypatch):
    seen = _fake_openai(monkeypatch, 0.02)
    row = asyncio.run(bench._level(_FakeServer(), "m", [[1, 2], [3]], 2, 32, min_wall_s=0.3))
    assert row["wall_s"] >= 0.3 and row["requests"] == seen["sent"] >= 8  # 8 requests take 0.08 s: it went on
    assert seen["most_in_flight"] == 2 and row["output_tokens"] == 32 * row["requests"]
    assert row["preemptions"] == 3


def test_the_burst_sends_exactly_its_requests(monkeypatch):
    seen = _fake_openai(monkeypatch, 0.01)
    row = asyncio.run(bench._level(_FakeServer(), "m", [[1, 2], [3]], 64, 8))
    assert row["requests"] == seen["sent"] == 64 and seen["most_in_flight"] == 64
