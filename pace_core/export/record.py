"""The complete record of a configuration (:func:`config_to_dict`): every setting, shaped like compressed-tensors'
``kv_cache_scheme`` (``QuantizationArgs``: ``num_bits``, ``type``, ``symmetric``, ``strategy``, ``group_size``,
``scale_dtype``, ``zp_dtype``) under the key ``state_cache_scheme``, with the PACE settings under ``pace``. It is
what result caches key on and results store; the deployable export is :mod:`pace_core.export.document`::

    {"schema_version": 7,
     "producer": {"name": "pace-studio", "version": "0.1.0"},
     "model": "qwen3.5-27b" | null,
     "state_cache_scheme": {"num_bits": 4, "type": "int", "symmetric": false, "strategy": "group",
                            "group_size": 32, "scale_dtype": "float16", "zp_dtype": "int4"},
     "pace": {"name": "pace-4-8", "method": "pace", "group_axis": "key", "decode_period": 8, ...,
              "high_heads": {"0": [3, 17, ...], "1": [...]} | null, ...},
     "provenance": {...}}

``type`` is ``"float"`` for the references (method ``none``, ``num_bits`` 32 or 16). ``strategy`` is the method's
(:attr:`pace_core.methods.Method.strategy`); ``group_size`` is always written. ``zp_dtype`` is ``"int<b>"`` with zero
points and ``null`` when symmetric. ``high_heads`` keys are GDN-layer ordinals ``"0".."L-1"``. Reading checks every
field and rejects unknown keys in ``state_cache_scheme`` and ``pace``; ``producer`` and ``provenance`` are free-form
objects. ``config_from_dict(config_to_dict(c)) == c`` for every valid config. Records of an older schema are read:
the settings added since (:attr:`~pace_core.settings.Setting.schema`) get what they were made with
(:attr:`~pace_core.settings.Setting.before`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pace_core._version import __version__
from pace_core.config import SETTINGS, PaceConfig, check_choice, is_int
from pace_core.errors import PaceError
from pace_core.methods import Calibrated, method_of

SCHEMA_VERSION = 7
"""The schema of the complete record (:func:`config_to_dict`), which result caches key on: 1-3, then 5 (4 is the
first deployable export's; from 5 on records and exports share the numbers and differ by the export's ``kind``);
6 adds the combinations (stochastic rounding, key rotation, static scales); 7 STEPQuant's calibration samples."""
READ_SCHEMA_VERSION = 7
"""The newest schema read, of records and of exports (:mod:`pace_core.export`; an export of 7 also records the codes'
packing)."""
PRODUCER_NAME = "pace-studio"



def _json_value(cfg: PaceConfig, field: str) -> Any:
    """A field's value in the record (the high-bit heads keyed by GDN-layer ordinal)."""
    value = getattr(cfg, field)
    if field == "high_heads" and value is not None:
        return {str(i): list(layer) for i, layer in enumerate(value)}
    if field == "calibrated" and value is not None:
        return value.to_json()
    return value


def _strategy(method: str) -> str | None:
    return method_of(method).strategy


def config_to_dict(cfg: PaceConfig, *, model: str | None = None, provenance: dict | None = None) -> dict:
    """The JSON document (a dict of plain JSON types) of `cfg` for `model`, with `provenance`."""
    if not isinstance(cfg, PaceConfig):
        raise PaceError(f"cfg must be a PaceConfig; got {type(cfg).__name__}")
    if model is not None and not isinstance(model, str):
        raise PaceError(f"model={model!r} is not allowed; allowed: a string or None")
    if provenance is not None and not isinstance(provenance, dict):
        raise PaceError(f"provenance={provenance!r} is not allowed; allowed: a JSON object (dict) or None")
    return {
        "schema_version": SCHEMA_VERSION,
        "producer": {"name": PRODUCER_NAME, "version": __version__},
        "model": model,
        "state_cache_scheme": {
            "num_bits": cfg.bits,
            "type": "int" if cfg.quantized else "float",
            "symmetric": cfg.symmetric,
            "strategy": _strategy(cfg.method),
            "group_size": cfg.group_size,
            "scale_dtype": cfg.scale_dtype,
            "zp_dtype": None if cfg.symmetric or not cfg.quantized else f"int{cfg.bits}",
        },
        "pace": {st.json: _json_value(cfg, st.field) for st in SETTINGS if st.section == "pace"},
        "provenance": dict(provenance or {}),
    }


_SCHEME_KEYS = ("num_bits", "type", "symmetric", "strategy", "group_size", "scale_dtype", "zp_dtype")
_PACE_KEYS_BY_SCHEMA = {v: tuple(st.json for st in SETTINGS if st.section == "pace" and st.schema <= v)
                        for v in range(1, SCHEMA_VERSION + 1)}
"""The ``pace`` keys of each record schema (:attr:`Setting.schema`)."""
_OLDER_SCHEMA_VALUES = {st.json: st.before for st in SETTINGS if st.schema > 1}
"""What documents of an older schema were made with (:attr:`Setting.before`)."""
_TOP_KEYS = ("schema_version", "producer", "model", "state_cache_scheme", "pace", "provenance")


