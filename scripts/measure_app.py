"""How fast the dashboard answers: the figures of issue 16, medians of ``--repeats`` runs.

    python scripts/measure_app.py [--model PATH] [--device cpu|cuda] [--weights float32|bfloat16] [--repeats 3]
                                  [--pages-only | --compare-only] [--busy N]
                                  [--out data/bench]

Each scenario drives the app as a user would, through streamlit's AppTest (the page scripts, the
caches and the computations exactly as ``streamlit run`` runs them, without a browser), timing one
interaction from the click to the finished page:

- ``first_page_s``: a fresh server's first page (Overview) including the model load;
- ``cached_control_change_s``: Head ranking, dP 8 -> 9 (E_h and the 8-bit heads from the kept calibration);
- ``drift_first_s``: Drift's first view (the fp32 reference and 3 configurations x 512 tokens);
- ``drift_recompute_s``: Drift after the sidebar's bits change (3 new configurations, the reference kept);
- ``generations_first_s``: Generations with 4 configurations x 64 new tokens (and the fp32 reference);
- ``generations_recompute_s``: the same after the sidebar's bits change (1 new configuration);
- ``head_ranking_recalibration_s``: Head ranking after the bits change and after the group axis
  changes (a new quantiser on the kept reference samples), the slower of the two;
- ``heatmap_position_s`` / ``heatmap_new_text_s``: State heatmaps, another position / another text;
- on cuda, ``page_<name>_s``: every page's first visit once the model is loaded (with ``--pages-only``
  these and ``first_page_s`` alone).

Before each repeat the computed results are dropped (not the loaded model, except for ``first_page_s``,
which starts a new process). With Debian's Chromium and Playwright installed, ``browser_first_page_s`` is
the time from ``streamlit run app.py`` to the first rendered page in a real browser. The table is printed
and saved as JSON with provenance (``<out>/app_<device>.json``, ``app_<device>_bfloat16.json`` for bfloat16
weights). Not a test: the numbers are the host's.

``--busy N`` runs N competing processes (each a Python busy loop, one core's worth) for the whole measurement,
as another program on the host would, and saves ``app_<device>[_bfloat16]_busy.json`` with the targets 2x the
quiet figures of the file without ``_busy``. Every file records the 1-minute load average at the start and end
of each repeat (the competing processes included) and the CPUs other processes kept busy just before the
measurement started (pace_core.host, the competing processes not yet started), and the torch intra-op threads
the app chose for each figure's computations (app_state.work.use_free_cores).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from pace_core.provenance import measurement  # noqa: E402

TARGETS_S = {
    "cpu": {
        "first_page_s": 10,
        "browser_first_page_s": 10,
        "cached_control_change_s": 1,
        "drift_first_s": 5,
        "drift_recompute_s": 5,
        "generations_first_s": 5,
        "generations_recompute_s": 5,
        "head_ranking_recalibration_s": 5,
        "heatmap_position_s": 5,
        "heatmap_new_text_s": 5,
    },
    "cuda": dict.fromkeys(
        (
            "cached_control_change_s",
            "drift_first_s",
            "drift_recompute_s",
            "generations_first_s",
            "generations_recompute_s",
            "head_ranking_recalibration_s",
            "heatmap_position_s",
            "heatmap_new_text_s",
        ),
        5,
    ),
}
"""Issue 16's targets (seconds). On the GPU every page must answer in 5 s once the model is loaded."""
TARGETS_S["cuda"].update({f"page_{p.stem}_s": 5 for p in (REPO_ROOT / "pages").glob("*.py")})
COMPARE_TARGETS_S = {"compare_page_s": 1, "compare_budget_s": 1}
"""Issue 38's target: the Compare page answers "best under budget" in under 1 s from stored results."""

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
IDLE = '[data-testid="stApp"][data-test-script-state="notRunning"]'


def _app(query: dict[str, str]):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(REPO_ROOT / "app.py"), default_timeout=900)
    for k, v in query.items():
        at.query_params[k] = v
    return at


def _checked(at):
    problems = [e.value for e in at.exception] + [e.value for e in at.error]
    if problems:
        raise RuntimeError(f"the page failed: {problems}")
    return at


_CHOSEN: list[int] = []
"""The intra-op threads app_state.work.use_free_cores chose since the last _timed began."""


def _record_threads() -> None:
    """Record every choice of app_state.work.use_free_cores in _CHOSEN."""
    from app_state import work

    choose = work.use_free_cores

    def recording() -> int:
        _CHOSEN.append(choose())
        return _CHOSEN[-1]

    work.use_free_cores = recording


