"""Head ranking: a_h, e_h and E_h per GDN layer and value head, and the heads chosen for 8 bits."""

import pandas as pd
import streamlit as st

from app_state import compute, controls, frame, session
from app_state.library import HIGH_SHARE_METHODS, PaceConfig, get_config, high_heads_for
from pace_core import figures


def page(cfg: PaceConfig) -> None:
    """The page body for the sidebar's configuration `cfg`."""
    st.title("Head ranking")
    st.caption("PACE-4/8 (spec §4): a rounding leaves error energy e_h in head h, which the head keeps with "
               "decay a_h per token; rounding every dP tokens it retains E_h = e_h / (1 − a_h^(2·dP)). In each "
               "layer the share of heads with the largest E_h keep 8 bits. Our choice: a_h = mean of α_t = e^(g_t) "
               "over the calibration tokens; e_h = mean ‖Q(S) − S‖²_F over calibration states with the "
               "sidebar's quantiser.")

    loaded = session.loaded_model()
    if cfg.method not in HIGH_SHARE_METHODS:
        st.info(f"Head-level precision applies to the methods {', '.join(HIGH_SHARE_METHODS)}; the sidebar's "
                f"method is '{cfg.method}'. Start from pace-4-8 to rank heads.", icon=":material/info:")
        st.stop()

    calib = compute.calibration(controls.model_source(), controls.runtime(),
                                compute.calibration_key(cfg))
    a, e = calib["calibration"].a, calib["calibration"].e  # [L, HV] float64
    st.caption(f"Calibration: {calib['provenance_label']}")
    E, high = high_heads_for(a, e, cfg)
    labels = [f"layer {layer}" for layer in loaded.gdn_layers]

    c1, c2, c3 = st.columns(3)
    c1.metric("dP", cfg.decode_period)
    c2.metric("8-bit heads per layer", f"{len(high[0]) if high else 0} of {E.shape[1]}",
              help="round(share × value heads) per layer.")
    kept = float(sum(E[i, list(h)].sum() for i, h in enumerate(high)) / E.sum()) if high else 0.0
    c3.metric("share of total E_h in the 8-bit heads", f"{kept:.1%}")
    if cfg.high_share == 0:
        paper = get_config("pace-4-8")
        st.info(f"No head keeps 8 bits: the sidebar's **Share of 8-bit heads** is 0%. To enable 8-bit heads, set "
                f"**Share of 8-bit heads** (sidebar, under Configuration) to {paper.high_share:.0%}, PACE-4/8's share "
                f"(in each layer that share of the heads, those with the largest E_h below, keep {paper.high_bits} "
                f"bits), or choose **Start from** {paper.name}. The ranking below does not depend on the share.",
                icon=":material/leaderboard:")
    st.plotly_chart(figures.head_ranking_figure(E, a, e, high, labels), key="heads_chart")

    table = pd.DataFrame([{"layer": layer, "head": h, "a_h": float(a[i, h]), "e_h": float(e[i, h]),
                           "E_h": float(E[i, h]), "8-bit": h in high[i]}
                          for i, layer in enumerate(loaded.gdn_layers) for h in range(E.shape[1])])
    st.dataframe(table.sort_values("E_h", ascending=False).style.format({"a_h": "{:.5f}", "e_h": "{:.4g}",
                                                                           "E_h": "{:.4g}"}),
                 hide_index=True, key="heads_table")
    if cfg.high_share > 0:
        st.button("Use this allocation in the exported configuration", key="heads_use", type="primary",
                  on_click=controls.set_allocation, args=(cfg, high),
                  help="Attaches these per-layer 8-bit heads to the sidebar configuration (Export page).")
        if cfg.high_heads is not None:
            st.success("The sidebar configuration carries this allocation." if tuple(map(tuple, cfg.high_heads)) ==
                       tuple(map(tuple, high)) else "The sidebar configuration carries an allocation from an "
                       "import or an earlier calibration.", icon=":material/check_circle:")


frame.run_page(page)
