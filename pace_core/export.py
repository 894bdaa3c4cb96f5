"""The deployable export: one PACE configuration as a JSON document a serving engine can apply.

Schema 4 (``config_to_dict`` in :mod:`pace_core.config` stays the complete record the result caches key
on; this is what leaves the project)::

    {"schema_version": 4, "kind": "pace-state-config",
     "producer": {"name": "pace-studio", "version": "0.1.0"},
     "model": {"source": "Qwen/Qwen3.5-4B" | "/path/to/checkpoint", "weights_fingerprint": "…" | null,
               "num_layers": 32, "gdn_layers": [0, 1, 2, 4, …], "num_k_heads": 16, "num_v_heads": 32,
               "d_k": 128, "d_v": 128} | null,
     "state_layout": {"tensor": "S [HV, K, V]", "rows": "key", "columns": "value",
                      "groups_along": "key" | "value" | "rows and columns" | null, "group_size": 64, …},
     "state_cache_scheme": {"num_bits": 4, "type": "int", …},            # as in pace_core.config
     "pace": {only the settings the method reads; 8-bit heads keyed by decoder layer:
              "high_heads": {"4": {"gdn_layer": 3, "heads": [0, 7]}, …}},
     "resident_bits": {"payload_bits": …, "metadata_bits": …, "c": …, "decode_period": 8,
                       "buffer_bits": …, "resident_bits": …, "paper_c": …, "formula_bits": …} | null,
     "provenance": {…}}

The state layout is named because engines differ: transformers keeps ``[B, HV, K, V]`` (this layout),
vLLM ``[slots, HV, V, K]``; a reader that stores ``[V, K]`` transposes and keeps the groups along the
named axis. ``pace`` leaves out what the method does not read (DAMP's rows in a PACE configuration, the
buffer at dP = 1); reading fills them with :class:`~pace_core.config.PaceConfig`'s defaults, so
``config_from_export(export_document(c, …)) == used_settings(c)``.
"""

from __future__ import annotations

import re
from typing import Any

from pace_core import __version__
from pace_core.buffer import BUFFER_LAYOUT
from pace_core.config import (
    PRODUCER_NAME,
    ConfigDocument,
    PaceConfig,
    config_from_sections,
    config_to_dict,
)
from pace_core.errors import PaceError
from pace_core.shapes import ModelShape

EXPORT_SCHEMA_VERSION = 4
EXPORT_KIND = "pace-state-config"
_JSON_NAMES = {"buffer": "buffer_precision"}
"""PaceConfig field -> its key in ``pace`` where they differ."""
_MODEL_KEYS = ("source", "weights_fingerprint", "num_layers", "gdn_layers", "num_k_heads", "num_v_heads", "d_k",
               "d_v")
_TOP_KEYS = ("schema_version", "kind", "producer", "model", "state_layout", "state_cache_scheme", "pace",
             "resident_bits", "provenance")


def used_fields(cfg: PaceConfig) -> tuple[str, ...]:
    """The PaceConfig fields besides the ``state_cache_scheme`` ones that ``cfg``'s method reads."""
    fields = ["name", "method", "decode_period", "prefill_period"]
    if cfg.method == "none":
        fields.append("reference_dtype")
    if cfg.method in ("rtn", "pace", "damp"):
        fields.append("group_axis")
    if cfg.high_share > 0:
        fields += ["high_bits", "high_share", "high_heads"]
    if cfg.method == "damp":
        fields += ["damp_outlier_rows", "damp_hadamard"]
    if cfg.buffered:
        fields += ["buffer", "exact_current_token", "prefill_after_decode"]
        for part, kind in zip(("key", "value"), BUFFER_LAYOUT[cfg.buffer]):
            if isinstance(kind, int):  # an integer part: its groups and zero points are read
                fields += [f"buffer_{part}_group", f"buffer_{part}_symmetric"]
    return tuple(fields)


_SCHEME_FIELDS = ("bits", "symmetric", "group_size", "scale_dtype")


def used_settings(cfg: PaceConfig) -> PaceConfig:
    """``cfg`` with every setting its method does not read at PaceConfig's default (same behaviour)."""
    return PaceConfig(**{f: getattr(cfg, f) for f in (*_SCHEME_FIELDS, *used_fields(cfg))})


