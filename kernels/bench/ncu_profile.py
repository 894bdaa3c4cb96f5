"""Nsight Compute summaries of the decode kernels (issue 18): achieved DRAM bandwidth, duration, registers,
occupancy and the warps' stall reasons of each kernel, one GDN layer of the Qwen3.5-4B shape
(:mod:`kernels.bench.bench`'s shapes and states).

For each batch and variant the script runs itself under ``ncu --clock-control none`` (the clocks as the
card has them) in ``--launch`` mode: one layer is built, every kernel of the variant is launched once to
compile it, then once more between ``cudaProfilerStart`` / ``cudaProfilerStop``, which is what ncu
profiles (``--profile-from-start off``):

- ``bf16 per-token``: the dense step (:func:`kernels.recurrent_step.dense_recurrent_step`);
- ``PACE-4 dP=8``, ``PACE-4/8 dP=8``: the dots kernel, the record kernel and the one-kernel step (the Gluon one
  and the Triton one where the Gluon one applies) with dP / 2 records buffered, then the flush with dP records
  (:func:`kernels.bench.bench.split_breakdown`'s set), and the window kernel over dP / 2 tokens from an empty
  buffer (:func:`kernels.packed_step.launch_window`).

Usage (on the GPU machine, from the repository root)::

    python3 kernels/bench/ncu_profile.py --out DIR [--batches 1,32,128]

writes ``DIR/ncu_<variant>_B<batch>.csv`` (ncu's raw page) and ``DIR/ncu_summary.json`` (the figures
below, per kernel) and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = ("bf16 per-token", "PACE-4 dP=8", "PACE-4/8 dP=8")
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats")
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed", "launch__registers_per_thread",
           "sm__warps_active.avg.pct_of_peak_sustained_active", "smsp__inst_executed.sum",
           "smsp__issue_active.avg.pct_of_peak_sustained_active",
           "launch__grid_size", "launch__block_size")
STALLS = tuple(f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio" for reason in (
    "barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle", "long_scoreboard",
    "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction", "not_selected", "selected",
    "short_scoreboard", "sleeping", "tex_throttle", "wait"))


def _slug(variant: str) -> str:
    return variant.split(" ")[0].replace("/", "-").replace(".", "")


def launch(variant: str, B: int) -> None:
    """Build one layer of ``variant`` at batch ``B``, compile its kernels, then launch each once inside
    the profiler's range (its buffer filled before the range opens, so ncu sees only the kernel)."""
    import torch

    from kernels.backend import TritonSteps
    from kernels.bench import bench
    from kernels.flush import launch_flush
    from kernels.packed_step import launch_dots, launch_packed_step, launch_records, launch_window
    from kernels.recurrent_step import dense_recurrent_step

    torch.manual_seed(0)
    bench.LAYERS = 1
    layers = bench.build(variant, B, torch.device("cuda"))[0]
    (kind, st, (q, k, v, g, beta), out), = layers
    if kind == "dense":  # (records to buffer first, kernel)
        work = [(None, lambda: dense_recurrent_step(st, q, k, v, g, beta, out=out))]
    else:
        plan = TritonSteps().plan(st)
        fused = TritonSteps({"fused_step": True}).plan(st)  # the Gluon step where it applies
        triton_step = TritonSteps({"fused_step": True, "gluon_step": False}).plan(st)
        n = bench.PERIOD // 2
        qw, kw, vw, gw, bw = (x[None].expand(n, *x.shape).contiguous() for x in (q, k, v, g, beta))  # [T, B, ...]
        work = [(n, lambda: launch_dots(plan, q, k)),
                (n, lambda: launch_records(plan, st.buffer, q, k, v, g, beta, out)),
                (n, lambda: launch_packed_step(fused, st.buffer, q, k, v, g, beta, out)),
                *([(n, lambda: launch_packed_step(triton_step, st.buffer, q, k, v, g, beta, out))] * fused.gluon_step),
                (bench.PERIOD, lambda: launch_flush(plan, st.buffer)),
                (0, lambda: launch_window(fused, st.buffer, qw, kw, vw, gw, bw, torch.empty_like(vw)))]
    for profiled in (False, True):  # compile, then profile only the kernel (the buffer is filled before)
        for records, kernel in work:
            if records is not None:
                bench.fill_buffers(layers, records)
            torch.cuda.synchronize()
            if profiled:
                torch.cuda.cudart().cudaProfilerStart()
            kernel()
            torch.cuda.synchronize()
            if profiled:
                torch.cuda.cudart().cudaProfilerStop()


