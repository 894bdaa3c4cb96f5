"""scripts/gpu_serving_harness.py (issue 44.2's GPU script) on the CPU: the Triton kernels under the interpreter at
small sizes, every stage it runs here (continuous batching against the reference, torch.compile against eager, the
timed decode), in a child process that sets ``TRITON_INTERPRET`` before Triton is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_harness_runs_and_checks_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(REPO / "scripts" / "gpu_serving_harness.py"), "--out", str(tmp_path), "--device", "cpu",
           "--configs", "bf16", "pace-4", "--batch", "6", "--heads", "2", "--v-heads", "4", "--dim", "64",
           "--steps", "5", "--compile-steps", "2", "--prompt", "12", "--chunk", "8", "--max-out", "6", "--join", "3",
           "--warmup", "1", "--timed", "2", "--launch", '{"split": {"flush_columns": 32}}']
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "harness.json").read_text())
    assert [r["config"] for r in doc["results"]] == ["bf16", "pace-4"]
    for r in doc["results"]:
        assert r["backend"] == "triton" and r["checks"] == {"continuous": True, "compiled": True}
        assert r["launch"] == {"split": {"flush_columns": 32}}
        c = r["continuous"]
        assert c["mixed_forwards"] >= 1 and c["tokens"] > 5 and c["output_rel_max"] <= doc["limit"]
        assert r["compiled"]["forwards"] == 2 and r["compiled"]["output_rel_max"] <= doc["limit"]
        assert r["decode"]["batch"] == 6 and r["decode"]["median_s"] > 0
        assert "graph" not in r  # no CUDA here
    assert doc["results"][0]["decode"]["ratio_over_bf16"] == 1.0
    assert "all checks passed" in (tmp_path / "harness_log.txt").read_text()
