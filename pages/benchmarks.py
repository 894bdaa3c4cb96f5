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
        st.subheader(path.stem)
        tables, provenance = figures.split_bench_document(doc)
        st.caption("Measured on " + ", ".join(f"{k} {provenance[k]}" for k in ("device", "date", "torch", "triton")
                                              if k in provenance) + f" · file {path.name}")
        with st.expander("Provenance", expanded=False):
            st.json(provenance)
        for name, rows in tables.items():
            frame = figures.bench_scalar_table(rows)
            plot = figures.bench_plot_columns(frame)
            if plot is not None:
                x, ys, series = plot
                for col, y in zip(st.columns(min(len(ys), 3)) * len(ys), ys):
                    col.plotly_chart(figures.bench_figure(frame, x=x, y=y, series=series, title=y,
                                                          y_title=y), key=f"bench_{path.stem}_{name}_{y}")
            st.dataframe(frame, hide_index=True, key=f"bench_table_{path.stem}_{name}")
        png = path.with_suffix(".png")
        if png.exists():
            st.image(str(png), caption=png.name)


frame.run_page(page)
