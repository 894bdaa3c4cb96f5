"""Downstream tasks through lm-eval on the embedded model (CPU, offline): a local multiple-choice task the test
writes (JSONL + config) and the synthetic variable-tracking task, each configuration applied to the one model
instance. lm-eval's log-likelihoods are checked against the model's own forward with the configuration applied,
and the state format is shown to change them on a long-context item."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from app_support import REPO_ROOT

from pace_core.analysis import tasks as harness
from pace_core.analysis.tasks import (
    TaskSettings,
    check_lengths,
    evaluate_config,
    prepare_tasks,
    run_tasks,
    split_specs,
    task_lm,
)
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.model.loading import load_model
from pace_core.model.patch import current_config, remove_pace

pytest.importorskip("lm_eval")

LONG = 640
"""The synthetic task's context: beyond the prefill period P = 256, so the state is rounded twice inside it."""


@pytest.fixture(scope="module")
def loaded():
    return load_model(None)


def local_task(folder) -> str:
    """A multiple-choice task over a JSONL file written here: its config's path."""
    rows = [{"question": "The sky on a clear day is", "choices": ["blue", "green", "loud"], "answer": 0},
            {"question": "Two and two make", "choices": ["four", "five"], "answer": 0},
            {"question": "Water freezes into", "choices": ["ice", "smoke", "sand"], "answer": 0}]
    data = folder / "tiny.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = folder / "tiny.yaml"
    config.write_text("\n".join([
        "task: pace_test_tiny", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {data}",
        "test_split: test", "output_type: multiple_choice", 'doc_to_text: "{{question}}"',
        'doc_to_choice: "{{choices}}"', 'doc_to_target: "{{answer}}"', "metric_list:", "  - metric: acc",
        "    aggregation: mean", "    higher_is_better: true", "metadata:", "  version: 2.0", ""]))
    return str(config)


def own_loglikelihoods(loaded, item: dict) -> list[float]:
    """log p(option | prompt) of each option by the model's own forward, as it is configured now: the independent
    reference of what lm-eval reports. The tokens are those of a scoring request (the continuation is what the
    prompt followed by a space and the option adds to the prompt's tokens; the forward reads the prompt and the
    continuation but its last token)."""
    out = []
    context = loaded.tokenizer(item["input"], add_special_tokens=False)["input_ids"]
    for choice in item["choices"]:
        whole = loaded.tokenizer(item["input"] + " " + choice, add_special_tokens=False)["input_ids"]
        cont = whole[len(context):]
        with torch.no_grad():
            logits = loaded.model(torch.tensor([whole[:-1]])).logits[0, -len(cont):].double()
        out.append(float(torch.log_softmax(logits, -1).gather(1, torch.tensor(cont)[:, None]).sum()))
    return out


