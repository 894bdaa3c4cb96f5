"""The session's model: loading the sidebar's checkpoint once per source and device (cached), a failed
load shown with what to do and tried again only once the source, the runtime or the folder's files change (or
on "Try again"), and the checkpoint's card (pace_core.model.card) for the pages that need no model, stored
after every load.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from app_state.controls import (
    EMBEDDED,
    Runtime,
    config_key,
    current_config,
    fallback_config,
    hide_paths,
    model_source,
    runtime,
)
from app_state.markup import escape
from pace_core.errors import PaceError


def model_label() -> str:
    """Human name of the sidebar's model for captions and provenance."""
    return model_label_of(model_source())


def model_label_of(source: str) -> str:
    """Human name of a model source ('' = the embedded model; in operator mode a folder of the models folder by its
    name there, :func:`app_state.controls.hide_paths`)."""
    return hide_paths(source) or f"embedded ({embedded_model_dir().name})"


def embedded_model_dir() -> Path:
    """Folder of the embedded default model (pace_core.model.DEFAULT_MODEL_DIR)."""
    from pace_core.model import DEFAULT_MODEL_DIR

    return Path(DEFAULT_MODEL_DIR)


@st.cache_resource(show_spinner=False, max_entries=2)
def _load_model(source: str, where: Runtime):
    from pace_core.model.card import checkpoint_stamp, save_card
    from pace_core.model.loading import load_model

    before = checkpoint_stamp(source or None)
    loaded = load_model(source or None, dtype=where.weights, device=where.device)
    save_card(loaded, results_model_name(source), before)
    return loaded


def results_model_name(source: str) -> str:
    """The model name the CLI stores results under (its --model, or the embedded model's folder)."""
    return source or str(embedded_model_dir())


@st.cache_data(show_spinner=False, ttl=30, max_entries=8)
def _stored_card(folder: str, name: str, dtype: str, stamp: tuple, root: str):
    """The card of `folder` for weights in `dtype` stored under the results root `root` (re-read at most every
    30 s, and at once when the folder's files change: ``stamp``, _folder_stamp)."""
    from pace_core.model.card import load_card

    return load_card(folder, name, dtype, root=root)


def stored_card():
    """The stored card of the sidebar's model folder as it is now (pace_core.model.card.ModelCard), or None: no
    model is loaded for it (the sidebar asks it on every page)."""
    from pace_core.results import results_root

    source = model_source()
    if source or st.session_state.get("model_kind") == EMBEDDED:
        return _stored_card(source or str(embedded_model_dir()), results_model_name(source), runtime().weights,
                            _folder_stamp(source), str(results_root()))
    return None


def model_card(*, stop: bool = True):
    """The sidebar's model as a pace_core.model.card.ModelCard: the stored card of its folder as it is
    now, else the card of the loaded model (loading it, or showing why it cannot: see loaded_model)."""
    from pace_core.model.card import card_of

    card = stored_card()
    if card is not None:
        return card
    loaded = loaded_model(stop=stop)
    return None if loaded is None else card_of(loaded)


def loaded_model(*, stop: bool = True):
    """The sidebar's model (cached per source and device) as a pace_core LoadedModel.

    When it cannot be loaded the page shows what to do and stops (stop=False: returns None instead,
    for pages that have more to show).
    """
    loaded = _try_load_model()
    if loaded is None and stop:
        st.stop()
    if loaded is not None:
        _warm_up(loaded)
    return loaded


def _warm_up(loaded) -> None:
    """Compile ahead, in the background, the kernels the live views launch for the sidebar's configuration
    (:mod:`app_state.warmup`; on a GPU, once per model and configuration)."""
    from app_state import warmup  # here, as load_model above: it brings the model code, which others skip

    try:
        cfg = current_config()
    except PaceError:
        cfg = fallback_config()
    warmup.ahead(loaded, cfg, config_key(cfg))


def _folder_stamp(source: str) -> tuple:
    """When a local folder last changed and the name, size and modification time of each of its files (empty for
    a hub id or a folder that cannot be read): a checkpoint fixed after a failed load (a file copied again, a
    config edited, the folder created) is loaded again at once."""
    if not source:
        return ()
    folder = Path(source).expanduser()
    try:
        return (folder.stat().st_mtime_ns, *sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                                   for p in folder.iterdir() if p.is_file()))
    except OSError:
        return ()


def _try_load_model():
    """Load the sidebar's model, or show what to do and return None. A failure (of any kind) is remembered for
    the source, runtime and folder files it happened with, so reruns do not load again (a 27B model takes
    minutes): it is shown until one of them changes or the user asks to try again."""
    source, where = model_source(), runtime()
    if not source and st.session_state.get("model_kind") != EMBEDDED:
        st.info("Enter a local folder or hub id in the sidebar to load a model.", icon=":material/arrow_back:")
        return None
    if not source and not embedded_model_dir().joinpath("config.json").exists():
        st.error(f"The embedded model is not in {escape(embedded_model_dir())} yet. Train it with "
                 "`python -m pace_core.train` (see README), or pick a local folder / hub id of a "
                 "Qwen3.5, Qwen3.6 or Qwen3-Next checkpoint in the sidebar.", icon=":material/folder_open:")
        return None
    failures = st.session_state.setdefault("_load_failures", {})
    attempt = (source, where, _folder_stamp(source))
    if attempt not in failures:
        try:
            with st.spinner(f"Loading {escape(model_label())} on {escape(where)}…"):
                return _load_model(source, where)
        except Exception as err:  # any failure: a PaceError says what to do, anything else is shown as it is
            detail = str(err) if isinstance(err, PaceError) else f"{type(err).__name__}: {err}"
            failures[attempt] = (f"Could not load model {escape(repr(model_label()))}: {escape(detail)}\n\nCheck the "
                                 "path or hub id (no hub is reachable offline) or switch back to the embedded model. "
                                 "It is tried "
                                 "again when the source, the device, the weights or the folder's files change.")
    st.error(failures[attempt], icon=":material/folder_open:")
    st.button("Try again", key="load_try_again", on_click=failures.pop, args=(attempt, None))
    return None


def token_count(loaded, text: str) -> int:
    """Number of tokens of `text` under the loaded tokenizer (no special tokens)."""
    return len(loaded.tokenizer(text, add_special_tokens=False)["input_ids"]) if text.strip() else 0
