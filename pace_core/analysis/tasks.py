"""Downstream tasks with the state format applied, through lm-evaluation-harness (issue 47).

Each configuration is applied to the one model instance with :func:`pace_core.model.deploy.apply` (the same
admission as every path: a file for another model is refused) and lm-eval's own ``simple_evaluate`` runs the
tasks on an ``HFLM`` that wraps that instance (:func:`task_lm`: no second loading path). Every configuration
runs with the same settings (:class:`TaskSettings`: few-shot examples, limit, seeds, batch, chat template,
generation arguments); the model's own configuration is restored afterwards.

What a configuration changes, and where: a log-likelihood task (multiple choice) scores its context and
continuation in one forward, the prefill path, whose state is rounded at the end of every P-token segment
(a configuration whose P exceeds the context, such as STEPQuant's, changes no log-likelihood there); a
generation task (GSM8K, IFEval, MATH-500, RULER's variable tracking) prefills the prompt and decodes, rounding
as the decode path does (every dP tokens). lm-eval pads a batch of generations on the left, and the P-token
segments are counted over the padded positions (:mod:`pace_core.model.patch`), so a generation task's
result depends on its batch: its key holds the batch.

Tasks are named as lm-eval names them (``gsm8k``, ``ifeval``, ``minerva_math500``; a group such as ``mmlu``
scores each subtask), as the path of a task config (YAML) of the user's, or as a synthetic variable-tracking
task generated here at a context length in the model's tokens (``pace_vt_32k``, ``pace_vt_mc_4096``:
:mod:`pace_core.analysis.vartrack`, written into a local folder and registered with lm-eval). A task is loaded
once before anything runs (:func:`prepare_tasks`), so a task whose data set must be downloaded, and cannot be,
is refused at once with what to download and how (:func:`unavailable`).

lm-eval is an optional dependency (``pip install ".[eval]"`` in a clone of this repository): this module imports
without it and :func:`require_lm_eval` says what to install. Stored results are read by
:mod:`pace_core.analysis.task_scores`, which never needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

from pace_core.analysis import vartrack
from pace_core.analysis.task_scores import INSTALL_COMMAND
from pace_core.config import PaceConfig
from pace_core.errors import PaceError
from pace_core.model.deploy import apply
from pace_core.model.patch import apply_pace, current_config, remove_pace
from pace_core.results import canonical_json, text_sha256

try:  # optional: the [eval] extra
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
except ImportError:
    simple_evaluate = HFLM = TaskManager = None

LM_EVAL_TESTED = "0.4.13"
"""The lm-eval version the tests run (requirements-dev.txt)."""
INSTALL = (f"{INSTALL_COMMAND} in a clone of this repository (lm-eval with the IFEval and MATH extras), or pip "
           f"install lm-eval=={LM_EVAL_TESTED}")

_DOWNLOADS = {
    "ifeval": 'the NLTK data punkt_tab: python -c "import nltk; nltk.download(\'punkt_tab\')", then copy ~/nltk_data',
}
"""What some tasks download besides their data set (lm-eval's IFEval fetches NLTK's sentence tokenizer)."""


def lm_eval_version() -> str | None:
    """The installed lm-eval's version, or None when it is not installed."""
    try:
        return importlib.metadata.version("lm_eval")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_lm_eval() -> None:
    """PaceError saying what to install when lm-eval is not importable."""
    if HFLM is None:
        raise PaceError(f"downstream tasks run through lm-evaluation-harness, which is not installed: {INSTALL}")


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """The settings every configuration's tasks run with: ``num_fewshot`` (None: each task's own), ``limit``
    (the first items of each task; None: all), ``seed`` (lm-eval's Python, NumPy, torch and few-shot seeds, and
    the synthetic tasks' items), ``batch`` (HFLM's batch size, or ``"auto"``: the largest that fits, found by
    lm-eval), ``chat_template``, ``gen_kwargs`` (overrides of the generation tasks' arguments),
    ``bootstrap_iters`` (lm-eval's resamples for the standard error of a score that is not a mean; a mean's is
    computed), ``samples`` (items of a synthetic task) and ``max_length`` (HFLM's context limit; None: the model
    config's)."""

    num_fewshot: int | None = None
    limit: int | None = None
    seed: int = 0
    batch: int | str = 1
    chat_template: bool = False
    gen_kwargs: dict[str, Any] | None = None
    bootstrap_iters: int = 100_000
    samples: int = 50
    max_length: int | None = None

    def __post_init__(self) -> None:
        checks = (("num_fewshot", self.num_fewshot, 0, True), ("limit", self.limit, 1, True),
                  ("seed", self.seed, 0, False), ("bootstrap_iters", self.bootstrap_iters, 0, False),
                  ("samples", self.samples, 1, False), ("max_length", self.max_length, 1, True))
        for name, value, low, optional in checks:
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise PaceError(f"{name}={value!r} is not allowed; allowed: an integer >= {low}"
                                + (" or none" if optional else ""))
        if not (self.batch == "auto" or (isinstance(self.batch, int) and not isinstance(self.batch, bool)
                                         and self.batch >= 1)):
            raise PaceError(f"batch={self.batch!r} is not allowed; allowed: an integer >= 1 or 'auto'")


