"""Session, URL and caching glue of the dashboard (the only app module besides app.py and pages/).

Every PACE setting is a sidebar control whose value lives in `st.session_state` and is mirrored
into `st.query_params`, so a link reproduces the view. URL values are validated when read: a bad
value is named in a warning and replaced by the value of the named configuration.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import streamlit as st
import torch

from pace_core.analysis.text import CALIBRATION_TEXT, read_text, tokenize
from pace_core.config import (NAMED_CONFIGS, PaceConfig, config_from_dict, config_from_json, config_to_json,
                              get_config)
from pace_core.errors import PaceError
from pace_core.heads import allocate_high_heads, retained_error

REPO_ROOT = Path(__file__).resolve().parent
DEFAULT_PRESET = "pace-4"
BENCH_DIR = Path(os.environ.get("PACE_BENCH_DIR", REPO_ROOT / "data" / "bench"))
BENCH_COMMAND = "python3 kernels/bench.py --out data/bench"
PROMPT_CHARS = 1500
HEATMAP_POSITION = 256
LOAD_RETRY_S = 60  # a model that failed to load is tried again after this long (a hub id offline takes ~30 s)
FALLBACK_PROMPT = ("The recurrent state of a Gated DeltaNet layer is a matrix per head that every token "
                   "updates: it decays the old memory, writes the new key and value, and the next "
                   "token reads from it. Storing that matrix in four bits instead of thirty-two lets a "
                   "server keep eight times as many conversations in the same memory.")


@dataclass(frozen=True)
class Control:
    """One sidebar control: URL key, PaceConfig field, the allowed values and the help text."""

    key: str
    field: str
    label: str
    help: str
    options: tuple[Any, ...]
    fmt: Callable[[Any], str] = str

    def parse(self, raw: str) -> Any:
        """URL text -> value; raises PaceError naming the URL key and the allowed values."""
        for option in self.options:
            if raw == url_text(option):
                return option
        allowed = ", ".join(url_text(o) for o in self.options)
        raise PaceError(f"URL parameter '{self.key}' = {raw!r} is not allowed; allowed: {allowed}")


def url_text(value: Any) -> str:
    """The URL spelling of a control value (booleans as 1/0, floats without trailing zeros)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _share(x: float) -> str:
    return f"{x:.0%}" if x in (0.0, 1.0) else f"{x:.1%}".replace(".0%", "%")


METHOD_HELP = {
    "none": "no quantisation: the checkpoint is kept in the reference dtype (fp32 or bf16)",
    "rtn": "round-to-nearest integer state (the paper's uniform baseline)",
    "pace": "PACE: key-axis (channel-aligned) groups, periodic rounding, decode buffer",
    "damp": "DAMP-style: 16 outlier key rows in fp16, Hadamard on the rest [ours]",
    "dsq": "Q-Mamba DSQ: decoupled row and column fp16 scales",
}

