"""PACE Studio: `streamlit run app.py`.

The entry point lists the pages of pages/; each page builds the shared sidebar (model, device,
named configuration and every PACE setting, mirrored into the URL) through app_state.run_page.
The pages carry no icons: streamlit makes a page's material icon the favicon and fetches it from an
outside host; the favicon is the local data/icon.png (app_state.frame). Streamlit's look-ups of this host's
addresses, which a foreign page's WebSocket would set off, are turned off first (app_state.offline).
"""

import streamlit as st

from app_state.offline import no_address_lookups

no_address_lookups()

PAGES = [
    st.Page("pages/overview.py", title="Overview", default=True),
    st.Page("pages/compare.py", title="Compare"),
    st.Page("pages/state_heatmaps.py", title="State heatmaps"),
    st.Page("pages/head_ranking.py", title="Head ranking"),
    st.Page("pages/drift.py", title="Drift"),
    st.Page("pages/memory.py", title="Memory"),
    st.Page("pages/generations.py", title="Generations"),
    st.Page("pages/benchmarks.py", title="Benchmarks"),
    st.Page("pages/export.py", title="Export"),
]

st.navigation(PAGES).run()