@dataclasses.dataclass(frozen=True)
class Task:
    """A task ready to run: ``spec`` as asked for, ``name`` (``spec``, or for a config file the lm-eval task names
    it defines), ``load`` what lm-eval loads it by (a name or a config path), its ``output_type``, ``items``
    (before the limit), ``identity`` (what defines it: name, version and config with local data files by their
    sha256) and, for a synthetic task, its files."""

    spec: str
    name: str
    load: str
    output_type: str
    items: int
    version: Any
    identity: dict[str, Any]
    synthetic: vartrack.TaskFiles | None = None

    def scored(self, settings: TaskSettings) -> int:
        """The items scored under ``settings``' limit."""
        return self.items if settings.limit is None else min(self.items, settings.limit)

    def params(self, settings: TaskSettings, lm_eval: str | None) -> dict[str, Any]:
        """What a stored result of this task is keyed on besides the model and the configuration: the task's
        identity, the settings (the batch only for a generation task: module docstring) and lm-eval's version."""
        return {"task": self.identity, "num_fewshot": settings.num_fewshot, "limit": settings.limit,
                "seed": settings.seed, "chat_template": settings.chat_template, "gen_kwargs": settings.gen_kwargs,
                "bootstrap_iters": settings.bootstrap_iters, "max_length": settings.max_length,
                "batch": settings.batch if self.output_type == "generate_until" else None, "lm_eval": lm_eval}


@dataclasses.dataclass(frozen=True)
class Tasks:
    """The tasks of a run and the lm-eval TaskManager that knows them."""

    tasks: tuple[Task, ...]
    manager: Any


def split_specs(specs: Sequence[str]) -> list[str]:
    """Task names given as separate arguments and/or comma-separated lists, in order, without repeats."""
    out: list[str] = []
    for spec in specs:
        for part in str(spec).split(","):
            if part.strip() and part.strip() not in out:
                out.append(part.strip())
    if not out:
        raise PaceError("--tasks names no task; allowed: lm-eval task names (gsm8k,ifeval,minerva_math500), task "
                        "config files (.yaml) or synthetic tasks (pace_vt_<length>, pace_vt_mc_<length>)")
    return out


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """16 hex digits naming a tokenizer's vocabulary (a synthetic task's items depend on it)."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode("utf-8")).hexdigest()[:16]


def _portable(config: Any) -> Any:
    """A task config as its identity: local files by their sha256 instead of their path, the config file's
    path left out, so another machine's run of the same task has the same identity."""
    if isinstance(config, dict):
        return {k: _portable(v) for k, v in config.items() if k != "config_source"}
    if isinstance(config, list):
        return [_portable(v) for v in config]
    if isinstance(config, str) and len(config) < 4096 and ("/" in config or "\\" in config):
        path = Path(config)
        with contextlib.suppress(OSError):
            if path.is_file():
                return {"file": path.name, "sha256": text_sha256(path)}
    return config


