"""Benchmarks: the GPU results stored in data/bench/ with their provenance."""

import json

import streamlit as st

from app_state import frame, stored
from pace_core import figures
from pace_core.config import PaceConfig


def page(cfg: PaceConfig) -> None:
    """The page body for the sidebar's configuration `cfg`."""
    st.title("Benchmarks")
    st.caption("GDN decode-step time and end-to-end time per output token measured on a GPU host by the "
               "project's benchmark script; this page only reads its JSON results and plots from data/bench/.")

    files = sorted(stored.BENCH_DIR.glob("*.json"))
    if not files:
        st.info(f"No benchmark results yet in {stored.BENCH_DIR}. On a CUDA host run "
                f"`{stored.BENCH_COMMAND}`; it writes JSON and PNG files there, and this page shows them.",
                icon=":material/speed:")
        st.stop()

    for path in files:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as err:  # ValueError: not UTF-8 or not JSON
            st.error(f"{path.name}: not readable as JSON ({err}); re-run the benchmark to rewrite it.",
                     icon=":material/block:")
            continue
        if not isinstance(doc, dict):
            st.error(f"{path.name}: a JSON {type(doc).__name__}, not a benchmark result object; re-run the "
                     "benchmark to rewrite it, or remove the file.", icon=":material/block:")
            continue
        st.subheader(TITLES.get(path.stem, path.stem))
        tables, provenance = figures.split_bench_document(doc)
        st.caption("Measured on " + ", ".join(f"{k} {provenance[k]}" for k in ("device", "date", "torch", "triton")
                                              if k in provenance) + f" · file {path.name}")
        for name, rows in tables.items():
            frame = figures.bench_scalar_table(rows)
            headline = figures.bench_headline(frame)
            if headline is not None:
                st.caption("Each cell: time per token · speed-up over bf16 per-token at the same batch B · share "
                           "of the copy bandwidth measured in the same run (decode step only).")
                st.dataframe(headline, hide_index=True, key=f"bench_headline_{path.stem}_{name}")
            plot = figures.bench_plot_columns(frame)
            if plot is not None:
                x, ys, series = plot
                shown = [y for y in ys if y in figures.BENCH_METRICS][:2] or ys[:2]
                readable = figures.bench_readable(frame)
                for col, y in zip(st.columns(len(shown)), shown):
                    title = figures.bench_metric_title(y)
                    col.plotly_chart(figures.bench_figure(readable, x=x, y=title, series=series, title=title,
                                                          y_title=title), key=f"bench_{path.stem}_{name}_{y}")
            with st.expander("All measurements", expanded=headline is None):
                st.dataframe(figures.bench_readable(frame), hide_index=True, key=f"bench_table_{path.stem}_{name}")
        with st.expander("Provenance", expanded=False):
            st.json(provenance)


TITLES = {"bench": "Decode step of 24 GDN layers (Qwen3.5-4B shapes), per batch",
          "bench_e2e": "End to end: time per output token of a Qwen3.5-4B-sized model under CUDA graphs",
          "bench_e2e_compiled": "End to end under torch.compile: time per output token of a Qwen3.5-4B-sized model "
                                "(the state a custom operator inside the compiled graph and CUDA graphs)",
          "memory_cpu": "What pace_core.apply holds per configuration, measured on the CPU (scripts/measure_memory.py)",
          "memory_cuda": "What pace_core.apply holds per configuration, measured on the GPU (scripts/measure_memory.py)",
          "app_cpu": "Dashboard responsiveness on the CPU (scripts/measure_app.py)",
          "app_cuda": "Dashboard responsiveness on the GPU (scripts/measure_app.py)",
          "app_cuda_bfloat16": "Dashboard responsiveness on the GPU, bfloat16 weights (scripts/measure_app.py --weights bfloat16)",
          "vllm_cpu": "vLLM plugin on the CPU: share of vLLM's greedy tokens the transformers path picks too "
                      "(python -m pace_core.vllm.check)",
          "vllm_cpu_own": "vLLM plugin on the CPU, unrounded fp32: greedy tokens against vLLM's own state "
                          "(python -m pace_core.vllm.check --own-state fp32)",
          "vllm_serve_cpu": "Serving with vllm serve on the CPU: vLLM's own state against the plugin at one memory "
                            "budget, per concurrency (python -m pace_core.vllm.bench)"}
"""Headings of the benchmark files this project writes (others show their file name)."""


frame.run_page(page)
