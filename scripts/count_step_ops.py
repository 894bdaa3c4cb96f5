"""How many operations each configuration's teacher-forced decode launches per token and GDN layer: the CPU-side
profile of the study's decode path (issue 43), which on a GPU replays these operations in CUDA graphs.

    python scripts/count_step_ops.py [--configs NAME ...] [--out data/bench/study_ops_cpu.json]

Per configuration (default every named configuration), one teacher-forced run (:func:`pace_core.model.teacher.
teacher_forced`) of the embedded model on the CPU, ``--rows`` seeded random sequences of ``--tokens`` tokens decoded
from ``--decode-from``, the configuration beside the fp32 reference as the study runs it, is counted under a
``TorchDispatchMode``: every ATen operation that makes or writes a tensor (views, which launch nothing, and
metadata queries left out), minus the same run of the fp32 reference alone, per decoded token and GDN layer; host
reads (``.item()``, ``_local_scalar_dense``) counted apart. The counts are of the reference path (the CPU's); on a
GPU the kernel configurations (bf16, RTN, PACE-4, PACE-4/8 where the format allows) launch the project's kernels
instead. Configurations that need a calibration are calibrated first on ``--calibration-tokens`` tokens of the
calibration text (the counts depend on the shapes it gives, not its values). Table on stdout, JSON with provenance
to ``--out`` (written atomically).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pace_core.analysis.calibration import calibrate  # noqa: E402
from pace_core.config import NAMED_CONFIGS, get_config  # noqa: E402
from pace_core.model.loading import load_model  # noqa: E402
from pace_core.model.teacher import Member, teacher_forced  # noqa: E402
from pace_core.provenance import measurement  # noqa: E402
from pace_core.results import atomic_write  # noqa: E402

HOST_READS = {"_local_scalar_dense"}
NO_DATA = {"_unsafe_view"}
"""Operations that return a tensor without computing one (a view the dispatcher does not mark as one)."""


class Count(TorchDispatchMode):
    """Counts of the ATen operations run under it that make or write a tensor, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if not func.is_view and name not in NO_DATA and (isinstance(out, torch.Tensor) or name in HOST_READS or (
                isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out))):
            self.ops[name] += 1
        return out


def counted(loaded, members: list[Member], ids: torch.Tensor, decode_from: int) -> collections.Counter[str]:
    """The operations of one teacher-forced run of ``members`` (after one run that warms every cache)."""
    teacher_forced(loaded, members, ids, decode_from)
    mode = Count()
    with mode:
        teacher_forced(loaded, members, ids, decode_from)
    return mode.ops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(NAMED_CONFIGS))
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=80)
    parser.add_argument("--decode-from", dest="decode_from", type=int, default=16)
    parser.add_argument("--calibration-tokens", dest="calibration_tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=REPO / "data" / "bench" / "study_ops_cpu.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model(None)
    ids = torch.randint(3, 1000, (args.rows, args.tokens))
    per = (args.tokens - args.decode_from) * len(loaded.gdn_layers)
    reference = Member("fp32", get_config("fp32"))
    base = counted(loaded, [reference], ids, args.decode_from)
    rows = []
    for name in args.configs:
        cfg = get_config(name)
        if cfg.needs_calibration:
            cfg = calibrate(loaded, cfg, tokens=args.calibration_tokens).config
        ops = counted(loaded, [reference, Member(name, cfg)], ids, args.decode_from) if name != "fp32" else base
        extra = {k: v - base.get(k, 0) for k, v in ops.items() if v > base.get(k, 0)}
        host = sum(extra.get(k, 0) for k in HOST_READS)
        launches = sum(v for k, v in extra.items() if k not in HOST_READS)
        rows.append({"config": name, "method": cfg.method, "ops_per_token_layer": launches / per,
                     "host_reads_per_token_layer": host / per,
                     "top": {k: v / per for k, v in sorted(extra.items(), key=lambda kv: -kv[1])[:6]}})
        top = ", ".join(f"{k} {v:.1f}" for k, v in rows[-1]["top"].items())
        print(f"{name:18s} {launches / per:6.1f} ops, {host / per:4.1f} host reads per token and layer ({top})",
              flush=True)
    doc = {"kind": "study-ops-cpu", "rows_per_run": args.rows, "tokens": args.tokens, "decode_from": args.decode_from,
           "gdn_layers": len(loaded.gdn_layers), "model": loaded.source, "rows": rows,
           "provenance": measurement()}
    atomic_write(args.out, lambda path: path.write_text(json.dumps(doc, indent=1) + "\n"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