def unavailable(spec: str, err: BaseException) -> PaceError:
    """The one message of a task that cannot be loaded here: the data set or package it needs, and how to get
    it on a machine without network (lm-eval's own load of the task run where there is network, the Hugging
    Face cache copied from there, then the offline switches)."""
    text = f"{type(err).__name__}: {err}"
    if isinstance(err, ModuleNotFoundError | ImportError):
        return PaceError(f"task {spec!r} needs a package lm-eval does not install by default ({text}); install "
                         f"it, e.g. {INSTALL}")
    found = re.search(r"reach '([^']+)'|Dataset '?([\w./-]+)'? is not cached|datasets/([\w.-]+/[\w.-]+)", text)
    dataset = next((g for g in found.groups() if g), None) if found else None
    what = f"the data set {dataset!r} from the Hugging Face Hub" if dataset else "a download"
    extra = f" and {_DOWNLOADS[spec]}" if spec in _DOWNLOADS else ""
    return PaceError(
        f"task {spec!r} needs {what}{extra}, which cannot be reached from here and is not in the local cache "
        f"({text[:300]}). On a machine with network, download it with python -c \"from lm_eval.tasks import "
        f"TaskManager; TaskManager().load(['{spec}'])\" (or run this command there once), copy that machine's "
        "~/.cache/huggingface (HF_HOME) here, and run with HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1. Synthetic "
        "tasks (pace_vt_<length>, pace_vt_mc_<length>) and task configs over local files need no download")


@contextlib.contextmanager
def _quiet_harness(quiet: bool) -> Iterator[None]:
    """lm-eval's and datasets' log lines at warning level (errors only when ``quiet``) for the block."""
    loggers = [logging.getLogger(name) for name in ("lm_eval", "datasets")]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR if quiet else logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, before):
            lg.setLevel(level)


def prepare_tasks(specs: Sequence[str], tokenizer_of: Callable[[], Any], folder: str | Path,
                  settings: TaskSettings, *, quiet: bool = False) -> Tasks:
    """The tasks named by ``specs`` (:func:`split_specs`), each loaded once by lm-eval so that a task that cannot
    be loaded is refused before anything runs: lm-eval's own tasks (whose index takes lm-eval some seconds to
    build, so it is built only when one is asked for) and config files first, then the synthetic ones, generated
    for the tokenizer ``tokenizer_of()`` returns (called only when there is one: a command loads its model there)
    into a folder of ``folder`` per task and setting (``<name>-<16 hex digits>``). PaceError: an unknown name
    (with the closest known ones), a task that needs a download or a package."""
    require_lm_eval()
    names = split_specs(specs)
    synthetic = {spec: vt for spec in names if (vt := vartrack.parse_name(spec, samples=settings.samples,
                                                                          seed=settings.seed)) is not None}
    for spec in names:
        if spec not in synthetic and spec.lower().endswith((".yaml", ".yml")) and not Path(spec).is_file():
            raise PaceError(f"task config {spec!r} does not exist; allowed: the path of an lm-eval task YAML")
    defaults = any(spec not in synthetic and not spec.lower().endswith((".yaml", ".yml")) for spec in names)
    found: dict[str, Task] = {}
    with _quiet_harness(quiet):
        manager = TaskManager(include_defaults=defaults)
        for spec in names:
            if spec not in synthetic:
                load = str(Path(spec).resolve()) if spec.lower().endswith((".yaml", ".yml")) else spec
                found[spec] = _task(spec, load, _load(manager, spec, load), None)
        for spec, vt in synthetic.items():
            tokenizer = tokenizer_of()
            tag = hashlib.sha256(canonical_json({**vt.settings, "tokenizer": tokenizer_fingerprint(tokenizer)})
                                 .encode()).hexdigest()[:16]
            files = vartrack.write_task(vt, tokenizer, Path(folder) / f"{vt.name}-{tag}")
            load = str(files.config.resolve())
            found[spec] = _task(spec, load, _load(manager, spec, load), files)
    return Tasks(tuple(found[spec] for spec in names), manager)


def _load(manager: Any, spec: str, load: str) -> dict[str, Any]:
    """lm-eval's tasks of ``load`` (a name or a config path; a group's subtasks); PaceError naming the close names
    of an unknown one, or what a task that cannot be loaded needs (:func:`unavailable`)."""
    try:
        return manager.load([load])["tasks"]
    except KeyError:
        close = difflib.get_close_matches(spec, manager.all_tasks, n=5)
        raise PaceError(f"task {spec!r} is unknown to lm-eval {lm_eval_version()}; "
                        + (f"close names: {', '.join(close)}; " if close else "")
                        + "allowed: lm-eval task names (`lm-eval ls tasks` lists them), task config files (.yaml) "
                          "or pace_vt_<length> / pace_vt_mc_<length>") from None
    except Exception as err:  # a data set or a package lm-eval could not get: one message for all of them
        raise unavailable(spec, err) from None


