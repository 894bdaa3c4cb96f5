"""Stored task results read without lm-eval: scores, the table per configuration, the quality axes they give a
stored comparison (matched by configuration record), and the check of a stored task result."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from pace_core.analysis.compare import point
from pace_core.analysis.task_scores import TASK_KIND, Score, scores, setting_label, task_axes, task_table
from pace_core.config import get_config
from pace_core.errors import PaceError
from pace_core.export import config_to_dict
from pace_core.frontier import Point, best_under
from pace_core.result_checks import check_result
from pace_core.results import Result, ResultSet, make_provenance
from pace_core.shapes import BUILTIN_SHAPES


def task_data(task: str, config, values: dict[str, float], *, stderr: float | None = 0.02, limit=None,
              original: int = 100, shots: int = 0) -> dict:
    """A stored task result's data as the command writes it (scores of one lm-eval task, metrics ``values``)."""
    return {"task": task, "output_type": "multiple_choice", "version": 1.0, "num_fewshot": shots, "limit": limit,
            "samples": {"original": original, "effective": limit or original}, "synthetic": None,
            "scores": [{"task": task, "metric": m, "filter": "none", "value": v, "stderr": stderr,
                        "higher_is_better": True} for m, v in values.items()],
            "config": config.name, "configuration": config_to_dict(config), "params_key": f"{task}-{limit}"}


def result(data: dict) -> Result:
    table = pd.DataFrame({"task": [data["task"]], "doc_id": [0], "filter": ["none"]})
    return Result(TASK_KIND, "m", "0" * 16, data, make_provenance("m", command="python -m pace_core tasks",
                                                                  extra={"lm_eval": {"version": "0.4.13"}}), table)


def test_scores_and_their_table_per_configuration():
    sets = [ResultSet(TASK_KIND, "a", [result(task_data("pace_vt_mc_4096", get_config(c), {"acc": v}))
                                       for c, v in (("fp32", 0.5), ("pace-4", 0.25))]),
            ResultSet(TASK_KIND, "b", [result(task_data("gsm8k", get_config("fp32"), {"exact_match": 0.125},
                                                        stderr=None, limit=10, shots=5))])]
    [s] = scores(sets[0].results[0].data)
    assert s == Score("pace_vt_mc_4096", "acc", "none", 0.5, 0.02, True) and s.label == "pace_vt_mc_4096 · acc"
    assert setting_label(sets[1].results[0].data) == "5-shot, 10 of 100 items"
    table = task_table(sets)
    assert list(table["config"]) == ["fp32", "pace-4"]
    assert table.set_index("config").to_dict() == {"pace_vt_mc_4096 · acc": {"fp32": "0.500 ± 0.020",
                                                                             "pace-4": "0.250 ± 0.020"},
                                                   "gsm8k · exact_match": {"fp32": "0.125", "pace-4": ""}}
    clash = task_table([sets[0], ResultSet(TASK_KIND, "c", [result(task_data("pace_vt_mc_4096", get_config("fp32"),
                                                                             {"acc": 0.75}, limit=20))])])
    assert sorted(clash.columns) == ["config", "pace_vt_mc_4096 · acc [0-shot, 100 of 100 items]",
                                     "pace_vt_mc_4096 · acc [0-shot, 20 of 100 items]"]


def test_task_axes_match_the_comparisons_points_by_their_configuration():
    shape = BUILTIN_SHAPES["qwen3.5-4b"]
    names = ["fp32", "rtn-int4", "pace-4", "rtn-int8"]
    points = [point(get_config(n), shape, {"kl": kl, "agreement": 0.9, "bpb": 1.5, "ppl": 20.0, "tokens": 99})
              for n, kl in zip(names, (0.0, 1e-2, 1e-3, 1e-4))]
    renamed = get_config("rtn-int8").replace(name="my-int8")  # the same record but its name: not a match
    other = get_config("pace-4").replace(decode_period=16)  # a configuration the comparison does not hold
    results = [result(task_data("t", c, {"acc": v, "acc_norm": 1 - v})) for c, v in
               ((get_config("fp32"), 0.8), (get_config("rtn-int4"), 0.9), (get_config("pace-4"), 0.3),
                (renamed, 0.95), (other, 1.0))]
    [acc, norm] = task_axes([ResultSet(TASK_KIND, "k", results)], points)
    assert acc.scores == {"fp32": 0.8, "rtn-int4": 0.9, "pace-4": 0.3} and acc.higher_is_better
    assert norm.scores == pytest.approx({"fp32": 0.2, "rtn-int4": 0.1, "pace-4": 0.7})
    assert acc.label == "t · acc [0-shot, 100 of 100 items]" and acc.evidence["task"] == "t"
    assert acc.evidence["lm_eval"] == "0.4.13" and acc.evidence["command"] == "python -m pace_core tasks"
    stored = [Point.of(p) for p in points]
    # the same budget, three axes, three answers: KL picks pace-4, acc rtn-int4, acc_norm pace-4 again
    assert best_under(stored, 6.0).config == "pace-4" and best_under(stored, 6.0, acc).config == "rtn-int4"
    assert best_under(stored, 6.0, norm).config == "pace-4"
    assert task_axes([ResultSet(TASK_KIND, "k", results[3:])], points) == []  # nothing matched: no axis


def test_the_check_of_a_stored_task_result():
    good = task_data("t", get_config("fp32"), {"acc": 0.5, "word_perplexity": 12.0})
    check_result(result(good))
    for change, reason in ((lambda d: d["scores"].clear(), "holds no score"),
                           (lambda d: d["scores"][0].update(value=1.5), "allowed: finite, >= 0, <= 1"),
                           (lambda d: d["scores"][1].update(value=math.nan), "allowed: finite"),
                           (lambda d: d["scores"][0].update(stderr=-0.1), "standard error"),
                           (lambda d: d["samples"].update(effective=0), "scored 0 of 100 items"),
                           (lambda d: d.pop("configuration"), "lacks the field configuration")):
        bad = task_data("t", get_config("fp32"), {"acc": 0.5, "word_perplexity": 12.0})
        change(bad)
        with pytest.raises(PaceError, match=reason):
            check_result(result(bad))
    with pytest.raises(PaceError, match="no table"):
        check_result(Result(TASK_KIND, "m", "0" * 16, good, {}, None))
