"""The pages' computations on the loaded model, cached per their inputs (``st.cache_data``), with a progress
bar for those that take long; each calls one pace_core analysis.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Callable

import pandas as pd
import streamlit as st
import torch

from app_state.session import _load_model, model_label_of
from app_state.stored import provenance_label, stored_results
from pace_core.analysis.calibration import Calibration, calibrate
from pace_core.analysis.text import CALIBRATION_TEXT, read_text, tokenize
from pace_core.config import PaceConfig, config_from_json, config_to_json, get_config
from pace_core.errors import PaceError

PROMPT_CHARS = 1500


FALLBACK_PROMPT = ("The recurrent state of a Gated DeltaNet layer is a matrix per head that every token "
                   "updates: it decays the old memory, writes the new key and value, and the next "
                   "token reads from it. Storing that matrix in four bits instead of thirty-two lets a "
                   "server keep eight times as many conversations in the same memory.")


HEATMAP_POSITION = 256


def default_text() -> str:
    """The first paragraphs of the calibration text (WikiText-2 validation), or a fixed prompt when
    the shared corpus is not on this machine."""
    if CALIBRATION_TEXT.is_file():
        with CALIBRATION_TEXT.open(encoding="utf-8") as f:
            return " ".join(f.read(PROMPT_CHARS * 2).split())[:PROMPT_CHARS]
    return FALLBACK_PROMPT


def default_prompt(chars: int = 400) -> str:
    """The default text cut after its last full sentence within `chars` characters."""
    text = default_text()[:chars]
    end = text.rfind(". ")
    return text[:end + 1] if end > 0 else text


def analysis_text() -> str:
    """The text of the teacher-forced analyses: the calibration split (WikiText-2 validation), or the
    fixed prompt when the shared corpus is not on this machine."""
    return read_text(CALIBRATION_TEXT, "calibration text") if CALIBRATION_TEXT.is_file() else FALLBACK_PROMPT


def progress_bar(total: int, text: str) -> Callable[[int], None]:
    """A st.progress bar of `total` units; returns the callback `advance(n)` (the bar goes away when
    full). Created inside a cached function, so a cache hit replays it as already gone."""
    bar = st.progress(0.0, text=text)
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        if done[0] >= total:
            bar.empty()
        else:
            bar.progress(done[0] / total, text=f"{text} ({done[0]}/{total})")

    return advance


@st.cache_data(show_spinner=False, max_entries=32)
def reference_states(source: str, device: str, text: str, position: int) -> dict[int, Any]:
    """fp32 reference state of every GDN layer after the first `position` tokens of `text`:
    {gdn_layer: S [HV, K, V] float32 numpy} (cached per model, device, text and position)."""
    from pace_core.model.capture import run_with_states

    loaded = _load_model(source, device)
    ids = tokenize(loaded.tokenizer, text, max_tokens=position, min_tokens=1)
    result = run_with_states(loaded, get_config("fp32"), ids, capture_steps=[ids.shape[1]])
    return {layer: S[0].numpy() for layer, S in result.states[ids.shape[1]].items()}


@st.cache_data(show_spinner=False, max_entries=16)
def generations(source: str, device: str, configs: tuple[tuple[str, str], ...], prompt: str,
                max_new_tokens: int, mode: str):
    """pace_core.analysis.generation.generate_side_by_side for (label, config JSON) pairs, fp32 first
    (cached per model, device, configurations, prompt, length and mode)."""
    from pace_core.analysis.generation import generate_side_by_side

    loaded = _load_model(source, device)
    ready = {label: runnable(source, device, config_from_json(text)) for label, text in configs}
    return generate_side_by_side(loaded, {label: cfg for label, (cfg, _) in ready.items()}, prompt,
                                 max_new_tokens=max_new_tokens, modes=(mode,),
                                 damp_rows={label: rows for label, (_, rows) in ready.items() if rows is not None})


@st.cache_data(show_spinner=False, max_entries=16)
def drift(source: str, device: str, configs: tuple[tuple[str, str], ...], prefill: int,
          steps: int) -> dict[str, Any]:
    """pace_core.analysis.drift.drift of (label, config JSON) pairs on the first prefill + steps + 1
    tokens of the analysis text: {"table", "summary", "provenance_label"} (cached per arguments)."""
    from pace_core.analysis.drift import drift as run_drift

    loaded = _load_model(source, device)
    ids = tokenize(loaded.tokenizer, analysis_text(), max_tokens=prefill + steps + 1, min_tokens=prefill + 3)
    ready = {label: runnable(source, device, config_from_json(text)) for label, text in configs}
    groups = [({label: cfg for label, (cfg, rows) in ready.items() if rows is None}, None)]
    groups += [({label: cfg}, rows) for label, (cfg, rows) in ready.items() if rows is not None]
    groups = [(cfgs, rows) for cfgs, rows in groups if cfgs]
    advance = progress_bar(len(ready) + len(groups), f"Teacher-forcing {len(ready)} configurations and the "
                                                     f"fp32 reference over {steps} decode steps")
    results = [run_drift(loaded, cfgs, ids, decode_from=prefill, damp_rows=rows, progress=advance)
               for cfgs, rows in groups]
    return {"table": pd.concat([r.table for r in results], ignore_index=True),
            "summary": pd.concat([r.summary for r in results], ignore_index=True),
            "provenance_label": f"computed live on {model_label_of(source)} ({device}), {ids.shape[1]} tokens "
                                f"of {CALIBRATION_TEXT.name if CALIBRATION_TEXT.is_file() else 'the fixed prompt'}, "
                                f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"}


CALIBRATION_TOKENS = 512


CALIBRATION_EVERY = 32


def calibration_key(cfg: PaceConfig) -> str:
    """What a calibration depends on: the quantiser (method, bits, axis, group size, zero point, DAMP
    rows), not dP, P, the share (the pages derive E_h and the allocation from a_h and e_h live) or
    what happens to a prompt after decoded tokens."""
    return config_to_json(cfg.replace(name="calibration", high_share=0.0, high_heads=None, decode_period=8,
                                      prefill_period=256, prefill_after_decode="flush"))


def _stored_calibration(source: str, weights: str, key: str) -> tuple[Calibration, str] | None:
    """A calibration stored by the CLI for the same weights and quantiser (see calibration_key) and its
    provenance line, if any."""
    for result in stored_results(source, "calibration", weights):
        try:
            cal = Calibration.from_data(result.data)
        except PaceError:
            continue
        if calibration_key(cal.config) == key:
            return cal, f"{cal.tokens} tokens, {cal.samples} states; " + provenance_label(result.provenance)
    return None


@st.cache_data(show_spinner=False, max_entries=16)
def calibration(source: str, device: str, key: str) -> dict[str, Any]:
    """The calibration of the quantiser of config JSON `key` (see calibration_key): one stored by the
    CLI under data/results/ when there is one, else pace_core.analysis.calibration.calibrate live on
    the calibration text. {"calibration": Calibration, "provenance_label"} (cached per model, device and
    quantiser)."""
    loaded = _load_model(source, device)
    stored = _stored_calibration(source, loaded.fingerprint, key)
    if stored is not None:
        return {"calibration": stored[0], "provenance_label": stored[1]}
    if not CALIBRATION_TEXT.is_file():
        raise PaceError(f"calibration text {CALIBRATION_TEXT} is not on this machine (the shared corpus), and no "
                        "calibration of this quantiser is stored for the loaded weights; allowed: put the corpus "
                        "there, or store one with `python -m pace_core calibrate --text FILE` and these settings, "
                        "or set the share of 8-bit heads to 0 (DAMP always needs one)")
    chunks = CALIBRATION_TOKENS // CALIBRATION_EVERY
    advance = progress_bar(chunks, f"Calibrating on {CALIBRATION_TOKENS} tokens of {CALIBRATION_TEXT.name}")
    cal = calibrate(loaded, config_from_json(key), tokens=CALIBRATION_TOKENS, sample_every=CALIBRATION_EVERY,
                    progress=advance)
    return {"calibration": cal,
            "provenance_label": f"{cal.tokens} tokens of {CALIBRATION_TEXT.name}, {cal.samples} states "
                                f"(one every {CALIBRATION_EVERY} tokens), computed live on {model_label_of(source)}"}


def runnable(source: str, device: str, cfg: PaceConfig) -> tuple[PaceConfig, list[torch.Tensor] | None]:
    """`cfg` ready to run on the model, with the DAMP outlier rows it needs (else None): a share of
    8-bit heads without chosen heads gets the allocation calibrated on the model (cached)."""
    if cfg.method == "damp":
        return cfg, calibration(source, device, calibration_key(cfg))["calibration"].damp_rows
    if cfg.high_share == 0 or cfg.high_heads is not None:
        return cfg, None
    return calibration(source, device, calibration_key(cfg))["calibration"].allocate(cfg), None
