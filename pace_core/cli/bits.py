"""``bits``: the resident-bit breakdown of one configuration (``--config``: a named configuration or
an exported config JSON file) or, without ``--config``, a table of every named configuration, on a
built-in shape, a ``config.json`` or a checkpoint folder (``--model``; default: the embedded model).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pace_core.accounting import resident_bits, sequences_that_fit, state_bytes, state_share
from pace_core.config import NAMED_CONFIGS, SETTINGS, PaceConfig, default_of
from pace_core.errors import PaceError
from pace_core.export import admit
from pace_core.model import DEFAULT_MODEL_DIR
from pace_core.settings import Setting
from pace_core.shapes import BUILTIN_SHAPES, ModelShape, load_shape

DEFAULT_SEQUENCES = 64
GIB = 2**30

def _override_kwargs(setting: Setting) -> dict[str, Any]:
    """argparse keyword arguments of a setting's flag (:attr:`Setting.cli`), from its field's type and choices."""
    default = default_of(setting.field)
    if isinstance(default, bool):
        return {"action": argparse.BooleanOptionalAction, "default": None, "help": setting.cli_help}
    if isinstance(default, str):
        return {"choices": setting.options, "help": setting.cli_help}
    return {"type": type(default), "help": setting.cli_help}


_OVERRIDES: tuple[Setting, ...] = tuple(st for st in SETTINGS if st.cli)
"""The configuration overrides of `bits`: every setting with a CLI flag."""


def _default_model() -> str:
    if not DEFAULT_MODEL_DIR.joinpath("config.json").is_file():
        raise PaceError(f"no --model given and the embedded model {DEFAULT_MODEL_DIR} is missing; allowed "
                        f"--model: {', '.join(BUILTIN_SHAPES)}, a config.json or a checkpoint folder")
    return str(DEFAULT_MODEL_DIR)


def _apply_overrides(cfg: PaceConfig, args: argparse.Namespace) -> PaceConfig:
    changes = {st.field: getattr(args, st.field) for st in _OVERRIDES if getattr(args, st.field) is not None}
    return cfg.replace(**changes) if changes else cfg


def _row(cfg: PaceConfig, shape: ModelShape, n_seq: int) -> dict[str, Any]:
    rb = resident_bits(cfg, shape)
    return {
        "model": shape.name,
        "config": cfg.name,
        "code_bits": rb.code_bits,
        "scale_bits": rb.scale_bits,
        "payload_bits": rb.payload_bits,
        "metadata_bits": rb.metadata_bits,
        "buffer_bits": rb.buffer_bits,
        "resident_bits": rb.resident_bits,
        "c": rb.c,
        "decode_period": cfg.decode_period,
        "exact_bits": rb.exact_bits,
        "formula_bits": rb.formula_bits,
        "sequence_bits": rb.sequence_bits,
        "paper_c": rb.paper_c,
        "sequences": n_seq,
        "state_bytes": state_bytes(cfg, shape, n_seq),
        "state_share": state_share(cfg, shape, n_seq),
    }


def _shape_line(shape: ModelShape) -> str:
    return (f"{shape.name}: {shape.num_gdn_layers} GDN layers of {shape.num_layers}, {shape.num_k_heads} key / "
            f"{shape.num_v_heads} value heads (γ = {shape.gamma}), d_k = {shape.d_k}, d_v = {shape.d_v}, "
            f"{shape.weight_params / 1e9:.2f}B weight parameters")


def _print_one(row: dict[str, Any], shape: ModelShape, budget: int | None, fits: int | None) -> None:
    print(f"{row['config']} on {_shape_line(shape)}")
    print(f"  payload   {row['payload_bits']:9.5f} bits per state value "
          f"(codes {row['code_bits']:.5f} + scales/zero points {row['scale_bits']:.5f})")
    print(
        f"  metadata  {row['metadata_bits']:9.5f}  (stored beyond payload and buffer: row indices, head map, padding)"
    )
    print(
        f"  buffer    {row['buffer_bits']:9.5f}  (c = {row['c']:.6f} x dP {row['decode_period']}, "
        "buffer scales included)"
    )
    print(f"  resident  {row['resident_bits']:9.5f}  (= the bits stored per state value, one sequence)")
    print(f"  per seq.  {row['sequence_bits']:9.5f}  (what each further sequence adds: resident without what is kept "
          "once per layer)")
    print(f"  formula   {row['formula_bits']:9.5f}  (the paper's payload + c·dP, c = {row['paper_c']:.6f} from the "
          "buffer's code bits alone)")
    print(f"  state of {row['sequences']} sequences: {row['state_bytes'] / GIB:.3f} GiB, "
          f"{100 * row['state_share']:.1f}% of weights + state")
    if budget is not None:
        print(f"  sequences that fit in {budget / 1e9:g} GB with the weights: {fits}")


def _print_table(rows: list[dict[str, Any]], shape: ModelShape) -> None:
    print(_shape_line(shape))
    fit = "sequences_that_fit" in rows[0]
    head = (
        f"{'config':<16} {'payload':>8} {'metadata':>9} {'buffer':>8} {'resident':>9} {'per seq':>8} {'formula':>8} "
        f"{'dP':>4} "
        f"{'state GiB':>10} {'share':>6}" + (f" {'fit':>8}" if fit else "")
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['config']:<16} {r['payload_bits']:8.4f} {r['metadata_bits']:9.4f} {r['buffer_bits']:8.4f} "
              f"{r['resident_bits']:9.4f} {r['sequence_bits']:8.4f} {r['formula_bits']:8.4f} {r['decode_period']:4d} "
              f"{r['state_bytes'] / GIB:10.3f} {100 * r['state_share']:5.1f}%"
              + (f" {r['sequences_that_fit']:8d}" if fit else ""))
    note = f"(bits per state value; state and share at {rows[0]['sequences']} sequences"
    print(note + (f"; fit: sequences in {rows[0]['budget_bytes'] / 1e9:g} GB with the weights)" if fit else ")"))


def run_bits(args: argparse.Namespace) -> int:
    """The ``bits`` command."""
    shape = load_shape(args.model if args.model is not None else _default_model())
    if args.sequences < 1:
        raise PaceError(f"--sequences={args.sequences} is not allowed; allowed: an integer >= 1")
    if args.budget_gb is not None and not 0 <= args.budget_gb < 1e9:  # also refuses nan and inf
        raise PaceError(f"--budget-gb={args.budget_gb} is not allowed; allowed: a number in [0, 1e9)")
    budget = None if args.budget_gb is None else int(args.budget_gb * 1e9)
    if args.config is not None:
        # admitted against the shape counted on (a file for another model is refused); the 8-bit heads may be
        # unchosen: the accounting counts their share
        cfg = _apply_overrides(admit(args.config, shape, ready_for="settings"), args)
        row = _row(cfg, shape, args.sequences)
        fits = None if budget is None else sequences_that_fit(cfg, shape, budget)
        if budget is not None:
            row.update(budget_bytes=budget, sequences_that_fit=fits)
        if args.json:
            print(json.dumps(row, indent=2))
        else:
            _print_one(row, shape, budget, fits)
        return 0
    configs = [_apply_overrides(c, args) if c.quantized else c for c in NAMED_CONFIGS.values()]
    rows = [_row(c, shape, args.sequences) for c in configs]
    if budget is not None:
        for r, c in zip(rows, configs):
            r.update(budget_bytes=budget, sequences_that_fit=sequences_that_fit(c, shape, budget))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_table(rows, shape)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bits`` command."""
    p = subparsers.add_parser(
        "bits", help="resident bits per state value of a configuration (or of all named ones)",
        description="Resident bits per state value (PACE_SPEC §5): payload, metadata, buffer c·dP, their sum, "
                    "and the bits actually stored. Without --config: a table of every named configuration "
                    "(overrides then apply to the quantised ones).")
    p.add_argument("--config", help=f"named configuration ({', '.join(NAMED_CONFIGS)}) or a config JSON file")
    p.add_argument("--model", help=f"built-in shape ({', '.join(BUILTIN_SHAPES)}), a config.json or a checkpoint "
                                   "folder (default: the embedded model)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--sequences", type=int, default=DEFAULT_SEQUENCES,
                   help=f"concurrent sequences for the state bytes and share (default {DEFAULT_SEQUENCES})")
    p.add_argument("--budget-gb", type=float, help="memory budget in GB (1e9 bytes): how many sequences fit")
    for st in _OVERRIDES:
        p.add_argument(st.cli, dest=st.field, **_override_kwargs(st))
    p.set_defaults(func=run_bits)