CONTROLS: tuple[Control, ...] = (
    Control("method", "method", "Method",
            "How the recurrent state is stored between roundings. " + "; ".join(
                f"**{k}**: {v}" for k, v in METHOD_HELP.items()),
            ("none", "rtn", "pace", "damp", "dsq")),
    Control("ref", "reference_dtype", "Reference dtype (method none)",
            "Storage dtype of the checkpoint when quantisation is off: the 'rounding' at each "
            "period end is the cast to this dtype (identity for float32).",
            ("float32", "bfloat16")),
    Control("bits", "bits", "State bits (bits/value)",
            "Bit width b of the integer codes of the low-precision heads (spec §2). Symmetric codes "
            "lie in [−(2^(b−1)−1), 2^(b−1)−1]; zero-point codes in [0, 2^b−1]. 2–4 bits are packed "
            "two codes per byte.", tuple(range(2, 9))),
    Control("dp", "decode_period", "Decode period dP (tokens)",
            "The state is rounded once every dP generated tokens (spec §3). In between, the rounded "
            "checkpoint Ŝ stays fixed and each token's (k_t, u_t, g_t) goes into the decode buffer "
            "[ours: u_t instead of v_t makes the buffered path exact]. dP = 1 is per-token rounding.",
            tuple(range(1, 65))),
    Control("pp", "prefill_period", "Prefill period P (tokens)",
            "The prompt is split into P-token segments; each segment runs from the dequantised state "
            "and its final state is rounded (spec §3; the paper fixes P = 256, the kernel chunk).",
            (16, 32, 64, 128, 256, 512, 1024, 2048)),
    Control("axis", "group_axis", "Group axis",
            "**key** [seed]: a group is g consecutive key rows of one value column S[k0:k0+g, j], so an "
            "outlier column widens only its own step. **value** (baseline): S[i, j0:j0+g].",
            ("key", "value")),
    Control("g", "group_size", "Group size g (values)",
            "Entries sharing one fp16 scale (and zero point). Must divide the head dimension along "
            "the group axis (128 on Qwen3.5).", (8, 16, 32, 64, 128)),
    Control("sym", "symmetric", "Symmetric (no zero point)",
            "On: scale = amax / qmax, no zero point. Off: scale = (max − min)/(2^b − 1) with an "
            "integer zero point stored in b bits (PACE-4/8 uses a zero point).", (True, False)),
    Control("buf", "buffer", "Decode buffer precision",
            "Precision of the buffered (k_t, u_t) records between roundings: int8 (PACE-4, uniform "
            "configs), mixed = keys 4-bit + values bf16 (PACE-4/8), bf16/fp32 as references [seed]. "
            "Integer buffers use per-vector fp16 scales [ours].", ("fp32", "bf16", "int8", "mixed")),
    Control("pad", "prefill_after_decode", "Prompt after decoded tokens",
            "[ours] (the spec is silent) How a prompt that follows decoded tokens starts, e.g. a user's next "
            "turn: **flush** folds the buffered records into the checkpoint and rounds it first (one extra "
            "rounding, off the dP grid); **carry** runs the prompt from the exact state (checkpoint plus "
            "buffer, not rounded), so its first rounding ends its first P-token segment. It is part of the "
            "exported configuration; this app's views run one prompt and then decode, so they do not change "
            "with it.", ("flush", "carry")),
    Control("hi", "high_share", "Share of 8-bit heads",
            "PACE-4/8 (spec §4): in each layer this share of value heads, those with the largest "
            "retained error E_h = e_h / (1 − a_h^(2·dP)), keep high_bits (8). [ours] a_h = mean decay "
            "on calibration text, e_h = mean rounding error energy of calibration states.",
            (0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0), _share),
)
CONTROL_BY_KEY = {c.key: c for c in CONTROLS}
QUANT_ONLY_KEYS = frozenset({"bits", "axis", "g", "sym", "hi"})
EMBEDDED, LOCAL, HUB = "Embedded", "Local path", "Hub id"
MODEL_KINDS = (EMBEDDED, LOCAL, HUB)


def device_options() -> tuple[str, ...]:
    """Devices this host offers: cpu, plus cuda when a CUDA device is visible."""
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def preset_values(name: str) -> dict[str, Any]:
    """Control values (by URL key) of a named configuration."""
    cfg = get_config(name)
    return {c.key: getattr(cfg, c.field) for c in CONTROLS}


def _closest(control: Control, value: Any) -> Any:
    """A preset value mapped onto the control's options (e.g. dP 128 beyond the slider range)."""
    if value in control.options:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return min(control.options, key=lambda o: abs(o - value))
    return control.options[0]


def apply_preset(name: str) -> None:
    """Set every control of the session to the values of named configuration `name`."""
    for key, value in preset_values(name).items():
        st.session_state[key] = _closest(CONTROL_BY_KEY[key], value)


def bind(key: str) -> str:
    """The widget key of setting `key`, loaded with the setting's value.

    Settings live under their own keys; each widget gets a copy every run (and `sync` copies a
    change back), so the values survive page switches, where streamlit drops widget state.
    """
    st.session_state[f"w_{key}"] = st.session_state[key]
    return f"w_{key}"


def sync(key: str) -> None:
    """on_change callback of a bound widget: store its new value as the setting `key`."""
    st.session_state[key] = st.session_state[f"w_{key}"]