def _rows(text: str) -> list[dict]:
    """ncu's ``--csv --page raw`` output as one dict per profiled kernel (the units row dropped)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    return [r for r in rows if r.get("ID", "").strip().isdigit()]


def _number(value: str) -> float | None:
    try:
        return float(value.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def summarise(row: dict) -> dict:
    """The figures of one kernel: time, DRAM bytes and bandwidth, registers, occupancy, instructions and
    the three largest stall reasons (warps stalled per issued instruction)."""
    get = {name: _number(row.get(name, "")) for name in METRICS}
    seconds = (get["gpu__time_duration.sum"] or 0) * 1e-9  # ncu reports nanoseconds
    nbytes = (get["dram__bytes_read.sum"] or 0) + (get["dram__bytes_write.sum"] or 0)
    stalls = {k.removeprefix("smsp__average_warps_issue_stalled_").removesuffix("_per_issue_active.ratio"): _number(v)
              for k, v in row.items() if k.startswith("smsp__average_warps_issue_stalled_")}
    top = sorted(((k, v) for k, v in stalls.items() if v is not None), key=lambda kv: -kv[1])[:3]
    return {"kernel": row.get("Kernel Name", "").split("(")[0], "seconds": seconds, "dram_bytes": nbytes,
            "dram_bytes_per_second": nbytes / seconds if seconds else None,
            "dram_pct_of_peak": get["dram__throughput.avg.pct_of_peak_sustained_elapsed"],
            "registers": get["launch__registers_per_thread"], "grid": get["launch__grid_size"],
            "block": get["launch__block_size"],
            "achieved_occupancy_pct": get["sm__warps_active.avg.pct_of_peak_sustained_active"],
            "instructions": get["smsp__inst_executed.sum"],
            "issue_active_pct": get["smsp__issue_active.avg.pct_of_peak_sustained_active"], "top_stalls": top}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("data/bench/ncu"))
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--launch", nargs=2, metavar=("VARIANT", "B"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.launch:
        launch(args.launch[0], int(args.launch[1]))
        return 0
    ncu = shutil.which("ncu")
    if ncu is None:
        print("ncu_profile: Nsight Compute (ncu) is not on the PATH; run this on the GPU machine", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "command": " ".join([sys.executable, *sys.argv]), "ncu": subprocess.run(
                   [ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:],
               "shape": "Qwen3.5-4B GDN layer: H 16, HV 32, K = V = 128, dP 8 (one layer)", "rows": []}
    for B in (int(b) for b in args.batches.split(",")):
        for variant in args.variants.split(","):
            # compile outside the profiler first (Triton's cache keeps it): under ncu it takes minutes
            subprocess.run([sys.executable, __file__, "--launch", variant, str(B)], cwd=ROOT, check=True)
            for metrics in (METRICS + STALLS, METRICS):  # without the stall metrics if this ncu lacks one
                cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
                       *(a for s in SECTIONS for a in ("--section", s)), "--metrics", ",".join(metrics),
                       sys.executable, __file__, "--launch", variant, str(B)]
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                rows = _rows(done.stdout)
                if rows:
                    break
            (args.out / f"ncu_{_slug(variant)}_B{B}.csv").write_text(done.stdout + "\n# stderr\n" + done.stderr[-4000:])
            if done.returncode or not rows:
                print(f"B={B} {variant}: ncu failed (rc {done.returncode}): {(done.stdout + done.stderr)[-600:]}",
                      flush=True)
                continue
            for row in rows:
                s = {"variant": variant, "batch": B, **summarise(row)}
                summary["rows"].append(s)
                bw = s["dram_bytes_per_second"]
                print(f"B={B:4d} {variant:15s} {s['kernel'][:22]:22s} {s['seconds'] * 1e6:8.2f} us "
                      f"{(bw or 0) / 1e12:5.2f} TB/s ({s['dram_pct_of_peak'] or 0:4.1f}% peak) regs {s['registers']} "
                      f"occ {s['achieved_occupancy_pct'] or 0:4.1f}% issue {s['issue_active_pct'] or 0:4.1f}% "
                      f"instr {(s['instructions'] or 0) / 1e6:.2f} M stalls "
                      + ", ".join(f"{k} {v:.1f}" for k, v in s["top_stalls"]), flush=True)
            (args.out / "ncu_summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
