"""Issue 43's kernel measurements in one GPU call: the decode bench at its default batches (every variant but PACE-3,
whose call is kernels/bench/widths_gpu.py; every launch configuration side by side; flash-linear-attention's baseline
where the fla-core wheel is installed), then Nsight Compute summaries (``ncu --clock-control none``) of the PACE-4
and PACE-4/8 kernels at B = 1, 32, 128 with the launch settings the bench found fastest there, then issue 43's kernel
targets read off both, beside the predictions written before the run (:data:`PREDICTIONS`, kernels/bench/NOTES.md
"issue 43: predictions").

Usage (on the GPU machine, from the repository root)::

    python3 kernels/bench/roofline.py --out DIR [--budget-s 510]

Writes into DIR (seven files, what one device call brings back): ``bench.json``, ``bench.png``, ``bench_log.txt``
(:mod:`kernels.bench.bench`), ``ncu_summary.json``, ``ncu_log.txt``, ``ncu_raw.tar.gz`` (ncu's raw pages,
:mod:`kernels.bench.ncu_profile`) and ``roofline.json`` (each target: the measured figure, met or missed, the
prediction, and the profile of the kernels behind it); prints the targets' table last. The stages share the budget:
the bench starts no batch after its share, ncu no run after the rest; whatever finished is written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kernels.bench import bench  # noqa: E402
from kernels.bench.widths_gpu import Tee  # noqa: E402
from pace_core.provenance import measurement  # noqa: E402

PACE4, PACE48, BF16 = "PACE-4 dP=8", "PACE-4/8 dP=8", "bf16 per-token"
NCU_VARIANTS = (PACE4, PACE48)
NCU_BATCHES = (1, 32, 128)
TARGETS = {
    "pace4_copy_bandwidth": "PACE-4 >= 70 % of the copy bandwidth from B = 32",
    "pace48_speedup_128": "PACE-4/8 >= 2x per-token bf16 at B = 128",
    "pace48_speedup_from_8": "PACE-4/8 >= 1x per-token bf16 from B = 8",
    "pace4_b1_ratio": "B = 1: PACE-4 <= 1.2x per-token bf16's time",
}
PREDICTIONS = {
    # card -> target -> the band predicted for this code, per batch where the target spans several
    # (kernels/bench/NOTES.md, "issue 43: predictions", written before the run)
    "H100": {"pace4_copy_bandwidth": {32: (0.36, 0.40), 128: (0.49, 0.56)}, "pace48_speedup_128": (1.52, 1.70),
             "pace48_speedup_from_8": {8: (0.55, 0.68), 32: (1.20, 1.35)}, "pace4_b1_ratio": (1.30, 1.45)},
    "H200": {"pace4_copy_bandwidth": {32: (0.27, 0.31), 128: (0.39, 0.45)}, "pace48_speedup_128": (1.50, 1.65),
             "pace48_speedup_from_8": {8: (0.52, 0.62), 32: (1.10, 1.25)}, "pace4_b1_ratio": (1.30, 1.45)},
}
BATCHES = (128, 1, 32, 8, 64, 16, 4, 2)
"""The bench's default batches (:data:`kernels.bench.bench.BATCHES`), those of the targets and the profiles first."""
BENCH_SHARE = 0.6
"""The bench's share of the budget (the rest: ncu and the summary). On the H200 a cold bench at all batches took
minutes of compilation (kernels/bench/NOTES.md, run 12's call 4); ``--warm-workers`` compiles in parallel first."""


def card(device_name: str) -> str | None:
    """``H100`` or ``H200`` from a CUDA device's name, else None."""
    return next((c for c in ("H100", "H200") if c in device_name), None)


def _rows(bench_json: dict) -> dict[tuple[str, int], dict]:
    return {(r["variant"], r["batch"]): r for r in bench_json["rows"] if "error" not in r}


def _within(value: float | None, band: tuple[float, float] | None) -> bool | None:
    return None if value is None or band is None else band[0] <= value <= band[1]