def _section(d: dict, key: str, keys: tuple[str, ...]) -> dict:
    sec = d[key]
    if not isinstance(sec, dict):
        raise PaceError(f"config JSON field {key!r} must be an object; got {type(sec).__name__}")
    missing = [k for k in keys if k not in sec]
    unknown = [k for k in sec if k not in keys]  # in the document's order
    if missing:
        raise PaceError(f"config JSON field {key}.{missing[0]} is missing; required: {', '.join(keys)}")
    if unknown:
        raise PaceError(
            f"config JSON field{'s' if len(unknown) > 1 else ''} {', '.join(f'{key}.{u}' for u in unknown)} "
            f"{'are' if len(unknown) > 1 else 'is'} unknown; allowed: {', '.join(keys)}"
        )
    return sec


def _high_heads_from_json(value: Any) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    allowed = 'allowed: null or an object {"0": [head, ...], "1": [...], ...} with one key per GDN layer'
    if not isinstance(value, dict) or not value:
        raise PaceError(f"config JSON field pace.high_heads={value!r} is not allowed; {allowed}")
    if sorted(value) != sorted(str(i) for i in range(len(value))):
        raise PaceError(f"config JSON field pace.high_heads has keys {sorted(value)}; {allowed} "
                        f"(keys 0..{len(value) - 1})")
    layers = []
    for i in range(len(value)):
        layer = value[str(i)]
        if not isinstance(layer, list) or not all(is_int(h) for h in layer):
            raise PaceError(f'config JSON field pace.high_heads["{i}"]={layer!r} is not allowed; '
                            "allowed: a list of integer head indices")
        layers.append(tuple(layer))
    return tuple(layers)


def record_from_dict(d: dict, version: int) -> ConfigDocument:
    """The configuration of a complete record (:func:`config_to_dict`) of schema ``version`` (1..3, 5..7: the
    settings added since are read as what it was made with, :attr:`~pace_core.settings.Setting.before`)."""
    missing = [k for k in _TOP_KEYS if k not in d]
    if missing:
        raise PaceError(f"config JSON field {missing[0]} is missing; required: {', '.join(_TOP_KEYS)}")
    for key in ("producer", "provenance"):
        if not isinstance(d[key], dict):
            raise PaceError(f"config JSON field {key} must be an object; got {type(d[key]).__name__}")
    if d["model"] is not None and not isinstance(d["model"], str):
        raise PaceError(f"config JSON field model={d['model']!r} is not allowed; allowed: a string or null")
    pace = {**_OLDER_SCHEMA_VALUES, **_section(d, "pace", _PACE_KEYS_BY_SCHEMA[version])}
    if pace["calibrated"] is not None:
        pace["calibrated"] = Calibrated.from_json(pace["calibrated"], "pace.calibrated")
    cfg = config_from_sections(d["state_cache_scheme"], pace, high_heads=_high_heads_from_json(pace["high_heads"]))
    return ConfigDocument(cfg, d["model"], d["provenance"])


def config_from_sections(scheme: Any, pace: dict, *, high_heads: tuple[tuple[int, ...], ...] | None) -> PaceConfig:
    """The PaceConfig of a ``state_cache_scheme`` object (its keys checked here) and a complete ``pace``
    object (every key of the current schema; ``high_heads`` already decoded), checked against each other."""
    scheme = _section({"state_cache_scheme": scheme}, "state_cache_scheme", _SCHEME_KEYS)
    check_choice("config JSON field state_cache_scheme.type", scheme["type"], ("int", "float"))
    try:
        quantized = method_of(pace["method"]).quantized
    except PaceError as e:
        raise PaceError(f"config JSON field pace.{e}") from None
    if (scheme["type"] == "float") == quantized:
        raise PaceError(f"config JSON field state_cache_scheme.type={scheme['type']!r} does not match "
                        f"pace.method={pace['method']!r}; allowed: 'float' for the references (method none), "
                        "'int' otherwise")
    try:
        cfg = PaceConfig.make(**{st.field: (high_heads if st.field == "high_heads" else
                                            (scheme if st.section == "state_cache_scheme" else pace)[st.json])
                                 for st in SETTINGS})
    except PaceError as e:
        raise PaceError(f"config JSON: {e}") from None
    expected = config_to_dict(cfg)["state_cache_scheme"]
    for key in ("strategy", "zp_dtype"):
        if scheme[key] != expected[key]:
            raise PaceError(f"config JSON field state_cache_scheme.{key}={scheme[key]!r} does not match the "
                            f"other settings; allowed: {expected[key]!r}")
    return cfg


def config_to_json(cfg: PaceConfig, *, model: str | None = None, provenance: dict | None = None,
                   indent: int | None = 2) -> str:
    """JSON text of :func:`config_to_dict`."""
    return json.dumps(config_to_dict(cfg, model=model, provenance=provenance), indent=indent)


@dataclass(frozen=True)
class ConfigDocument:
    """A parsed config JSON document: the config plus its model (a path or hub id; ``model_info``: the
    export's whole model object, with the fingerprint and shape, or None) and provenance."""

    config: PaceConfig
    model: str | None
    provenance: dict
    model_info: dict | None = None


def parse_json(s: str) -> Any:
    """JSON text -> Python objects; PaceError in the user's words when it is not JSON."""
    if not isinstance(s, str):
        raise PaceError(f"config JSON must be text; got {type(s).__name__}")
    try:
        return json.loads(s)
    except json.JSONDecodeError as e:
        raise PaceError(f"this is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); expected a "
                        "PACE configuration as the Export page or `python -m pace_core export` writes it") from None
    except RecursionError:
        raise PaceError("this JSON is nested too deeply to read; expected a PACE configuration as the Export "
                        "page or `python -m pace_core export` writes it") from None
