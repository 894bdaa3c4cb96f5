"""scripts/compare_drift.py: two folders' drift results matched by settings and configuration, step by step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from compare_drift import compare

from pace_core.results import list_results, results_root, save_result

MODEL = "pace-tiny-qwen35"


def test_the_same_drift_in_two_folders_is_compared_step_by_step(tmp_path):
    """The shipped PACE-4 drift stored in two folders, one of them with step 8's relative error raised by 1e-3
    of itself and another configuration only in one folder: one row, whose figures are those changes."""
    shipped = {r.data["config"]: r for r in list_results(MODEL, "drift", root=results_root()).results}
    pace4, other = shipped["pace-4"], shipped["rtn-int4"]
    changed = pace4.table.copy()
    at = (changed.config == "pace-4") & (changed.step == 8)
    assert at.sum() == 1
    changed.loc[at, "rel_error"] *= 1 + 1e-3
    for root, table in (("gpu", changed), ("cpu", pace4.table)):
        save_result("drift", MODEL, pace4.key, pace4.data, pace4.provenance, table, root=tmp_path / root)
    save_result("drift", MODEL, other.key, other.data, other.provenance, other.table, root=tmp_path / "gpu")
    [row] = compare(str(tmp_path / "gpu"), str(tmp_path / "cpu"), MODEL)
    base = float(pace4.table.loc[at, "rel_error"].iloc[0])
    assert row["config"] == "pace-4" and row["steps"] == len(pace4.table)
    assert row["max_rel_diff_rel_error"] == pytest.approx(1e-3, rel=1e-9)
    assert row["max_abs_diff_rel_error"] == pytest.approx(base * 1e-3, rel=1e-9)
    assert row["mean_rel_error_gpu"] - row["mean_rel_error_cpu"] == pytest.approx(
        base * 1e-3 / len(pace4.table), rel=1e-6
    )
    assert row["max_abs_diff_excess_nll"] == 0.0
