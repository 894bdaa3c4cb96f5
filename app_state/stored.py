"""Results stored by ``python -m pace_core <command>`` (under ``data/results/``) and benchmarks (under
``data/bench/``): listing them for the loaded weights, choosing one on a page, and naming its provenance.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import streamlit as st

from app_state.controls import model_source
from app_state.session import results_model_name

REPO_ROOT = Path(__file__).resolve().parents[1]

BENCH_DIR = Path(os.environ.get("PACE_BENCH_DIR", REPO_ROOT / "data" / "bench"))


BENCH_COMMAND = "python3 kernels/bench/bench.py --out data/bench"


@st.cache_data(show_spinner=False, ttl=30)
def stored_results(source: str, kind: str, weights: str) -> list[Any]:
    """Results of `kind` stored by `python -m pace_core <command>` under data/results/ for the model
    whose weights have the fingerprint `weights` (pace_core.model.loading.weights_fingerprint; results
    of other weights under the same name, e.g. before a retrained checkpoint replaced it, are left out),
    newest first (re-read at most every 30 s)."""
    from pace_core.results import list_results

    return [r for r in list_results(results_model_name(source), kind) if r.provenance.get("weights") == weights]


@st.cache_data(show_spinner=False, ttl=30)
def stored_sets(source: str, kind: str, weights: str) -> list[Any]:
    """The per-configuration results of `kind` (drift, perplexity, generation) stored for the weights
    `weights`, one pace_core.results.ResultSet per setting, newest first (re-read at most every 30 s)."""
    from pace_core.results import result_sets

    return result_sets(results_model_name(source), kind, weights=weights)


def choose_stored(kind: str, command: str, weights: str, label: Callable[[Any], str], key: str, *,
                  live: str | None = None, title: str = "Source", per_config: bool = False) -> Any | None:
    """One result of `python -m pace_core <command>` stored as `kind` for the weights `weights`
    (:func:`stored_results`; with `per_config`, one set of per-configuration results, :func:`stored_sets`),
    labelled by `label`: with `live`, a radio whose first option is `live` (returns None for it); else a
    selectbox titled `title` (None, and nothing shown, when none is stored). The chosen result's
    provenance is captioned."""
    stored = (stored_sets if per_config else stored_results)(model_source(), kind, weights)
    if not stored and live is None:
        return None
    options = ([live] if live else []) + [label(r) for r in stored]
    help_text = (f"Results of `python -m pace_core {command}` stored under data/results/ for the loaded weights, "
                 "newest first, with their provenance"
                 + ("; 'live' computes on the loaded model now." if live else "."))
    if live:
        choice = st.radio(title, options, key=key, horizontal=len(options) < 3, help=help_text)
    else:
        choice = st.selectbox(title, options, key=key, help=help_text)
    if choice == live:
        return None
    result = stored[options.index(choice) - (1 if live else 0)]
    st.caption(f"Source: {provenance_label(result.provenance)}")
    return result


def provenance_label(prov: dict[str, Any]) -> str:
    """One line naming where a stored result comes from: command, date, device, text."""
    text = prov.get("text", {})
    parts = [f"`{prov.get('command', '?')}`", prov.get("date", "?")]
    if prov.get("device"):
        parts.append(str(prov["device"]))
    if text:
        parts.append(f"text {Path(text.get('path', '?')).name} (sha256 {str(text.get('sha256', ''))[:12]}…)")
    return "stored result of " + ", ".join(parts)
