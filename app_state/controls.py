"""The sidebar's controls and their URL schema: every PACE setting is a control whose value lives in
``st.session_state`` and is mirrored into ``st.query_params``, so a link reproduces the view. URL values are
validated when read: a bad value is named in a warning and replaced by the value of the named configuration;
an unknown URL key is named in a warning; the sidebar's names (``dP``, ``P``) and the settings' names
(``decode_period``) are aliases of the URL keys (:func:`url_aliases`). The configuration of the controls,
admitted by :func:`pace_core.export.admit`, is :func:`current_config`.

Which model a link may open: the embedded model (no ``model``), a folder of the operator's models folder
(:data:`MODELS_DIR_ENV`) and, where the operator allows it (:data:`ALLOW_HUB_ENV`), a hub id; anything
else is refused with a message that says nothing of what exists on the server. A path or hub id typed in
the sidebar is the local user's own choice and is opened as typed, unless the operator configured a models
folder: then the sidebar follows the same rule as a link.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import streamlit as st
import torch

from pace_core.config import METHOD_SETTINGS, NAMED_CONFIGS, SETTINGS, PaceConfig, default_of, get_config
from pace_core.errors import PaceError
from pace_core.export import admit, config_to_json
from pace_core.methods import COMBINATIONS, method_of

DEFAULT_PRESET = "pace-4"


@dataclass(frozen=True)
class Control:
    """One sidebar control: URL key, PaceConfig field, the allowed values and the help text; ``symbol``:
    the name its label gives the setting (``dP``), a URL alias of ``key``."""

    key: str
    field: str
    label: str
    help: str
    options: tuple[Any, ...]
    fmt: Callable[[Any], str] = str
    symbol: str | None = None

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


CONTROLS: tuple[Control, ...] = tuple(
    Control(st.url, st.field, st.label, st.help, st.options, st.fmt, st.symbol) for st in SETTINGS if st.url)
"""The sidebar's controls: every setting with a URL key (:data:`pace_core.config.SETTINGS`), in its order."""


CONTROL_BY_KEY = {c.key: c for c in CONTROLS}


URL_KEYS = ("preset", "model", "device", "weights", *CONTROL_BY_KEY)
"""Every URL key the app reads."""


def _url_name(name: str) -> str:
    """How a URL key is compared: case and '-' / '_' do not matter (dP = dp, decode-period = decode_period)."""
    return name.lower().replace("-", "_")


def url_aliases() -> dict[str, str]:
    """Normalised URL name (:func:`_url_name`) -> URL key: each key itself, and each control's setting name
    (``decode_period``) and the symbol of its label (``dP``, ``P``, ``g``)."""
    aliases = {_url_name(k): k for k in URL_KEYS}
    for c in CONTROLS:
        for name in (c.field, c.symbol):
            if name is not None:
                aliases.setdefault(_url_name(name), c.key)
    return aliases


QUANT_ONLY_KEYS = frozenset({"bits", "axis", "g", "sym", "hi"})
READERS_ONLY = frozenset(METHOD_SETTINGS) | {f for fields in COMBINATIONS.values() for f in fields}
"""Settings that only the methods reading them take (a method's own; a combination's, for the methods that compose
with it): for another method they stay at their defaults."""


def enabled(control: Control, method: str) -> bool:
    """Whether ``control`` applies to ``method``: the reference dtype only to the references, the quantiser's
    settings only to quantised methods, a method's own setting and a combination's only to the methods that read
    them."""
    quantised = method_of(method).quantized
    if control.key == "ref":
        return not quantised
    if control.field in READERS_ONLY:
        return control.field in method_of(method).reads
    return quantised or control.key not in QUANT_ONLY_KEYS


EMBEDDED, LOCAL, HUB = "Embedded", "Local path", "Hub id"


MODEL_KINDS = (EMBEDDED, LOCAL, HUB)


WEIGHT_DTYPES = ("float32", "bfloat16")
"""The dtypes the app can load a model's weights in; the recurrent state's arithmetic is float32 in both."""


class Runtime(NamedTuple):
    """Where the live views run: the torch device and the dtype of the model's weights (the key under which
    a loaded model and everything computed on it are kept)."""

    device: str
    weights: str

    def __str__(self) -> str:
        return self.device if self.weights == WEIGHT_DTYPES[0] else f"{self.device}, {self.weights} weights"


def runtime() -> Runtime:
    """The sidebar's device and weight dtype."""
    return Runtime(st.session_state["device"], st.session_state["weights"])


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


