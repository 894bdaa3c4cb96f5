"""The analyses of one model, each over configurations: ``drift``, ``structure``, ``perplexity``, ``generate`` and
``sweep`` (:mod:`pace_core.analysis`)."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import pandas as pd

from pace_core.analysis.text import CALIBRATION_TEXT, TEST_TEXT, read_text, tokenize
from pace_core.cli.context import (
    DEFAULT_PROMPT,
    Context,
    _common,
    _configs_arg,
    _context,
    _interruptible,
    _print_table,
    _read_configs,
    _reuse,
    _sha,
)
from pace_core.config import BUFFER_PRECISIONS, get_config
from pace_core.errors import PaceError

_SWEEP_DEFAULTS: dict[str, Any] = {"bits": [3, 4, 5, 6, 8], "dp": [1, 8, 32], "axis": ["key", "value"],
                                   "group_size": [32], "buffer": "int8", "prefill_period": None, "symmetric": True,
                                   "tokens": 2048, "decode_tokens": 128}


def run_drift(args: argparse.Namespace) -> int:
    from pace_core.analysis.drift import drift, drift_progress_total

    docs = _read_configs(args.configs)
    ctx = _context(args)
    text = args.text or str(CALIBRATION_TEXT)
    cfgs = ctx.prepared(docs)
    ids = tokenize(ctx.loaded.tokenizer, read_text(text), args.tokens)
    if ids.shape[1] < args.tokens:
        print(f"drift: --tokens {args.tokens:,} is more than the text holds: using the whole text, "
              f"{ids.shape[1]:,} tokens")
    decode_from = args.decode_from if args.decode_from is not None else ids.shape[1] // 2
    params = {"text": _sha(text), "tokens": args.tokens, "decode_from": args.decode_from, "every": args.every}

    def compute(group: list, stored: dict) -> dict:
        with ctx.bar(drift_progress_total(ctx.loaded, len(group), ids.shape[1], decode_from), "drift") as bar:
            res = drift(ctx.loaded, group, ids, decode_from, every=args.every,
                        progress=bar.update)
        return {c.name: ({"summary": res.summary[res.summary.config == c.name].to_dict("records")[0],
                          "decode_from": decode_from, "tokens": int(ids.shape[1]),
                          "layer_table": res.layer_table[res.layer_table.config == c.name].to_dict("list")},
                         res.table[res.table.config == c.name].reset_index(drop=True)) for c in group}

    results = ctx.per_config("drift", cfgs, params, compute, text=text)
    _print_table(pd.DataFrame([r.data["summary"] for r in results.values()]))
    return 0


def run_structure(args: argparse.Namespace) -> int:
    from pace_core.analysis.structure import structure_table
    from pace_core.model.capture import run_with_states

    ctx = _context(args)
    text = args.text or str(CALIBRATION_TEXT)
    params = {"text": _sha(text), "tokens": args.tokens, "threshold": args.threshold}
    key, found = ctx.cached("structure", params)
    if _reuse(found, "structure"):
        return 0
    ids = tokenize(ctx.loaded.tokenizer, read_text(text), args.tokens)
    n = int(ids.shape[1])
    states = run_with_states(ctx.loaded, get_config("fp32"), ids, capture_steps=[n]).states[n]
    table = structure_table(states, args.threshold)
    summary = table.groupby("layer").agg(col_ratio_median=("col_ratio", "median"), col_ratio_max=("col_ratio", "max"),
                                         row_ratio_median=("row_ratio", "median"), row_ratio_max=("row_ratio", "max"),
                                         outlier_cols=("outlier_cols", "sum")).reset_index()
    _print_table(summary)
    print(f"(fp32 state after {n} tokens; ratios are max/median column or row RMS per head; outlier columns: "
          f"column RMS > {args.threshold:g} x the head's median)")
    ctx.save("structure", key, {"tokens": n, "threshold": args.threshold, "summary": summary.to_dict("records")},
             table.drop(columns=["outlier_col_index"]), configs=[get_config("fp32")], text=text)
    return 0


def _decode_from(args: argparse.Namespace, stride: int) -> int | None:
    """The prompt tokens per window of --decode-from / --prefill-only (default: window - stride, at least 1)."""
    if args.prefill_only:
        return None
    chosen = args.decode_from
    if chosen is None:
        return max(args.window - stride, 1)
    if not 1 <= chosen < args.window:
        raise PaceError(f"--decode-from: {chosen} not allowed; allowed: 1..{args.window - 1} "
                        "(prompt tokens per window, fewer than --window)")
    return chosen


def measure_quality(ctx: Context, kind: str, cfgs: list, text: str, *, window: int, stride: int, max_tokens: int,
                    decode_from: int | None, batch: int, params: dict[str, Any] | None = None,
                    bar: Any = None) -> dict:
    """Each configuration's perplexity, KL and agreement on ``text`` (:func:`pace_core.analysis.quality.perplexity_run`
    against fp32; the fp32 reference itself among ``cfgs`` gets its own row) as results of ``kind`` through
    :meth:`Context.per_config` (reused, stored group by group), each with its row (``data["row"]``) and its
    per-window sums as its table. Their key: the text's sha256, window, stride, max_tokens (0: the whole text),
    decode_from and ``params``. ``batch``: windows run together (0: :func:`windows_per_batch`); ``bar``: one
    progress bar for every group (else one per group). Returns ``{name: Result}``."""
    from pace_core.analysis.quality import perplexity_run, quality_progress_total, windows_per_batch

    reference = get_config("fp32")
    keyed = {"text": _sha(text), "window": window, "stride": stride, "max_tokens": max_tokens,
             "decode_from": decode_from, **(params or {})}
    n = tokenize(ctx.loaded.tokenizer, read_text(text), max_tokens or None).shape[1]

    def compute(group: list, stored: dict) -> dict:
        others = [c for c in group if c.name != reference.name]
        size = batch or windows_per_batch(ctx.loaded, len(others) + 1, window, decode_from)
        total = quality_progress_total(ctx.loaded, len(others), n, window, stride, decode_from, size)
        with contextlib.nullcontext(bar) if bar is not None else ctx.bar(
                total, f"perplexity ({size} windows per batch)") as progress:
            run = perplexity_run(ctx.loaded, others, text, window=window, stride=stride, max_tokens=max_tokens or None,
                                 decode_from=decode_from, batch=size, progress=progress.update)
        names = {c.name for c in group}
        return {row["config"]: ({"row": row, "decode_from": decode_from},
                                run.windows[run.windows.config == row["config"]].reset_index(drop=True))
                for row in run.table.to_dict("records") if row["config"] in names}

    return ctx.per_config(kind, cfgs, keyed, compute, text=text)


def run_perplexity(args: argparse.Namespace) -> int:

    docs = _read_configs(args.configs)
    ctx = _context(args)
    text = args.text or str(TEST_TEXT)
    cfgs = ctx.prepared(docs)
    stride = args.stride if args.stride is not None else max(args.window // 2, 1)
    decode_from = _decode_from(args, stride)
    reference = get_config("fp32")
    members = [reference] + [c for c in cfgs if c.name != reference.name]
    results = measure_quality(ctx, "perplexity", members, text, window=args.window, stride=stride,
                              max_tokens=args.max_tokens, decode_from=decode_from, batch=args.batch)
    _print_table(pd.DataFrame([r.data["row"] for r in results.values()]))
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from pace_core.analysis.generation import generate_side_by_side, generation_progress_total

    docs = _read_configs(args.configs)
    ctx = _context(args)
    cfgs = ctx.prepared(docs)
    params = {"prompt": args.prompt, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
              "temperature": args.temperature, "top_p": args.top_p, "modes": args.modes}
    reference = get_config("fp32")
    members = [reference] + [c for c in cfgs if c.name != reference.name]

    def compute(group: list, stored: dict) -> dict:
        others = [c for c in group if c.name != reference.name]
        kept = stored[reference.name].table if reference.name in stored else None
        with ctx.bar(generation_progress_total(args.modes, args.max_new_tokens), "generate") as bar:
            table = generate_side_by_side(ctx.loaded, others, args.prompt, max_new_tokens=args.max_new_tokens,
                                          modes=args.modes, seed=args.seed, temperature=args.temperature,
                                          top_p=args.top_p, reference_rows=kept,
                                          progress=bar.update)
        return {c.name: ({"prompt": args.prompt}, table[table.config == c.name].reset_index(drop=True))
                for c in group}

    results = ctx.per_config("generation", members, params, compute)
    table = pd.concat([r.table for r in results.values()], ignore_index=True)
    _print_table(table, ["mode", "config", "first_divergence", "ref_nll", "ref_agreement", "text"])
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    from pace_core.analysis.sweep import grid_configs, sweep, sweep_progress_total

    ctx = _context(args)
    text = args.text or str(CALIBRATION_TEXT)
    ids = tokenize(ctx.loaded.tokenizer, read_text(text), args.tokens)
    if not 1 <= args.decode_tokens < ids.shape[1]:
        raise PaceError(f"--decode-tokens: {args.decode_tokens} not allowed; allowed: 1..{ids.shape[1] - 1} "
                        f"(the text gives {ids.shape[1]} tokens)")
    prompt = ids.shape[1] - args.decode_tokens
    period = prompt if args.prefill_period is None else args.prefill_period
    base = get_config("pace-4").replace(buffer=args.buffer, prefill_period=period,
                                        symmetric=args.symmetric)
    cfgs = grid_configs(args.bits, args.dp, args.axis, args.group_size, base)
    params = {"grid": {"bits": args.bits, "dp": args.dp, "axis": args.axis, "group_size": args.group_size},
              "base": {"buffer": args.buffer, "prefill_period": args.prefill_period, "symmetric": args.symmetric},
              "text": _sha(text), "tokens": args.tokens, "decode_tokens": args.decode_tokens}
    key, found = ctx.cached("sweep", params)
    if _reuse(found, "sweep"):
        return 0
    with ctx.bar(sweep_progress_total(cfgs, ids.shape[1], args.decode_tokens), "sweep") as bar:
        summary, steps = sweep(ctx.loaded, ids, cfgs, decode_tokens=args.decode_tokens, progress=bar.update)
    _print_table(summary, ["config", "prefill_rel_error", "mean_rel_error", "final_rel_error", "output_rel_error",
                           "resident_bits"])
    ctx.save("sweep", key, {"steps": steps.to_dict("list"), "tokens": int(ids.shape[1]),
                            "decode_tokens": args.decode_tokens, "mode": "layer-local"},
             summary, configs=cfgs, text=text)
    return 0



def register(subparsers: argparse._SubParsersAction) -> None:
    """Add drift, structure, perplexity, generate, sweep."""
    p = subparsers.add_parser("drift", help="state error and excess NLL over teacher-forced decode steps")
    _common(p)
    _configs_arg(p)
    p.add_argument("--text", help="text (default wikitext2-valid)")
    p.add_argument("--tokens", type=int, default=512, help="tokens of the sequence (default 512)")
    p.add_argument("--decode-from", dest="decode_from", type=int,
                   help="prefill this many tokens, decode the rest (default: half)")
    p.add_argument("--every", type=int, default=1, help="capture the states every this many steps (default 1)")
    p.set_defaults(func=_interruptible(run_drift))

    p = subparsers.add_parser("structure", help="column/row structure of the fp32 states after a prefill")
    _common(p)
    p.add_argument("--text", help="text (default wikitext2-valid)")
    p.add_argument("--tokens", type=int, default=1024, help="prefill tokens (default 1024)")
    p.add_argument("--threshold", type=float, default=4.0,
                   help="outlier column: column RMS above this many times the head's median (default 4)")
    p.set_defaults(func=_interruptible(run_structure))

    p = subparsers.add_parser("perplexity", help="sliding-window perplexity, bits per byte, agreement and KL")
    _common(p)
    _configs_arg(p)
    p.add_argument("--text", help="text (default wikitext2-test)")
    p.add_argument("--window", type=int, default=512, help="window tokens (default 512)")
    p.add_argument("--stride", type=int, help="stride tokens (default: half the window)")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=4096,
                   help="use the first this many tokens of the text, 0 for all of it (default 4096)")
    p.add_argument("--decode-from", dest="decode_from", type=int,
                   help="per window: prefill this many tokens and decode the rest token by token (default: "
                        "window - stride, at least 1, so every scored token after the first window is decoded; "
                        "a prefill with P >= window would round the state only after the last scored token)")
    p.add_argument("--prefill-only", dest="prefill_only", action="store_true",
                   help="score whole windows through the prefill path (P-token segments) instead")
    p.add_argument("--batch", type=int, default=0,
                   help="run up to this many windows together, each with its own state (same scores; "
                        "faster, above all on a GPU; memory grows with batch x window x vocabulary: the "
                        "logits of a batch are held in fp32; default 0: 1 on the CPU, on a GPU as many as "
                        "fit in half its free memory, at most 16)")
    p.set_defaults(func=_interruptible(run_perplexity))

    p = subparsers.add_parser("generate", help="side-by-side greedy and sampled generations")
    _common(p)
    _configs_arg(p)
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same for every configuration)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", dest="top_p", type=float, default=0.95)
    p.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    p.set_defaults(func=_interruptible(run_generate))

    p = subparsers.add_parser("sweep", help="grid of bits x dP x axis x group size (layer-local state errors)")
    _common(p)
    d = _SWEEP_DEFAULTS
    p.add_argument("--bits", nargs="+", type=int, default=d["bits"], help="state bits (default 3 4 5 6 8)")
    p.add_argument("--dp", nargs="+", type=int, default=d["dp"], help="decode periods (default 1 8 32)")
    p.add_argument("--axis", nargs="+", default=d["axis"], choices=["key", "value"], help="group axes")
    p.add_argument("--group-size", dest="group_size", nargs="+", type=int, default=d["group_size"],
                   help="group sizes (default 32)")
    p.add_argument("--buffer", default=d["buffer"], choices=BUFFER_PRECISIONS,
                   help="decode buffer precision for dP > 1 (default int8)")
    p.add_argument("--prefill-period", dest="prefill_period", type=int, default=d["prefill_period"],
                   help="prefill period P (default: the whole prompt, i.e. the fp32 prefill state rounded once, "
                        "so the grid measures the decode-time rounding)")
    p.add_argument("--symmetric", action=argparse.BooleanOptionalAction, default=d["symmetric"])
    p.add_argument("--text", help="text (default wikitext2-valid)")
    p.add_argument("--tokens", type=int, default=d["tokens"], help="tokens (default 2048)")
    p.add_argument("--decode-tokens", dest="decode_tokens", type=int, default=d["decode_tokens"],
                   help="the last this many tokens are decoded, the rest prefilled (default 128)")
    p.set_defaults(func=_interruptible(run_sweep))
