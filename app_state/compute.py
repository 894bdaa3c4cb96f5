"""The pages' computations on the loaded model, each one pace_core analysis: results kept per
configuration and the shared fp32 reference runs kept apart (:mod:`app_state.work`), a progress bar with
the time left and a Stop button for those that take long.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pandas as pd
import streamlit as st
import torch

from app_state import turns, work
from app_state.controls import Runtime
from app_state.markup import escape
from app_state.session import _load_model, model_label_of
from app_state.stored import provenance_label, stored_results
from pace_core.analysis.calibration import (
    Calibration,
    calibrate,
    calibration_progress_total,
    calibration_samples,
    protocol_samples,
)
from pace_core.analysis.text import CALIBRATION_TEXT, read_text, tokenize
from pace_core.config import PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.export import admit, config_from_json, config_to_json
from pace_core.methods import method_of

PROMPT_CHARS = 1500


FALLBACK_PROMPT = ("The recurrent state of a Gated DeltaNet layer is a matrix per head that every token "
                   "updates: it decays the old memory, writes the new key and value, and the next "
                   "token reads from it. Storing that matrix in four bits instead of thirty-two lets a "
                   "server keep eight times as many conversations in the same memory.")


def default_text() -> str:
    """The first paragraphs of the calibration text (WikiText-2 validation), or a fixed prompt when
    the shared corpus is not on this machine."""
    if CALIBRATION_TEXT.is_file():
        with CALIBRATION_TEXT.open(encoding="utf-8") as f:
            return " ".join(f.read(PROMPT_CHARS * 2).split())[:PROMPT_CHARS]
    return FALLBACK_PROMPT


def default_prompt() -> str:
    """The Generations page's prompt: plain prose that stops mid-sentence, so the configurations have something
    to continue. Not the calibration text (it was, and gave "<unk>" text, the same for every configuration):
    WikiText-2 is stored tokenised, every rare word replaced by the literal placeholder "<unk>" and spaces around
    punctuation, and a model continues that form; the embedded model, which saw WikiText in training, wrote
    "<unk>" after "<unk>" and phrases so likely that no state error moved them. On this prose it writes text,
    and PACE-4's and RTN-INT4's greedy continuations part from fp32's within the page's default 32 tokens."""
    return ("A dictionary maps keys to values. Keys must be hashable, and a value is found by its key in constant "
            "time on average. When a key is not in the dictionary, the")


def analysis_text() -> str:
    """The text of the teacher-forced analyses: the calibration split (WikiText-2 validation), or the
    fixed prompt when the shared corpus is not on this machine."""
    return read_text(CALIBRATION_TEXT, "calibration text") if CALIBRATION_TEXT.is_file() else FALLBACK_PROMPT


HEATMAP_POSITIONS = 32
"""Positions of the heatmap slider: the states of a text are captured at this many evenly spaced token
counts in one reference run, so moving the slider reads a kept state."""


def heatmap_positions(n_tokens: int) -> list[int]:
    """The token counts the heatmap slider offers for a text of ``n_tokens`` tokens (the last one included)."""
    step = -(-n_tokens // HEATMAP_POSITIONS)
    return sorted(set(range(step, n_tokens + 1, step)) | {n_tokens})


def reference_states(source: str, where: Runtime, text: str) -> dict[int, dict[int, torch.Tensor]]:
    """fp32 reference states of every GDN layer of ``text`` at each of :func:`heatmap_positions`:
    ``{position: {gdn_layer: S [HV, K, V] float32}}`` on the CPU, from one run (kept per model, runtime and
    text)."""
    from pace_core.model.capture import run_with_states

    key = (source, where, text)
    found = work.kept("heatmap_states", 4).get(key)
    if found is None:
        loaded = _load_model(source, where)
        ids = tokenize(loaded.tokenizer, text, min_tokens=1)
        with turns.of(loaded.model).page():
            work.use_free_cores()
            with st.spinner(f"Reading {ids.shape[1]} tokens with the fp32 reference…"):
                run = run_with_states(loaded, get_config("fp32"), ids,
                                      capture_steps=heatmap_positions(ids.shape[1]))
        found = {pos: {layer: S[0] for layer, S in layers.items()} for pos, layers in run.states.items()}
        work.kept("heatmap_states", 4).put(key, found)
    return found


def _ready(source: str, where: Runtime, configs: dict[str, str]) -> dict[str, PaceConfig]:
    """{label: configuration ready to run} of {label: config JSON}."""
    return {label: runnable(source, where, config_from_json(text)) for label, text in configs.items()}


GENERATION_SEED = 0


def generations(source: str, where: Runtime, configs: tuple[tuple[str, str], ...], prompt: str,
                max_new_tokens: int, mode: str) -> pd.DataFrame:
    """pace_core.analysis.generation.generate_side_by_side rows of (label, config JSON) pairs, the fp32
    reference first. The reference's continuation and each configuration's are kept apart (per model,
    runtime, prompt, length and mode): a new configuration generates only itself; without a kept reference,
    the reference is generated in the same batch."""
    from pace_core.analysis.generation import generate_side_by_side, generation_progress_total

    loaded = _load_model(source, where)
    setting = (source, where, prompt, max_new_tokens, mode)
    reference = work.kept("generation_reference", 16)
    ref = reference.get(setting)

    def compute(missing: dict[str, str]) -> dict:
        names = ", ".join(missing if ref is not None else ["fp32", *missing])
        with turns.of(loaded.model).page():
            ready = _ready(source, where, missing)
            with work.progress(generation_progress_total((mode,), max_new_tokens),
                               f"Generating {max_new_tokens} tokens with {names}",
                               ("generation", setting, tuple(missing.values()))) as advance:
                table = generate_side_by_side(loaded, ready, prompt,
                                              max_new_tokens=max_new_tokens, modes=(mode,), seed=GENERATION_SEED,
                                              reference_rows=ref, progress=advance)
        if ref is None:
            reference.put(setting, table[table.config == "fp32"])
        return {label: table[table.config == label] for label in missing}

    rows = work.per_config("generation", setting, configs, compute)
    if ref is None and reference.get(setting) is None:  # every configuration was kept: the reference alone
        compute({})
    return pd.concat([reference.get(setting)] + [rows[label].assign(config=label) for label, _ in configs],
                     ignore_index=True)


DRIFT_CAPTURES = 32
"""States are compared at about this many decode steps of a Drift view (every ⌈steps/32⌉-th step and the
last): the kept reference holds this many fp32 states of the model."""


def drift(source: str, where: Runtime, configs: tuple[tuple[str, str], ...], prefill: int,
          steps: int) -> dict[str, Any]:
    """pace_core.analysis.drift.drift of (label, config JSON) pairs on the first prefill + steps + 1
    tokens of the analysis text: {"table", "summary", "every", "provenance_label"}. The fp32 reference run
    is kept per (model, runtime, length) and every configuration's result apart: changing one configuration
    teacher-forces only that one; without a kept reference, the reference runs in the same batch."""
    from pace_core.analysis.drift import drift as run_drift
    from pace_core.analysis.drift import drift_progress_total

    loaded = _load_model(source, where)
    ids = tokenize(loaded.tokenizer, analysis_text(), max_tokens=prefill + steps + 1, min_tokens=prefill + 3)
    every = -(-steps // DRIFT_CAPTURES)
    setting = (source, where, prefill, steps)
    T = int(ids.shape[1])
    read = escape(CALIBRATION_TEXT.name) if CALIBRATION_TEXT.is_file() else "the fixed prompt"
    reference = work.kept("drift_reference", 2)

    def compute(missing: dict[str, str]) -> dict:
        kept = reference.get(setting)
        names = ", ".join(missing if kept is not None else ["the fp32 reference", *missing])
        with turns.of(loaded.model).page():
            ready = _ready(source, where, missing)
            with work.progress(drift_progress_total(loaded, len(missing), T, prefill, with_reference=kept is None),
                               f"Teacher-forcing {names} over {T - prefill - 1} decode steps",
                               ("drift", setting, tuple(missing.values()))) as advance:
                res = run_drift(loaded, ready, ids, prefill, every=every,
                                reference=kept, keep_reference=kept is None, progress=advance)
        reference.put(setting, res.reference)
        return {label: (res.table[res.table.config == label], res.summary[res.summary.config == label])
                for label in missing}

    found = work.per_config("drift", setting, configs, compute)
    return {"table": pd.concat([found[label][0].assign(config=label) for label, _ in configs], ignore_index=True),
            "summary": pd.concat([found[label][1].assign(config=label) for label, _ in configs], ignore_index=True),
            "every": every,
            "provenance_label": f"computed live on {escape(model_label_of(source))} ({escape(where)}), {T} tokens "
                                f"of {read} "
                                f"(states compared every {every} decode steps), "
                                f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"}


CALIBRATION_TOKENS = 512


CALIBRATION_EVERY = 32


def calibration_key(cfg: PaceConfig) -> str:
    """What a calibration depends on: the quantiser (method, bits, axis, group size, zero point, DAMP
    rows), not dP, P, the share (the pages derive E_h and the allocation from a_h and e_h live) or
    what happens to a prompt after decoded tokens."""
    return config_to_json(cfg.replace(name="calibration", high_share=0.0, high_heads=None, calibrated=None,
                                      decode_period=8, prefill_period=256, prefill_after_decode="flush"))


def _stored_calibration(source: str, weights: str, key: str) -> tuple[Calibration, str] | None:
    """A current calibration stored by the CLI for the same weights and quantiser (see calibration_key) and
    its provenance line, if any (one of another method version is not used)."""
    for result in stored_results(source, "calibration", weights).results:
        cal = Calibration.from_data(result.data)  # checked when read (pace_core.result_checks)
        if not result.stale and calibration_key(cal.config) == key:
            return cal, f"{cal.tokens} tokens, {cal.samples} states; " + provenance_label(result.provenance)
    return None


def _damaged_calibrations(source: str, weights: str) -> str:
    """The damaged stored calibration files, named for a provenance line of Markdown ('' when none)."""
    damaged = stored_results(source, "calibration", weights).damaged
    return "".join(f"; not used, damaged: {escape(d.message)}" for d in damaged)


def calibration(source: str, where: Runtime, key: str) -> dict[str, Any]:
    """The calibration of the quantiser of config JSON `key` (see calibration_key): one stored by the
    CLI under data/results/ when there is one, else pace_core.analysis.calibration.calibrate live on
    reference samples of the calibration text, which are taken once per model and runtime and serve every
    quantiser. {"calibration": Calibration, "provenance_label"} (kept per model, runtime and quantiser)."""
    found = work.kept("calibration", 64).get((source, where, key))
    if found is not None:
        return found
    loaded = _load_model(source, where)
    stored = _stored_calibration(source, loaded.fingerprint, key)
    if stored is not None:
        found = {"calibration": stored[0], "provenance_label": stored[1]}
        work.kept("calibration", 64).put((source, where, key), found)
        return found
    if not CALIBRATION_TEXT.is_file():
        raise PaceError(f"calibration text {CALIBRATION_TEXT} is not on this machine (the shared corpus), and no "
                        "calibration of this quantiser is stored for the loaded weights; allowed: put the corpus "
                        "there, or store one with `python -m pace_core calibrate --text FILE` and these settings, "
                        "or set the share of 8-bit heads to 0 (DAMP always needs one)")
    cfg = config_from_json(key)
    sampling = method_of(cfg).sampling(cfg)  # a method's own samples (STEPQuant's authors' protocol), else the shared
    with turns.of(loaded.model).page():
        samples = work.kept("calibration_samples", 2).get((source, where, sampling))
        if samples is None:
            what = (f"{CALIBRATION_TOKENS} calibration tokens" if sampling is None else
                    f"{sampling.total_tokens:,} calibration tokens ({sampling.describe()})")
            with work.progress(calibration_progress_total(loaded, sampling),
                               f"Reading {what} of {CALIBRATION_TEXT.name}",
                               ("calibration", source, where, sampling)) as advance:
                samples = (calibration_samples(loaded, tokens=CALIBRATION_TOKENS, sample_every=CALIBRATION_EVERY,
                                               progress=advance) if sampling is None else
                           protocol_samples(loaded, CALIBRATION_TEXT, sampling, progress=advance))
            work.kept("calibration_samples", 2).put((source, where, sampling), samples)
        work.use_free_cores()
        cal = calibrate(loaded, cfg, samples=samples)
    found = {"calibration": cal,
             "provenance_label": f"{escape(samples.describe())}, computed live on {escape(model_label_of(source))}"
                                 + _damaged_calibrations(source, loaded.fingerprint)}
    work.kept("calibration", 64).put((source, where, key), found)
    return found


def runnable(source: str, where: Runtime, cfg: PaceConfig) -> PaceConfig:
    """`cfg` admitted for the model (:func:`pace_core.export.admit`: its settings must fit it) and ready to
    run on it: what it needs calibrated on the model (8-bit heads, a method's per-layer tensors such as DAMP's
    outlier rows) comes from the calibration of its quantiser (cached)."""
    loaded = _load_model(source, where)

    def calibrate(c: PaceConfig) -> PaceConfig:
        cal = calibration(source, where, calibration_key(c))["calibration"]
        return cal.allocate(c.replace(calibrated=cal.config.calibrated) if c.calibrated is None else c)

    return admit(cfg, loaded.shape, loaded.fingerprint, calibrate=calibrate)