def _url_values() -> tuple[dict[str, str], list[str]]:
    """The URL's values by URL key (aliases resolved, :func:`url_aliases`) and the problems found: unknown
    keys (ignored) and a key given twice under different names (the first kept)."""
    aliases, values, problems = url_aliases(), {}, []
    spelled: dict[str, str] = {}
    for name in st.query_params:
        key = aliases.get(_url_name(name))
        if key is None:
            problems.append(f"URL parameter {name!r} is unknown and was ignored; allowed: {', '.join(URL_KEYS)} "
                            "(or the sidebar's names dP, P, g and the settings' names such as decode_period).")
        elif key in values:
            problems.append(f"URL parameter {key!r} is given twice ({spelled[key]!r} and {name!r}); using "
                            f"{spelled[key]} = {values[key]}.")
        else:
            values[key], spelled[key] = st.query_params[name], name
    return values, problems


def read_url_once() -> list[str]:
    """On a session's first run, take preset, model, device, weight dtype and every control from the URL.

    Returns the problems found (each names the URL parameter and the allowed values); the bad
    values fall back to the named configuration's values, a model a link may not open to the embedded one.
    """
    if st.session_state.get("_url_read"):
        return []
    qp, problems = _url_values()
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
    try:
        kind, text = url_model(qp.get("model", "").strip())
    except PaceError as err:
        problems.append(f"{err} Using the embedded model.")
        kind, text = EMBEDDED, ""
    st.session_state["model_kind"], st.session_state["model_text"] = kind, text
    device = qp.get("device", "cpu")
    if device not in device_options():
        problems.append(f"URL parameter 'device' = {device!r} is not available here; allowed: "
                        f"{', '.join(device_options())}. Using cpu.")
        device = "cpu"
    st.session_state["device"] = device
    weights = qp.get("weights", WEIGHT_DTYPES[0])
    if weights not in WEIGHT_DTYPES:
        problems.append(f"URL parameter 'weights' = {weights!r} is not a weight dtype; allowed: "
                        f"{', '.join(WEIGHT_DTYPES)}. Using {WEIGHT_DTYPES[0]}.")
        weights = WEIGHT_DTYPES[0]
    st.session_state["weights"] = weights
    st.session_state["_url_read"] = True
    return problems


MODELS_DIR_ENV = "PACE_MODELS_DIR"
"""Environment variable: the operator's models folder, whose folders a link may open (and, when set, the
only local folders the sidebar opens)."""
ALLOW_HUB_ENV = "PACE_ALLOW_HUB"
"""Environment variable: ``1`` lets a link (and, with a models folder, the sidebar) open hub ids."""
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def models_dir() -> Path | None:
    """The operator's models folder (:data:`MODELS_DIR_ENV`), or None when none is configured."""
    folder = os.environ.get(MODELS_DIR_ENV, "").strip()
    return Path(folder).expanduser().resolve() if folder else None


