"""Task scores as ``python -m pace_core tasks`` stores them (kind ``task``), read without lm-eval: each result's
scores with the standard errors lm-eval reported, a table of them per configuration, and the quality axes they
give the Compare page (:class:`pace_core.frontier.Axis`).

A stored task result (one per configuration, task and setting; :mod:`pace_core.analysis.tasks` makes them) holds
in its data: ``task`` (the name asked for), ``scores`` (one per lm-eval task, metric and filter: ``task``,
``metric``, ``filter``, ``value``, ``stderr`` (None where lm-eval reports none), ``higher_is_better``),
``output_type``, ``version`` (the task's), ``num_fewshot``, ``limit``, ``samples`` (``original``: the task's
items, ``effective``: those scored), ``synthetic`` (a generated task's settings, items' sha256 and prompt
token range, else None), and as every per-configuration result ``config``, ``configuration`` and ``params_key``
(the same for every configuration run with the same task and settings).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from pace_core.frontier import Axis
from pace_core.results import ResultSet, result_key

TASK_KIND = "task"
"""The result kind of one configuration's scores on one task."""
INSTALL_COMMAND = 'pip install ".[eval]"'
"""How lm-evaluation-harness is installed for the tasks: the ``[eval]`` extra, in a clone of this repository (README;
the project publishes no package to a registry, so a registry name would install whatever holds it)."""


def harness_installed() -> bool:
    """Whether lm-evaluation-harness can be imported here (without importing it)."""
    return importlib.util.find_spec("lm_eval") is not None


@dataclass(frozen=True)
class Score:
    """One score of a stored task result: lm-eval's task (a group's subtask included), metric and filter, its
    value, standard error (None: not reported) and direction."""

    task: str
    metric: str
    filter: str
    value: float
    stderr: float | None
    higher_is_better: bool

    @property
    def label(self) -> str:
        """``task · metric`` with the filter where it is not lm-eval's ``none``."""
        return f"{self.task} · {self.metric}" + ("" if self.filter == "none" else f" ({self.filter})")

    @property
    def shown(self) -> str:
        """The value with its standard error, as text."""
        return f"{self.value:.3f}" + ("" if self.stderr is None else f" ± {self.stderr:.3f}")


def scores(data: dict[str, Any]) -> list[Score]:
    """The scores of a stored task result's data."""
    return [Score(str(s["task"]), str(s["metric"]), str(s["filter"]), float(s["value"]),
                  None if s.get("stderr") is None else float(s["stderr"]), bool(s["higher_is_better"]))
            for s in data["scores"]]


def setting_label(data: dict[str, Any]) -> str:
    """The setting a task result was run with, in words: few-shot examples, items scored of the task's, and a
    synthetic task's prompt tokens."""
    shots = data.get("num_fewshot")
    samples = data.get("samples") or {}
    parts = [f"{shots}-shot" if shots is not None else "the task's own few-shot setting",
             f"{int(samples.get('effective', 0)):,} of {int(samples.get('original', 0)):,} items"]
    synthetic = data.get("synthetic")
    if synthetic:
        low, high = synthetic["tokens"]
        parts.append(f"prompts of {low:,}-{high:,} tokens (seed {synthetic['seed']})")
    return ", ".join(parts)


def _configuration_key(configuration: dict[str, Any]) -> str:
    return result_key(configuration)


def task_table(sets: Sequence[ResultSet]) -> pd.DataFrame:
    """One row per configuration (in the order of the sets' results), one column per score of the sets
    (``task · metric (filter)``, with the setting when two sets share a label), each cell ``value ± stderr`` as
    lm-eval reported it; empty where a configuration has no result."""
    rows: dict[str, dict[str, str]] = {}
    for result_set in sets:
        task = result_set.results[0].data["task"]
        clash = sum(1 for other in sets if other.results[0].data["task"] == task) > 1
        for r in result_set.results:
            row = rows.setdefault(r.data["config"], {})
            for score in scores(r.data):
                row[score.label + (f" [{setting_label(r.data)}]" if clash else "")] = score.shown
    table = pd.DataFrame.from_dict(rows, orient="index").fillna("")
    table.index.name = "config"
    return table.reset_index()


def task_axes(sets: Sequence[ResultSet], points: Sequence[dict[str, Any]]) -> list[Axis]:
    """The quality axes the stored task results give the stored comparison ``points`` (its ``data["points"]``):
    one per set and score, its values those of the configurations that are points of the comparison (matched by
    their configuration record, calibration included, whatever their names), higher better where lm-eval says
    so; an axis no point has a value on is left out. Each axis's ``evidence`` names the task, metric, filter,
    setting and the results' provenance."""
    by_record = {_configuration_key(p["configuration"]): p["config"] for p in points}
    axes = []
    for result_set in sets:
        matched = [(by_record[k], r) for r in result_set.results
                   if (k := _configuration_key(r.data["configuration"])) in by_record]
        if not matched:
            continue
        first = matched[0][1]
        for score in scores(first.data):
            values, errors = {}, {}
            for name, r in matched:
                found = [s for s in scores(r.data) if (s.task, s.metric, s.filter) == (score.task, score.metric,
                                                                                      score.filter)]
                if found and math.isfinite(found[0].value):
                    values[name], errors[name] = found[0].value, found[0].stderr
            if not values:
                continue
            prov = first.provenance
            axes.append(Axis(
                key=f"task:{result_set.params_key}:{score.task}:{score.metric}:{score.filter}",
                label=f"{score.label} [{setting_label(first.data)}]", higher_is_better=score.higher_is_better,
                fmt=".3f", scores=values, stderr=errors,
                evidence={"task": score.task, "metric": score.metric, "filter": score.filter,
                          "asked": first.data["task"], "version": first.data.get("version"),
                          "num_fewshot": first.data.get("num_fewshot"), "limit": first.data.get("limit"),
                          "samples": first.data.get("samples"), "lm_eval": (prov.get("lm_eval") or {}).get("version"),
                          "command": prov.get("command"), "date": prov.get("date"),
                          "code": (prov.get("code") or {}).get("commit")}))
    return axes