def _task(spec: str, load: str, loaded: dict[str, Any], files: vartrack.TaskFiles | None) -> Task:
    """The :class:`Task` of lm-eval's loaded tasks (a group's subtasks together)."""
    kinds = {t.get_config("output_type") for t in loaded.values()}
    name = ",".join(sorted(loaded)) if files is None and spec.lower().endswith((".yaml", ".yml")) else spec
    identity = {"name": name, "tasks": {task: {"version": t.VERSION, "config": _portable(t.dump_config())}
                                        for task, t in sorted(loaded.items())}}
    if files is not None:
        identity = {"name": name, "synthetic": files.task.settings, "sha256": files.sha256,
                    "version": next(iter(loaded.values())).VERSION}
    version = {task: t.VERSION for task, t in loaded.items()}
    return Task(spec, name, load, "generate_until" if "generate_until" in kinds else sorted(kinds)[0],
                sum(len(t.eval_docs) for t in loaded.values()),
                next(iter(version.values())) if len(version) == 1 else version, identity, files)


def task_lm(model: nn.Module, tokenizer: Any, settings: TaskSettings, *, quiet: bool = False) -> Any:
    """lm-eval's HFLM around the model instance itself (its batch size and context limit from ``settings``);
    ``quiet``: without lm-eval's progress bars of the requests."""
    require_lm_eval()
    with _quiet_harness(True):  # its warning that a model instance ignores loading arguments: none are given
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch, max_length=settings.max_length)
    if quiet:  # the evaluator calls these without their disable_tqdm argument
        for request in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
            setattr(lm, request, functools.partial(getattr(lm, request), disable_tqdm=True))
    return lm