REPO_ROOT = Path(__file__).resolve().parents[1]
SERVER_PATH = "<server path>"
"""How :func:`hide_paths` shows a path of the server outside the models folder and the repository."""
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~\\-])~?/[^\s'\"`,;()\[\]<>{}|*]+")


def hide_paths(text: str) -> str:
    """``text`` with the server's paths hidden where the operator configured a models folder (a server others
    visit): a path in the models folder as its name there, one in the repository as its path from the
    repository's root, any other absolute path as :data:`SERVER_PATH`. Unchanged without a models folder (the
    local user's own machine, where paths are theirs)."""
    folder = models_dir()
    if folder is None:
        return text
    raw = Path(os.environ[MODELS_DIR_ENV].strip()).expanduser().absolute()
    roots = sorted({folder, raw, REPO_ROOT}, key=lambda r: len(str(r)), reverse=True)

    def shown(match: re.Match) -> str:
        path = match.group(0).rstrip(".:")
        tail = match.group(0)[len(path):]  # the sentence's punctuation after the path
        full = Path(path).expanduser()
        for root in roots:
            if full.is_relative_to(root):
                inside = full.relative_to(root).as_posix()
                return (inside if inside != "." else "the models folder" if root != REPO_ROOT else ".") + tail
        return SERVER_PATH + tail

    return _ABSOLUTE_PATH.sub(shown, text)


def hub_allowed() -> bool:
    """Whether the operator lets links open hub ids (:data:`ALLOW_HUB_ENV` = 1)."""
    return os.environ.get(ALLOW_HUB_ENV, "").strip() == "1"


def _in_models_dir(text: str) -> Path | None:
    """The path ``text`` names inside the models folder (relative to it, or absolute within it), else None."""
    folder = models_dir()
    if folder is None or not text:
        return None
    path = (folder / Path(text).expanduser()).resolve()
    return path if path.is_relative_to(folder) else None


def _model_rule() -> str:
    folder = "a folder of the operator's models folder" if models_dir() is not None else \
        f"a folder of a models folder (none is configured: {MODELS_DIR_ENV})"
    hub = "a hub id" if hub_allowed() else f"a hub id where the operator allows it ({ALLOW_HUB_ENV}=1)"
    return f"allowed: the embedded model (no model parameter), {folder}, {hub}"


def url_model(text: str) -> tuple[str, str]:
    """(model kind, text) of a link's ``model``, or PaceError. The answer never depends on what exists
    outside the models folder, so a link cannot probe the server's paths."""
    if not text:
        return EMBEDDED, ""
    inside = _in_models_dir(text)
    if inside is not None and (not hub_allowed() or inside.exists()):
        return LOCAL, text
    if hub_allowed() and HUB_ID.fullmatch(text):
        return HUB, text
    raise PaceError(f"URL parameter 'model' is not allowed: a link opens only models the operator offers; "
                    f"{_model_rule()}. Type a local path in the sidebar to open it on your own machine.")


def sidebar_model_problem(kind: str, text: str) -> str | None:
    """Why the sidebar may not open (kind, text), or None: anything is opened unless the operator configured
    a models folder, which then holds the local folders (hub ids as for a link)."""
    if kind == EMBEDDED or not text.strip() or models_dir() is None:
        return None
    if kind == LOCAL and _in_models_dir(text.strip()) is not None:
        return None
    if kind == HUB and hub_allowed():
        return None
    return f"This server opens only the models its operator offers; {_model_rule()}. Using the embedded model."


def on_model_change(key: str) -> None:
    """on_change callback of the model widgets: store the change, or go back to the embedded model with the
    reason (shown at the top of the page) when the operator's rule refuses it."""
    sync(key)
    problem = sidebar_model_problem(st.session_state["model_kind"], st.session_state.get("model_text", ""))
    if problem is not None:
        st.session_state["model_kind"], st.session_state["model_text"] = EMBEDDED, ""
        st.session_state["_model_problem"] = problem


def _control_fields() -> dict:
    """The settings the sidebar controls hold, as PaceConfig fields."""
    fields = {c.field: st.session_state[c.key] for c in CONTROLS}
    method = method_of(fields["method"])
    if not method.quantized:
        fields["bits"] = 32 if fields["reference_dtype"] == "float32" else 16
    for name in READERS_ONLY:  # another method's own settings and the combinations it does not take: defaults
        if name in fields and name not in method.reads:
            fields[name] = default_of(name)
    return fields


def current_config() -> PaceConfig:
    """The PaceConfig of the sidebar controls, admitted by :func:`pace_core.export.admit` (PaceError when
    the combination is invalid; the model is checked where a page runs it, :func:`app_state.compute.runnable`).
    It is named after its preset, or after an imported configuration while the controls hold its settings,
    else 'custom'."""
    fields = _control_fields()
    base = get_config(st.session_state["preset"])
    changed = {k: v for k, v in fields.items() if getattr(base, k) != v}
    imported = st.session_state.get("imported_name")
    name = imported[1] if imported is not None and imported[0] == fields else "custom"
    cfg = base.replace(name=name, **changed) if changed else base
    stored = st.session_state.get("allocation")
    if stored is not None and cfg.high_share > 0 and stored[0] == allocation_key(cfg):
        cfg = cfg.replace(high_heads=stored[1])
    return admit(cfg, ready_for="settings")


def allocation_key(cfg: PaceConfig) -> str:
    """What a head allocation depends on: the model and every setting except name, the heads and what
    happens to a prompt after decoded tokens."""
    return model_source() + "|" + config_to_json(cfg.uncalibrated().replace(name="custom",
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
    st.session_state["imported_name"] = (_control_fields(), cfg.name)
    if cfg.high_heads is not None:
        set_allocation(cfg, cfg.high_heads)


def fallback_config() -> PaceConfig:
    """The named configuration the controls started from (used while the controls are invalid)."""
    return get_config(st.session_state["preset"])


def model_source() -> str:
    """The sidebar's model: '' for the embedded default, else a local folder (a name in the operator's models
    folder is that folder's path) or hub id."""
    kind = st.session_state.get("model_kind", EMBEDDED)
    if kind == EMBEDDED:
        return ""
    text = st.session_state.get("model_text", "").strip()
    inside = _in_models_dir(text) if kind == LOCAL else None
    return str(inside) if inside is not None else text


def write_url() -> None:
    """Mirror preset, model, device, weight dtype (when not float32) and every control into the URL
    (shareable link)."""
    params = {"preset": st.session_state["preset"]}
    if model_source():
        params["model"] = st.session_state["model_text"].strip()  # as given: a name in the models folder stays one
    params["device"] = st.session_state["device"]
    if st.session_state["weights"] != WEIGHT_DTYPES[0]:
        params["weights"] = st.session_state["weights"]
    params.update({c.key: url_text(st.session_state[c.key]) for c in CONTROLS})
    if dict(st.query_params) != params:
        st.query_params.from_dict(params)


def config_key(cfg: PaceConfig) -> str:
    """A stable hashable key of a configuration for st.cache_data."""
    return config_to_json(cfg)
