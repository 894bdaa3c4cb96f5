"""Model commands of ``python -m pace_core``: card, calibrate, drift, perplexity, generate, sweep, export, compare,
claims, all.

Each command loads a checkpoint (``--model``: a local folder or a hub id; default: the embedded
model), runs one analysis of :mod:`pace_core.analysis`, prints a short table and stores the result
under ``<--out>/<model>/`` (default ``data/results/``) through :mod:`pace_core.results`, keyed by
everything that defines it (method version, model, configurations, text hash, settings), so the app and
later runs reuse it; ``--force`` recomputes a stored result, and a damaged one is named and recomputed.
Per-configuration commands (drift, perplexity, generate, compare's and the claims' quality) store each group of
:data:`CONFIG_GROUP` configurations as it finishes; Ctrl-C exits with 130 naming what was stored and the
command that resumes. Configurations are named ones or exported config JSON files; a configuration that
needs calibration (PACE-4/8's high-bit heads, DAMP's outlier rows) is calibrated first on the
calibration text. ``export`` leaves a file of the same configuration as it is and refuses one of another
unless ``--force``. ``all`` produces the full result set in one command, e.g. ``python -m pace_core all
--model Qwen/Qwen3.5-4B --device cuda``.

Heavy imports (torch models, transformers) happen inside the commands, so ``bits`` stays quick.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable

from pace_core.errors import PaceError

DEFAULT_CONFIGS = ("bf16", "rtn-int4", "rtn-int8", "pace-4", "pace-4-8")
ALL_CONFIGS = ("bf16", "rtn-int4", "rtn-int8", "pace-4", "pace-4-8", "damp-int8", "damp-int4", "qmamba-dsq")
DEFAULT_PROMPT = "The history of the city begins in"

COMPARE_TOKENS = 4096
"""The default prefix of ``compare``: the 17 named configurations of the embedded model in 9 minutes on this project's
shared 2-core CPU (measured at a load average of 4.7: data/results/pace-tiny-qwen35/README.md), well under 20."""

CONFIG_GROUP = 4
"""Configurations measured (and stored) together by a per-configuration command, each group with its own run
of the reference: a stopped run loses at most these."""

_SAVED: list[str] = []
"""What this process stored, in order (named when a command is interrupted)."""


def config_groups(cfgs: list) -> list[list]:
    """``cfgs`` in groups of :data:`CONFIG_GROUP`, in their order."""
    return [cfgs[i:i + CONFIG_GROUP] for i in range(0, len(cfgs), CONFIG_GROUP)]


class Context:
    """What every command needs: the loaded model, its result folder name, provenance, progress."""

    def __init__(self, args: argparse.Namespace):
        from pace_core.model.card import checkpoint_stamp, save_card
        from pace_core.model.loading import load_model

        self.args = args
        before = checkpoint_stamp(args.model)
        self.loaded = load_model(args.model, dtype=args.dtype, device=args.device, device_map=args.device_map)
        self.model_name = args.model if args.model is not None else self.loaded.source
        # the app's Overview shows the card without a load
        self.card_stored = save_card(self.loaded, self.model_name, before, root=args.out)
        self._calibrations: dict[str, Any] = {}

    def bar(self, total: int, desc: str):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, disable=self.args.quiet, file=sys.stderr, leave=False)

    def cached(self, kind: str, params: dict[str, Any]):
        """(key, stored Result or None unless --force). The key holds the method version
        (:data:`pace_core.version.METHOD_VERSION`: results of other numerics are never reused), the model as another
        machine names it (:attr:`LoadedModel.reference`: a clone elsewhere reuses the shipped results), its weights,
        dtype and device, and the ``--device-map`` when one is given (results differ a little between devices;
        sampling draws other numbers) and ``params``. A damaged stored result is named on stdout
        and computed again (the new one replaces it)."""
        from pace_core.results import DamagedResult, load_result, result_key
        from pace_core.version import METHOD_VERSION

        placement = {"device_map": self.args.device_map} if self.args.device_map else {}  # none: the keys of before
        key = result_key({"kind": kind, "method_version": METHOD_VERSION, "model": self.loaded.reference,
                          "weights": self.loaded.fingerprint, "dtype": self.args.dtype,
                          "device": str(self.loaded.device), **placement, **params})
        try:
            found = None if self.args.force else load_result(kind, self.model_name, key, root=self.args.out)
        except DamagedResult as err:
            print(f"damaged stored {kind}: {err.damaged.path}: {err.damaged.reason}; computing it again")
            found = None
        return key, found

    def save(self, kind: str, key: str, data: dict, table=None, *, configs=(), text=None, extra=None):
        from pace_core.results import make_provenance, save_result

        prov = make_provenance(self.model_name, configs=list(configs), text_path=text, command=_command(),
                               extra={"weights": self.loaded.fingerprint, "dtype": self.args.dtype,
                                      "device": str(self.loaded.device), **(extra or {})})
        result = save_result(kind, self.model_name, key, data, prov, table, root=self.args.out)
        _SAVED.append(f"{kind} of {data['config']}" if "config" in data else kind)
        print(f"saved {result.path}")
        return result

    def per_config(self, kind: str, cfgs: list, params: dict[str, Any],
                   compute: Callable[[list, dict], dict[str, tuple[dict, Any]]], *, text: str | None = None) -> dict:
        """Results of ``kind``, one per configuration, each stored under its own key (the configuration's
        JSON, its calibrated tensors included, with ``params``): a stored one is reused, the missing ones are
        computed :data:`CONFIG_GROUP` at a time by ``compute(group of missing configs, {name: stored Result})
        -> {name: (data, table)}`` and each group stored as soon as it is done (a stopped run keeps every
        group it finished; the stored results passed on include the groups before).
        Every result's data carries ``params_key`` (the same for all results of one setting and method
        version, so a listing can put them side by side), ``config`` (the name) and ``configuration`` (its
        JSON form, which the checks of a stored result read). Returns ``{name: Result}`` in the order of
        ``cfgs``."""
        from pace_core.config import config_to_dict
        from pace_core.results import result_key
        from pace_core.version import METHOD_VERSION

        params_key = result_key({**params, "method_version": METHOD_VERSION})
        keys, found = self.stored(kind, cfgs, params)
        missing = [c for c in cfgs if found[c.name] is None]
        _say_reused(kind, [c.name for c in cfgs if found[c.name] is not None])
        for group in config_groups(missing):
            stored = {name: result for name, result in found.items() if result is not None}
            for name, (data, table) in compute(group, stored).items():
                cfg = next(c for c in group if c.name == name)
                found[name] = self.save(kind, keys[name], {**data, "params_key": params_key, "config": name,
                                                           "configuration": config_to_dict(cfg)},
                                        table, configs=[cfg], text=text)
        return {c.name: found[c.name] for c in cfgs}

    def stored(self, kind: str, cfgs: list, params: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
        """``({name: key}, {name: stored Result or None})`` of each configuration's result of ``kind``
        (:meth:`per_config`'s keys)."""
        from pace_core.config import config_to_dict

        keys, found = {}, {}
        for cfg in cfgs:
            keys[cfg.name], found[cfg.name] = self.cached(kind, {**params, "config": config_to_dict(cfg)})
        return keys, found

    def calibration(self, cfg, text: str | None, tokens: int, sample_every: int):
        """The calibration of ``cfg`` (cached in memory and on disk as kind 'calibration')."""
        from pace_core.analysis.calibration import Calibration, calibrate
        from pace_core.analysis.text import CALIBRATION_TEXT
        from pace_core.config import config_to_dict
        from pace_core.results import text_sha256

        path = str(text or CALIBRATION_TEXT)
        if not 1 <= sample_every <= tokens:
            raise PaceError(f"--sample-every: {sample_every} not allowed; allowed: 1..{tokens} (at most --tokens)")
        key, found = self.cached("calibration", {"config": config_to_dict(cfg), "text": _sha(path),
                                                 "tokens": tokens, "sample_every": sample_every})
        if key in self._calibrations:
            return self._calibrations[key]
        if found is not None:
            cal = Calibration.from_data(found.data)
        else:
            with self.bar(len(self.loaded.gdn_layers), f"calibrate {cfg.name}") as bar:
                cal = calibrate(self.loaded, cfg, path, tokens=tokens, sample_every=sample_every, progress=bar.update)
            self.save("calibration", key, {**cal.to_data(), "text_sha256": text_sha256(path)},
                      cal.table(), configs=[cal.config], text=path)
        self._calibrations[key] = cal
        return cal

    def admit(self, config, calibrate=None, ready_for: str = "run"):
        """``config`` (a name, a config JSON file or a document of :func:`_read_configs`) admitted for the
        loaded model (:func:`pace_core.export.admit`: a file for another model or weights is refused),
        completed by ``calibrate`` when it needs a calibration for ``ready_for``."""
        from pace_core.export import admit

        return admit(config, self.loaded.shape, self.loaded.fingerprint, calibrate=calibrate, ready_for=ready_for)

    def prepared(self, configs: list) -> list:
        """Admit every configuration (:meth:`admit`), calibrating those that need it (PACE-4/8 high-bit
        heads, a method's per-layer tensors such as DAMP's outlier rows) on the calibration text."""
        def calibrate(cfg):
            return self.calibration(cfg, self.args.calibration_text, self.args.calibration_tokens, 64).config

        return [self.admit(config, calibrate) for config in configs]


def _read_configs(specs: list[str]) -> list:
    """The documents of configuration names or files (:func:`pace_core.export.read_config`), read before the
    model loads: a malformed file or one whose sections disagree is refused at once."""
    from pace_core.export import read_config

    return [read_config(spec) for spec in specs]


def _command() -> str:
    return " ".join(["python -m pace_core", *sys.argv[1:]])


def _interruptible(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``run`` that answers Ctrl-C (KeyboardInterrupt) with exit code 130 and a line on stderr naming what
    this run stored before it and the command that resumes (stored results are reused)."""
    @functools.wraps(run)
    def interruptible(args: argparse.Namespace) -> int:
        start = len(_SAVED)
        try:
            return run(args)
        except KeyboardInterrupt:
            saved = _SAVED[start:]
            what = f"stored {len(saved)} result(s): {', '.join(saved)}" if saved else "nothing stored by this run"
            print(f"\ninterrupted: {what}. `{_command()}` resumes (it reuses what is stored)", file=sys.stderr)
            return 130

    return interruptible


_CONTEXTS: dict[tuple, Context] = {}


def _context(args: argparse.Namespace) -> Context:
    """One Context (one loaded model) per model, dtype and device within a process (``all`` reuses it)."""
    key = (args.model, args.dtype, args.device, args.device_map)
    if key not in _CONTEXTS:
        _CONTEXTS[key] = Context(args)
    ctx = _CONTEXTS[key]
    ctx.args = args
    return ctx


def _sha(path: str | os.PathLike) -> str:
    from pace_core.analysis.text import read_text
    from pace_core.results import text_sha256

    read_text(path)  # missing / empty -> PaceError
    return text_sha256(path)


def _print_table(table, columns: list[str] | None = None) -> None:
    import pandas as pd

    with pd.option_context("display.max_columns", None, "display.width", 160, "display.max_colwidth", 60):
        print((table[columns] if columns else table).to_string(index=False))


def _reuse(found, what: str) -> bool:
    if found is None:
        return False
    print(f"reusing stored {what}: {found.path} (--force recomputes)")
    if found.table is not None:
        _print_table(found.table)
    return True


def _say_reused(kind: str, names: list[str]) -> None:
    if names:
        print(f"reusing stored {kind} of {', '.join(names)} (--force recomputes)")


# ----------------------------------------------------------------------------- commands


def run_card(args: argparse.Namespace) -> int:
    """Load the model (which stores its card, :mod:`pace_core.model.card`) and print the card."""
    from pace_core.model.card import card_of

    ctx = _context(args)
    card = card_of(ctx.loaded)
    for name, value in {**card.summary, "weights_fingerprint": card.fingerprint}.items():
        print(f"{name:32} {value}")
    print("card stored" if ctx.card_stored else "card not stored (a hub id, weights other than safetensors, "
          "offloaded weights or a results folder that cannot be written): the app's Overview loads this model")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    [doc] = _read_configs([args.config])
    ctx = _context(args)
    made: list = []

    def calibrate(cfg):
        made.append(ctx.calibration(cfg, args.text, args.tokens, args.sample_every))
        return made[-1].config

    cfg = ctx.admit(doc, calibrate)
    # a configuration that needs no calibration to run is calibrated too: the table is what this command shows
    cal = made[-1] if made else ctx.calibration(cfg, args.text, args.tokens, args.sample_every)
    _print_table(cal.table())
    print(f"high_heads: {cal.config.high_heads}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    """Write the configuration (calibrated where it has 8-bit heads) as deployable JSON. A file already there is
    left as it is when it holds the same configuration and calibration, and refused (naming the differences)
    when it holds another, unless --force."""
    from pace_core.analysis.text import CALIBRATION_TEXT
    from pace_core.export import export_filename, export_json
    from pace_core.results import atomic_write, make_provenance, results_dir

    [doc] = _read_configs([args.config])
    ctx = _context(args)
    cfg = ctx.admit(doc, lambda c: ctx.calibration(c, args.text, args.tokens, args.sample_every).config,
                    ready_for="run")
    prov = make_provenance(ctx.model_name, configs=[cfg], text_path=args.text or CALIBRATION_TEXT,
                           command=_command(), extra={"calibration_tokens": args.tokens})
    text = export_json(cfg, shape=ctx.loaded.shape, source=ctx.loaded.reference,
                       weights_fingerprint=ctx.loaded.fingerprint, provenance=prov)
    out = Path(args.output) if args.output else results_dir(ctx.model_name, args.out) / f"config-{export_filename(cfg)}"
    if out.exists() and not args.force:
        differences = export_differences(out.read_bytes(), text)
        if not differences:
            print(f"{out} already holds this configuration and calibration: left as it is")
            return 0
        raise PaceError(f"{out} holds another configuration: {'; '.join(differences)}. Not replaced; allowed: "
                        "--force replaces it (and calibrates again), --output writes elsewhere")
    atomic_write(out, lambda p: p.write_text(text, encoding="utf-8"))
    _SAVED.append(f"configuration {out.name}")
    print(f"wrote {out}")
    return 0


def export_differences(old: bytes, new: str) -> list[str]:
    """How the exported configuration JSON ``old`` (a file's bytes) differs from ``new``: every field of the
    configuration, its model and its calibration (tokens, text) that differs, as ``field <old> in the file,
    <new> now``; empty when they are the same configuration (the date, command and versions of the
    provenance do not count)."""
    import json

    def view(doc: dict) -> dict:
        prov = doc.get("provenance") or {}
        text = prov.get("text") or {}
        calibration = {"tokens": prov.get("calibration_tokens"), "text sha256": text.get("sha256"),
                       "text": text.get("path")}
        return _flat({**{k: v for k, v in doc.items() if k not in ("provenance", "producer")},
                      "calibration": calibration})

    try:
        before = json.loads(old.decode("utf-8"))
        if not isinstance(before, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError) as err:
        return [f"it is not a configuration JSON ({err})"]
    was, now = view(before), view(json.loads(new))
    same_text = was.get("calibration.text sha256") == now.get("calibration.text sha256")
    return [f"{field} {was.get(field)!r} in the file, {now.get(field)!r} now" for field in sorted(set(was) | set(now))
            if was.get(field) != now.get(field) and not (field == "calibration.text" and same_text)]


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested objects as one level of dotted field names."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def run_drift(args: argparse.Namespace) -> int:
    import pandas as pd

    from pace_core.analysis.drift import drift, drift_progress_total
    from pace_core.analysis.text import CALIBRATION_TEXT, read_text, tokenize

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
    from pace_core.analysis.text import CALIBRATION_TEXT, read_text, tokenize
    from pace_core.config import get_config
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
    from pace_core.analysis.text import read_text, tokenize
    from pace_core.config import get_config

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
    import pandas as pd

    from pace_core.analysis.text import TEST_TEXT
    from pace_core.config import get_config

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


def run_compare(args: argparse.Namespace) -> int:
    """Every named configuration (or --configs) as a point of resident bits against KL, agreement and bpb on the
    loaded model (pace_core.analysis.compare), each configuration's perplexity stored as the ``perplexity``
    command stores it (kind 'perplexity', the same key: either command reuses the other's), then the points and
    their Pareto frontier as one result of kind 'compare'."""
    from pace_core.analysis.compare import comparison, point
    from pace_core.analysis.text import TEST_TEXT
    from pace_core.config import NAMED_CONFIGS, config_to_dict, get_config

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


def run_generate(args: argparse.Namespace) -> int:
    import pandas as pd

    from pace_core.analysis.generation import generate_side_by_side, generation_progress_total
    from pace_core.config import get_config

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
    from pace_core.analysis.text import CALIBRATION_TEXT, read_text, tokenize
    from pace_core.config import get_config

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


def run_claims(args: argparse.Namespace) -> int:
    """The paper's claims and ours measured with their spreads (pace_core.analysis.claims), stored as kind
    'claims'. The perplexity of each of its configurations is stored as it is measured, with its per-window sums
    (kind 'claims_quality', CONFIG_GROUP configurations at a time), so a stopped run resumes where it stopped.
    ``--max-tokens 0`` (the default) scores the whole text: the GPU host's one command for the whole split."""
    import pandas as pd

    from pace_core.analysis.claims import claims_progress_total, claims_table, measure_claims, quality_configs
    from pace_core.analysis.quality import QualityRun, windows_per_batch
    from pace_core.analysis.text import TEST_TEXT, read_text, tokenize
    from pace_core.config import config_to_dict

    ctx = _context(args)
    text = args.text or str(TEST_TEXT)
    params = {"text": _sha(text), "max_tokens": args.max_tokens, "window": args.window, "seeds": args.seeds, "drift_tokens": args.drift_tokens, "calibration_tokens": args.calibration_tokens}
    pace48, *others = ctx.prepared(["pace-4-8", "damp-int4", "damp-int8", "stepquant-4"])
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
        ("calibrate", run_calibrate, {"config": "pace-4-8", "text": args.calibration_text,
                                      "tokens": args.calibration_tokens, "sample_every": 64}),
        ("export", run_export, {"config": "pace-4-8", "text": args.calibration_text,
                                "tokens": args.calibration_tokens, "sample_every": 64, "output": None}),
        ("structure", run_structure, {"text": None, "tokens": 1024, "threshold": 4.0}),
        ("sweep", run_sweep, {**_SWEEP_DEFAULTS, "text": None, "tokens": args.sweep_tokens,
                              "decode_tokens": args.sweep_decode_tokens}),
        ("drift", run_drift, {"configs": list(args.configs), "text": None, "tokens": args.drift_tokens,
                              "decode_from": None, "every": args.drift_every}),
        ("perplexity", run_perplexity, {"configs": list(args.configs), "text": args.ppl_text, "window": args.ppl_window,
                                        "stride": args.ppl_window // 2, "max_tokens": args.ppl_tokens,
                                        "decode_from": None, "prefill_only": False, "batch": args.ppl_batch}),
        ("generate", run_generate, {"configs": list(args.configs), "prompt": DEFAULT_PROMPT, "max_new_tokens": args.max_new_tokens,
                                    "seed": 0, "temperature": 0.8, "top_p": 0.95, "modes": ["greedy", "sampled"]}),
        ("compare", run_compare, {"configs": None, "text": args.ppl_text, "window": args.ppl_window,
                                  "max_tokens": args.ppl_tokens, "batch": args.ppl_batch}),
        ("claims", run_claims, {"text": args.ppl_text, "max_tokens": args.ppl_tokens, "window": 512,
                                "batch": args.ppl_batch, "seeds": 5, "drift_tokens": 512}),
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

_SWEEP_DEFAULTS: dict[str, Any] = {"bits": [3, 4, 5, 6, 8], "dp": [1, 8, 32], "axis": ["key", "value"],
                                   "group_size": [32], "buffer": "int8", "prefill_period": None, "symmetric": True,
                                   "tokens": 2048, "decode_tokens": 128}


# ----------------------------------------------------------------------------- parsers


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint folder or hub id (default: the embedded model data/models/pace-tiny-qwen35)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, mps (default cpu)")
    p.add_argument("--device-map", dest="device_map", help="transformers device_map, e.g. auto (overrides --device)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                   help="weight dtype (default float32)")
    p.add_argument("--out", help="results root folder (default data/results or $PACE_RESULTS_DIR)")
    p.add_argument("--force", action="store_true", help="recompute even if a stored result matches")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--calibration-text", dest="calibration_text",
                   help="calibration text for configs that need it (default ../shared/corpus/wikitext2-valid.txt)")
    p.add_argument("--calibration-tokens", dest="calibration_tokens", type=int, default=2048,
                   help="calibration tokens (default 2048)")


def _configs_arg(p: argparse.ArgumentParser, default=DEFAULT_CONFIGS) -> None:
    p.add_argument("--configs", nargs="+", default=list(default),
                   help=f"named configurations or config JSON files (default {' '.join(default)}); "
                        "the fp32 reference is always included")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add card, calibrate, export, drift, structure, perplexity, generate, sweep, compare, claims and all."""
    p = subparsers.add_parser("card", help="the checkpoint's architecture and weights fingerprint, stored for "
                                           "the app's Overview (no model load there)")
    _common(p)
    p.set_defaults(func=_interruptible(run_card))

    p = subparsers.add_parser("calibrate", help="head calibration (a_h, e_h, E_h, 8-bit heads) on a text")
    _common(p)
    p.add_argument("--config", default="pace-4-8", help="configuration to calibrate (default pace-4-8)")
    p.add_argument("--text", help="calibration text (default wikitext2-valid; the test split is refused)")
    p.add_argument("--tokens", type=int, default=2048, help="calibration tokens (default 2048)")
    p.add_argument("--sample-every", dest="sample_every", type=int, default=64,
                   help="one calibration state every this many tokens (default 64)")
    p.set_defaults(func=_interruptible(run_calibrate))

    p = subparsers.add_parser("export", help="write a config JSON with calibration-derived high_heads")
    _common(p)
    p.add_argument("--config", default="pace-4-8", help="configuration to export (default pace-4-8)")
    p.add_argument("--text", help="calibration text (default wikitext2-valid)")
    p.add_argument("--tokens", type=int, default=2048, help="calibration tokens (default 2048)")
    p.add_argument("--sample-every", dest="sample_every", type=int, default=64, help="calibration sample spacing")
    p.add_argument("--output", help="output JSON path (default <out>/<model>/config-<name>.json); a file there "
                                    "of another configuration or calibration is replaced only with --force")
    p.set_defaults(func=_interruptible(run_export))

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
    p.add_argument("--buffer", default=d["buffer"], choices=["fp32", "bf16", "int8", "mixed"],
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

    p = subparsers.add_parser("all", help="the full result set: calibrate, export, structure, sweep, drift, perplexity, "
                                          "generate, compare, claims")
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
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=64, help="generated tokens (default 64)")
    p.set_defaults(func=_interruptible(run_all))
