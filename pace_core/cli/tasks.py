"""``python -m pace_core tasks``: downstream tasks through lm-evaluation-harness with each configuration applied
(issue 47; the work is :mod:`pace_core.analysis.tasks`, this is its command line).

Each (configuration, task) is one stored result of kind ``task`` (:mod:`pace_core.analysis.task_scores`), keyed as
every command keys its results (:meth:`pace_core.cli.context.Context.cached`: method version, model, weights,
dtype, device) and by the task's identity and the settings (:meth:`pace_core.analysis.tasks.Task.params`), stored
as soon as it is done: a stopped run resumes at the first pair not stored, and a later run with more
configurations or tasks reuses every pair it has. The reference rows (``--references``, default fp32 and bf16)
run first with the same settings. The analyses (lm-eval and transformers with them) are imported inside
:func:`run_tasks`, as the other commands import theirs, so ``bits`` and ``--help`` start without them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from pace_core.cli.context import _common, _context, _interruptible, _print_table, _read_configs, _say_reused
from pace_core.export import config_to_dict
from pace_core.model import DEFAULT_MODEL_DIR
from pace_core.results import ResultSet, result_key, results_dir
from pace_core.version import METHOD_VERSION

REFERENCES = ("fp32", "bf16")
DEFAULT_CONFIGS = ("rtn-int4", "pace-4", "pace-4-8", "stepquant-4")
SYNTHETIC_DIR = "synthetic"
"""The folder under the model's results folder that the synthetic tasks are generated into (not shipped)."""


def _batch(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: an integer >= 1 or auto") from None


def _gen_kwargs(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a JSON object, e.g. "
                                         '\'{"max_gen_toks": 512}\'')
    return value


def _synthetic_dir(args: argparse.Namespace) -> Path:
    """--synthetic-dir, else the model's results folder's :data:`SYNTHETIC_DIR` (the model named as the results
    are: the embedded model by its folder)."""
    if args.synthetic_dir:
        return Path(args.synthetic_dir)
    return results_dir(args.model if args.model is not None else str(DEFAULT_MODEL_DIR), args.out) / SYNTHETIC_DIR


def run_tasks(args: argparse.Namespace) -> int:
    """Every task under every configuration (the references first), each pair stored as it finishes."""
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


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``tasks`` command."""
    p = subparsers.add_parser(
        "tasks", help="downstream tasks (lm-evaluation-harness) with each configuration applied, fp32/bf16 beside",
        description="Runs lm-eval tasks on the loaded model with each configuration applied by pace_core.apply "
                    "(the same settings for all; the references first) and stores each (configuration, task) "
                    "as it finishes. Needs lm-eval: pip install \".[eval]\" in a clone of this repository.")
    _common(p)
    p.add_argument("--tasks", nargs="+", required=True,
                   help="lm-eval task names (comma lists allowed: gsm8k,ifeval,minerva_math500), task config files "
                        "(.yaml), or synthetic variable tracking generated here at a length in the model's tokens: "
                        "pace_vt_<length> (RULER's, generation) or pace_vt_mc_<length> (multiple choice), e.g. "
                        "pace_vt_32k")
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                   help=f"named configurations or config JSON files (default {' '.join(DEFAULT_CONFIGS)})")
    p.add_argument("--references", nargs="*", default=list(REFERENCES),
                   help=f"reference rows run first (default {' '.join(REFERENCES)}; none: --references)")
    p.add_argument("--num-fewshot", dest="num_fewshot", type=int, help="few-shot examples (default: each task's own)")
    p.add_argument("--limit", type=int, help="score the first this many items of each task (default: all)")
    p.add_argument("--seed", type=int, default=0, help="lm-eval's seeds and the synthetic items' (default 0)")
    p.add_argument("--batch", type=_batch, help="items per batch, or auto (default: 1 on the CPU, auto on a GPU; a "
                                                "generation task's result depends on it: see the docs)")
    p.add_argument("--chat-template", dest="chat_template", action="store_true",
                   help="apply the tokenizer's chat template (instruct checkpoints)")
    p.add_argument("--gen-kwargs", dest="gen_kwargs", type=_gen_kwargs,
                   help="JSON object overriding the generation tasks' arguments, e.g. '{\"max_gen_toks\": 512}'")
    p.add_argument("--bootstrap-iters", dest="bootstrap_iters", type=int, default=100_000,
                   help="lm-eval's resamples for the standard error of a score that is not a mean (default 100000)")
    p.add_argument("--samples", type=int, default=50, help="items of each synthetic task (default 50)")
    p.add_argument("--max-length", dest="max_length", type=int,
                   help="context limit in tokens (default: the model config's max_position_embeddings)")
    p.add_argument("--synthetic-dir", dest="synthetic_dir",
                   help=f"folder the synthetic tasks are written into (default <out>/<model>/{SYNTHETIC_DIR})")
    p.set_defaults(func=_interruptible(run_tasks))
