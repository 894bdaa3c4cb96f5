"""``python -m pace_core tasks``: downstream tasks through lm-evaluation-harness with each configuration applied
(issue 47). This module only registers the command: the work is :mod:`pace_core.analysis.tasks`, run and stored by
:mod:`pace_core.model.task_runner`, which is imported when the command runs (it brings lm-eval and transformers,
which the other commands, ``bits`` above all, start without).
"""

from __future__ import annotations

import argparse
import importlib
import json

from pace_core.model.commands import _common, _interruptible

REFERENCES = ("fp32", "bf16")
DEFAULT_CONFIGS = ("rtn-int4", "pace-4", "pace-4-8", "stepquant-4")
RUNNER = "pace_core.model.task_runner"
"""The module that runs the command (:func:`run_tasks` imports it)."""


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


def run_tasks(args: argparse.Namespace) -> int:
    """The command: :func:`pace_core.model.task_runner.run_tasks`, imported now."""
    return importlib.import_module(RUNNER).run_tasks(args)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``tasks`` command."""
    p = subparsers.add_parser(
        "tasks", help="downstream tasks (lm-evaluation-harness) with each configuration applied, fp32/bf16 beside",
        description="Runs lm-eval tasks on the loaded model with each configuration applied by pace_core.apply "
                    "(the same settings for all; the references first) and stores each (configuration, task) "
                    "as it finishes. Needs lm-eval: pip install \"pace-studio[eval]\".")
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
                   help="folder the synthetic tasks are written into (default <out>/<model>/synthetic)")
    p.set_defaults(func=_interruptible(run_tasks))

