"""``python -m pace_core <command>``: the command line of PACE Studio, one module per family of commands:
:mod:`~pace_core.cli.bits` (``bits``), :mod:`~pace_core.cli.calibration` (``card``, ``calibrate``, ``export``),
:mod:`~pace_core.cli.analyses` (``drift``, ``structure``, ``perplexity``, ``generate``, ``sweep``),
:mod:`~pace_core.cli.study` (``compare``, ``claims``, ``all``) and :mod:`~pace_core.cli.tasks` (``tasks``, lm-eval);
:mod:`~pace_core.cli.context` is what they share.

Each family's ``register(subparsers)`` adds its parsers, each with ``set_defaults(func=run)`` where ``run(args) ->
int`` is the exit code; :func:`build_parser` calls every registrar in :data:`REGISTRARS`. A
:class:`~pace_core.errors.PaceError` from any command is printed as ``error: <message>`` on stderr with exit code 2,
without a traceback. The analyses (and transformers and lm-eval with them) are imported inside the commands that run
them, so ``bits`` and ``--help`` start in a second.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pace_core.cli import analyses, bits, calibration, study, tasks
from pace_core.errors import PaceError

REGISTRARS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    bits.register, calibration.register, analyses.register, study.register, tasks.register)
"""Command registrars, called in order by build_parser."""


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with every registered command."""
    parser = argparse.ArgumentParser(prog="python -m pace_core",
                                     description="PACE Studio: 4-bit recurrent states for Gated DeltaNet hybrids.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_commands in REGISTRARS:
        add_commands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 with a message on stderr for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PaceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path that cannot be written or read (a file where a folder belongs, no permission)
        print(f"error: {e}; allowed: a path this process can write (--out, --output) and read", file=sys.stderr)
        return 2
