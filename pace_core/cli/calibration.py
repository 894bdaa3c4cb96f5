"""The model's card and its calibrations: ``card``, ``calibrate`` and ``export`` (the deployable configuration,
calibrated on the model)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pace_core.analysis.text import CALIBRATION_TEXT
from pace_core.cli.context import _SAVED, _common, _context, _interruptible, _print_table, _read_configs
from pace_core.errors import PaceError
from pace_core.export import export_filename, export_json
from pace_core.model.card import card_of
from pace_core.results import atomic_write, make_provenance, results_dir


def run_card(args: argparse.Namespace) -> int:
    """Load the model (which stores its card, :mod:`pace_core.model.card`) and print the card."""
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
    [doc] = _read_configs([args.config])
    ctx = _context(args)
    cfg = ctx.admit(doc, lambda c: ctx.calibration(c, args.text, args.tokens, args.sample_every).config,
                    ready_for="run")
    prov = make_provenance(ctx.loaded.reference, configs=[cfg], text_path=args.text or CALIBRATION_TEXT,
                           extra={"calibration_tokens": args.tokens})
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



def register(subparsers: argparse._SubParsersAction) -> None:
    """Add card, calibrate, export."""
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
