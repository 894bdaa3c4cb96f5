"""kernels/bench/ncu_profile.py on the CPU: reading Nsight Compute's raw CSV page into the per-kernel summary, and the
command line's runs with ncu replaced by a script that prints a raw page (ncu itself runs on the GPU machine only)."""

from __future__ import annotations

import csv
import io
import json
import os
import random
import stat
import sys
from pathlib import Path

from kernels.bench import ncu_profile


def _raw_page(rows: list[dict]) -> str:
    """A raw page as ncu writes it: a warning line, the header, the units row, one row per kernel."""
    names = ["ID", "Kernel Name", *ncu_profile.METRICS, *ncu_profile.STALLS]
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(names)
    writer.writerow(["", "", *("nsecond" if "time" in n else "" for n in names[2:])])
    for row in rows:
        writer.writerow([row.get(n, "") for n in names])
    return "==WARNING== Note: Running with unmodified GPU clocks.\n" + out.getvalue()


def test_raw_page_to_summary() -> None:
    rng = random.Random()
    kernels = []
    for i in range(3):
        ns, read, write = rng.uniform(5e3, 1e5), rng.uniform(1e6, 1e8), rng.uniform(1e5, 1e7)
        stalls = {s: rng.uniform(0, 6) for s in ncu_profile.STALLS}
        kernels.append(
            {
                "ID": str(i),
                "Kernel Name": f"_kernel_{i}(float *, int)",
                "gpu__time_duration.sum": f"{ns:,.2f}",
                "dram__bytes_read.sum": f"{read:.0f}",
                "dram__bytes_write.sum": f"{write:.0f}",
                "launch__registers_per_thread": "128",
                **{k: f"{v:.3f}" for k, v in stalls.items()},
            }
        )
    rows = ncu_profile.raw_rows(_raw_page(kernels))
    assert [r["ID"] for r in rows] == ["0", "1", "2"]  # the units row and the warning are not kernels
    for row, given in zip(rows, kernels):
        s = ncu_profile.summarise(row)
        seconds = float(given["gpu__time_duration.sum"].replace(",", "")) * 1e-9
        nbytes = float(given["dram__bytes_read.sum"]) + float(given["dram__bytes_write.sum"])
        assert s["kernel"] == given["Kernel Name"].split("(")[0]
        assert abs(s["seconds"] - seconds) <= 1e-12 * seconds
        assert s["dram_bytes"] == nbytes
        assert abs(s["dram_bytes_per_second"] - nbytes / seconds) <= 1e-9 * nbytes / seconds
        assert s["registers"] == 128 and s["achieved_occupancy_pct"] is None  # a metric ncu did not give
        stalls = sorted(((k.removeprefix("smsp__average_warps_issue_stalled_").removesuffix("_per_issue_active.ratio"),
                          float(given[k])) for k in ncu_profile.STALLS), key=lambda kv: -kv[1])
        assert s["top_stalls"] == stalls[:3]


def fake_ncu(folder: Path, kernels: list[str]) -> None:
    """An ``ncu`` in ``folder`` that prints its version, or a raw page of ``kernels`` whatever it is asked to
    profile."""
    page = _raw_page([{"ID": str(i), "Kernel Name": f"{k}(int)", "gpu__time_duration.sum": "20,000.00",
                       "dram__bytes_read.sum": "30000000", "dram__bytes_write.sum": "1000000",
                       "launch__registers_per_thread": "128"} for i, k in enumerate(kernels)])
    (folder / "page.txt").write_text(page)
    script = folder / "ncu"
    script.write_text(f"#!{sys.executable}\nimport sys\nif '--version' in sys.argv:\n    print('Version 2025.3.0')\n"
                      f"else:\n    print(open({str(folder / 'page.txt')!r}).read())\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_runs_take_the_bench_settings_and_stop_at_the_deadline(tmp_path, monkeypatch) -> None:
    """Each (batch, variant) runs under ncu with the settings its bench row found fastest (the defaults where the bench
    has no row), its raw page kept and its kernels summarised with those settings; past the deadline the runs left
    are named, not started."""
    tools = tmp_path / "bin"
    tools.mkdir()
    fake_ncu(tools, ["_step_kernel", "_flush_kernel"])
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    best = {"fused_step": True, "gluon_step_warps": 4}
    bench_json = tmp_path / "bench.json"
    bench_json.write_text(json.dumps({"rows": [
        {"variant": "PACE-4 dP=8", "batch": 1, "config": best},
        {"variant": "PACE-4 dP=8", "batch": 32, "error": "PaceError: refused"}]}))
    out = tmp_path / "ncu"
    assert ncu_profile.main(["--out", str(out), "--batches", "1,32", "--variants", "PACE-4 dP=8", "--no-precompile",
                             "--settings-from", str(bench_json)]) == 0
    summary = json.loads((out / "ncu_summary.json").read_text())
    assert [(r["batch"], r["kernel"], r["settings"]) for r in summary["rows"]] == [
        (1, "_step_kernel", best), (1, "_flush_kernel", best), (32, "_step_kernel", None), (32, "_flush_kernel", None)]
    assert sorted(p.name for p in out.iterdir()) == ["ncu_PACE-4_B1.csv", "ncu_PACE-4_B32.csv", "ncu_summary.json"]
    late = tmp_path / "late"
    assert ncu_profile.main(["--out", str(late), "--batches", "1,32", "--variants", "PACE-4 dP=8", "--no-precompile",
                             "--deadline-s", "-1"]) == 0
    summary = json.loads((late / "ncu_summary.json").read_text())
    assert summary["rows"] == [] and [(r["batch"], r["why"]) for r in summary["not_run"]] == [
        (1, "past the deadline"), (32, "past the deadline")]
