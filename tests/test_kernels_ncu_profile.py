"""kernels/bench/ncu_profile.py on the CPU: reading Nsight Compute's raw CSV page into the per-kernel summary
(ncu itself runs on the GPU machine only)."""

from __future__ import annotations

import csv
import io
import random

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
    rows = ncu_profile._rows(_raw_page(kernels))
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