def check_lengths(tasks: Tasks, lm: Any) -> None:
    """PaceError when a synthetic task's context is longer than the model takes (lm-eval would cut its left)."""
    for task in tasks.tasks:
        if task.synthetic is not None and task.synthetic.task.length > lm.max_length:
            raise PaceError(f"task {task.spec}: {task.synthetic.task.length:,} tokens of context exceed the "
                            f"{lm.max_length:,} this model takes (its config's max_position_embeddings, or "
                            "max_length); allowed: a length up to that")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _scores(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Every score of lm-eval's results (each task and group, metric and filter) with its standard error."""
    rows = []
    for name, res in out["results"].items():
        direction = out.get("higher_is_better", {}).get(name, {})
        for key, value in res.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or _number(value) is None or not math.isfinite(value):
                continue
            se = _number(res.get(f"{metric}_stderr,{filt}"))
            rows.append({"task": name, "metric": metric, "filter": filt, "value": float(value),
                         "stderr": se if se is not None and math.isfinite(se) else None,
                         "higher_is_better": bool(direction.get(metric, True))})
    return rows


def _cell(value: Any) -> Any:
    """A per-item value as a table cell: numbers and text as they are, anything else as JSON."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float | str) or value is None:
        return value
    return json.dumps(value, default=str)


def _samples(out: dict[str, Any]) -> pd.DataFrame:
    """One row per lm-eval item and filter: task, doc_id, filter, the prompt's hash, the target, each metric, and
    what the model gave: the log-likelihood of each continuation (log-likelihood tasks) or the generated text."""
    rows = []
    for name, samples in out.get("samples", {}).items():
        for s in samples:
            resps = s.get("resps") or []
            ll = [float(r[0][0]) for r in resps if r and isinstance(r[0], tuple | list)]
            text = [r[0] for r in resps if r and isinstance(r[0], str)]
            rows.append({"task": name, "doc_id": int(s["doc_id"]), "filter": str(s.get("filter", "none")),
                         "prompt_hash": str(s.get("prompt_hash", "")), "target": _cell(s.get("target")),
                         "loglikelihoods": ll or None, "response": text[0] if text else None,
                         **{f"metric:{m}": _cell(s.get(m)) for m in s.get("metrics", [])}})
    return pd.DataFrame(rows)


def evaluate(lm: Any, tasks: Tasks, task: Task, settings: TaskSettings, *, quiet: bool = False
             ) -> tuple[dict[str, Any], pd.DataFrame, dict[str, Any]]:
    """One task on the model as it is configured now, through ``simple_evaluate``: ``(data, table, harness)``,
    the data of a stored task result (:mod:`pace_core.analysis.task_scores`), its per-item table
    (:func:`_samples`) and what lm-eval ran it with (its version, the task's version and few-shot examples, the
    limit, seeds, batch sizes, context limit), for the provenance."""
    seed = settings.seed
    with _quiet_harness(quiet):
        out = simple_evaluate(model=lm, tasks=[task.load], task_manager=tasks.manager,
                              num_fewshot=settings.num_fewshot, limit=settings.limit, log_samples=True,
                              bootstrap_iters=settings.bootstrap_iters, apply_chat_template=settings.chat_template,
                              gen_kwargs=dict(settings.gen_kwargs) if settings.gen_kwargs else None,
                              random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                              fewshot_random_seed=seed)
    shots = out.get("n-shot", {})
    counts = out.get("n-samples", {})
    data = {"task": task.name, "scores": _scores(out), "output_type": task.output_type, "version": task.version,
            "num_fewshot": next(iter(shots.values())) if len(set(shots.values())) == 1 else shots,
            "limit": settings.limit,
            "samples": {"original": sum(c["original"] for c in counts.values()),
                        "effective": sum(c["effective"] for c in counts.values())},
            "synthetic": None if task.synthetic is None else {
                **task.synthetic.task.settings, "sha256": task.synthetic.sha256, "tokens": list(task.synthetic.tokens)}}
    harness = {"version": lm_eval_version(), "task_versions": out.get("versions", {}), "n_shot": shots,
               "limit": settings.limit, "seed": seed, "batch": settings.batch,
               "batch_sizes": list(getattr(lm, "batch_sizes", {}).values()), "max_length": lm.max_length,
               "chat_template": settings.chat_template, "gen_kwargs": settings.gen_kwargs,
               "bootstrap_iters": settings.bootstrap_iters}
    return data, _samples(out), harness


@contextlib.contextmanager
def restored(model: nn.Module) -> Iterator[None]:
    """The model's own configuration (:func:`pace_core.model.patch.current_config`) put back when the block ends,
    whatever ends it."""
    before = current_config(model)
    try:
        yield
    finally:
        if before is None:
            remove_pace(model)
        else:
            apply_pace(model, before)


def run_tasks(model: nn.Module, tokenizer: Any, configs: Sequence[Any], specs: Sequence[str],
              settings: TaskSettings = TaskSettings(), *, folder: str | Path, quiet: bool = False,
              progress: Callable[[int], None] | None = None) -> pd.DataFrame:
    """Every task of ``specs`` on ``model`` under every configuration of ``configs`` (names, exported files or
    PaceConfigs, each applied with :func:`pace_core.apply`; one needing a calibration must come calibrated, as an
    exported file), with the same ``settings``; synthetic tasks are written into ``folder``. ``progress(n)``
    after each configuration's task, with the items it scored. The model's own configuration is restored at
    the end. Returns one row per configuration, task, metric and filter: config, task (asked for), subtask,
    metric, filter, value, stderr, higher_is_better, items (scored). Nothing is stored: ``python -m pace_core
    tasks`` stores each (configuration, task) as it finishes and resumes."""
    tasks = prepare_tasks(specs, lambda: tokenizer, folder, settings, quiet=quiet)
    lm = task_lm(model, tokenizer, settings, quiet=quiet)
    check_lengths(tasks, lm)
    rows = []
    with restored(model):
        for config in configs:
            cfg = apply(model, config)
            for task in tasks.tasks:
                data, _, _ = evaluate(lm, tasks, task, settings, quiet=quiet)
                rows += [{"config": cfg.name, "task": task.name, "subtask": s["task"], "metric": s["metric"],
                          "filter": s["filter"], "value": s["value"], "stderr": s["stderr"],
                          "higher_is_better": s["higher_is_better"], "items": data["samples"]["effective"]}
                         for s in data["scores"]]
                if progress is not None:
                    progress(task.scored(settings))
    return pd.DataFrame(rows)


def evaluate_config(model: nn.Module, lm: Any, tasks: Tasks, task: Task, cfg: PaceConfig, settings: TaskSettings,
                    *, quiet: bool = False) -> tuple[dict[str, Any], pd.DataFrame, dict[str, Any]]:
    """:func:`evaluate` of ``task`` with ``cfg`` applied to ``model`` (the instance ``lm`` wraps)."""
    apply(model, cfg)
    return evaluate(lm, tasks, task, settings, quiet=quiet)


def device_batch(device: torch.device | str) -> int | str:
    """The default batch of a device: 1 on the CPU (a batch saves nothing there), lm-eval's ``auto`` elsewhere."""
    return 1 if torch.device(device).type == "cpu" else "auto"
