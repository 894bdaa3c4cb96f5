"""scripts/count_step_ops.py (issue 43's CPU-side profile of the study's decode path) on the embedded model: the
counter leaves views out, and each configuration's row counts what it launches beyond the fp32 reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from count_step_ops import Count  # noqa: E402


def test_the_counter_counts_computations_not_views() -> None:
    x = torch.arange(12.0)
    with Count() as mode:
        y = x.view(3, 4).t()[1]  # views: nothing computed
        z = (y * 2).sum()
        float(z)  # a host read
    assert mode.ops == {"mul": 1, "sum": 1, "_local_scalar_dense": 1}


def test_each_configuration_counts_its_operations_beyond_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "ops.json"
    cmd = [sys.executable, str(REPO / "scripts" / "count_step_ops.py"), "--configs", "fp32", "bf16", "pace-4",
           "--tokens", "24", "--decode-from", "8", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = {r["config"]: r for r in doc["rows"]}
    assert list(rows) == ["fp32", "bf16", "pace-4"] and doc["tokens"] == 24
    assert "commit" in json.dumps(doc["provenance"])
    assert rows["fp32"]["ops_per_token_layer"] == 0 and rows["fp32"]["top"] == {}
    # a rounded state launches more per token than an unrounded bf16 one, which launches more than fp32's none
    assert rows["pace-4"]["ops_per_token_layer"] > rows["bf16"]["ops_per_token_layer"] > 0
    assert all(v > 0 for r in rows.values() for v in r["top"].values())
