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

``--settings-from`` profiles each variant and batch with the launch settings a bench run found fastest there
(:mod:`kernels.bench.bench`'s JSON): a period's kernels with them (its step as set, then its flush), so that the
profile is of the kernels behind the figure.

Usage (on the GPU machine, from the repository root)::

    python3 kernels/bench/ncu_profile.py --out DIR [--batches 1,32,128] [--settings-from BENCH_JSON]

writes ``DIR/ncu_<variant>_B<batch>.csv`` (ncu's raw page) and ``DIR/ncu_summary.json`` (the figures
below, per kernel, with the settings) and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kernels.settings import Launch, RecurrentSettings, SplitSettings  # noqa: E402
from pace_core.provenance import measurement  # noqa: E402

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


def settings_of(bench_json: Path | None, variant: str, B: int) -> dict | None:
    """The launch settings (fields) of ``variant``'s fastest configuration at batch ``B`` in a bench run's JSON
    (:mod:`kernels.bench.bench`), or None (the defaults) where there is none."""
    if bench_json is None or not bench_json.exists():
        return None
    rows = json.loads(bench_json.read_text())["rows"]
    found = [r for r in rows if r["variant"] == variant and r["batch"] == B and "error" not in r]
    return found[0]["config"] if found else None


def launch(variant: str, B: int, settings: dict | None = None, window: bool = True) -> None:
    """Build one layer of ``variant`` at batch ``B``, compile its kernels, then launch each once inside the profiler's
    range (its buffer filled before the range opens, so ncu sees only the kernel). Without ``settings``: every split
    kernel with the default settings (the dots, record, one-kernel step, the Triton step beside the Gluon one, flush;
    ``window``: the window kernel too); with ``settings`` (fields of the variant's family in :mod:`kernels.settings`,
    e.g. a bench's fastest): the kernels a decode period runs with them (the step as it is set, and the flush), so
    that the profile is of the figure's kernels and nothing compiles that the bench did not."""
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
        dense = RecurrentSettings(**settings) if settings else None
        work = [(None, lambda: dense_recurrent_step(st, q, k, v, g, beta, dense, out=out))]
    else:
        split = SplitSettings(**settings) if settings else SplitSettings()
        plan = TritonSteps(Launch.of(split)).plan(st)
        # the one-kernel step: the Gluon one where it applies
        fused = TritonSteps(Launch.of(dataclasses.replace(split, fused_step=True))).plan(st)
        triton_step = TritonSteps(Launch.of(dataclasses.replace(split, fused_step=True, gluon_step=False))).plan(st)
        n = bench.PERIOD // 2
        qw, kw, vw, gw, bw = (x[None].expand(n, *x.shape).contiguous() for x in (q, k, v, g, beta))  # [T, B, ...]
        if settings:  # the period's kernels: its step as set (one kernel or two), then its flush
            work = [(n, lambda: launch_packed_step(plan, st.buffer, q, k, v, g, beta, out)),
                    (bench.PERIOD, lambda: launch_flush(plan, st.buffer))]
        else:
            work = [(n, lambda: launch_dots(plan, q, k)),
                    (n, lambda: launch_records(plan, st.buffer, q, k, v, g, beta, out)),
                    (n, lambda: launch_packed_step(fused, st.buffer, q, k, v, g, beta, out)),
                    *([(n, lambda: launch_packed_step(triton_step, st.buffer, q, k, v, g, beta, out))]
                      * fused.split.gluon_step),
                    (bench.PERIOD, lambda: launch_flush(plan, st.buffer)),
                    *([(0, lambda: launch_window(fused, st.buffer, qw, kw, vw, gw, bw, torch.empty_like(vw)))]
                      * window)]
    for profiled in (False, True):  # compile, then profile only the kernel (the buffer is filled before)
        for records, kernel in work:
            if records is not None:
                bench.fill_buffers(layers, records)
            in_range(kernel, profiled)


def in_range(fn, profiled: bool = True) -> None:
    """``fn()`` on an idle GPU, inside the profiler's range (``cudaProfilerStart`` / ``Stop``: what ncu profiles with
    ``--profile-from-start off``) where ``profiled``, else alone (a run that compiles its kernels first)."""
    import torch

    torch.cuda.synchronize()
    if profiled:
        torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    if profiled:
        torch.cuda.cudart().cudaProfilerStop()


def raw_rows(text: str) -> list[dict]:
    """ncu's ``--csv --page raw`` output as one dict per profiled kernel (the units row dropped)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    return [r for r in rows if r.get("ID", "").strip().isdigit()]


def run_ncu(ncu: str, child: list[str], timeout_s: float) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """``child`` (a command that opens the profiler's range around what to profile) under ``ncu --clock-control
    none`` with :data:`SECTIONS`, :data:`METRICS` and :data:`STALLS` (without the stall metrics if this ncu lacks
    one), from the repository root: ncu's run and its rows (:func:`raw_rows`)."""
    for metrics in (METRICS + STALLS, METRICS):
        cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
               *(a for s in SECTIONS for a in ("--section", s)), "--metrics", ",".join(metrics), *child]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        rows = raw_rows(done.stdout)
        if rows:
            break
    return done, rows


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
    ap.add_argument("--settings-from", type=Path, default=None,
                    help="a bench.json: profile each variant and batch with its fastest configuration there")
    ap.add_argument("--no-window", action="store_true", help="leave out the window kernel (teacher forcing)")
    ap.add_argument("--no-precompile", action="store_true",
                    help="no compile run outside the profiler first (Triton's cache already holds the kernels)")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="the longest one ncu run may take")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no ncu run after this many seconds")
    ap.add_argument("--launch", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.launch:
        variant, B, *rest = args.launch
        launch(variant, int(B), json.loads(rest[0]) if rest else None, not args.no_window)
        return 0
    ncu = shutil.which("ncu")
    if ncu is None:
        print("ncu_profile: Nsight Compute (ncu) is not on the PATH; run this on the GPU machine", file=sys.stderr)
        return 2
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:]
    summary = {**measurement(), "ncu": version,
               "shape": "Qwen3.5-4B GDN layer: H 16, HV 32, K = V = 128, dP 8 (one layer)", "rows": [],
               "not_run": []}
    for B in (int(b) for b in args.batches.split(",")):
        for variant in args.variants.split(","):
            if args.deadline_s is not None and time.monotonic() - started > args.deadline_s:
                summary["not_run"].append({"variant": variant, "batch": B, "why": "past the deadline"})
                continue
            settings = settings_of(args.settings_from, variant, B)
            child = [sys.executable, __file__, "--launch", variant, str(B), json.dumps(settings),
                     *(["--no-window"] if args.no_window else [])]
            try:
                if not args.no_precompile:  # compile outside the profiler first: under ncu it takes minutes
                    subprocess.run(child, cwd=ROOT, check=True, timeout=args.timeout_s)
                done, rows = run_ncu(ncu, child, args.timeout_s)
            except (subprocess.SubprocessError, OSError) as err:
                summary["not_run"].append({"variant": variant, "batch": B, "why": f"{type(err).__name__}: {err}"})
                print(f"B={B} {variant}: not profiled: {type(err).__name__}: {err}", flush=True)
                continue
            (args.out / f"ncu_{_slug(variant)}_B{B}.csv").write_text(done.stdout + "\n# stderr\n" + done.stderr[-4000:])
            if done.returncode or not rows:
                summary["not_run"].append({"variant": variant, "batch": B, "why": f"ncu rc {done.returncode}"})
                print(f"B={B} {variant}: ncu failed (rc {done.returncode}): {(done.stdout + done.stderr)[-600:]}",
                      flush=True)
                continue
            for row in rows:
                s = {"variant": variant, "batch": B, "settings": settings, **summarise(row)}
                summary["rows"].append(s)
                print(row_text(s), flush=True)
            (args.out / "ncu_summary.json").write_text(json.dumps(summary, indent=1))
    (args.out / "ncu_summary.json").write_text(json.dumps(summary, indent=1))
    return 0


def row_text(s: dict) -> str:
    """One printed line of a kernel's summary."""
    bw = s["dram_bytes_per_second"]
    return (f"B={s['batch']:4d} {s['variant']:15s} {s['kernel'][:22]:22s} {s['seconds'] * 1e6:8.2f} us "
            f"{(bw or 0) / 1e12:5.2f} TB/s ({s['dram_pct_of_peak'] or 0:4.1f}% peak) regs {s['registers']} "
            f"occ {s['achieved_occupancy_pct'] or 0:4.1f}% issue {s['issue_active_pct'] or 0:4.1f}% "
            f"instr {(s['instructions'] or 0) / 1e6:.2f} M stalls "
            + ", ".join(f"{k} {v:.1f}" for k, v in s["top_stalls"]))


if __name__ == "__main__":
    raise SystemExit(main())
