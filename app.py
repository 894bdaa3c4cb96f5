"""PACE Studio: `streamlit run app.py`.

The entry point lists the pages of pages/; each page builds the shared sidebar (model, device,
named configuration and every PACE setting, mirrored into the URL) through app_state.run_page.
"""

import streamlit as st

PAGES = [
    st.Page("pages/overview.py", title="Overview", icon=":material/home:", default=True),
    st.Page("pages/state_heatmaps.py", title="State heatmaps", icon=":material/grid_on:"),
    st.Page("pages/head_ranking.py", title="Head ranking", icon=":material/leaderboard:"),
    st.Page("pages/drift.py", title="Drift", icon=":material/show_chart:"),
    st.Page("pages/memory.py", title="Memory", icon=":material/memory:"),
    st.Page("pages/generations.py", title="Generations", icon=":material/chat:"),
    st.Page("pages/benchmarks.py", title="Benchmarks", icon=":material/speed:"),
    st.Page("pages/export.py", title="Export", icon=":material/download:"),
]

st.navigation(PAGES).run()