def _profile(ncu: dict | None, variant: str, batch: int) -> list[dict]:
    """The ncu rows of ``variant``'s kernels at ``batch`` (kernel, time, DRAM bandwidth and its share of peak,
    registers, occupancy, issue activity, instructions, the largest stalls, the launch settings); none where that batch
    was not profiled."""
    keys = ("kernel", "seconds", "dram_bytes_per_second", "dram_pct_of_peak", "registers", "achieved_occupancy_pct",
            "issue_active_pct", "instructions", "top_stalls", "settings")
    return [{k: r.get(k) for k in keys} for r in (ncu or {}).get("rows", [])
            if r["variant"] == variant and r["batch"] == batch]


def targets(bench_json: dict, ncu: dict | None) -> dict:
    """Issue 43's kernel targets from a bench run (and its profiles): per target the figure at each batch it covers,
    met or missed (None where a row is missing), the prediction for the card and whether the figure fell inside it,
    and the profile of the kernels behind the figure."""
    rows = _rows(bench_json)
    pred = PREDICTIONS.get(card(bench_json.get("device", "")) or "", {})
    batches = sorted({r["batch"] for r in bench_json["rows"]})  # a batch whose row failed counts, with no figure
    out = {}

    def speed(variant: str, b: int) -> float | None:
        mine, base = rows.get((variant, b)), rows.get((BF16, b))
        return None if mine is None or base is None else base["seconds_per_token"] / mine["seconds_per_token"]

    figures = {b: rows[(PACE4, b)]["hbm_fraction"] if (PACE4, b) in rows else None for b in batches if b >= 32}
    out["pace4_copy_bandwidth"] = {"figures": figures, "threshold": 0.70, "batches": [b for b in batches if b >= 32]}
    out["pace48_speedup_128"] = {"figures": {128: speed(PACE48, 128)}, "threshold": 2.0, "batches": [128]}
    out["pace48_speedup_from_8"] = {"figures": {b: speed(PACE48, b) for b in batches if b >= 8}, "threshold": 1.0,
                                    "batches": [b for b in batches if b >= 8]}
    one = speed(PACE4, 1)
    out["pace4_b1_ratio"] = {"figures": {1: None if one is None else 1 / one}, "threshold": 1.2, "batches": [1],
                             "at_most": True}
    for name, t in out.items():
        vals = [t["figures"].get(b) for b in t["batches"]]
        ok = [None if v is None else (v <= t["threshold"] if t.get("at_most") else v >= t["threshold"]) for v in vals]
        t["met"] = False if False in ok else None if not ok or None in ok else True  # a miss, or every batch met
        t["what"] = TARGETS[name]
        band = pred.get(name)
        if isinstance(band, dict):
            t["predicted"] = {b: list(v) for b, v in band.items()}
            t["inside_prediction"] = {b: _within(t["figures"].get(b), v) for b, v in band.items()}
        elif band is not None:
            t["predicted"] = list(band)
            t["inside_prediction"] = {b: _within(t["figures"].get(b), band) for b in t["batches"]}
        variant = PACE4 if name.startswith("pace4") else PACE48
        t["profile"] = {b: p for b in t["batches"] if (p := _profile(ncu, variant, b))}
    return out


def table(result: dict) -> str:
    """The targets as printed lines: the figure per batch, met or missed, the predicted band."""
    lines = [f"{'target':52s} {'figures':40s} {'met':6s} predicted"]
    for t in result["targets"].values():
        figs = " ".join("-" if v is None else f"B={b}: {v * 100:.0f}%" if t["threshold"] == 0.70 else f"B={b}: {v:.2f}x"
                        for b, v in t["figures"].items())
        met = {True: "met", False: "missed", None: "-"}[t["met"]]
        lines.append(f"{t['what']:52s} {figs:40s} {met:6s} {t.get('predicted', '-')}")
    return "\n".join(lines)


def run_bench(out: Path, argv: list[str], deadline_s: float, device=None) -> int:
    """The bench (in this process, its output teed into ``out/bench_log.txt``), starting no batch after
    ``deadline_s``."""
    log = out / "bench_log.txt"
    with log.open("w") as f, contextlib.redirect_stdout(Tee(sys.stdout, f)):
        try:
            return bench.main([*argv, "--out", str(out), "--deadline-s", f"{deadline_s:.0f}"], device=device)
        except Exception as err:
            print(f"roofline: the bench stopped: {type(err).__name__}: {err}")
            return 1