def export_filename(cfg: PaceConfig) -> str:
    """The download's file name: the configuration's name (``pace-4-8.json``), made file-system safe."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", cfg.name.strip()).strip("-.") or "pace-config"
    return f"{stem}.json"


def model_block(source: str, shape: ModelShape, weights_fingerprint: str | None = None) -> dict[str, Any]:
    """The ``model`` object: where the weights come from, which weights (fingerprint), and the shape a
    reader checks before applying the configuration (``shape.gdn_layers`` must be known)."""
    if shape.gdn_layers is None:
        raise PaceError(f"the GDN layers of {shape.name!r} are unknown; export with the loaded model")
    return {"source": source, "weights_fingerprint": weights_fingerprint, "num_layers": shape.num_layers,
            "gdn_layers": list(shape.gdn_layers), "num_k_heads": shape.num_k_heads, "num_v_heads": shape.num_v_heads,
            "d_k": shape.d_k, "d_v": shape.d_v}


def state_layout(cfg: PaceConfig) -> dict[str, Any]:
    """How the stored state is laid out and which axis the scale groups run along."""
    groups = {"none": None, "dsq": "rows and columns"}.get(cfg.method, cfg.group_axis)
    return {"tensor": "S [HV, K, V] per GDN layer and sequence", "rows": "key", "columns": "value",
            "groups_along": groups, "group_size": cfg.group_size if cfg.method in ("rtn", "pace", "damp") else None,
            "update": "S_t = exp(g_t) S_{t-1} + k_t u_t^T, o_t = S_t^T q_t",
            "engines": "transformers stores [B, HV, K, V] (this layout); vLLM stores [slots, HV, V, K]: "
                       "transpose the last two axes, the groups stay along the named axis"}


def export_document(cfg: PaceConfig, *, shape: ModelShape | None = None, source: str | None = None,
                    weights_fingerprint: str | None = None, provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """The schema 4 document of ``cfg`` for the model ``source`` of ``shape`` (None when no model is known:
    then no 8-bit heads and no resident bits; with heads calibrated but no shape, PaceError)."""
    from pace_core.accounting import resident_bits

    record = config_to_dict(cfg)
    pace = {_JSON_NAMES.get(f, f): record["pace"][_JSON_NAMES.get(f, f)] for f in used_fields(cfg)}
    model = None if shape is None else model_block(source or shape.name, shape, weights_fingerprint)
    if shape is not None:
        cfg.validate_for(shape)
    if cfg.high_heads is not None:
        if model is None:
            raise PaceError("the 8-bit heads are chosen per decoder layer of a model; export them with the model "
                            "they were calibrated on (or export the share alone)")
        pace["high_heads"] = {str(layer): {"gdn_layer": i, "heads": list(heads)}
                              for i, (layer, heads) in enumerate(zip(model["gdn_layers"], cfg.high_heads))}
    bits = None
    if shape is not None:
        r = resident_bits(cfg, shape)
        bits = {"payload_bits": r.payload_bits, "metadata_bits": r.metadata_bits, "c": r.c,
                "decode_period": cfg.decode_period, "buffer_bits": r.buffer_bits, "resident_bits": r.resident_bits,
                "paper_c": r.paper_c, "formula_bits": r.formula_bits}
    return {"schema_version": EXPORT_SCHEMA_VERSION, "kind": EXPORT_KIND,
            "producer": {"name": PRODUCER_NAME, "version": __version__}, "model": model,
            "state_layout": state_layout(cfg), "state_cache_scheme": record["state_cache_scheme"], "pace": pace,
            "resident_bits": bits, "provenance": dict(provenance or {})}


def _high_heads(value: Any, model: dict | None) -> tuple[tuple[int, ...], ...] | None:
    allowed = ('allowed: null or {"<decoder layer>": {"gdn_layer": i, "heads": [head, ...]}, ...} with one entry '
               "per GDN layer")
    if value is None:
        return None
    if not isinstance(value, dict) or not value:
        raise PaceError(f"the field pace.high_heads={value!r} is not allowed; {allowed}")
    by_gdn: dict[int, tuple[int, ...]] = {}
    for layer, entry in value.items():
        if (not isinstance(entry, dict) or set(entry) != {"gdn_layer", "heads"} or not isinstance(entry["heads"], list)
                or not all(isinstance(h, int) and not isinstance(h, bool) for h in entry["heads"])
                or not isinstance(entry["gdn_layer"], int)):
            raise PaceError(f'the field pace.high_heads["{layer}"]={entry!r} is not allowed; {allowed}')
        if model is not None and not (0 <= entry["gdn_layer"] < len(model["gdn_layers"])
                                      and str(model["gdn_layers"][entry["gdn_layer"]]) == layer):
            raise PaceError(f'the field pace.high_heads["{layer}"] names GDN layer {entry["gdn_layer"]}, but the '
                            f"model's GDN layers are the decoder layers {model['gdn_layers']}; {allowed}")
        by_gdn[entry["gdn_layer"]] = tuple(entry["heads"])
    if sorted(by_gdn) != list(range(len(by_gdn))):
        raise PaceError(f"the field pace.high_heads covers GDN layers {sorted(by_gdn)}; {allowed} (0..{len(by_gdn) - 1})")
    return tuple(by_gdn[i] for i in range(len(by_gdn)))


def _model(value: Any) -> dict | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or set(value) != set(_MODEL_KEYS) or not isinstance(value["source"], str)
            or not isinstance(value["gdn_layers"], list)
            or not all(isinstance(value[k], int) for k in ("num_layers", "num_k_heads", "num_v_heads", "d_k", "d_v"))):
        raise PaceError(f"the field model is not allowed; allowed: null or an object with {', '.join(_MODEL_KEYS)}")
    return value


def document_from_export(d: dict) -> ConfigDocument:
    """The configuration of a schema 4 document (settings its method does not read at their defaults),
    with its model, producer and provenance. Malformed documents raise PaceError naming the field."""
    missing = [k for k in _TOP_KEYS if k not in d]
    unknown = [k for k in d if k not in _TOP_KEYS]
    if missing or unknown:
        raise PaceError(f"the document {'lacks ' + ', '.join(missing) if missing else 'has unknown fields ' + ', '.join(unknown)}"
                        f"; a PACE configuration has exactly: {', '.join(_TOP_KEYS)}")
    if d["kind"] != EXPORT_KIND:
        raise PaceError(f"the field kind={d['kind']!r} is not allowed; allowed: {EXPORT_KIND!r}")
    model = _model(d["model"])
    pace = d["pace"]
    if not isinstance(pace, dict):
        raise PaceError(f"the field pace must be an object; got {type(pace).__name__}")
    names = {_JSON_NAMES.get(f, f) for f in PaceConfig.__dataclass_fields__}
    unknown = [k for k in pace if k not in names]
    if unknown:
        raise PaceError(f"the field{'s' if len(unknown) > 1 else ''} {', '.join('pace.' + k for k in unknown)} "
                        f"{'are' if len(unknown) > 1 else 'is'} unknown; allowed: {', '.join(sorted(names))}")
    defaults = config_to_dict(PaceConfig())["pace"]
    full = {**defaults, **pace, "high_heads": None}
    cfg = config_from_sections(d["state_cache_scheme"], full, high_heads=_high_heads(pace.get("high_heads"), model))
    expected = set(map(lambda f: _JSON_NAMES.get(f, f), used_fields(cfg)))
    missing = sorted(expected - set(pace))
    if missing:
        raise PaceError(f"the field pace.{missing[0]} is missing; method {cfg.method!r} reads "
                        f"{', '.join(sorted(expected))}")
    source = model["source"] if model else None
    return ConfigDocument(cfg, source, d["producer"], d["provenance"], model)


def export_json(cfg: PaceConfig, **kwargs: Any) -> str:
    """JSON text of :func:`export_document` (same arguments), indented."""
    import json

    return json.dumps(export_document(cfg, **kwargs), indent=2)


def check_model(doc: ConfigDocument, shape: ModelShape, weights_fingerprint: str | None = None) -> None:
    """Refuse to apply ``doc`` to a model it was not made for: its layer count, GDN layers or head shape
    differ, or (when both are known) its weights fingerprint. PaceError naming what differs."""
    model = doc.model_info
    if model is not None:
        have = {"num_layers": shape.num_layers, "gdn_layers": list(shape.gdn_layers or ()),
                "num_k_heads": shape.num_k_heads, "num_v_heads": shape.num_v_heads, "d_k": shape.d_k, "d_v": shape.d_v}
        wrong = [f"{k} {model[k]} in the file, {v} in the model" for k, v in have.items() if model[k] != v]
        if wrong:
            raise PaceError(f"this configuration was made for {model['source']!r} and does not fit this model: "
                            + "; ".join(wrong) + ". Export it again on this model.")
        if weights_fingerprint and model["weights_fingerprint"] and weights_fingerprint != model["weights_fingerprint"]:
            raise PaceError(f"this configuration was calibrated on other weights than the model's (fingerprint "
                            f"{model['weights_fingerprint']} in the file, {weights_fingerprint} here); export it "
                            "again on these weights")
    doc.config.validate_for(shape)
