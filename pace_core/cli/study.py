"""The study: ``compare`` (every named configuration as a point of resident bits against quality, the Pareto
frontier), ``claims`` (the paper's claims and ours with their spreads) and ``all`` (the full result set in one
command)."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from pace_core.accounting import best_in_memory, capacity
from pace_core.analysis.text import TEST_TEXT, read_text, tokenize
from pace_core.cli.analyses import (
    _SWEEP_DEFAULTS,
    measure_quality,
    run_drift,
    run_generate,
    run_perplexity,
    run_structure,
    run_sweep,
)
from pace_core.cli.calibration import run_calibrate, run_export
from pace_core.cli.context import (
    ALL_CONFIGS,
    COMPARE_TOKENS,
    COMPARE_WINDOW,
    CONFIG_GROUP,
    DEFAULT_PROMPT,
    _common,
    _configs_arg,
    _context,
    _interruptible,
    _print_table,
    _read_configs,
    _reuse,
    _sha,
    config_groups,
)
from pace_core.config import NAMED_CONFIGS, get_config
from pace_core.errors import PaceError
from pace_core.export import config_to_dict
from pace_core.frontier import KL, PERPLEXITY, Point, best_under
from pace_core.model import DEFAULT_MODEL_DIR
from pace_core.provenance import code_label
from pace_core.results import list_results

AXES = {"kl": KL, "ppl": PERPLEXITY}
"""The quality axes of ``compare --axis`` (pace_core.frontier)."""


def run_compare(args: argparse.Namespace) -> int:
    """Every named configuration (or --configs) as a point of resident bits against KL, agreement and bpb on the
    loaded model (pace_core.analysis.compare), each configuration's perplexity stored as the ``perplexity``
    command stores it (kind 'perplexity', the same key: either command reuses the other's), then the points and
    their Pareto frontier as one result of kind 'compare'.

    Without --force, --window, --max-tokens, --text or --configs, a stored comparison of these weights (any window:
    the one over the most tokens, then the newest) is used and named instead of measuring. With --budget-bits, or
    --memory and --sequences (--context, --weight-bits), the last line is ``recommended: NAME`` (or ``recommended:
    none — why``): the best configuration under that budget (pace_core.accounting.best_in_memory for a memory)."""
    budget = _budget_request(args)
    told = args.force or any(getattr(args, name) is not None for name in ("window", "max_tokens", "text", "configs"))
    stored = None if told else _stored_comparison(args)
    if stored is None:
        data, table, shape = _measure_comparison(args)
    else:
        result, shape = stored
        data, table = result.data, result.table
        _print_table(table)
    print(f"frontier (no configuration with fewer bits and lower KL): {', '.join(data['frontier'])}")
    if budget is not None:
        _recommend(data, shape, budget)
    return 0


def _measure_comparison(args: argparse.Namespace):
    """Measure (or reuse by its exact key) the comparison of --configs on --text with --window and --max-tokens
    (defaults 512 and COMPARE_TOKENS), store it, print its table; (data, table, the model's shape)."""
    from pace_core.analysis.compare import comparison, point

    window = COMPARE_WINDOW if args.window is None else args.window
    max_tokens = COMPARE_TOKENS if args.max_tokens is None else args.max_tokens
    docs = _read_configs(args.configs or list(NAMED_CONFIGS))
    ctx = _context(args)
    text = args.text or str(TEST_TEXT)
    reference = get_config("fp32")
    cfgs = [reference] + [c for c in ctx.prepared(docs) if c.name != reference.name]
    stride = max(window // 2, 1)
    decode_from = max(window - stride, 1)
    key, found = ctx.cached("compare", {"text": _sha(text), "window": window, "stride": stride,
                                        "max_tokens": max_tokens, "decode_from": decode_from,
                                        "configs": [config_to_dict(c) for c in cfgs]})
    if _reuse(found, "compare"):
        return found.data, found.table, ctx.loaded.shape
    results = measure_quality(ctx, "perplexity", cfgs, text, window=window, stride=stride,
                              max_tokens=max_tokens, decode_from=decode_from, batch=args.batch)
    data, table = comparison([point(c, ctx.loaded.shape, results[c.name].data["row"]) for c in cfgs])
    tokens = int(table.tokens.iloc[0])
    _print_table(table)
    print(f"(resident bits per state value on {ctx.loaded.reference}; KL to fp32 in nats per token and top-1 "
          f"agreement over {tokens:,} scored tokens, bits per byte of their text)")
    data = {**data, "tokens": tokens, "max_tokens": max_tokens, "window": window, "stride": stride,
            "decode_from": decode_from}
    ctx.save("compare", key, data, table, configs=cfgs, text=text)
    return data, table, ctx.loaded.shape


def _stored_comparison(args: argparse.Namespace):
    """``(result, shape)`` of the stored comparison to use for this model's weights, named on stdout, or None
    (then it says why it measures). The weights are known from the stored card without a load (else the model
    loads); of the current comparisons of these weights, the one over the most tokens, then the newest."""
    from pace_core.model.card import card_of, load_card

    source = args.model if args.model is not None else str(DEFAULT_MODEL_DIR)
    card = load_card(source, source, args.dtype, root=args.out) if args.dtype != "auto" else None
    if card is None:
        card = card_of(_context(args).loaded)
    listing = list_results(source, "compare", root=args.out)
    for damaged in listing.damaged:
        print(f"not used, damaged: {damaged.path}: {damaged.reason}")
    mine = [r for r in listing.results if r.provenance.get("weights") == card.fingerprint]
    current = sorted((r for r in mine if not r.stale), key=lambda r: (r.data["tokens"], r.provenance.get("date", "")),
                     reverse=True)
    if not current:
        why = (f"the stored ones are of another method version ({len(mine)})" if mine else
               "none is stored for these weights")
        print(f"measuring the comparison: {why} (about 9 minutes for the embedded model on a 2-core CPU)")
        return None
    result = current[0]
    print(f"using the stored comparison {result.path}: windows of {result.data['window']:,} tokens, "
          f"{result.data['tokens']:,} scored tokens of {Path(result.provenance.get('text', {}).get('path', '?')).name}"
          f", made by commit {code_label(result.provenance)} on {result.provenance.get('date', '?')} "
          f"({result.provenance.get('device', '?')}, {result.provenance.get('dtype', '?')}); "
          "--window, --max-tokens, --text or --configs for other settings, --force to measure again")
    return result, card.shape


def _budget_request(args: argparse.Namespace) -> dict[str, Any] | None:
    """The budget the options give: ``{"bits": B}``, ``{"memory", "sequences", "context", "weight_bits"}`` or None;
    PaceError for options that do not make one."""
    memory_options = {"--sequences": args.sequences, "--context": args.context, "--weight-bits": args.weight_bits}
    if args.budget_bits is not None:
        given = [name for name, v in {"--memory": args.memory, **memory_options}.items() if v is not None]
        if given:
            raise PaceError(f"--budget-bits with {', '.join(given)}; allowed: --budget-bits alone, or --memory and "
                            "--sequences (with --context, --weight-bits)")
        if not args.budget_bits > 0:
            raise PaceError(f"--budget-bits: {args.budget_bits} not allowed; allowed: bits per state value > 0")
        return {"bits": args.budget_bits, "axis": args.axis}
    if args.memory is None:
        given = [name for name, v in {**memory_options, "--axis": args.axis if args.axis != "kl" else None}.items()
                 if v is not None]
        if given:
            raise PaceError(f"{', '.join(given)} without a budget; allowed: --budget-bits B, or --memory BYTES "
                            "--sequences N (with --context, --weight-bits), and --axis with either")
        return None
    if args.sequences is None:
        raise PaceError("--memory without --sequences; allowed: --memory BYTES --sequences N")
    for name, value, least in (("--memory", args.memory, 0), ("--sequences", args.sequences, 1),
                               ("--context", args.context, 0), ("--weight-bits", args.weight_bits, 1)):
        if value is not None and value < least:
            raise PaceError(f"{name}: {value} not allowed; allowed: an integer >= {least}")
    return {"memory": args.memory, "sequences": args.sequences, "context": args.context or 0,
            "weight_bits": args.weight_bits, "axis": args.axis}


def _recommend(data: dict, shape, budget: dict[str, Any]) -> None:
    """Print the recommendation under ``budget`` (:func:`_budget_request`), its last line ``recommended: ...``."""
    from pace_core.analysis.compare import budget_bits, recommendation, stored_configs

    axis = AXES[budget["axis"]]
    points = [Point.of(p) for p in data["points"]]
    measured = axis.measured(points)
    if not measured:
        print(f"recommended: none — no configuration of this comparison has a {axis.label} (a comparison stored "
              "before it was recorded: --force measures again)")
        return
    fewest = min(measured, key=lambda p: p.resident_bits)
    if "bits" in budget:
        best = best_under(points, budget["bits"], axis)
        print(f"budget: {budget['bits']:g} resident bits per state value; quality: {axis.label}")
        why = (f"the fewest, {fewest.config}, takes {fewest.resident_bits:.4f} bits per state value, above "
               f"{budget['bits']:g}")
        print(f"recommended: {best.config}" if best is not None else f"recommended: none — {why}")
        return
    memory, n, context = budget["memory"], budget["sequences"], budget["context"]
    weight_bits = budget["weight_bits"] or 8 * shape.weight_bytes_per_param
    configs = stored_configs(data)
    best = best_in_memory(points, configs, shape, memory, n, context=context, weight_bits=weight_bits, axis=axis)
    room = budget_bits(shape, memory, n, context=context, weight_bits=weight_bits)
    print(f"budget: {memory:,} bytes for {n:,} sequences at {context:,} tokens of context with {weight_bits}-bit "
          f"weights: {room:.4f} bits per state value per sequence after the weights and the attention KV cache, "
          f"less what a configuration keeps once per layer (pace_core.accounting.capacity); quality: {axis.label}")
    if best is not None:
        print(recommendation(best, configs[best.config], shape, memory, f"{memory:,} bytes", context=context,
                             weight_bits=weight_bits, axis=axis))
        print(f"recommended: {best.config}")
        return
    caps = {p.config: capacity(configs[p.config], shape, memory, weight_bits=weight_bits, context=context)
            for p in measured}
    most = max(measured, key=lambda p: (caps[p.config].sequences, -axis.loss(p)))
    weights = caps[most.config].weight_bytes
    why = (f"the weights alone take {weights:,} of {memory:,} bytes" if weights > memory else
           f"no configuration holds {n:,} sequences; the most, {caps[most.config].sequences:,}, with {most.config}")
    print(f"recommended: none — {why}")


def run_claims(args: argparse.Namespace) -> int:
    """The paper's claims and ours measured with their spreads (pace_core.analysis.claims), stored as kind
    'claims'. The perplexity of each of its configurations is stored as it is measured, with its per-window sums
    (kind 'claims_quality', CONFIG_GROUP configurations at a time), so a stopped run resumes where it stopped.
    ``--max-tokens 0`` (the default) scores the whole text: the GPU host's one command for the whole split."""
    from pace_core.analysis.claims import (
        CALIBRATED,
        claims_progress_total,
        claims_table,
        drift_sequence,
        measure_claims,
        quality_configs,
    )
    from pace_core.analysis.quality import QualityRun, windows_per_batch

    ctx = _context(args)
    text = args.text or str(TEST_TEXT)
    params = {
        "text": _sha(text),
        "max_tokens": args.max_tokens,
        "window": args.window,
        "seeds": args.seeds,
        "drift_tokens": args.drift_tokens,
        "calibration_tokens": args.calibration_tokens,
    }
    pace48, *others = ctx.prepared(list(CALIBRATED))
    calibrated = {cfg.name: cfg for cfg in others}
    key, found = ctx.cached("claims", {**params, **{name: config_to_dict(c) for name, c in
                                                    {"pace-4-8": pace48, **calibrated}.items()}})
    if _reuse(found, "claims"):
        return 0
    n = tokenize(ctx.loaded.tokenizer, read_text(text), args.max_tokens or None).shape[1]
    drift_n = drift_sequence(ctx.loaded, text, args.drift_tokens).shape[1]  # refused before the long part
    stride = max(args.window // 2, 1)
    decode_from = max(args.window - stride, 1)
    per_window = {"tables": "per window"}  # results of before carry no per-window table: not reused
    cfgs = list(quality_configs(ctx.loaded, pace48, args.seeds, calibrated).values())
    _, found = ctx.stored("claims_quality", cfgs, {"text": _sha(text), "window": args.window, "stride": stride,
                                                   "max_tokens": args.max_tokens, "decode_from": decode_from,
                                                   **per_window})
    groups = config_groups([c for c in cfgs if found[c.name] is None])
    batch = args.batch or windows_per_batch(ctx.loaded, CONFIG_GROUP + 1, args.window, decode_from)
    with ctx.bar(claims_progress_total(ctx.loaded, pace48, args.seeds, n, args.window, stride, batch,
                                       drift_n, groups=[len(g) for g in groups], calibrated=calibrated),
                 "claims") as bar:
        found = measure_quality(ctx, "claims_quality", cfgs, text, window=args.window, stride=stride,
                                max_tokens=args.max_tokens, decode_from=decode_from, batch=batch, params=per_window,
                                bar=bar)
        quality = QualityRun(pd.DataFrame([found[c.name].data["row"] for c in cfgs]),
                             pd.concat([found[c.name].table for c in cfgs], ignore_index=True))
        report = measure_claims(ctx.loaded, text, pace48, max_tokens=args.max_tokens or None, window=args.window,
                                stride=stride, batch=batch, seeds=args.seeds, drift_tokens=args.drift_tokens,
                                calibrated=calibrated, quality=quality, progress=bar.update)
    table = claims_table(report)
    _print_table(table)
    _print_table(pd.DataFrame(report["main"]))
    ctx.save("claims", key, report, table, configs=[pace48], text=text)
    return 0


def all_steps(args: argparse.Namespace) -> list[tuple[str, Callable[[], int]]]:
    """The steps of ``all`` in order, each ``(name, run)`` with its arguments bound: calibrate (pace-4-8),
    export, structure, sweep, drift, perplexity, generate, compare (every named configuration, on the
    perplexity's text, window and tokens: it reuses the perplexity step's results) and claims with the given
    settings (the claims on the perplexity text and tokens)."""
    steps: list[tuple[str, Callable[[argparse.Namespace], int], dict[str, Any]]] = [
        (
            "calibrate",
            run_calibrate,
            {
                "config": "pace-4-8",
                "text": args.calibration_text,
                "tokens": args.calibration_tokens,
                "sample_every": 64,
            },
        ),
        (
            "export",
            run_export,
            {
                "config": "pace-4-8",
                "text": args.calibration_text,
                "tokens": args.calibration_tokens,
                "sample_every": 64,
                "output": None,
            },
        ),
        ("structure", run_structure, {"text": None, "tokens": 1024, "threshold": 4.0}),
        (
            "sweep",
            run_sweep,
            {**_SWEEP_DEFAULTS, "text": None, "tokens": args.sweep_tokens, "decode_tokens": args.sweep_decode_tokens},
        ),
        (
            "drift",
            run_drift,
            {
                "configs": list(args.configs),
                "text": None,
                "tokens": args.drift_tokens,
                "decode_from": None,
                "every": args.drift_every,
            },
        ),
        (
            "perplexity",
            run_perplexity,
            {
                "configs": list(args.configs),
                "text": args.ppl_text,
                "window": args.ppl_window,
                "stride": args.ppl_window // 2,
                "max_tokens": args.ppl_tokens,
                "decode_from": None,
                "prefill_only": False,
                "batch": args.ppl_batch,
            },
        ),
        (
            "generate",
            run_generate,
            {
                "configs": list(args.configs),
                "prompt": DEFAULT_PROMPT,
                "max_new_tokens": args.max_new_tokens,
                "seed": 0,
                "temperature": 0.8,
                "top_p": 0.95,
                "modes": ["greedy", "sampled"],
            },
        ),
        (
            "compare",
            run_compare,
            {
                "configs": None,
                "text": args.ppl_text,
                "window": args.ppl_window,
                "max_tokens": args.ppl_tokens,
                "batch": args.ppl_batch,
                **dict.fromkeys(("budget_bits", "memory", "sequences", "context", "weight_bits")),
                "axis": "kl",
            },
        ),
        (
            "claims",
            run_claims,
            {
                "text": args.ppl_text,
                "max_tokens": args.ppl_tokens,
                "window": 512,
                "batch": args.ppl_batch,
                "seeds": 5,
                "drift_tokens": 512,
            },
        ),
    ]
    return [(name, functools.partial(run, argparse.Namespace(**{**vars(args), **extra}))) for name, run, extra in steps]


def run_all(args: argparse.Namespace) -> int:
    """Every step of :func:`all_steps`, stopping at the first that fails."""
    for name, run in all_steps(args):
        print(f"== {name}")
        code = run()
        if code:
            return code
    return 0



def register(subparsers: argparse._SubParsersAction) -> None:
    """Add compare, claims, all."""
    p = subparsers.add_parser("compare", help="every named configuration as a point of resident bits against KL, "
                                              "agreement and bpb, and the Pareto frontier")
    _common(p)
    p.add_argument("--configs", nargs="+", help="named configurations or config JSON files (default: every named "
                                               "configuration); the fp32 reference is always included")
    p.add_argument("--text", help="held-out text (default wikitext2-test)")
    p.add_argument("--window", type=int, help=f"perplexity window, stride half of it (default {COMPARE_WINDOW}); "
                                               "given, only a comparison of this window is reused")
    p.add_argument("--max-tokens", dest="max_tokens", type=int,
                   help=f"score the first this many tokens, 0 for the whole text (default {COMPARE_TOKENS:,}: every "
                        "named configuration of the embedded model in about 9 minutes on a 2-core CPU; the GPU "
                        "host runs 0)")
    p.add_argument("--batch", type=int, default=8,
                   help="windows per batch (default 8; larger is faster on a GPU; 0: as perplexity's --batch 0)")
    p.add_argument("--budget-bits", dest="budget_bits", type=float,
                   help="recommend the configuration of lowest KL whose resident bits per state value fit this")
    p.add_argument("--memory", type=int, help="recommend for this many bytes of GPU memory (with --sequences): the "
                                              "configuration of lowest KL that holds the sequences beside the weights")
    p.add_argument("--sequences", type=int, help="concurrent sequences the memory must hold (with --memory)")
    p.add_argument("--context", type=int, help="tokens of context per sequence, for the attention KV cache (with "
                                               "--memory; default 0)")
    p.add_argument("--weight-bits", dest="weight_bits", type=int,
                   help="bits per weight parameter (with --memory; default the checkpoint's own: 16 bf16, 8 fp8)")
    p.add_argument("--axis", choices=list(AXES), default="kl",
                   help="the quality a budget's recommendation is best on: kl (KL to fp32, default) or ppl "
                        "(perplexity); the Compare page also offers stored task scores")
    p.set_defaults(func=_interruptible(run_compare))

    p = subparsers.add_parser("claims", help="the paper's claims (a)-(d) and ours (e) measured, each with its margin "
                                             "and the margin's spread, and the main table")
    _common(p)
    p.add_argument("--text", help="held-out text (default wikitext2-test)")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=0,
                   help="score the first this many tokens, 0 for the whole text (default 0)")
    p.add_argument("--window", type=int, default=512, help="perplexity window, stride half of it (default 512)")
    p.add_argument("--batch", type=int, default=8,
                   help="windows per batch (default 8; larger is faster on a GPU; 0: as perplexity's --batch 0)")
    p.add_argument("--seeds", type=int, default=5, help="random allocations for claim (c) (default 5)")
    p.add_argument("--drift-tokens", dest="drift_tokens", type=int, default=512,
                   help="tokens of the drift sequence for the state errors, the second half decoded (default 512)")
    p.set_defaults(func=_interruptible(run_claims))

    p = subparsers.add_parser(
        "all",
        help="the full result set: calibrate, export, structure, sweep, drift, perplexity, generate, compare, claims",
    )
    _common(p)
    _configs_arg(p, ALL_CONFIGS)
    p.add_argument("--sweep-tokens", dest="sweep_tokens", type=int, default=2048, help="sweep tokens (default 2048)")
    p.add_argument("--sweep-decode-tokens", dest="sweep_decode_tokens", type=int, default=128,
                   help="decoded tokens of the sweep (default 128)")
    p.add_argument("--drift-tokens", dest="drift_tokens", type=int, default=1024,
                   help="drift sequence length, the second half decoded (default 1024)")
    p.add_argument("--drift-every", dest="drift_every", type=int, default=4, help="drift capture spacing (default 4)")
    p.add_argument("--ppl-text", dest="ppl_text", help="perplexity text (default wikitext2-test)")
    p.add_argument("--ppl-tokens", dest="ppl_tokens", type=int, default=4096,
                   help="perplexity on the first this many tokens, 0 for the whole text (default 4096)")
    p.add_argument("--ppl-window", dest="ppl_window", type=int, default=1024,
                   help="perplexity window, stride half of it (default 1024)")
    p.add_argument("--ppl-batch", dest="ppl_batch", type=int, default=0,
                   help="perplexity windows run together (default 0: as perplexity's --batch 0; the claims' "
                        "--batch then takes the same default)")
    p.add_argument(
        "--max-new-tokens", dest="max_new_tokens", type=int, default=64, help="generated tokens (default 64)"
    )
    p.set_defaults(func=_interruptible(run_all))
