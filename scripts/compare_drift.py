"""GPU result = CPU result for the stored drift: the drift results of two result folders (say one made with
``--device cuda``, one on the CPU) compared configuration by configuration and step by step, for the settings both
hold (the same drift settings, ``params_key``: model, text, tokens, spacing; and the same configuration name).

Per configuration: each side's mean relative state error, the largest difference of the relative error at one
step, absolute and relative to the CPU side's, and the same for the excess NLL. Prints a table and writes
``<out>`` (JSON with provenance).

    python scripts/compare_drift.py GPU_RESULTS CPU_RESULTS --out data/bench/drift_cuda_vs_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from pace_core.provenance import measurement  # noqa: E402
from pace_core.results import list_results  # noqa: E402


def compare(gpu_root: str, cpu_root: str, model: str) -> list[dict]:
    """One row per (drift settings, configuration) both folders hold under ``model``'s folder name."""
    def held(root: str) -> dict:
        return {(r.data["params_key"], r.data["config"]): r for r in list_results(model, "drift", root=root).results}

    gpu, cpu = held(gpu_root), held(cpu_root)
    rows = []
    for key in sorted(gpu.keys() & cpu.keys()):
        g, c = gpu[key], cpu[key]
        m = g.table.merge(c.table, on=["config", "step"], suffixes=("_gpu", "_cpu"))
        d_err = (m.rel_error_gpu - m.rel_error_cpu).abs()
        d_nll = (m.excess_nll_gpu - m.excess_nll_cpu).abs()
        rows.append(
            {
                "config": key[1],
                "params_key": key[0],
                "steps": len(m),
                "gpu_device": g.provenance.get("device"),
                "cpu_device": c.provenance.get("device"),
                "mean_rel_error_gpu": float(m.rel_error_gpu.mean()),
                "mean_rel_error_cpu": float(m.rel_error_cpu.mean()),
                "max_abs_diff_rel_error": float(d_err.max()),
                "max_rel_diff_rel_error": float((d_err / m.rel_error_cpu.abs().clip(lower=1e-30)).max()),
                "max_abs_diff_excess_nll": float(d_nll.max()),
            }
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gpu_results", help="results root folder made on the GPU")
    p.add_argument("cpu_results", help="results root folder made on the CPU")
    p.add_argument("--model", default="pace-tiny-qwen35", help="model folder name under both roots")
    p.add_argument("--out", default=None, help="JSON file to write")
    args = p.parse_args()
    rows = compare(args.gpu_results, args.cpu_results, args.model)
    if not rows:
        print("no drift result is held by both folders (same settings)", file=sys.stderr)
        return 2
    print(
        f"{'config':<12}{'steps':>6}{'mean gpu':>11}{'mean cpu':>11}{'max |d|':>11}{'max |d|/cpu':>13}"
        f"{'max |d nll|':>13}"
    )
    for r in rows:
        print(f"{r['config']:<12}{r['steps']:>6}{r['mean_rel_error_gpu']:>11.6f}{r['mean_rel_error_cpu']:>11.6f}"
              f"{r['max_abs_diff_rel_error']:>11.2e}{r['max_rel_diff_rel_error']:>13.2e}{r['max_abs_diff_excess_nll']:>13.2e}")
    if args.out:
        doc = {"kind": "drift_gpu_vs_cpu", "provenance": measurement(), "rows": rows}
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
