"""Measure the dashboard's responsiveness in a real browser (Debian's Chromium through Playwright).

    python scripts/measure_app.py [--model PATH] [--repeats 3] [--omp-threads N]

Prints JSON with, per repeat: the time from starting `streamlit run app.py` to the first rendered
page, a control change on cached data (Head ranking: dP changes E_h and the 8-bit heads from the
cached calibration), and a live heatmap recompute (State heatmaps: a new position runs the fp32
reference on the model), plus the machine's load average. Not a test: the numbers depend on the host.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
IDLE = '[data-testid="stApp"][data-test-script-state="notRunning"]'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_text(page, text: str, timeout_ms: int = 300_000) -> None:
    """Wait until `text` is shown in the main area and the script run has finished."""
    page.wait_for_function("t => document.querySelector('[data-testid=\"stMain\"]').innerText.includes(t)",
                           arg=text, timeout=timeout_ms)
    page.wait_for_selector(IDLE, timeout=timeout_ms)


def measure_once(model: str | None, omp_threads: int | None) -> dict[str, float]:
    """One fresh server: start-to-first-page, cached control change, live heatmap recompute (seconds)."""
    from playwright.sync_api import sync_playwright

    port = _free_port()
    query = urllib.parse.urlencode({"model": model} if model else {})
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ) if omp_threads is None else dict(os.environ, OMP_NUM_THREADS=str(omp_threads))
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
                             "--server.port", str(port), "--server.address", "127.0.0.1",
                             "--browser.gatherUsageStats", "false"], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict[str, float] = {}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1440, "height": 1600})
            while True:
                try:
                    page.goto(f"{base}/?{query}", timeout=5_000)
                    break
                except Exception:  # the server is not listening yet
                    if proc.poll() is not None:
                        raise RuntimeError("streamlit exited")
                    time.sleep(0.2)
            _wait_text(page, "Recurrent state memory")
            out["start_to_first_page_s"] = time.perf_counter() - started

            page.goto(f"{base}/head_ranking?{query}")
            _wait_text(page, "share of total E_h")
            slider = page.get_by_role("slider", name="Decode period dP (tokens)")
            slider.focus()
            t0 = time.perf_counter()
            slider.press("ArrowRight")                    # dP 8 -> 9: E_h and allocation from the cached a_h, e_h
            page.wait_for_function("() => location.search.includes('dp=9')", timeout=60_000)
            page.wait_for_function("() => document.querySelector('[data-testid=\"stMetricValue\"]')"
                                   ".innerText.trim() === '9'", timeout=60_000)
            page.wait_for_selector(IDLE, timeout=60_000)
            out["cached_control_change_s"] = time.perf_counter() - t0

            page.goto(f"{base}/state_heatmaps?{query}")
            _wait_text(page, "after 256 tokens")
            pos = page.get_by_role("slider", name="Position (tokens read)")
            pos.focus()
            t0 = time.perf_counter()
            pos.press("ArrowLeft")                        # 256 -> 255 tokens: a new fp32 reference run
            _wait_text(page, "after 255 tokens")
            out["live_heatmap_recompute_s"] = time.perf_counter() - t0
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    out["load_average_1min"] = os.getloadavg()[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local folder or hub id (default: the embedded model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--omp-threads", type=int, default=None,
                        help="OMP_NUM_THREADS of the server (torch intra-op threads); default: torch's own")
    args = parser.parse_args()
    runs = [measure_once(args.model, args.omp_threads) for _ in range(args.repeats)]
    keys = ["start_to_first_page_s", "cached_control_change_s", "live_heatmap_recompute_s"]
    summary = {k: {"median": sorted(r[k] for r in runs)[len(runs) // 2], "min": min(r[k] for r in runs)}
               for k in keys}
    print(json.dumps({"runs": runs, "summary": summary, "cpu_count": os.cpu_count(),
                      "omp_threads": args.omp_threads}, indent=2))


if __name__ == "__main__":
    main()