def test_the_state_format_changes_what_lm_eval_scores_on_a_long_context(loaded, tmp_path):
    """lm-eval's log-likelihood of every option of the synthetic task's long items is the model's own (this
    instance, the configuration applied by pace_core.apply), and RTN-INT2's state makes it differ from fp32's."""
    settings = TaskSettings(limit=2, samples=2)
    tasks = prepare_tasks([f"pace_vt_mc_{LONG}"], lambda: loaded.tokenizer, tmp_path, settings, quiet=True)
    [task] = tasks.tasks
    lm = task_lm(loaded.model, loaded.tokenizer, settings, quiet=True)
    check_lengths(tasks, lm)
    items = [json.loads(line) for line in task.synthetic.data.read_text().splitlines()]
    assert all(256 < i["tokens"] <= LONG for i in items)
    assert task.output_type == "multiple_choice" and task.items == 2 and task.version == 1.0
    seen = {}
    for name in ("fp32", "rtn-int2", "fp32"):
        data, table, harness_info = evaluate_config(loaded.model, lm, tasks, task, get_config(name), settings,
                                                    quiet=True)
        lls = [list(row) for row in table.sort_values("doc_id")["loglikelihoods"]]
        for item, ll in zip(items, lls):  # lm-eval's numbers are this model's, configured as applied
            own = own_loglikelihoods(loaded, item)
            assert max(abs(a - b) for a, b in zip(ll, own)) < 1e-5, (name, ll, own)  # float32 vs float64 softmax
        assert seen.setdefault(name, lls) == lls  # the same configuration again: the same numbers, bit for bit
        assert data["samples"] == {"original": 2, "effective": 2} and data["synthetic"]["length"] == LONG
        [score] = data["scores"]
        assert (score["metric"], score["filter"], score["higher_is_better"]) == ("acc", "none", True)
        assert score["value"] == table["metric:acc"].mean()  # the mean of the per-item scores ...
        # ... with the standard error of a mean of 0/1 scores over 2 items, as lm-eval computes it
        assert score["stderr"] == pytest.approx(table["metric:acc"].std(ddof=1) / math.sqrt(2))
        assert harness_info["version"] == harness.lm_eval_version()
        assert harness_info["n_shot"] == {f"pace_vt_mc_{LONG}": 0}
    remove_pace(loaded.model)
    # 2-bit states rounded at tokens 256 and 512 move the options' log-likelihoods of every item, by far more than
    # float32 noise (~1e-6)
    differences = [[abs(a - b) for a, b in zip(x, y)] for x, y in zip(seen["fp32"], seen["rtn-int2"])]
    assert all(max(d) > 1e-4 for d in differences) and max(map(max, differences)) > 1e-3, differences


def test_run_tasks_from_python_runs_every_configuration_with_the_same_settings(loaded, tmp_path):
    remove_pace(loaded.model)
    rows = run_tasks(loaded.model, loaded.tokenizer, ["fp32", "rtn-int4"], [local_task(tmp_path)],
                     TaskSettings(limit=2), folder=tmp_path / "synthetic", quiet=True)
    assert current_config(loaded.model) is None  # the model's own configuration is back
    assert list(rows["config"]) == ["fp32", "rtn-int4"]
    assert set(rows["subtask"]) == set(rows["task"]) == {"pace_test_tiny"}
    assert (rows["metric"] == "acc").all() and rows["value"].between(0, 1).all() and (rows["items"] == 2).all()
    assert rows["stderr"].notna().all()


def test_task_names_and_what_cannot_run_are_refused_in_the_users_words(loaded, tmp_path, monkeypatch):
    assert split_specs(["gsm8k,ifeval", "gsm8k", " pace_vt_4k "]) == ["gsm8k", "ifeval", "pace_vt_4k"]
    with pytest.raises(PaceError, match="names no task"):
        split_specs([" , "])
    with pytest.raises(PaceError, match="does not exist"):
        prepare_tasks([str(tmp_path / "missing.yaml")], lambda: loaded.tokenizer, tmp_path, TaskSettings())
    with pytest.raises(PaceError, match="too few"):
        prepare_tasks(["pace_vt_mc_200"], lambda: loaded.tokenizer, tmp_path, TaskSettings(samples=1))
    lm = task_lm(loaded.model, loaded.tokenizer, TaskSettings())
    long = prepare_tasks(["pace_vt_mc_9000"], lambda: loaded.tokenizer, tmp_path, TaskSettings(samples=1))
    with pytest.raises(PaceError, match="exceed the 8,192 this model takes"):  # lm-eval would cut its left
        check_lengths(long, lm)
    for bad in (dict(limit=0), dict(batch=0), dict(batch="max"), dict(num_fewshot=-1)):
        with pytest.raises(PaceError, match="is not allowed"):
            TaskSettings(**bad)
    monkeypatch.setattr(harness, "HFLM", None)  # lm-eval not installed
    with pytest.raises(PaceError, match=r'pip install "\.\[eval\]" in a clone of this repository'):
        prepare_tasks(["gsm8k"], lambda: loaded.tokenizer, tmp_path, TaskSettings())


