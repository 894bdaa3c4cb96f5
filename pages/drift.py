"""Drift: relative state error and excess NLL over decode steps for several dP and bit widths."""

import pandas as pd
import streamlit as st

from app_state import compute, controls, frame, session, stored
from app_state.library import PaceConfig
from pace_core import figures

DEFAULT_PREFILL, DEFAULT_STEPS = 256, 256
"""512 tokens: long enough that per-token rounding (dP 1) visibly drifts away from dP 8 and 16 on the embedded
model (the default curves: dP 1, the sidebar's dP and twice it), and short enough for a live run of a few
seconds on two CPU cores."""

SUMMARY_FORMAT = {"mean_rel_error": "{:.3%}", "final_rel_error": "{:.3%}", "mean_excess_nll": "{:+.4f} nats"}


def page(cfg: PaceConfig) -> None:
    """The page body for the sidebar's configuration `cfg`."""
    st.title("Drift")
    st.caption("One text, teacher-forced: the prompt prefix is prefilled, then every further token goes "
               "through the decode path (buffer, a rounding every dP tokens). Relative state error "
               "‖S̃_t − S_t‖_F / ‖S_t‖_F compares the effective state (checkpoint + folded buffer) with the "
               "fp32 reference, pooled over all GDN layers; excess NLL is the quantised run's NLL of the next "
               "token minus the reference's (spec §7).")

    loaded = session.loaded_model()  # load the model (or show why it cannot) before any control
    result = stored.choose_stored(
        "drift", "drift", loaded.fingerprint,
        lambda r: f"stored: {', '.join(r.configs)} · {r.provenance.get('date', '?')}",
        "drift_source", live="live: the sidebar configuration at several dP and bit widths", per_config=True)
    if result is not None:
        st.plotly_chart(figures.drift_figure(result.table, title=f"Drift of {', '.join(result.configs)}"),
                        key="drift_chart")
        st.dataframe(pd.DataFrame(result.rows("summary")).style.format(SUMMARY_FORMAT), hide_index=True,
                     key="drift_summary")
        return
    if not cfg.quantized:
        st.info("Method 'none' does not quantise: choose a quantising method (e.g. start from pace-4) to "
                "see the drift of its bits and dP.", icon=":material/info:")
        return
    c1, c2, c3, c4 = st.columns(4)
    # the pickers start from the sidebar's bits and dP, and start over when those change
    choices = sorted({1, 2, 4, 8, 16, 32, 64, cfg.decode_period, 2 * cfg.decode_period})
    periods = c1.multiselect(
        "Decode periods dP",
        choices,
        default=sorted({1, cfg.decode_period, 2 * cfg.decode_period}),
        key=f"drift_periods_{cfg.decode_period}",
        help="One curve per dP × bit width; each new curve is one more teacher-forced run (the others are kept).",
    )
    bit_list = c2.multiselect("Bit widths", list(range(2, 9)), default=[cfg.bits], key=f"drift_bits_{cfg.bits}")
    prefill = c3.slider("Prompt tokens (prefill)", 8, 1024, DEFAULT_PREFILL, step=8, key="drift_prefill")
    steps = c4.slider("Decode steps", 8, 1024, DEFAULT_STEPS, step=8, key="drift_steps",
                      help="Tokens teacher-forced through the decode path after the prompt.")
    if not periods or not bit_list:
        st.warning("Choose at least one dP and one bit width.", icon=":material/touch_app:")
        return

    configs = {f"{cfg.name}, {b}-bit, dP {p}": cfg.replace(name=f"{b}-bit dP{p}", bits=b, decode_period=p)
               for b in bit_list for p in periods}
    result = compute.drift(controls.model_source(), controls.runtime(),
                           tuple((label, controls.config_key(c)) for label, c in configs.items()),
                           prefill, steps)
    st.caption(f"Source: {result['provenance_label']}")
    st.plotly_chart(figures.drift_figure(result["table"], title=f"Drift of {', '.join(configs)}"),
                    key="drift_chart")
    st.dataframe(result["summary"].style.format(SUMMARY_FORMAT), hide_index=True, key="drift_summary")


frame.run_page(page)
