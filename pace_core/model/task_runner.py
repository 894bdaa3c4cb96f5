"""The work of ``python -m pace_core tasks`` (:mod:`pace_core.model.task_commands` registers it and imports this
module only when the command runs, so the other commands start without lm-eval and transformers).

Each (configuration, task) is one stored result of kind ``task`` (:mod:`pace_core.analysis.task_scores`), keyed as
every command keys its results (:meth:`pace_core.model.commands.Context.cached`: method version, model, weights,
dtype, device) and by the task's identity and the settings (:meth:`pace_core.analysis.tasks.Task.params`), stored
as soon as it is done: a stopped run resumes at the first pair not stored, and a later run with more
configurations or tasks reuses every pair it has. The reference rows (``--references``, default fp32 and bf16)
run first with the same settings.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from pace_core.analysis.task_scores import TASK_KIND, task_table
from pace_core.analysis.tasks import (
    TaskSettings,
    check_lengths,
    device_batch,
    evaluate_config,
    lm_eval_version,
    prepare_tasks,
    require_lm_eval,
    restored,
    task_lm,
)
from pace_core.config import config_to_dict
from pace_core.model import DEFAULT_MODEL_DIR
from pace_core.model.commands import _context, _print_table, _read_configs, _say_reused
from pace_core.results import ResultSet, result_key, results_dir
from pace_core.version import METHOD_VERSION

SYNTHETIC_DIR = "synthetic"
"""The folder under the model's results folder that the synthetic tasks are generated into (not shipped)."""


def _synthetic_dir(args: argparse.Namespace) -> Path:
    """--synthetic-dir, else the model's results folder's :data:`SYNTHETIC_DIR` (the model named as the results
    are: the embedded model by its folder)."""
    if args.synthetic_dir:
        return Path(args.synthetic_dir)
    return results_dir(args.model if args.model is not None else str(DEFAULT_MODEL_DIR), args.out) / SYNTHETIC_DIR


def run_tasks(args: argparse.Namespace) -> int:
    """Every task under every configuration (the references first), each pair stored as it finishes."""
    require_lm_eval()
    docs = _read_configs(list(dict.fromkeys([*args.references, *args.configs])))
    settings = TaskSettings(num_fewshot=args.num_fewshot, limit=args.limit, seed=args.seed, batch=args.batch or 1,
                            chat_template=args.chat_template, gen_kwargs=args.gen_kwargs,
                            bootstrap_iters=args.bootstrap_iters, samples=args.samples, max_length=args.max_length)
    # lm-eval's tasks are loaded (and refused) before the model; a synthetic task's tokenizer loads it
    tasks = prepare_tasks(args.tasks, lambda: _context(args).loaded.tokenizer, _synthetic_dir(args), settings,
                          quiet=args.quiet)
    ctx = _context(args)
    if args.batch is None:
        settings = dataclasses.replace(settings, batch=device_batch(ctx.loaded.device))
    cfgs = ctx.prepared(docs)
    lm = task_lm(ctx.loaded.model, ctx.loaded.tokenizer, settings, quiet=args.quiet)
    check_lengths(tasks, lm)
    version = lm_eval_version()
    params = {task.spec: task.params(settings, version) for task in tasks.tasks}
    found: dict[tuple[str, str], object] = {}
    keys: dict[tuple[str, str], str] = {}
    for task in tasks.tasks:
        k, f = ctx.stored(TASK_KIND, cfgs, params[task.spec])
        for cfg in cfgs:
            keys[cfg.name, task.spec], found[cfg.name, task.spec] = k[cfg.name], f[cfg.name]
        _say_reused(f"{task.name} scores", [c.name for c in cfgs if f[c.name] is not None])
    total = sum(task.scored(settings) for cfg in cfgs for task in tasks.tasks if found[cfg.name, task.spec] is None)
    with ctx.bar(total, f"tasks ({total:,} items)") as bar, restored(ctx.loaded.model):
        for cfg in cfgs:
            for task in tasks.tasks:
                if found[cfg.name, task.spec] is not None:
                    continue
                bar.set_postfix_str(f"{cfg.name} · {task.name}")
                data, table, harness = evaluate_config(ctx.loaded.model, lm, tasks, task, cfg, settings,
                                                       quiet=args.quiet)
                found[cfg.name, task.spec] = ctx.save(
                    TASK_KIND, keys[cfg.name, task.spec],
                    {**data, "params_key": result_key({**params[task.spec], "method_version": METHOD_VERSION}),
                     "config": cfg.name, "configuration": config_to_dict(cfg)},
                    table, configs=[cfg], extra={"lm_eval": harness})
                bar.update(task.scored(settings))
    sets = [ResultSet(TASK_KIND, task.spec, [found[c.name, task.spec] for c in cfgs]) for task in tasks.tasks]
    _print_table(task_table(sets))
    print(f"(lm-eval {version}; each score ± its standard error as lm-eval reports it; the state format applied "
          f"with pace_core.apply to {ctx.loaded.reference})")
    return 0
