"""The study: ``compare`` (every named configuration as a point of resident bits against quality, the Pareto
frontier), ``claims`` (the paper's claims and ours with their spreads) and ``all`` (the full result set in one
command)."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import pandas as pd

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
from pace_core.export import config_to_dict


def run_compare(args: argparse.Namespace) -> int:
    """Every named configuration (or --configs) as a point of resident bits against KL, agreement and bpb on the
    loaded model (pace_core.analysis.compare), each configuration's perplexity stored as the ``perplexity``
    command stores it (kind 'perplexity', the same key: either command reuses the other's), then the points and
    their Pareto frontier as one result of kind 'compare'."""
    from pace_core.analysis.compare import comparison, point

    docs = _read_configs(args.configs or list(NAMED_CONFIGS))
    ctx = _context(args)
    text = args.text or str(TEST_TEXT)
    reference = get_config("fp32")
    cfgs = [reference] + [c for c in ctx.prepared(docs) if c.name != reference.name]
    stride = max(args.window // 2, 1)
    decode_from = max(args.window - stride, 1)
    key, found = ctx.cached("compare", {"text": _sha(text), "window": args.window, "stride": stride,
                                        "max_tokens": args.max_tokens, "decode_from": decode_from,
                                        "configs": [config_to_dict(c) for c in cfgs]})
    if _reuse(found, "compare"):
        return 0
    results = measure_quality(ctx, "perplexity", cfgs, text, window=args.window, stride=stride,
                              max_tokens=args.max_tokens, decode_from=decode_from, batch=args.batch)
    data, table = comparison([point(c, ctx.loaded.shape, results[c.name].data["row"]) for c in cfgs])
    tokens = int(table.tokens.iloc[0])
    _print_table(table)
    print(f"frontier (no configuration with fewer bits and lower KL): {', '.join(data['frontier'])}")
    print(f"(resident bits per state value on {ctx.loaded.reference}; KL to fp32 in nats per token and top-1 "
          f"agreement over {tokens:,} scored tokens, bits per byte of their text)")
    ctx.save("compare", key, {**data, "tokens": tokens, "max_tokens": args.max_tokens, "window": args.window,
                              "stride": stride, "decode_from": decode_from}, table, configs=cfgs, text=text)
    return 0


def run_claims(args: argparse.Namespace) -> int:
    """The paper's claims and ours measured with their spreads (pace_core.analysis.claims), stored as kind
    'claims'. The perplexity of each of its configurations is stored as it is measured, with its per-window sums
    (kind 'claims_quality', CONFIG_GROUP configurations at a time), so a stopped run resumes where it stopped.
    ``--max-tokens 0`` (the default) scores the whole text: the GPU host's one command for the whole split."""
    from pace_core.analysis.claims import (
        CALIBRATED,
        claims_progress_total,
        claims_table,
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
                                       args.drift_tokens, groups=[len(g) for g in groups], calibrated=calibrated),
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
    p.add_argument("--window", type=int, default=512, help="perplexity window, stride half of it (default 512)")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=COMPARE_TOKENS,
                   help=f"score the first this many tokens, 0 for the whole text (default {COMPARE_TOKENS:,}: every "
                        "named configuration of the embedded model in about 9 minutes on a 2-core CPU; the GPU "
                        "host runs 0)")
    p.add_argument("--batch", type=int, default=8,
                   help="windows per batch (default 8; larger is faster on a GPU; 0: as perplexity's --batch 0)")
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
