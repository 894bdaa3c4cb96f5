"""What every command of ``python -m pace_core`` needs (:class:`Context`: the loaded model, its results, its
configurations admitted, progress), the arguments they share, and how a command is run (Ctrl-C, stored results
reused)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import pandas as pd
from tqdm import tqdm

from pace_core import version
from pace_core.analysis.text import CALIBRATION_TEXT, read_text
from pace_core.config import tagged
from pace_core.errors import PaceError
from pace_core.export import admit, config_to_dict, read_config
from pace_core.methods import method_of
from pace_core.model.card import checkpoint_stamp, save_card
from pace_core.provenance import invocation
from pace_core.results import DamagedResult, load_result, make_provenance, result_key, save_result, text_sha256

DEFAULT_CONFIGS = tagged("cli-default")


ALL_CONFIGS = tagged("all")


DEFAULT_PROMPT = "The history of the city begins in"


COMPARE_TOKENS = 4096
"""The default prefix of ``compare``: the 17 named configurations of the embedded model in 9 minutes on this project's
shared 2-core CPU (measured at a load average of 4.7: data/results/pace-tiny-qwen35/README.md), well under 20."""


COMPARE_WINDOW = 512
"""The default perplexity window of ``compare`` (stride half of it) when it measures."""


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
        from pace_core.model.loading import load_model

        self.args = args
        before = checkpoint_stamp(args.model)
        self.loaded = load_model(args.model, dtype=args.dtype, device=args.device, device_map=args.device_map)
        self.model_name = args.model if args.model is not None else self.loaded.source
        # the app's Overview shows the card without a load
        self.card_stored = save_card(self.loaded, self.model_name, before, root=args.out)
        self._calibrations: dict[str, Any] = {}

    def bar(self, total: int, desc: str):
        return tqdm(total=total, desc=desc, disable=self.args.quiet, file=sys.stderr, leave=False)

    def cached(self, kind: str, params: dict[str, Any]):
        """(key, stored Result or None unless --force). The key holds the method version
        (:data:`pace_core.version.METHOD_VERSION`: results of other numerics are never reused), the model as another
        machine names it (:attr:`LoadedModel.reference`: a clone elsewhere reuses the shipped results), its weights,
        dtype and device, and the ``--device-map`` when one is given (results differ a little between devices;
        sampling draws other numbers) and ``params``. A damaged stored result is named on stdout
        and computed again (the new one replaces it)."""
        placement = {"device_map": self.args.device_map} if self.args.device_map else {}  # none: the keys of before
        key = result_key({"kind": kind, "method_version": version.METHOD_VERSION, "model": self.loaded.reference,
                          "weights": self.loaded.fingerprint, "dtype": self.args.dtype,
                          "device": str(self.loaded.device), **placement, **params})
        try:
            found = None if self.args.force else load_result(kind, self.model_name, key, root=self.args.out)
        except DamagedResult as err:
            print(f"damaged stored {kind}: {err.damaged.path}: {err.damaged.reason}; computing it again")
            found = None
        return key, found

    def save(self, kind: str, key: str, data: dict, table=None, *, configs=(), text=None, extra=None):
        prov = make_provenance(self.loaded.reference, configs=list(configs), text_path=text,
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
        params_key = result_key({**params, "method_version": version.METHOD_VERSION})
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
        keys, found = {}, {}
        for cfg in cfgs:
            keys[cfg.name], found[cfg.name] = self.cached(kind, {**params, "config": config_to_dict(cfg)})
        return keys, found

    def calibration(self, cfg, text: str | None, tokens: int, sample_every: int):
        """The calibration of ``cfg`` (cached in memory and on disk as kind 'calibration')."""
        from pace_core.analysis.calibration import Calibration, calibrate, calibration_progress_total

        path = str(text or CALIBRATION_TEXT)
        if not 1 <= sample_every <= tokens:
            raise PaceError(f"--sample-every: {sample_every} not allowed; allowed: 1..{tokens} (at most --tokens)")
        sampling = method_of(cfg).sampling(cfg)  # a method's own samples: its numbers, not --tokens / --sample-every
        samples = ({"tokens": tokens, "sample_every": sample_every} if sampling is None else
                   {"sampling": sampling.describe()})
        key, found = self.cached("calibration", {"config": config_to_dict(cfg), "text": _sha(path), **samples})
        if key in self._calibrations:
            return self._calibrations[key]
        if found is not None:
            cal = Calibration.from_data(found.data)
        else:
            with self.bar(calibration_progress_total(self.loaded, sampling), f"calibrate {cfg.name}") as bar:
                cal = calibrate(self.loaded, cfg, path, tokens=tokens, sample_every=sample_every, progress=bar.update)
            self.save("calibration", key, {**cal.to_data(), "text_sha256": text_sha256(path)},
                      cal.table(), configs=[cal.config], text=path)
        self._calibrations[key] = cal
        return cal

    def admit(self, config, calibrate=None, ready_for: str = "run"):
        """``config`` (a name, a config JSON file or a document of :func:`_read_configs`) admitted for the
        loaded model (:func:`pace_core.export.admit`: a file for another model or weights is refused),
        completed by ``calibrate`` when it needs a calibration for ``ready_for``."""
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
    return [read_config(spec) for spec in specs]


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
            print(f"\ninterrupted: {what}. `{invocation()}` resumes (it reuses what is stored)", file=sys.stderr)
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
    read_text(path)  # missing / empty -> PaceError
    return text_sha256(path)


def _print_table(table, columns: list[str] | None = None) -> None:
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


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help="checkpoint folder or hub id (default: the embedded model data/models/pace-tiny-qwen35)"
    )
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
