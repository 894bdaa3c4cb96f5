"""Memory: resident bits per state value, the curve over dP, the measured error against resident bits
(stored sweeps), and how many sequences fit."""

import streamlit as st

from app_state import frame, session, stored
from pace_core import figures
from pace_core.config import NAMED_CONFIGS, PaceConfig
from pace_core.shapes import BUILTIN_SHAPES


def page(cfg: PaceConfig) -> None:
    """The page body for the sidebar's configuration `cfg`."""
    cfg = cfg.replace(high_heads=None)  # bits follow the share of 8-bit heads; calibrated heads fit one model only
    st.title("Memory")
    st.caption("Resident bits per state value = payload + metadata + c · dP (spec §5), where "
               "c = (b_k·d_k/γ + b_v·d_v + 32) / (d_k·d_v) is the decode buffer's cost per value and "
               "buffered token. 'exact' is what the implementation actually stores.")

    loaded = session.loaded_model(stop=False)
    shapes = {} if loaded is None else {f"{session.model_label()} (loaded)": loaded.shape}
    shapes.update(BUILTIN_SHAPES)

    col_shape, col_cfgs = st.columns([1, 2])
    shape_name = col_shape.selectbox("Model shape", list(shapes), key="memory_shape",
                                     help="The loaded model's shape, or a built-in Qwen shape (no download).")
    shape = shapes[shape_name]
    default_named = ["fp32", "bf16", "rtn-int4", "rtn-int8", "pace-4", "pace-4-8", "damp-int8", "damp-int4",
                     "qmamba-dsq"]
    chosen = col_cfgs.multiselect("Configurations to compare", list(NAMED_CONFIGS),
                                  default=[n for n in default_named if n in NAMED_CONFIGS], key="memory_cfgs")
    configs = {"sidebar: " + cfg.name: cfg}
    configs.update({n: NAMED_CONFIGS[n] for n in chosen})

    table = figures.resident_bits_table(configs, shape)
    st.subheader(f"Resident bits per state value on {shape_name}")
    st.plotly_chart(figures.resident_bits_figure(table), key="memory_bits_chart")
    st.dataframe(table.style.format({c: "{:.4f}" for c in ["payload", "metadata", "buffer c·dP", "resident",
                                                            "exact", "c"]}),
                 hide_index=True, key="memory_bits_table")

    st.subheader("Resident bits against the decode period dP")
    st.caption("Rounding less often shrinks the rounding error's growth but the buffer holds dP records: "
               "the buffer term grows linearly with dP.")
    curve_cfgs = {"sidebar: " + cfg.name: cfg}
    curve_cfgs.update({n: NAMED_CONFIGS[n] for n in ("pace-4", "pace-4-8") if n in NAMED_CONFIGS and n != cfg.name})
    st.plotly_chart(figures.dp_curve_figure(curve_cfgs, shape), key="memory_dp_chart")

    st.subheader("Measured error against resident bits")
    result = None if loaded is None else stored.choose_stored(
        "sweep", "sweep", loaded.fingerprint,
        lambda r: f"{r.provenance.get('date', '?')} · {len(r.table)} configurations · {r.key}", "memory_sweep",
        title="Stored sweep")
    if result is None:
        st.caption("No stored sweep for the loaded model: `python -m pace_core sweep` measures the grid of bit "
                   "widths × dP × group axis on it (relative state and output errors against the fp32 "
                   "reference), and this section then plots it against the resident bits.")
    else:
        error = st.radio("Relative error", list(figures.SWEEP_ERRORS), format_func=figures.SWEEP_ERRORS.get,
                         horizontal=True, key="memory_sweep_error")
        st.plotly_chart(figures.sweep_figure(result.table, error), key="memory_sweep_chart")
        st.dataframe(result.table, hide_index=True, key="memory_sweep_table")

    st.subheader("Sequences that fit beside the weights")
    custom_gb = st.number_input("Custom budget (GB, 10⁹ bytes)", min_value=1.0, max_value=10000.0, value=48.0,
                                step=1.0, key="memory_budget",
                                help="Accelerator memory for weights + recurrent states; attention KV of the "
                                     "full-attention layers is not included.")
    budgets = dict(figures.GPU_BUDGETS_GB)
    budgets[f"{custom_gb:g} GB"] = custom_gb
    fit_models = {shape_name: shape}
    fit_models.update({k: v for k, v in shapes.items() if k != shape_name})
    fits = figures.fit_table(configs, fit_models, budgets)
    st.dataframe(fits.style.format({"state MiB / sequence": "{:.3f}"}), hide_index=True, key="memory_fit_table")


frame.run_page(page)