def on_preset_change() -> None:
    """Callback of the 'Start from' select: load the chosen named configuration into the controls."""
    sync("preset")
    apply_preset(st.session_state["preset"])


def read_url_once() -> list[str]:
    """On a session's first run, take preset, model, device and every control from the URL.

    Returns the problems found (each names the URL parameter and the allowed values); the bad
    values fall back to the named configuration's values.
    """
    if st.session_state.get("_url_read"):
        return []
    problems: list[str] = []
    qp = st.query_params
    preset = qp.get("preset", DEFAULT_PRESET)
    if preset not in NAMED_CONFIGS:
        problems.append(f"URL parameter 'preset' = {preset!r} is not a named configuration; "
                        f"allowed: {', '.join(NAMED_CONFIGS)}. Using {DEFAULT_PRESET}.")
        preset = DEFAULT_PRESET
    st.session_state["preset"] = preset
    apply_preset(preset)
    for control in CONTROLS:
        raw = qp.get(control.key)
        if raw is None:
            continue
        try:
            st.session_state[control.key] = control.parse(raw)
        except PaceError as err:
            problems.append(f"{err}. Using {url_text(st.session_state[control.key])} from {preset}.")
    source = qp.get("model", "").strip()
    st.session_state["model_text"] = source
    if not source:
        st.session_state["model_kind"] = EMBEDDED
    elif Path(source).expanduser().exists() or source.startswith(("/", ".", "~")):
        st.session_state["model_kind"] = LOCAL
    else:
        st.session_state["model_kind"] = HUB
    device = qp.get("device", "cpu")
    if device not in device_options():
        problems.append(f"URL parameter 'device' = {device!r} is not available here; allowed: "
                        f"{', '.join(device_options())}. Using cpu.")
        device = "cpu"
    st.session_state["device"] = device
    st.session_state["_url_read"] = True
    return problems


def current_config() -> PaceConfig:
    """The validated PaceConfig of the sidebar controls (PaceError when the combination is invalid)."""
    fields = {c.field: st.session_state[c.key] for c in CONTROLS}
    if fields["method"] == "none":
        fields["bits"] = 32 if fields["reference_dtype"] == "float32" else 16
    base = get_config(st.session_state["preset"])
    changed = {k: v for k, v in fields.items() if getattr(base, k) != v}
    cfg = base.replace(name="custom", **changed) if changed else base
    stored = st.session_state.get("allocation")
    if stored is not None and cfg.high_share > 0 and stored[0] == allocation_key(cfg):
        cfg = cfg.replace(high_heads=stored[1])
    return cfg


def allocation_key(cfg: PaceConfig) -> str:
    """What a head allocation depends on: the model and every setting except name, the heads and what
    happens to a prompt after decoded tokens."""
    return model_source() + "|" + config_to_json(cfg.replace(name="custom", high_heads=None,
                                                             prefill_after_decode="flush"))


def set_allocation(cfg: PaceConfig, high_heads: tuple[tuple[int, ...], ...]) -> None:
    """Attach calibrated 8-bit heads to the sidebar configuration while its settings stay as they are."""
    st.session_state["allocation"] = (allocation_key(cfg), tuple(tuple(h) for h in high_heads))


def outside_controls(cfg: PaceConfig) -> list[str]:
    """The settings of `cfg` that no sidebar control offers (e.g. dP 128), as 'label = value'; loading
    `cfg` into the sidebar moves them to the nearest offered value."""
    return [f"{c.label} = {url_text(getattr(cfg, c.field))}" for c in CONTROLS
            if getattr(cfg, c.field) not in c.options]


def load_config(cfg: PaceConfig) -> None:
    """Callback: put an imported configuration into the sidebar controls (and its 8-bit heads)."""
    if cfg.name in NAMED_CONFIGS:
        st.session_state["preset"] = cfg.name
    for control in CONTROLS:
        st.session_state[control.key] = _closest(control, getattr(cfg, control.field))
    if cfg.high_heads is not None:
        set_allocation(cfg, cfg.high_heads)


def fallback_config() -> PaceConfig:
    """The named configuration the controls started from (used while the controls are invalid)."""
    return get_config(st.session_state["preset"])


