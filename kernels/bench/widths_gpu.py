"""Issue 48's GPU call: the 3-bit kernels' correctness at full Qwen3.5 GDN shapes, then the decode step of PACE-3
against PACE-4 (and the bf16 per-token baseline) on the same card in the same run.

1. ``PACE_KERNEL_TESTS=cuda`` pytest of the 3-bit cases (:data:`TESTS`, :data:`SELECT`): stores and loads
   bit-identical to pace_core.quant, decode steps, flushes, per-token runs and the held bytes of PACE-3, PACE-3/8,
   RTN-3 against the reference on the same GPU, and the refusal of 2-, 5-, 6- and 7-bit codes.
2. ``kernels/bench/bench.py`` for ``PACE-3 dP=8`` and ``PACE-4 dP=8`` at ``--batches``: each one's fastest launch
   settings, and PACE-3's time against PACE-4's (with each one's fastest kernels, and on the Triton kernels alone:
   PACE-4's Gluon kernels off) beside the bytes model's ratio (``bench.vs_pace4``). Every configuration is compiled
   first by ``--warm-workers`` processes, and no batch starts once ``--budget-s`` is spent (bench.py's
   ``--deadline-s``: the batches left are named in bench.json); a variant that cannot run at a batch gets bench.py's
   error row, and no ratio there.

Writes ``DIR/widths_gpu.json`` (device, versions, code commit and command, the tests' exit status and summary
line, the ratios per batch), ``DIR/bench.json`` and ``DIR/bench.png`` (bench.py's) and ``DIR/widths_gpu_log.txt``
(everything printed).

Usage (on the GPU machine, from the repository root): ``python3 kernels/bench/widths_gpu.py --out DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kernels.bench import bench  # noqa: E402
from pace_core.provenance import measurement  # noqa: E402

TESTS = ("tests/test_kernels_quantize.py", "tests/test_kernels_decode.py")
SELECT = ("pace-3 or rtn-int3 or rtn-value-3 or True-3 or False-3 or False-1-3 or True-1-3 or other_widths "
          "or three_bit or cover")
"""The tests' 3-bit cases (their ids name the configuration, or end in the width 3), the other widths' refusal and
what the kernels cover."""
VARIANTS = ("PACE-3 dP=8", "PACE-4 dP=8")
BATCHES = "1,8,32,128"
BUDGET_S = 420.0
"""The seconds after which the bench starts no new batch (the tests' time included): the call ends well under 8
minutes."""


class Tee(io.TextIOBase):
    """Writes to several text streams at once (the terminal and the log)."""

    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
            s.flush()
        return len(text)


def run_tests() -> dict:
    """The 3-bit GPU tests (module docstring, 1.): pytest's exit status and its summary line."""
    env = {**os.environ, "PACE_KERNEL_TESTS": "cuda",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    cmd = [sys.executable, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-rfE", "-q", "-k", SELECT,
           *TESTS]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    print(done.stdout[-6000:], done.stderr[-2000:], sep="\n")
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {"command": " ".join(cmd[1:]), "returncode": done.returncode, "summary": lines[-1] if lines else ""}


def ratios(results: dict) -> list[dict]:
    """PACE-3 against PACE-4 at each batch both were timed at (bench.py's rows; an error row is no timing)."""
    by = {(r["variant"], r["batch"]): r for r in results["rows"] if "error" not in r}
    return [{"batch": B, "pace3_us": by[(VARIANTS[0], B)]["seconds_per_token"] * 1e6,
             "pace4_us": by[(VARIANTS[1], B)]["seconds_per_token"] * 1e6,
             **bench.vs_pace4(by[(VARIANTS[0], B)], by[(VARIANTS[1], B)])}
            for B in sorted({r["batch"] for r in results["rows"]}) if (VARIANTS[0], B) in by and (VARIANTS[1], B) in by]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default=BATCHES)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip-tests", action="store_true", help="the benchmark alone")
    ap.add_argument("--warm-workers", type=int, default=8,
                    help="parallel processes compiling the bench's kernels first")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="start no bench batch after this many seconds")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "widths_gpu_log.txt").open("w", encoding="utf-8")
    with contextlib.redirect_stdout(Tee(sys.stdout, log)):
        import torch
        import triton

        if not torch.cuda.is_available():
            print("widths_gpu: no CUDA device; run this on the GPU machine")
            return 2
        start = time.time()
        doc = {"device": torch.cuda.get_device_name(), **measurement(), "triton": triton.__version__,
               "variants": list(VARIANTS)}
        print(f"device {doc['device']}  torch {doc['torch']}  triton {doc['triton']}", flush=True)
        doc["tests"] = None if args.skip_tests else run_tests()
        left = max(args.budget_s - (time.time() - start), 0.0)
        status = bench.main(["--out", str(args.out), "--variants", ",".join(VARIANTS), "--batches", args.batches,
                             "--reps", str(args.reps), "--warm-workers", str(args.warm_workers),
                             "--deadline-s", f"{left:.0f}"])
        if status == 0:
            doc["pace3_vs_pace4"] = ratios(json.loads((args.out / "bench.json").read_text()))
            for r in doc["pace3_vs_pace4"]:
                triton_alone = "-" if r["triton_time_ratio"] is None else f"{r['triton_time_ratio']:.3f}x"
                print(f"B={r['batch']:4d} PACE-3 {r['pace3_us']:8.1f} us, PACE-4 {r['pace4_us']:8.1f} us: time "
                      f"{r['time_ratio']:.3f}x, Triton kernels alone {triton_alone}, bytes {r['bytes_ratio']:.3f}x")
        doc["seconds"] = time.time() - start
        (args.out / "widths_gpu.json").write_text(json.dumps(doc, indent=1))
        tests_ok = doc["tests"] is None or doc["tests"]["returncode"] == 0
        return status or (0 if tests_ok else 1)


if __name__ == "__main__":
    raise SystemExit(main())