def test_a_task_that_needs_a_download_fails_offline_with_what_to_download(tmp_path):
    """lm-eval's GSM8K needs its data set from the Hub: refused before the model loads, one message naming it and
    how to bring it (the index of lm-eval's tasks takes it some seconds to build)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-m", "pace_core", "tasks", "--tasks", "gsm8k", "--out", str(tmp_path),
                           "--quiet"], capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert "task 'gsm8k' needs the data set 'openai/gsm8k' from the Hugging Face Hub" in line
    assert "TaskManager().load(['gsm8k'])" in line and "HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1" in line
    assert "Loading weights" not in done.stderr  # refused before the model loads
    assert not list(tmp_path.glob("*/task-*.json"))


def test_the_library_and_the_command_line_import_without_lm_eval():
    code = ("import sys; sys.modules['lm_eval'] = None\n"  # `import lm_eval` now fails as if not installed
            "import pace_core.cli, pace_core.analysis.task_scores as s\n"
            "from pace_core.analysis import tasks\n"
            "assert tasks.HFLM is None and tasks.lm_eval_version() is not None\n"
            "sys.exit(pace_core.cli.main(['tasks', '--tasks', 'pace_vt_4k']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: downstream tasks run through lm-evaluation-harness, which is not installed" in done.stderr
    assert 'pip install ".[eval]" in a clone of this repository' in done.stderr


def test_scores_and_items_are_read_from_lm_eval_results():
    out = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.25, "exact_match,flex": 1.0,
                             "exact_match_stderr,flex": "N/A", "sample_len": 4}},
           "higher_is_better": {"t": {"acc": True, "exact_match": True}},
           "samples": {"t": [{"doc_id": 0, "filter": "none", "prompt_hash": "h", "target": 1, "metrics": ["acc"],
                              "acc": True, "resps": [[(-1.5, False)], [(-0.5, True)]]},
                             {"doc_id": 0, "filter": "flex", "target": "4", "metrics": ["exact_match"],
                              "exact_match": 1.0, "resps": [["The answer is 4"]]}]}}
    assert harness._scores(out) == [
        {"task": "t", "metric": "acc", "filter": "none", "value": 0.5, "stderr": 0.25, "higher_is_better": True},
        {"task": "t", "metric": "exact_match", "filter": "flex", "value": 1.0, "stderr": None,
         "higher_is_better": True}]
    table = harness._samples(out)
    assert list(table["loglikelihoods"].iloc[0]) == [-1.5, -0.5] and table["response"].iloc[1] == "The answer is 4"
    assert table["metric:acc"].iloc[0] == 1.0 and pd.isna(table["metric:acc"].iloc[1])


def test_a_synthetic_tasks_identity_is_its_items_not_its_path(loaded, tmp_path):
    settings = TaskSettings(samples=2)
    a, b = (prepare_tasks(["pace_vt_mc_700"], lambda: loaded.tokenizer, tmp_path / d, settings).tasks[0]
            for d in ("a", "b"))
    assert a.identity == b.identity and a.params(settings, "x") == b.params(settings, "x")
    assert a.identity["sha256"] == a.synthetic.sha256
    other = prepare_tasks(["pace_vt_mc_700"], lambda: loaded.tokenizer, tmp_path / "c", TaskSettings(samples=2, seed=1))
    assert other.tasks[0].identity != a.identity
    local = []
    for folder in (tmp_path / "d", tmp_path / "e"):
        folder.mkdir()
        local.append(prepare_tasks([local_task(folder)], lambda: None, tmp_path, settings).tasks[0])
    assert local[0].identity == local[1].identity  # a local task by its data's sha256, not its folder
    assert a.params(settings, "x")["batch"] is None  # a log-likelihood task's key holds no batch ...
    gen = prepare_tasks(["pace_vt_700"], lambda: loaded.tokenizer, tmp_path, settings).tasks[0]
    assert gen.output_type == "generate_until" and gen.params(settings, "x")["batch"] == 1  # ... a generation's does
