"""Results stored by ``python -m pace_core <command>`` (under ``data/results/``) and benchmarks (under
``data/bench/``): listing them for the loaded weights, choosing one on a page, and naming its provenance.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import streamlit as st

from app_state.controls import REPO_ROOT, model_source
from app_state.markup import code, escape
from app_state.session import results_model_name
from pace_core.provenance import code_label

BENCH_DIR = Path(os.environ.get("PACE_BENCH_DIR", REPO_ROOT / "data" / "bench"))


BENCH_COMMAND = "python3 kernels/bench/bench.py --out data/bench"


@st.cache_data(show_spinner=False, ttl=30)
def stored_results(source: str, kind: str, weights: str) -> Any:
    """Results of `kind` stored by `python -m pace_core <command>` under data/results/ for the model
    whose weights have the fingerprint `weights` (pace_core.model.loading.weights_fingerprint; results
    of other weights under the same name, e.g. before a retrained checkpoint replaced it, are left out),
    current ones first, each newest first, with the damaged files of `kind` beside them: a
    pace_core.results.Listing (re-read at most every 30 s)."""
    from pace_core.results import Listing, list_results

    listing = list_results(results_model_name(source), kind)
    return Listing([r for r in listing.results if r.provenance.get("weights") == weights], listing.damaged)


@st.cache_data(show_spinner=False, ttl=30)
def stored_sets(source: str, kind: str, weights: str) -> Any:
    """The per-configuration results of `kind` (drift, perplexity, generation) stored for the weights
    `weights`, one pace_core.results.ResultSet per setting and method version, current ones first, with
    the damaged files of `kind`: a pace_core.results.Listing (re-read at most every 30 s)."""
    from pace_core.results import result_sets

    return result_sets(results_model_name(source), kind, weights=weights)


STALE = "stale · "
"""The start of a stale result's label in a chooser."""


def choose_stored(kind: str, command: str, weights: str, label: Callable[[Any], str], key: str, *,
                  live: str | None = None, title: str = "Source", per_config: bool = False,
                  rank: Callable[[Any], Any] | None = None) -> Any | None:
    """One result of `python -m pace_core <command>` stored as `kind` for the weights `weights`
    (:func:`stored_results`; with `per_config`, one set of per-configuration results, :func:`stored_sets`),
    labelled by `label` (a stale one, made by another method version, after "stale · "): with `live`, a radio
    whose first option is `live` (returns None for it); else a selectbox titled `title` (None, and nothing
    shown, when none is stored). The results are offered current ones first, then by `rank` (a sort key; the
    newest first among equals). The chosen result's provenance is captioned, and a stale one's warning says how
    to recompute it. Damaged files of `kind` are named in a warning each, with what to do."""
    listing = (stored_sets if per_config else stored_results)(model_source(), kind, weights)
    name_damaged(kind, listing.damaged)
    stored = listing.results if rank is None else sorted(listing.results, key=lambda r: (r.stale, rank(r)))
    if not stored and live is None:
        return None
    options = ([live] if live else []) + [(STALE if r.stale else "") + label(r) for r in stored]
    help_text = (f"Results of `python -m pace_core {command}` stored under data/results/ for the loaded weights, "
                 "current ones first, newest first, with their provenance; a stale one was made by another "
                 "version of the method's code" + ("; 'live' computes on the loaded model now." if live else "."))
    if live:
        choice = st.radio(title, options, key=key, horizontal=len(options) < 3, help=help_text, format_func=escape)
    else:
        choice = st.selectbox(title, options, key=key, help=help_text)
    if choice == live:
        return None
    result = stored[options.index(choice) - (1 if live else 0)]
    if result.stale:
        st.warning(f"{escape(result.stale_label)}. Its numbers may not be what the current code computes"
                   + ("; the first option computes them now." if live else "."), icon=":material/history:")
    st.caption(f"Source: {provenance_label(result.provenance)}")
    return result


def name_damaged(kind: str, damaged: list) -> None:
    """A warning per damaged stored file of ``kind`` (pace_core.results.Damaged): which file, what is wrong, what to
    do."""
    for d in damaged:
        st.warning(f"A stored {kind} result is damaged and not shown: {escape(d.message)}", icon=":material/warning:")


