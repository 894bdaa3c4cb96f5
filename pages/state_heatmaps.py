"""State heatmaps: one head's fp32 state, its key-axis and value-axis quantisation and the errors."""

import streamlit as st
import torch

from app_state import compute, controls, frame, session
from app_state.library import PaceConfig, QuantSpec, fake_quantize, strongest_outlier_head, structure_stats
from pace_core import figures


def page(cfg: PaceConfig) -> None:
    """The page body for the sidebar's configuration `cfg`."""
    st.title("State heatmaps")
    st.caption("The fp32 reference state S [d_k × d_v] of one value head after a prompt prefix, rounded once "
               "with the sidebar's bits, group size and zero point, once with key-axis (channel-aligned) "
               "groups and once with value-axis groups. Outlier columns (column RMS > 4× the head's median) "
               "are marked ▼. Colours span the 99th percentile of the absolute values; larger entries saturate.")

    loaded = session.loaded_model()
    if not cfg.quantized:
        st.info("Method 'none' stores the state unquantised; the views below use the bits, group size and "
                "zero point of the sidebar controls to show what a quantised state would look like.",
                icon=":material/info:")

    text = st.text_area("Prompt text", compute.default_text(), key="heat_text", height=110,
                        help="The state is the model's recurrent state after reading this text up to the position.")
    n_tokens = session.token_count(loaded, text)
    if n_tokens == 0:
        st.error("The prompt text is empty: type some text to see a state.", icon=":material/edit:")
        st.stop()
    states = compute.reference_states(controls.model_source(), controls.runtime(), text)
    positions = sorted(states)
    if "heat_layer" not in st.session_state:  # first visit: open on the head with the strongest outlier columns
        st.session_state["heat_layer"], st.session_state["heat_head"] = strongest_outlier_head(states[positions[-1]])
    c1, c2, c3 = st.columns(3)
    layer = c1.selectbox("GDN layer", loaded.gdn_layers, key="heat_layer",
                         help="Decoder layer index (only Gated DeltaNet layers have a recurrent state).")
    gamma = loaded.shape.num_v_heads // loaded.shape.num_k_heads
    head = 0 if loaded.shape.num_v_heads == 1 else c2.slider(
        "Value head", 0, loaded.shape.num_v_heads - 1, key="heat_head",
        help=f"Key head = value head // γ (γ = {gamma}). The page opens on the head whose columns differ most "
             "(column RMS max/median) at the end of the text.")
    if st.session_state.get("heat_pos") not in positions:  # a new text: start at its end
        st.session_state["heat_pos"] = positions[-1]
    position = positions[0] if len(positions) == 1 else c3.select_slider(
        "Position (tokens read)", positions, key="heat_pos",
        help=f"The state after this many prompt tokens: {len(positions)} positions of the text, all read in one "
             "reference run, so moving the slider is instant.")
    S = states[position][layer]                      # [HV, K, V] fp32
    stats = structure_stats(S)
    outliers = [int(j) for j in torch.nonzero(stats.outlier_cols[head]).flatten()]
    views, groups = {}, {}
    for axis in ("key", "value"):
        spec = QuantSpec(bits=cfg.bits if cfg.quantized else st.session_state["bits"], symmetric=cfg.symmetric,
                         axis=axis, group_size=cfg.group_size)
        label = f"{axis}-axis g={cfg.group_size}"
        views[label], groups[label] = fake_quantize(S[head], spec), (axis, cfg.group_size)
    sidebar = f"{cfg.group_axis}-axis g={cfg.group_size}"

    errors = {label: float(torch.linalg.norm(q - S[head]) / torch.linalg.norm(S[head]).clamp_min(1e-30))
              for label, q in views.items()}
    m = st.columns(4)
    for i, (label, err) in enumerate(errors.items()):
        m[i].metric(f"relative error, {label}", f"{err:.3%}")
    m[2].metric("column RMS max/median", f"{float(stats.col_ratio[head]):.2f}")
    m[3].metric("row RMS max/median", f"{float(stats.row_ratio[head]):.2f}")
    key_err, value_err = errors.values()
    col_ratio, row_ratio = float(stats.col_ratio[head]), float(stats.row_ratio[head])
    if key_err <= value_err:
        st.caption(f"Key-axis groups win here ({key_err:.1%} vs {value_err:.1%}): a key-axis group lies inside one "
                   f"value column, so {'the ▼ outlier columns set' if outliers else 'each column sets'} only their "
                   f"own scales (columns differ {col_ratio:.1f}× here, rows {row_ratio:.1f}×).")
    else:
        st.caption(
            f"Value-axis groups win here ({value_err:.1%} vs {key_err:.1%}): this head's rows differ more "
            f"({row_ratio:.1f}×) than its columns ({col_ratio:.1f}×{', no outlier column' if not outliers else ''}), "
            "and a value-axis group lies inside one key row, so a large row sets only its own scales. "
            "PACE's key-axis groups pay off on heads with outlier columns, which the page opens on."
        )
    st.plotly_chart(figures.state_heatmaps(S[head], views, groups=groups, sidebar=sidebar, outlier_columns=outliers,
                                           title=f"layer {layer}, value head {head}, after {position} tokens"),
                    key="heat_chart")
    inside = cfg.group_size < (S.shape[-2] if cfg.group_axis == "key" else S.shape[-1])
    st.caption(f"Dotted lines: where one scale group ends and the next begins, on each grouping's quantised and error "
               f"panels. Key-axis groups are {cfg.group_size} consecutive key rows of one value column (lines between "
               f"rows), value-axis groups {cfg.group_size} consecutive value columns of one key row (lines between "
               f"columns). The sidebar's grouping, {cfg.group_axis} axis (Group axis, Group size g), is the row marked "
               "'(sidebar)'" + ("." if inside else f"; with g = {cfg.group_size} one group spans the whole "
                                                    f"{'column' if cfg.group_axis == 'key' else 'row'}, so it has no "
                                                    "line inside."))
    st.plotly_chart(figures.rms_profiles(stats.col_rms[head], stats.row_rms[head], float(stats.col_ratio[head]),
                                         float(stats.row_ratio[head]), outliers, stats.threshold),
                    key="heat_profiles")
    with st.expander("All heads of this layer: structure statistics"):
        st.dataframe(stats.table(layer).drop(columns=["outlier_col_index"]), hide_index=True, key="heat_stats")


frame.run_page(page)
