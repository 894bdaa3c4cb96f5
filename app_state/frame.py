"""The page frame: page configuration, the shared sidebar (model, device, weight dtype, named configuration
and every setting), and the page body run so that a failure is shown as a message and the app keeps running.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import streamlit as st
import torch

from app_state.controls import (
    CONTROLS,
    EMBEDDED,
    LOCAL,
    MODEL_KINDS,
    NAMED_CONFIGS,
    WEIGHT_DTYPES,
    bind,
    current_config,
    device_options,
    enabled,
    fallback_config,
    on_model_change,
    on_preset_change,
    read_url_once,
    sync,
    write_url,
)
from app_state.markup import escape
from app_state.session import model_label, stored_card
from pace_core import figures
from pace_core.config import PaceConfig
from pace_core.errors import PaceError
from pace_core.shapes import BUILTIN_SHAPES

ICON = Path(__file__).resolve().parents[1] / "data" / "icon.png"
"""The favicon, a local file: an emoji or material icon would be fetched from an outside host."""

def sidebar() -> PaceConfig:
    """The shared sidebar: model, device, starting configuration and every setting (mirrored into
    the URL); returns the validated configuration (the named one while the controls are invalid, said at the
    top of the page)."""
    url_problems = read_url_once()
    for problem in url_problems:
        st.warning(escape(problem), icon=":material/link:")
    model_problem = st.session_state.pop("_model_problem", None)
    if model_problem is not None:
        st.warning(model_problem, icon=":material/folder_off:")
    with st.sidebar:
        st.subheader("Model")
        st.radio("Source", MODEL_KINDS, key=bind("model_kind"), horizontal=True,
                 on_change=on_model_change, args=("model_kind",),
                 help="The embedded model ships in data/models (a small Qwen3.5-architecture hybrid "
                      "trained by this project); or any Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoint by "
                      "local folder or Hugging Face hub id.")
        if st.session_state["model_kind"] != EMBEDDED:
            st.text_input("Local folder" if st.session_state["model_kind"] == LOCAL else "Hub id",
                          key=bind("model_text"), on_change=on_model_change, args=("model_text",),
                          placeholder="/path/to/checkpoint" if
                          st.session_state["model_kind"] == LOCAL else "Qwen/Qwen3.5-4B")
        st.selectbox("Device", device_options(), key=bind("device"),
                     on_change=sync, args=("device",),
                     help="Where the model runs for the live views (cuda when a GPU is visible).")
        st.selectbox("Weights", WEIGHT_DTYPES, key=bind("weights"), on_change=sync, args=("weights",),
                     help="The dtype the model's weights are loaded in. The recurrent state is computed in "
                          "float32 either way; bfloat16 halves the weights' memory (a 27B model: 54 GB "
                          "instead of 108 GB) and the fp32 reference then means fp32 state arithmetic on "
                          "those weights.")
        st.subheader("Configuration")
        st.selectbox("Start from", list(NAMED_CONFIGS), key=bind("preset"),
                     on_change=on_preset_change,
                     help="A named configuration of spec §6. It only sets the controls below; every "
                          "setting stays adjustable.")
        method = st.session_state["method"]
        widths = None
        for control in CONTROLS:
            common = dict(key=bind(control.key), help=control.help, on_change=sync,
                          args=(control.key,), disabled=not enabled(control, method))
            if isinstance(control.options[0], bool):
                st.toggle(control.label, **common)
            elif len(control.options) <= 5:
                st.selectbox(control.label, control.options, format_func=control.fmt, **common)
            else:
                st.select_slider(control.label, control.options, format_func=control.fmt, **common)
            if control.field == "bits":
                widths = st.empty()  # what each width costs, once the configuration is known
        try:
            cfg, problem = current_config(), None
        except PaceError as err:
            cfg, problem = fallback_config(), err
            st.error(f"These settings do not form a valid configuration: {escape(err)}.")
        if widths is not None and problem is None:
            widths.caption(width_costs(cfg))
        st.caption(f"Active: **{escape(cfg.name)}** · the link in the address bar reproduces this view")
    if problem is not None:
        st.error(f"The sidebar's settings do not form a valid configuration: {escape(problem)}. The views use "
                 f"'{escape(cfg.name)}' until you change them.", icon=":material/tune:")
    write_url()
    return cfg


def width_costs(cfg: PaceConfig) -> str:
    """The sidebar's line under the state bits: each width's resident bits and state bytes per sequence with the
    other settings as they are (:func:`pace_core.figures.width_table`), on the sidebar model's stored shape, else
    on Qwen3.5-27B's; the current width in bold."""
    card = stored_card()
    shape, where = (card.shape, model_label()) if card is not None else (BUILTIN_SHAPES[WIDTH_SHAPE], WIDTH_SHAPE)
    table = figures.width_table(cfg.uncalibrated(), shape)
    if table.empty:
        return "A reference state has no code width."
    cells = []
    for row in table.to_dict("records"):
        cell = f"{row['bits']} → {row['resident bits']:.2f} bits, {_size(row['state KiB / sequence'] * 1024)}"
        cells.append(f"**{cell}**" if row["current"] else cell)
    return (f"Each width with these settings on {where} (resident bits per state value, state per sequence; every "
            "width stored densely): " + " · ".join(cells))


WIDTH_SHAPE = "qwen3.5-27b"
"""The shape the sidebar counts widths on when the sidebar model has no stored card (no model is loaded for it)."""


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.1f} KiB"


def _out_of_memory(err: BaseException) -> bool:
    """A device or host allocation failure (torch raises plain RuntimeErrors on the CPU)."""
    text = str(err)
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text))


def run_page(body: Callable[[PaceConfig], None]) -> None:
    """Run one page: page config, the shared sidebar, then `body(cfg)`.

    A PaceError or any other exception of the page is shown as st.error with what to do; the app
    keeps running. (Each page calls this itself, so a page also works when streamlit runs its file
    directly, as it does for a deep link on a fresh server because the folder is named pages/.)
    """
    st.set_page_config(page_title="PACE Studio", page_icon=str(ICON), layout="wide")
    cfg = sidebar()
    try:
        body(cfg)
    except PaceError as err:
        st.error(f"{escape(err)}\n\nChange the named setting in the sidebar (or the input on this page) and the "
                 "page recomputes.", icon=":material/warning:")
    except Exception as err:  # a page failure must not take the app down: report it, keep going
        if _out_of_memory(err):
            st.error(f"Out of memory on {escape(st.session_state.get('device', 'the device'))}: "
                     f"{escape(str(err).partition(chr(10))[0])}\n\nAsk for less at once on this page (fewer tokens, "
                     "steps, sequences or configurations), or pick a smaller model or another device in the sidebar; "
                     "what was computed before is kept.", icon=":material/memory:")
            return
        logging.getLogger("pace_studio").error("a page failed", exc_info=err)  # the server's log keeps where
        st.error(f"This page failed: {type(err).__name__}: {escape(err)}\n\nTry another configuration or model; "
                 "if it persists, please report it with the link in the address bar.", icon=":material/error:")