def mixed_code(parts: list[tuple[str, dict[str, Any]]], what: str) -> None:
    """A warning naming the commits when the stored results shown together (``parts``: a name for each and its
    provenance) were made by different code: their figures may differ by more than their settings. Nothing when
    one commit made them all."""
    made: dict[str, list[str]] = {}
    for name, provenance in parts:
        made.setdefault(code_label(provenance), []).append(name)
    if len(made) > 1:
        st.warning(f"{what} were made by different code: "
                   + "; ".join(f"commit {escape(label)} ({escape(', '.join(names))})" for label, names in made.items())
                   + ". Figures of different code may differ by more than their settings do: recompute them with one "
                     "commit (the commands in their provenance, `--force`) to compare them.",
                   icon=":material/commit:")


def measured_by(comparison: Any, weights: str) -> list[tuple[str, dict[str, Any]]]:
    """(configuration, provenance) of each point of a stored ``compare`` result: the provenance of the stored
    ``perplexity`` result the point's figures were taken from (the same configuration, tokens and figures; the
    compare command reuses stored ones, which another commit may have made), else the comparison's own."""
    measured = stored_results(model_source(), "perplexity", weights).results
    parts = []
    for point in comparison.data["points"]:
        same = (r for r in measured if "row" in r.data and r.data["row"].get("config") == point["config"]
                and all(r.data["row"].get(k) == point.get(k) for k in ("tokens", "kl", "agreement", "bpb")))
        parts.append((point["config"], next(same, comparison).provenance))
    return parts


@dataclass(frozen=True)
class Quality:
    """Stored quality figures of one configuration: ``which`` result they come from, ``row`` (tokens, nll, ppl,
    agreement, kl, bpb against fp32) and that result (its provenance, staleness)."""

    which: str
    row: dict[str, Any]
    result: Any


def measured_quality(cfg: Any, weights: str) -> list[Quality]:
    """The stored quality figures of the configuration ``cfg`` (the same settings, whatever its name) for the
    sidebar's model with the weights ``weights``: ``python -m pace_core perplexity`` results (matched by their
    configuration hash) and rows of ``python -m pace_core claims`` reports (matched by their configuration
    JSON); current before stale, then the most scored tokens first."""
    from pace_core.errors import PaceError
    from pace_core.export import config_from_json
    from pace_core.results import config_hash

    def same(name: str, stored_hash: str | None) -> bool:
        return stored_hash is not None and config_hash(cfg.replace(name=name)) == stored_hash

    found = [Quality(f"the perplexity result of '{r.data['config']}'", r.data["row"], r)
             for r in stored_results(model_source(), "perplexity", weights).results
             if "row" in r.data and same(r.data["config"], r.provenance.get("config_hashes", {}).get(r.data["config"]))]
    for report in stored_results(model_source(), "claims", weights).results:
        for row in report.data.get("quality", []):
            try:
                stored = config_from_json(row["config"])
            except PaceError:  # a configuration this code no longer reads: not this one
                continue
            if same("stored", config_hash(stored.replace(name="stored"))):
                found.append(Quality(f"the row '{row['label']}' of the claims report",
                                     {**row, "tokens": report.data["tokens"]}, report))
    return sorted(found, key=lambda q: (q.result.stale, -int(q.row["tokens"])))


def text_name(provenance: dict[str, Any]) -> str:
    """The file name of a stored result's text, as inline code ('its text' when none is recorded)."""
    path = (provenance.get("text") or {}).get("path")
    return code(Path(path).name) if path else "its text"


def provenance_label(prov: dict[str, Any]) -> str:
    """One line of Markdown (its values escaped) naming where a stored result comes from: command, date, device,
    text, and the code that made it (commit)."""
    text = prov.get("text", {})
    parts = [code(prov.get("command", "?")), escape(prov.get("date", "?"))]
    if prov.get("device"):
        parts.append(escape(prov["device"]))
    if text:
        parts.append(f"text {escape(Path(text.get('path', '?')).name)} "
                     f"(sha256 {escape(str(text.get('sha256', ''))[:12])}…)")
    parts.append(f"code {escape(code_label(prov))}")
    return "stored result of " + ", ".join(parts)
