"""kernels/bench/roofline.py on the CPU: the bench in this process (Triton interpreter, small shapes, the CUDA-graph
timer replaced, as tests/test_kernels_bench.py runs it), Nsight Compute replaced by a script that prints a raw page,
and the targets read off what they wrote: the files one device call brings back, and each target's figure, verdict,
prediction and profile."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest
import torch
from test_kernels_bench import bench  # noqa: F401 - the fixture
from test_kernels_ncu_profile import fake_ncu

from pace_core.version import code_commit

ROOT = Path(__file__).resolve().parents[1]


def test_one_call_writes_the_bench_the_profiles_and_the_targets(bench, monkeypatch, tmp_path):  # noqa: F811
    from kernels.bench import roofline

    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 1e11)
    monkeypatch.setattr(bench, "plot", lambda results, path: path.write_text("figure"))
    tools = tmp_path / "bin"
    tools.mkdir()
    fake_ncu(tools, ["_step_kernel", "_flush_kernel"])
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "out"
    rc = roofline.main(["--out", str(out), "--batches", "1", "--variants", "PACE-4 dP=8", "--warm-workers", "0",
                        "--ncu-batches", "1", "--ncu-variants", "PACE-4 dP=8", "--budget-s", "400"],
                       device=torch.device("cpu"))
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.png", "bench_log.txt", "ncu_log.txt",
                                                     "ncu_raw.tar.gz", "ncu_summary.json", "roofline.json"]
    with tarfile.open(out / "ncu_raw.tar.gz") as tar:
        assert tar.getnames() == ["ncu_PACE-4_B1.csv"]
    doc = json.loads((out / "roofline.json").read_text())
    assert doc["code"] == code_commit() and doc["device"] == "cpu"
    rows = {r["variant"]: r for r in json.loads((out / "bench.json").read_text())["rows"]}
    ratio = rows["PACE-4 dP=8"]["seconds_per_token"] / rows["bf16 per-token"]["seconds_per_token"]
    b1 = doc["targets"]["pace4_b1_ratio"]
    assert b1["figures"] == {"1": pytest.approx(ratio)} and b1["met"] == (ratio <= 1.2)
    assert [k["kernel"] for k in b1["profile"]["1"]] == ["_step_kernel", "_flush_kernel"]
    assert b1["profile"]["1"][0]["settings"] == rows["PACE-4 dP=8"]["config"]
    assert doc["targets"]["pace4_copy_bandwidth"]["met"] is None  # no batch from 32 was run
    assert "B=   1 PACE-4 dP=8" in (out / "bench_log.txt").read_text()


def _bench_doc(device: str, times: dict) -> dict:
    rows = [{"variant": v, "batch": b, "seconds_per_token": t, "hbm_fraction": f, "config": None}
            for (v, b), (t, f) in times.items()]
    return {"device": device, "copy_bandwidth": 3e12, "rows": rows + [{"variant": "PACE-4 dP=8", "batch": 64,
                                                                         "error": "PaceError: out of memory"}]}


def test_targets_read_off_the_rows_with_their_verdicts_and_predictions():
    from kernels.bench import roofline

    bf, p4, p48 = roofline.BF16, roofline.PACE4, roofline.PACE48
    times = {(bf, 1): (70e-6, 0.2), (p4, 1): (80e-6, 0.02), (bf, 8): (200e-6, 0.5), (p48, 8): (190e-6, 0.1),
             (bf, 32): (700e-6, 0.5), (p4, 32): (200e-6, 0.72), (p48, 32): (300e-6, 0.3),
             (bf, 128): (2500e-6, 0.6), (p4, 128): (700e-6, 0.69), (p48, 128): (1300e-6, 0.3)}
    t = roofline.targets(_bench_doc("NVIDIA H100 80GB HBM3", times), None)
    bw = t["pace4_copy_bandwidth"]
    assert bw["figures"] == {32: 0.72, 64: None, 128: 0.69} and bw["batches"] == [32, 64, 128]
    assert bw["met"] is False  # missed at 128, whatever B = 64 (its row failed) would have been
    assert bw["predicted"] == {b: list(v) for b, v in roofline.PREDICTIONS["H100"]["pace4_copy_bandwidth"].items()}
    assert t["pace48_speedup_128"]["figures"][128] == pytest.approx(2500 / 1300) and not t["pace48_speedup_128"]["met"]
    assert t["pace48_speedup_from_8"]["figures"] == {8: pytest.approx(200 / 190), 32: pytest.approx(700 / 300),
                                                     64: None, 128: pytest.approx(2500 / 1300)}
    assert t["pace48_speedup_from_8"]["met"] is None  # met where measured, B = 64 not measured
    assert t["pace4_b1_ratio"]["figures"][1] == pytest.approx(80 / 70) and t["pace4_b1_ratio"]["met"] is True
    assert t["pace4_b1_ratio"]["inside_prediction"] == {1: False}  # 1.14 below the predicted 1.30 .. 1.45
    assert roofline.targets(_bench_doc("Tesla T4", times), None)["pace4_b1_ratio"].get("predicted") is None
    lines = roofline.table({"targets": t}).splitlines()
    assert len(lines) == 5 and "B=32: 72%" in lines[1] and "missed" in lines[1] and "B=1: 1.14x" in lines[4]