def run_ncu(out: Path, batches: str, variants: str, deadline_s: float) -> int:
    """:mod:`kernels.bench.ncu_profile` on the bench's fastest settings, as a child process (ncu runs children of its
    own), its raw pages packed into ``out/ncu_raw.tar.gz`` and its summary moved to ``out/ncu_summary.json``."""
    raw = out / "ncu_raw"
    cmd = [sys.executable, str(ROOT / "kernels" / "bench" / "ncu_profile.py"), "--out", str(raw), "--batches", batches,
           "--variants", variants, "--settings-from", str(out / "bench.json"), "--no-window", "--no-precompile",
           "--deadline-s", f"{max(deadline_s - 60, 0):.0f}", "--timeout-s", f"{max(min(deadline_s, 150), 30):.0f}"]
    with (out / "ncu_log.txt").open("w") as log:
        log.write("# " + " ".join(cmd) + "\n")
        log.flush()
        try:
            done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=deadline_s + 30)
            rc = done.returncode
        except subprocess.TimeoutExpired:
            log.write("\nroofline: ncu_profile ran past its deadline and was stopped\n")
            rc = 124
    if raw.exists():
        if (raw / "ncu_summary.json").exists():
            shutil.move(str(raw / "ncu_summary.json"), out / "ncu_summary.json")
        with tarfile.open(out / "ncu_raw.tar.gz", "w:gz") as tar:
            for f in sorted(raw.iterdir()):
                tar.add(f, arcname=f.name)
        shutil.rmtree(raw)
    return rc


def main(argv: list[str] | None = None, device=None) -> int:
    """The command line (module docstring); ``device``: another device than CUDA for the bench (the CPU tests)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=510.0, help="the whole run's seconds (bench, ncu, summary)")
    ap.add_argument("--reps", type=int, default=10, help="CUDA-graph replays per configuration")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)),
                    help="the bench's batches, in the order run (the targets' first: a late batch may miss the budget)")
    ap.add_argument("--variants", default=None,
                    help="the bench's variants (default: all available but PACE-3, kernels/bench/widths_gpu.py's)")
    ap.add_argument("--warm-workers", type=int, default=8, help="parallel processes compiling the kernels first")
    ap.add_argument("--ncu-batches", default=",".join(map(str, NCU_BATCHES)))
    ap.add_argument("--ncu-variants", default=",".join(NCU_VARIANTS))
    ap.add_argument("--no-ncu", action="store_true", help="the bench alone")
    args = ap.parse_args(argv)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    variants = args.variants or ",".join(v for v in bench.available_variants() if v != bench.PACE3)
    bench_rc = run_bench(args.out, ["--reps", str(args.reps), "--batches", args.batches, "--warm-workers",
                                    str(args.warm_workers), "--variants", variants],
                         args.budget_s * BENCH_SHARE, device)
    ncu_rc = None
    if not args.no_ncu and (args.out / "bench.json").exists():
        if shutil.which("ncu") is None:
            (args.out / "ncu_log.txt").write_text("roofline: Nsight Compute (ncu) is not on the PATH\n")
        else:
            ncu_rc = run_ncu(args.out, args.ncu_batches, args.ncu_variants,
                             args.budget_s - (time.monotonic() - started) - 20)
    bench_json = json.loads((args.out / "bench.json").read_text()) if (args.out / "bench.json").exists() else None
    ncu_path = args.out / "ncu_summary.json"
    ncu = json.loads(ncu_path.read_text()) if ncu_path.exists() else None
    result = {**measurement(), "bench_rc": bench_rc, "ncu_rc": ncu_rc,
              "seconds": time.monotonic() - started,
              "device": None if bench_json is None else bench_json["device"],
              "copy_bandwidth": None if bench_json is None else bench_json["copy_bandwidth"],
              "targets": {} if bench_json is None else targets(bench_json, ncu)}
    (args.out / "roofline.json").write_text(json.dumps(result, indent=1, default=bench.jsonable))
    print(f"\nroofline: {result['seconds']:.0f} s on {result['device']}")
    if result["targets"]:
        print(table(result))
    return 0 if bench_rc == 0 else bench_rc


if __name__ == "__main__":
    raise SystemExit(main())