def _timed(action: Callable[[], object]) -> float:
    _CHOSEN.clear()
    start = time.perf_counter()
    _checked(action())
    return time.perf_counter() - start


def _forget() -> None:
    """Drop every computed result (the loaded model stays)."""
    import streamlit as st

    from app_state import work

    work._all_kept().clear()
    st.cache_data.clear()


def scenarios(query: dict[str, str], pages_only: bool = False) -> tuple[dict[str, float], dict[str, list[int]]]:
    """One repeat of every AppTest scenario: ``({figure: seconds}, {figure: intra-op threads chosen})``;
    ``pages_only``: the first page and every page's first visit (on cuda) alone."""
    out: dict[str, float] = {}
    threads: dict[str, list[int]] = {}

    def measure(name: str, *actions: Callable[[], object]) -> None:
        """``name``: the slowest of ``actions``, each timed, and the threads chosen in any of them."""
        chosen = set()
        seconds = []
        for action in actions:
            seconds.append(_timed(action))
            chosen |= set(_CHOSEN)
        out[name], threads[name] = max(seconds), sorted(chosen)

    at = _app(query)
    measure("first_page_s", at.run)  # app_state not imported before: the time includes the app's imports
    _record_threads()
    _forget()
    if pages_only:
        return {**out, **(every_page(query) if query["device"] == "cuda" else {})}, threads

    at = _app({**query, "preset": "pace-4-8"})
    _checked(at.run())
    _checked(at.switch_page("pages/head_ranking.py").run())
    measure("cached_control_change_s", lambda: at.sidebar.select_slider(key="w_dp").set_value(9).run())
    measure("head_ranking_recalibration_s", lambda: at.sidebar.select_slider(key="w_bits").set_value(3).run(),
            lambda: at.sidebar.selectbox(key="w_axis").set_value("value").run())

    at = _app({**query, "preset": "pace-4"})
    _checked(at.run())
    measure("drift_first_s", lambda: at.switch_page("pages/drift.py").run())
    if len(at.get("plotly_chart")) != 1:
        raise RuntimeError("Drift showed no chart")
    measure("drift_recompute_s", lambda: at.sidebar.select_slider(key="w_bits").set_value(3).run())

    at = _app({**query, "preset": "pace-4"})
    _checked(at.run())
    _checked(at.switch_page("pages/generations.py").run())
    _forget()
    at.slider(key="gen_tokens").set_value(64)
    measure("generations_first_s",
            lambda: at.multiselect(key="gen_others").set_value(["rtn-int4", "rtn-int8", "pace-4-8"]).run())
    measure("generations_recompute_s", lambda: at.sidebar.select_slider(key="w_bits").set_value(3).run())

    at = _app({**query, "preset": "pace-4"})
    _checked(at.run())
    _checked(at.switch_page("pages/state_heatmaps.py").run())
    positions = at.select_slider(key="heat_pos").options
    measure("heatmap_position_s",
            lambda: at.select_slider(key="heat_pos").set_value(int(positions[len(positions) // 2])).run())
    text = at.text_area(key="heat_text").value
    measure("heatmap_new_text_s", lambda: at.text_area(key="heat_text").set_value(text[:len(text) // 2]).run())
    _forget()
    if query["device"] == "cuda":
        out.update(every_page(query))
    return out, threads


def compare_scenarios(query: dict[str, str]) -> tuple[dict[str, float], dict[str, list[int]]]:
    """One repeat of the Compare page's figures (seconds), from the stored comparison of the model, and the
    threads chosen (none: the page computes nothing)."""
    at = _app(query)
    _checked(at.run())
    out = {"compare_page_s": _timed(lambda: at.switch_page("pages/compare.py").run())}
    if not at.success:
        raise RuntimeError("the Compare page recommended nothing: no stored comparison of the model, or no budget fits")
    out["compare_budget_s"] = _timed(lambda: at.number_input(key="compare_bits").set_value(5.0).run())
    return out, {}


def app_query(device: str, weights: str, model: str | None) -> dict[str, str]:
    """The URL query of the app on ``model`` (None: the embedded one) with these sidebar choices. A link opens
    only what the operator offers (app_state.controls), so this process and the servers it starts offer the
    model: a local folder through its parent as the models folder, a hub id by allowing hub ids."""
    if not model:
        return {"device": device, "weights": weights}
    if Path(model).expanduser().is_dir():
        model = str(Path(model).expanduser().resolve())
        os.environ["PACE_MODELS_DIR"] = str(Path(model).parent)  # app_state.controls.MODELS_DIR_ENV
    else:
        os.environ["PACE_ALLOW_HUB"] = "1"  # app_state.controls.ALLOW_HUB_ENV
    return {"device": device, "weights": weights, "model": model}


def app_model(query: dict[str, str]) -> object:
    """The app's cached load of the model of ``query`` (the one every page's visit then finds loaded)."""
    from app_state.controls import Runtime
    from app_state.session import _load_model

    return _load_model(query.get("model", ""), Runtime(query["device"], query["weights"]))


def every_page(query: dict[str, str]) -> dict[str, float]:
    """``page_<name>_s``: each page's first visit after the model is loaded (nothing computed kept). The
    model is loaded first, outside the timings: the Overview reads a stored model card without loading it,
    so otherwise the first page that needs the model would carry the load."""
    out: dict[str, float] = {}
    at = _app({**query, "preset": "pace-4-8"})
    _checked(at.run())
    app_model(query)
    _forget()
    for page in sorted((REPO_ROOT / "pages").glob("*.py")):
        out[f"page_{page.stem}_s"] = _timed(lambda page=page: at.switch_page(f"pages/{page.name}").run())
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def browser_first_page(query: dict[str, str]) -> float | None:
    """Seconds from ``streamlit run app.py`` to the first rendered page in Chromium (None without one)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    if not Path(CHROMIUM).exists():
        return None
    port = _free_port()
    base = f"http://127.0.0.1:{port}/?{urllib.parse.urlencode(query)}"
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
                             "--server.port", str(port), "--server.address", "127.0.0.1",
                             "--browser.gatherUsageStats", "false"], cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1440, "height": 1600})
            while True:
                try:
                    page.goto(base, timeout=5_000)
                    break
                except Exception:  # the server is not listening yet
                    if proc.poll() is not None:
                        raise RuntimeError("streamlit exited") from None
                    time.sleep(0.2)
            page.wait_for_function("t => document.querySelector('[data-testid=\"stMain\"]').innerText.includes(t)",
                                   arg="Recurrent state memory", timeout=300_000)
            page.wait_for_selector(IDLE, timeout=300_000)
            seconds = time.perf_counter() - started
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return seconds


def _one_process(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, list[int]]]:
    """One repeat in a fresh Python process (a fresh server: the model is loaded again): seconds and threads
    chosen per figure."""
    cmd = [sys.executable, __file__, "--repeat-once", "--device", args.device, "--weights", args.weights,
           *(["--pages-only"] if args.pages_only else []), *(["--compare-only"] if args.compare_only else [])]
    if args.model:
        cmd += ["--model", args.model]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if done.returncode:  # its whole log beside the figures (a page's traceback may lie far from the end)
        log = Path(args.out) / f"measure_app_failed_{args.device}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(done.stderr)
        raise RuntimeError(f"a repeat failed (its whole log: {log}):\n{done.stderr[-4000:]}")
    seconds, threads = json.loads(done.stdout.strip().splitlines()[-1])
    return seconds, threads


def settings(args: argparse.Namespace) -> dict:
    """What this measurement ran with, beside its provenance (:func:`pace_core.provenance.measurement`)."""
    return {
        "torch_threads": torch.get_num_threads(),
        "device": args.device,
        "weights": args.weights,
        "model": args.model or "embedded",
        "repeats": args.repeats,
        "pages_only": args.pages_only,
        "compare_only": args.compare_only,
        "competing_busy_processes": args.busy,
    }


def _competitors(n: int) -> list[subprocess.Popen]:
    """``n`` busy-loop processes, each keeping one core's worth busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local folder or hub id (default: the embedded model)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    # app_state.controls.WEIGHT_DTYPES, not imported here: first_page_s must include the app's imports
    parser.add_argument("--weights", default="float32", choices=["float32", "bfloat16"],
                        help="the sidebar's weight dtype (default float32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pages-only", dest="pages_only", action="store_true",
                        help="only the first page and (on cuda) every page's first visit: for models too large "
                             "to run every scenario in reasonable time")
    parser.add_argument("--compare-only", dest="compare_only", action="store_true",
                        help="only the Compare page's figures, into app_<device>_compare.json")
    parser.add_argument("--busy", type=int, default=0,
                        help="competing busy-loop processes during the measurement (default 0: a quiet host)")
    parser.add_argument("--out", default=str(REPO_ROOT / "data" / "bench"))
    parser.add_argument("--repeat-once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    query = app_query(args.device, args.weights, args.model)
    if args.repeat_once:
        print(json.dumps(compare_scenarios(query) if args.compare_only else scenarios(query, args.pages_only)))
        return
    from pace_core.host import busy_cpus_of_others

    targets = _targets(args)
    busy_cpus_of_others()
    time.sleep(1.2)  # a full sampling window (pace_core.host.SAMPLE_S)
    host = {"busy_cpus_of_others_before": round(busy_cpus_of_others(), 2), "load_average_1min": []}
    competitors = _competitors(args.busy)
    runs: list[dict[str, float]] = []
    threads: dict[str, set[int]] = {}
    try:
        for _ in range(args.repeats):  # the table is saved after every repeat: a stopped run keeps what it measured
            load = os.getloadavg()[0]
            run, chosen = _one_process(args)
            browser = args.device == "cpu" and not (args.pages_only or args.compare_only)
            seconds = browser_first_page(query) if browser else None
            if seconds is not None:
                run["browser_first_page_s"] = seconds
            runs.append(run)
            for name, counts in chosen.items():
                threads.setdefault(name, set()).update(counts)
            host["load_average_1min"].append([round(load, 2), round(os.getloadavg()[0], 2)])
            print(json.dumps(run), flush=True)
            path = _save(args, _rows(runs, targets, threads), host)
    finally:
        for proc in competitors:
            proc.kill()
    rows = _rows(runs, targets, threads)
    print(f"{'figure':32} {'median s':>9} {'target s':>9}  met   threads  runs")
    for r in rows:
        print(f"{r['figure']:32} {r['median_s']:9.2f} {str(r['target_s'] or '-'):>9}  "
              f"{'-' if r['met'] is None else ('yes' if r['met'] else 'NO'):4}  {str(r['threads']):7}  {r['runs_s']}")
    print(f"load average (1 min) at the start and end of each repeat: {host['load_average_1min']}")
    print(f"saved {path}")


def _path(args: argparse.Namespace, busy: bool) -> Path:
    """``<out>/app_<device>[_<weights>][_compare][_busy].json`` (no weights suffix for float32)."""
    return Path(args.out) / (f"app_{args.device}{'' if args.weights == 'float32' else '_' + args.weights}"
                             f"{'_compare' if args.compare_only else ''}{'_busy' if busy else ''}.json")


def _targets(args: argparse.Namespace) -> dict[str, float]:
    """Issue 16's targets; with competing processes, 2x each quiet figure of the quiet file (where there is one)."""
    if not args.busy:
        return COMPARE_TARGETS_S if args.compare_only else TARGETS_S[args.device]
    quiet = _path(args, busy=False)
    if not quiet.is_file():
        return {}
    return {row["figure"]: round(2 * row["median_s"], 3) for row in json.loads(quiet.read_text())["figures"]}


def _rows(runs: list[dict[str, float]], targets: dict[str, float], threads: dict[str, set[int]]) -> list[dict]:
    """One row per figure: the median over ``runs``, every run, the target and whether it is met, and the
    intra-op threads the app chose for its computations (empty: it computed nothing)."""
    rows = []
    for name in runs[0]:
        values = [r[name] for r in runs if name in r]
        median = statistics.median(values)
        target = targets.get(name)
        rows.append({"figure": name, "median_s": round(median, 3), "runs_s": [round(v, 3) for v in values],
                     "target_s": target, "met": None if target is None else median <= target,
                     "threads": sorted(threads.get(name, ()))})
    return rows


def _save(args: argparse.Namespace, rows: list[dict], host: dict) -> Path:
    """Write the table (:func:`_path`) atomically with its provenance and the host's load; returns its path."""
    from pace_core.results import atomic_write

    path = _path(args, busy=bool(args.busy))
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = json.dumps({"kind": "app_responsiveness",
                      "provenance": {**measurement(), **settings(args), "repeats_done": len(rows[0]["runs_s"]), **host,
                                     "targets": "2x the quiet figures of " + _path(args, busy=False).name
                                                if args.busy else "issue 16"},
                      "figures": rows}, indent=2)
    atomic_write(path, lambda p: Path(p).write_text(doc + "\n"))
    return path


if __name__ == "__main__":
    main()