def model_source() -> str:
    """The sidebar's model: '' for the embedded default, else a local folder or hub id."""
    if st.session_state.get("model_kind", EMBEDDED) == EMBEDDED:
        return ""
    return st.session_state.get("model_text", "").strip()


def write_url() -> None:
    """Mirror preset, model, device and every control into the URL (shareable link)."""
    params = {"preset": st.session_state["preset"]}
    if model_source():
        params["model"] = model_source()
    params["device"] = st.session_state["device"]
    params.update({c.key: url_text(st.session_state[c.key]) for c in CONTROLS})
    if dict(st.query_params) != params:
        st.query_params.from_dict(params)


def config_key(cfg: PaceConfig) -> str:
    """A stable hashable key of a configuration for st.cache_data."""
    return config_to_json(cfg)


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


def model_label() -> str:
    """Human name of the sidebar's model for captions and provenance."""
    return model_label_of(model_source())


def model_label_of(source: str) -> str:
    """Human name of a model source ('' = the embedded model)."""
    return source or f"embedded ({embedded_model_dir().name})"


def embedded_model_dir() -> Path:
    """Folder of the embedded default model (pace_core.model.loading.DEFAULT_MODEL_DIR)."""
    from pace_core.model.loading import DEFAULT_MODEL_DIR

    return Path(DEFAULT_MODEL_DIR)


@st.cache_resource(show_spinner=False, max_entries=2)
def _load_model(source: str, device: str):
    from pace_core.model.loading import load_model

    return load_model(source or None, device=device)


def loaded_model(*, stop: bool = True):
    """The sidebar's model (cached per source and device) as a pace_core LoadedModel.

    When it cannot be loaded the page shows what to do and stops (stop=False: returns None instead,
    for pages that have more to show).
    """
    loaded = _try_load_model()
    if loaded is None and stop:
        st.stop()
    return loaded


def _folder_stamp(source: str) -> tuple[int | None, int | None]:
    """When a local folder and its config.json last changed (None where absent, e.g. a hub id): a folder
    fixed after a failed load is loaded again at once."""
    def stamp(path: Path) -> int | None:
        try:
            return path.stat().st_mtime_ns
        except OSError:
            return None

    folder = Path(source).expanduser()
    return (stamp(folder), stamp(folder / "config.json")) if source else (None, None)


def _try_load_model():
    """Load the sidebar's model, or show what to do and return None."""
    source, device = model_source(), st.session_state["device"]
    if not source and st.session_state.get("model_kind") != EMBEDDED:
        st.info("Enter a local folder or hub id in the sidebar to load a model.", icon=":material/arrow_back:")
        return None
    if not source and not embedded_model_dir().joinpath("config.json").exists():
        st.error(f"The embedded model is not in {embedded_model_dir()} yet. Train it with "
                 "`python -m pace_core.train` (see README), or pick a local folder / hub id of a "
                 "Qwen3.5, Qwen3.6 or Qwen3-Next checkpoint in the sidebar.", icon=":material/folder_open:")
        return None
    failures = st.session_state.setdefault("_load_failures", {})
    attempt = (source, device, _folder_stamp(source))
    failed = failures.get(attempt)
    if failed is not None and time.monotonic() - failed[1] < LOAD_RETRY_S:
        st.error(failed[0], icon=":material/folder_open:")
        return None
    try:
        with st.spinner(f"Loading {model_label()} on {device}…"):
            return _load_model(source, device)
    except (PaceError, OSError) as err:
        message = (f"Could not load model {model_label()!r}: {err}\n\nCheck the path or hub id (no hub is "
                   "reachable offline) or switch back to the embedded model. (The same source is tried again "
                   f"after {LOAD_RETRY_S} s or once its folder changes, not on every change of a setting.)")
        failures[attempt] = (message, time.monotonic())
        st.error(message, icon=":material/folder_open:")
        return None


def token_count(loaded, text: str) -> int:
    """Number of tokens of `text` under the loaded tokenizer (no special tokens)."""
    return len(loaded.tokenizer(text, add_special_tokens=False)["input_ids"]) if text.strip() else 0


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


