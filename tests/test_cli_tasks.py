"""``python -m pace_core tasks`` (pace_core.cli.tasks) on the embedded model (CPU, offline): every (configuration,
task) stored as the other analyses store theirs, read back, reused by a later run with more configurations, and a
stopped run resumed at the first pair not stored."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_analysis_tasks import local_task

from pace_core import cli
from pace_core.analysis import tasks as task_analysis
from pace_core.analysis.task_scores import TASK_KIND, scores, task_table
from pace_core.config import get_config
from pace_core.export import config_to_dict
from pace_core.results import list_results, result_sets

pytest.importorskip("lm_eval")

MODEL = "pace-tiny-qwen35"
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, str]]:
    """Every (configuration, task) the command computes, in order."""
    done: list[tuple[str, str]] = []
    real = task_analysis.evaluate_config

    def counting(model, lm, tasks, task, cfg, settings, **kw):
        done.append((cfg.name, task.name))
        return real(model, lm, tasks, task, cfg, settings, **kw)

    monkeypatch.setattr(task_analysis, "evaluate_config", counting)
    return done


def _run(tmp_path, *configs: str, extra: tuple[str, ...] = ()) -> int:
    argv = ["tasks", "--tasks", f"{local_task(tmp_path)},pace_vt_mc_640", "--configs", *configs, "--references",
            "fp32", "--limit", "2", "--samples", "2", "--out", str(tmp_path), "--quiet", *extra]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [str(REPO_ROOT / "pace_core" / "__main__.py"), *argv])  # `python -m pace_core`
        return cli.main(argv)


def test_tasks_are_stored_per_configuration_and_task_reloaded_and_reused(tmp_path, calls, capsys):
    assert _run(tmp_path, "rtn-int2") == 0
    tasks = ["pace_test_tiny", "pace_vt_mc_640"]
    assert calls == [(c, t) for c in ("fp32", "rtn-int2") for t in tasks]
    listing = result_sets(MODEL, TASK_KIND, root=tmp_path)
    assert not listing.damaged and len(listing.results) == 2  # one set per task, fp32 first
    for result_set in listing.results:
        assert result_set.configs == ["fp32", "rtn-int2"]
        for r in result_set.results:
            assert r.data["configuration"] == config_to_dict(get_config(r.data["config"]))
            assert r.data["samples"]["effective"] == 2 and r.data["limit"] == 2 and r.data["num_fewshot"] == 0
            [score] = scores(r.data)
            assert score.metric == "acc" and 0 <= score.value <= 1 and score.stderr is not None
            harness = r.provenance["lm_eval"]
            assert harness["version"] == "0.4.13" and harness["limit"] == 2 and harness["seed"] == 0
            assert list(harness["task_versions"].values()) in ([2.0], [1.0]) and harness["batch"] == 1
            assert r.provenance["code"] is not None and r.provenance["weights"]
            assert len(r.table) == 2 and r.table["loglikelihoods"].map(len).isin([2, 3, 4]).all()
    synthetic = next(s for s in listing.results if s.results[0].data["task"] == "pace_vt_mc_640")
    assert synthetic.results[0].data["synthetic"]["length"] == 640
    fp32, int2 = (list(map(list, r.table["loglikelihoods"])) for r in synthetic.results)
    assert fp32 != int2  # the state format changed what the model computed on the long items
    printed = capsys.readouterr().out
    assert "pace_test_tiny · acc" in printed and "pace_vt_mc_640 · acc" in printed
    files = {p.name: p.read_bytes() for p in (tmp_path / MODEL).glob("task-*")}

    calls.clear()  # a later run with one more configuration computes only its pairs
    assert _run(tmp_path, "rtn-int2", "rtn-int4") == 0
    assert calls == [("rtn-int4", t) for t in tasks]
    assert "reusing stored pace_vt_mc_640 scores of fp32, rtn-int2" in capsys.readouterr().out
    assert all((tmp_path / MODEL / name).read_bytes() == blob for name, blob in files.items())
    assert len(list_results(MODEL, TASK_KIND, root=tmp_path).results) == 6
    assert list(task_table(result_sets(MODEL, TASK_KIND, root=tmp_path).results)["config"]) == \
        ["fp32", "rtn-int2", "rtn-int4"]


def test_a_stopped_run_resumes_at_the_first_pair_not_stored(tmp_path, calls, monkeypatch, capsys):
    counting = task_analysis.evaluate_config

    def stopping(*args, **kw):  # Ctrl-C during the third pair
        if len(calls) == 2:
            raise KeyboardInterrupt
        return counting(*args, **kw)

    monkeypatch.setattr(task_analysis, "evaluate_config", stopping)
    assert _run(tmp_path, "rtn-int2") == 130
    err = capsys.readouterr().err
    assert "stored 2 result(s): task of fp32, task of fp32. `python -m pace_core tasks --tasks " in err
    monkeypatch.setattr(task_analysis, "evaluate_config", counting)
    calls.clear()
    assert _run(tmp_path, "rtn-int2") == 0
    assert calls == [("rtn-int2", "pace_test_tiny"), ("rtn-int2", "pace_vt_mc_640")]
    assert len(list_results(MODEL, TASK_KIND, root=tmp_path).results) == 4


def test_bad_arguments_are_refused_before_anything_runs(tmp_path, calls, capsys):
    assert cli.main(["tasks", "--tasks", "pace_vt_mc_640", "--configs", "nope", "--out", str(tmp_path)]) == 2
    assert "config 'nope' is unknown" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["tasks", "--tasks", "x", "--batch", "many"])
    with pytest.raises(SystemExit):
        cli.main(["tasks", "--tasks", "x", "--gen-kwargs", "[1]"])
    assert cli.main(["tasks", "--tasks", "pace_vt_mc_640", "--limit", "0", "--out", str(tmp_path)]) == 2
    assert "limit=0 is not allowed" in capsys.readouterr().err
    assert calls == []


def test_the_command_line_starts_without_the_tasks_analyses():
    """The tasks command imports its analyses when it runs (pace_core.cli.tasks.run_tasks), as every command does:
    ``bits`` and ``--help`` start without lm-eval, transformers or datasets (before: 28-30 s against 6-8 s)."""
    code = ("import sys, pace_core.cli\n"
            "assert pace_core.cli.main(['bits', '--config', 'pace-4', '--model', 'qwen3.5-27b']) == 0\n"
            "print(sorted(m for m in ('lm_eval', 'transformers', 'datasets', 'pace_core.analysis.tasks',\n"
            "                         'pace_core.analysis.task_scores') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "[]"