def results_model_name(source: str) -> str:
    """The model name the CLI stores results under (its --model, or the embedded model's folder)."""
    return source or str(embedded_model_dir())


@st.cache_data(show_spinner=False, ttl=30)
def stored_results(source: str, kind: str, weights: str) -> list[Any]:
    """Results of `kind` stored by `python -m pace_core <command>` under data/results/ for the model
    whose weights have the fingerprint `weights` (pace_core.model.loading.weights_fingerprint; results
    of other weights under the same name, e.g. before a retrained checkpoint replaced it, are left out),
    newest first (re-read at most every 30 s)."""
    from pace_core.results import list_results

    return [r for r in list_results(results_model_name(source), kind) if r.provenance.get("weights") == weights]


def choose_stored(kind: str, command: str, weights: str, label: Callable[[Any], str], key: str, *,
                  live: str | None = None, title: str = "Source") -> Any | None:
    """One result of `python -m pace_core <command>` stored as `kind` for the weights `weights`
    (:func:`stored_results`), labelled by `label`: with `live`, a radio whose first option is `live`
    (returns None for it); else a selectbox titled `title` (None, and nothing shown, when none is
    stored). The chosen result's provenance is captioned."""
    stored = stored_results(model_source(), kind, weights)
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


def _stored_calibration(source: str, weights: str, key: str) -> dict[str, Any] | None:
    """A calibration stored by the CLI for the same weights and quantiser (see calibration_key), if any."""
    for result in stored_results(source, "calibration", weights):
        try:
            same = calibration_key(config_from_dict(result.data["config"])) == key
        except (PaceError, KeyError, TypeError):
            continue
        if same:
            rows = result.data.get("damp_rows")
            return {"a": np.asarray(result.data["a"], dtype=np.float64),
                    "e": np.asarray(result.data["e"], dtype=np.float64),
                    "damp_rows": None if rows is None else [np.asarray(r, dtype=np.int64) for r in rows],
                    "provenance_label": f"{result.data['tokens']} tokens, {result.data['samples']} states; "
                                        + provenance_label(result.provenance)}
    return None


@st.cache_data(show_spinner=False, max_entries=16)
def calibration(source: str, device: str, key: str) -> dict[str, Any]:
    """The calibration of the quantiser of config JSON `key` (see calibration_key): one stored by the
    CLI under data/results/ when there is one, else pace_core.analysis.calibration.calibrate live on
    the calibration text. {"a", "e" [L, HV] numpy, "damp_rows" (list of [HV, r] numpy or None),
    "provenance_label"} (cached per model, device and quantiser)."""
    from pace_core.analysis.calibration import calibrate

    loaded = _load_model(source, device)
    stored = _stored_calibration(source, loaded.fingerprint, key)
    if stored is not None:
        return stored
    if not CALIBRATION_TEXT.is_file():
        raise PaceError(f"calibration text {CALIBRATION_TEXT} is not on this machine (the shared corpus), and no "
                        "calibration of this quantiser is stored for the loaded weights; allowed: put the corpus "
                        "there, or store one with `python -m pace_core calibrate --text FILE` and these settings, "
                        "or set the share of 8-bit heads to 0 (DAMP always needs one)")
    chunks = CALIBRATION_TOKENS // CALIBRATION_EVERY
    advance = progress_bar(chunks, f"Calibrating on {CALIBRATION_TOKENS} tokens of {CALIBRATION_TEXT.name}")
    calib = calibrate(loaded, config_from_json(key), tokens=CALIBRATION_TOKENS, sample_every=CALIBRATION_EVERY,
                      progress=advance)
    return {"a": calib.a.numpy(), "e": calib.e.numpy(),
            "damp_rows": None if calib.damp_rows is None else [r.cpu().numpy() for r in calib.damp_rows],
            "provenance_label": f"{calib.tokens} tokens of {CALIBRATION_TEXT.name}, {calib.samples} states "
                                f"(one every {CALIBRATION_EVERY} tokens), computed live on {model_label_of(source)}"}


def runnable(source: str, device: str, cfg: PaceConfig) -> tuple[PaceConfig, list[torch.Tensor] | None]:
    """`cfg` ready to run on the model, with the DAMP outlier rows it needs (else None): a share of
    8-bit heads without chosen heads gets the allocation calibrated on the model (cached)."""
    if cfg.method == "damp":
        rows = calibration(source, device, calibration_key(cfg))["damp_rows"]
        return cfg, [torch.from_numpy(r) for r in rows]
    if cfg.high_share == 0 or cfg.high_heads is not None:
        return cfg, None
    calib = calibration(source, device, calibration_key(cfg))
    E = retained_error(torch.from_numpy(calib["e"]), torch.from_numpy(calib["a"]), cfg.decode_period)
    return cfg.replace(high_heads=allocate_high_heads(E, cfg.high_share)), None


def sidebar() -> PaceConfig:
    """The shared sidebar: model, device, starting configuration and every setting (mirrored into
    the URL); returns the validated configuration (the named one while the controls are invalid)."""
    url_problems = read_url_once()
    for problem in url_problems:
        st.warning(problem, icon=":material/link:")
    with st.sidebar:
        st.subheader("Model")
        st.radio("Source", MODEL_KINDS, key=bind("model_kind"), horizontal=True,
                 on_change=sync, args=("model_kind",),
                 help="The embedded model ships in data/models (a small Qwen3.5-architecture hybrid "
                      "trained by this project); or any Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoint by "
                      "local folder or Hugging Face hub id.")
        if st.session_state["model_kind"] != EMBEDDED:
            st.text_input("Local folder" if st.session_state["model_kind"] == LOCAL else "Hub id",
                          key=bind("model_text"), on_change=sync, args=("model_text",),
                          placeholder="/path/to/checkpoint" if
                          st.session_state["model_kind"] == LOCAL else "Qwen/Qwen3.5-4B")
        st.selectbox("Device", device_options(), key=bind("device"),
                     on_change=sync, args=("device",),
                     help="Where the model runs for the live views (cuda when a GPU is visible).")
        st.subheader("Configuration")
        st.selectbox("Start from", list(NAMED_CONFIGS), key=bind("preset"),
                     on_change=on_preset_change,
                     help="A named configuration of spec §6. It only sets the controls below; every "
                          "setting stays adjustable.")
        method = st.session_state["method"]
        quantised = method != "none"
        for control in CONTROLS:
            common = dict(key=bind(control.key), help=control.help, on_change=sync,
                          args=(control.key,), disabled=(control.key == "ref") == quantised or (
                              control.key in QUANT_ONLY_KEYS and not quantised))
            if isinstance(control.options[0], bool):
                st.toggle(control.label, **common)
            elif len(control.options) <= 5:
                st.selectbox(control.label, control.options, format_func=control.fmt, **common)
            else:
                st.select_slider(control.label, control.options, format_func=control.fmt, **common)
        try:
            cfg = current_config()
        except PaceError as err:
            cfg = fallback_config()
            st.error(f"These settings do not form a valid configuration: {err}. The views use "
                     f"'{cfg.name}' until you change them.")
        st.caption(f"Active: **{cfg.name}** · the link in the address bar reproduces this view")
    write_url()
    return cfg


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
    st.set_page_config(page_title="PACE Studio", page_icon=":material/calculate:", layout="wide")
    cfg = sidebar()
    try:
        body(cfg)
    except PaceError as err:
        st.error(f"{err}\n\nChange the named setting in the sidebar (or the input on this page) and the "
                 "page recomputes.", icon=":material/warning:")
    except Exception as err:  # a page failure must not take the app down: report it, keep going
        if _out_of_memory(err):
            st.error(f"Out of memory on {st.session_state.get('device', 'the device')}: "
                     f"{str(err).partition(chr(10))[0]}\n\nAsk for less at once on this page (fewer tokens, steps, "
                     "sequences or configurations), or pick a smaller model or another device in the sidebar; "
                     "what was computed before is kept.", icon=":material/memory:")
            return
        st.error(f"This page failed: {type(err).__name__}: {err}\n\nTry another configuration or model; "
                 "if it persists, please report it with the link in the address bar.", icon=":material/error:")
