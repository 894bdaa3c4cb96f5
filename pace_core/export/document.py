"""The deployable export: one PACE configuration as a JSON document a serving engine can apply.

Schema 7 (4 to 6 are read: their settings of later schemas are the defaults, their codes' packing is migrated
(:func:`document_from_export`); ``config_to_dict`` in :mod:`pace_core.export.record` stays the complete
record the result caches key on; this is what leaves the project)::

    {"schema_version": 4, "kind": "pace-state-config",
     "producer": {"name": "pace-studio", "version": "0.1.0"},
     "model": {"source": "Qwen/Qwen3.5-4B" | "/path/to/checkpoint", "weights_fingerprint": "…" | null,
               "num_layers": 32, "gdn_layers": [0, 1, 2, 4, …], "num_k_heads": 16, "num_v_heads": 32,
               "d_k": 128, "d_v": 128} | null,
     "state_layout": {"tensor": "S [HV, K, V]", "rows": "key", "columns": "value",
                      "groups_along": "key" | "value" | "rows and columns" | null, "group_size": 64,
                      "packing": "dense" | null, "codes": "how codes lie in bytes", …},
     "state_cache_scheme": {"num_bits": 4, "type": "int", …},            # as in pace_core.config
     "pace": {only the settings the method reads; 8-bit heads keyed by decoder layer:
              "high_heads": {"4": {"gdn_layer": 3, "heads": [0, 7]}, …}},
     "resident_bits": {"payload_bits": …, "metadata_bits": …, "c": …, "decode_period": 8,
                       "buffer_bits": …, "resident_bits": …, "paper_c": …, "formula_bits": …} | null,
     "provenance": {…, "evidence": {…}}}

``provenance.evidence`` (optional; written since issue 47 without a schema change, so readers of schema 6 before
it read these files, and files without it stay valid) records what the configuration was picked on when the
Compare page exported it (:func:`pace_core.analysis.compare.evidence`): ``axis`` (``kl``, ``ppl`` or
``task:<setting>:<task>:<metric>:<filter>``), ``label``, ``higher_is_better``, ``config``, ``value`` and ``stderr``
on that axis, the fp32 ``reference``'s value, ``budget_bits``, ``resident_bits`` and the ``frontier`` on the axis;
for a pick in a memory also ``memory`` (``bytes``, ``sequences``, ``context``, ``weight_bits``); for a task score
also the task, metric, filter, few-shot setting, limit, items, lm-eval version and the command and code that
measured it. A reader checks its form (:func:`check_evidence`).

The state layout is named because engines differ: transformers keeps ``[B, HV, K, V]`` (this layout),
vLLM ``[slots, HV, V, K]``; a reader that stores ``[V, K]`` transposes and keeps the groups along the
named axis. ``pace`` leaves out what the method does not read (DAMP's rows in a PACE configuration, the
buffer at dP = 1); reading fills them with :class:`~pace_core.config.PaceConfig`'s defaults, so
``config_from_export(export_document(c, …)) == used_settings(c)``.

Schema 7 records the packing of the codes (``state_layout.packing``, :data:`pace_core.quant.PACKING`: every width
2..8 packed densely). A file of schema 4 to 6 was exported when 2-, 3-, 5-, 6- and 7-bit codes were stored padded to
4 or 8 bits: it is read (migrated) as the same settings stored densely, its ``resident_bits`` taken as that padded
storage's count (the padding in its metadata: the same terms but ``metadata_bits`` and ``resident_bits``, each at
least the current count by the same padding); 4- and 8-bit codes were stored as now.

Reading a document refuses sections that disagree: a ``pace`` key the method does not read or that belongs to
``state_cache_scheme`` (``pace.bits``), a ``state_layout`` or ``resident_bits`` other than the settings give
on the file's model, 8-bit heads for another layer count than the model block's. :func:`admit` is the one
way a configuration enters a run, whichever way it arrives (a name, a file, JSON text, the app's controls):
read and checked as above, checked against the model it is to run on (:func:`check_model`), and completed
by a calibration on that model or refused when it needs one.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pace_core._version import __version__
from pace_core.accounting import resident_bits
from pace_core.buffer import BUFFER_LAYOUT
from pace_core.config import SETTING_OF, SETTINGS, PaceConfig
from pace_core.errors import PaceError
from pace_core.export.record import PRODUCER_NAME, ConfigDocument, config_from_sections, config_to_dict
from pace_core.methods import Calibrated, method_of
from pace_core.quant import PACKING, packing_layout
from pace_core.shapes import ModelShape

EXPORT_SCHEMA_VERSION = 7
PACKING_SINCE = 7
"""The first export schema that records the codes' packing (``state_layout.packing``); older files are migrated."""
EXPORT_KIND = "pace-state-config"
_MODEL_KEYS = ("source", "weights_fingerprint", "num_layers", "gdn_layers", "num_k_heads", "num_v_heads", "d_k",
               "d_v")
_TOP_KEYS = ("schema_version", "kind", "producer", "model", "state_layout", "state_cache_scheme", "pace",
             "resident_bits", "provenance")
_EVIDENCE_KEYS = {"axis": str, "label": str, "higher_is_better": bool, "config": str, "value": float,
                  "budget_bits": float, "resident_bits": float, "frontier": list}
"""The fields ``provenance.evidence`` must have, with their types (float: any number)."""


def used_fields(cfg: PaceConfig) -> tuple[str, ...]:
    """The PaceConfig fields besides the ``state_cache_scheme`` ones that ``cfg``'s method reads (its
    :attr:`~pace_core.methods.Method.reads` where their :attr:`~pace_core.settings.Setting.read_if` holds: the
    high-bit heads' only with a share of them, a combination's only when it is on; the buffer's only at dP > 1, an
    integer buffer part's groups and zero points only for that part)."""
    fields = ["name", "method", "decode_period", "prefill_period"]
    fields += [f for f in method_of(cfg).reads if SETTING_OF[f].read_if is None or SETTING_OF[f].read_if(cfg)]
    if cfg.buffered:
        fields += ["buffer", "exact_current_token", "prefill_after_decode"]
        for part, kind in zip(("key", "value"), BUFFER_LAYOUT[cfg.buffer]):
            if isinstance(kind, int):  # an integer part: its groups and zero points are read
                fields += [f"buffer_{part}_group", f"buffer_{part}_symmetric"]
    return tuple(fields)


_SCHEME_FIELDS = {st.field: st.json for st in SETTINGS if st.section == "state_cache_scheme"}
"""PaceConfig fields held by ``state_cache_scheme`` -> their key there (never in ``pace``)."""
_LAYOUT_KEYS = ("rows", "columns", "groups_along", "group_size", "packing")
"""The ``state_layout`` entries that follow from the settings (the rest is explanation)."""


def used_settings(cfg: PaceConfig) -> PaceConfig:
    """``cfg`` with every setting its method does not read at PaceConfig's default (same behaviour)."""
    return PaceConfig.make(**{f: getattr(cfg, f) for f in (*_SCHEME_FIELDS, *used_fields(cfg))})


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
    """How the stored state is laid out: which axis the scale groups run along and how codes are packed."""
    method = method_of(cfg)
    return {"tensor": "S [HV, K, V] per GDN layer and sequence", "rows": "key", "columns": "value",
            "groups_along": method.groups_along(cfg), "group_size": cfg.group_size if method.grouped else None,
            "packing": PACKING if cfg.quantized else None, "codes": packing_layout() if cfg.quantized else None,
            "update": "S_t = exp(g_t) S_{t-1} + k_t u_t^T, o_t = S_t^T q_t",
            "engines": "transformers stores [B, HV, K, V] (this layout); vLLM stores [slots, HV, V, K]: "
                       "transpose the last two axes, the groups stay along the named axis"}


def export_document(cfg: PaceConfig, *, shape: ModelShape | None = None, source: str | None = None,
                    weights_fingerprint: str | None = None, provenance: dict[str, Any] | None = None,
                    evidence: dict[str, Any] | None = None) -> dict[str, Any]:
    """The export document (schema :data:`EXPORT_SCHEMA_VERSION`) of ``cfg`` for the model ``source`` of ``shape``
    (None when no model is known: then no 8-bit heads and no resident bits; with heads calibrated but no shape,
    PaceError), with ``evidence``, what it was picked on, as ``provenance.evidence`` (module docstring; checked by
    :func:`check_evidence`)."""
    if evidence is not None:
        check_evidence(evidence)
        provenance = {**(provenance or {}), "evidence": dict(evidence)}
    record = config_to_dict(cfg)
    pace = {SETTING_OF[f].json: record["pace"][SETTING_OF[f].json] for f in used_fields(cfg)}
    model = None if shape is None else model_block(source or shape.name, shape, weights_fingerprint)
    if cfg.high_heads is not None:
        if model is None:
            raise PaceError("the 8-bit heads are chosen per decoder layer of a model; export them with the model "
                            "they were calibrated on (or export the share alone)")
        pace["high_heads"] = {str(layer): {"gdn_layer": i, "heads": list(heads)}
                              for i, (layer, heads) in enumerate(zip(model["gdn_layers"], cfg.high_heads))}
    return {"schema_version": EXPORT_SCHEMA_VERSION, "kind": EXPORT_KIND,
            "producer": {"name": PRODUCER_NAME, "version": __version__}, "model": model,
            "state_layout": state_layout(cfg), "state_cache_scheme": record["state_cache_scheme"], "pace": pace,
            "resident_bits": None if shape is None else _resident_block(used_settings(cfg), shape),
            "provenance": dict(provenance or {})}


def check_evidence(evidence: Any) -> None:
    """PaceError naming the field when ``evidence`` is not the ``provenance.evidence`` object of the module
    docstring (its fields of :data:`_EVIDENCE_KEYS`, ``stderr`` a number or null)."""
    if not isinstance(evidence, dict):
        raise PaceError(f"the field provenance.evidence must be an object; got {type(evidence).__name__}")
    for key, kind in _EVIDENCE_KEYS.items():
        value = evidence.get(key)
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not (number if kind is float else isinstance(value, kind)):
            raise PaceError(f"the field provenance.evidence.{key}={value!r} is not allowed; allowed: "
                            + ("a finite number" if kind is float else f"a {kind.__name__}"))
    stderr = evidence.get("stderr")
    if stderr is not None and not (isinstance(stderr, int | float) and not isinstance(stderr, bool)
                                   and math.isfinite(stderr) and stderr >= 0):
        raise PaceError(f"the field provenance.evidence.stderr={stderr!r} is not allowed; allowed: null or a number "
                        ">= 0")


def _resident_block(cfg: PaceConfig, shape: ModelShape) -> dict[str, Any]:
    """The ``resident_bits`` object of ``cfg`` on ``shape`` (each term of :func:`pace_core.accounting.resident_bits`).
    An export records those of the settings it writes (:func:`used_settings`: at dP = 1 the ``c`` of a buffer
    it does not use is the default buffer's), so that a reader recomputes the same."""
    r = resident_bits(cfg, shape)
    return {"payload_bits": r.payload_bits, "metadata_bits": r.metadata_bits, "c": r.c,
            "decode_period": cfg.decode_period, "buffer_bits": r.buffer_bits, "resident_bits": r.resident_bits,
            "paper_c": r.paper_c, "formula_bits": r.formula_bits}


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
        raise PaceError(
            f"the field pace.high_heads covers GDN layers {sorted(by_gdn)}; {allowed} (0..{len(by_gdn) - 1})"
        )
    return tuple(by_gdn[i] for i in range(len(by_gdn)))


def _model(value: Any) -> ModelShape | None:
    """The shape the ``model`` object describes (None for null); PaceError naming the field otherwise."""
    if value is None:
        return None
    allowed = f"allowed: null or an object with exactly {', '.join(_MODEL_KEYS)}"
    if not isinstance(value, dict) or set(value) != set(_MODEL_KEYS):
        raise PaceError(f"the field model is not allowed; {allowed}")
    fingerprint = value["weights_fingerprint"]
    if not isinstance(value["source"], str) or not (fingerprint is None or isinstance(fingerprint, str)):
        raise PaceError(f"the fields model.source and model.weights_fingerprint must be text "
                        f"(the fingerprint may be null); {allowed}")
    layers = value["gdn_layers"]
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) and not isinstance(i, bool)
                                                             for i in layers):
        raise PaceError("the field model.gdn_layers is not allowed; allowed: the list of the model's GDN layers "
                        "(decoder-layer indices)")
    try:
        return ModelShape(name=value["source"], num_layers=value["num_layers"], num_gdn_layers=len(layers),
                          num_k_heads=value["num_k_heads"], num_v_heads=value["num_v_heads"], d_k=value["d_k"],
                          d_v=value["d_v"], weight_params=0, gdn_layers=tuple(layers))
    except PaceError as e:
        raise PaceError(f"the field model describes no valid model: {e}") from None


def _disagree(field: str, have: Any, want: Any) -> PaceError:
    return PaceError(f"the field {field}={have!r} contradicts the file's other sections, which give {want!r}; "
                     "the sections of a PACE configuration must agree: export it again instead of editing one part")


def document_from_export(d: dict) -> ConfigDocument:
    """The configuration of a schema 4 document (settings its method does not read at their defaults),
    with its model, producer and provenance. Malformed documents, and documents whose sections disagree
    (module docstring), raise PaceError naming the field."""
    missing = [k for k in _TOP_KEYS if k not in d]
    unknown = [k for k in d if k not in _TOP_KEYS]
    if missing or unknown:
        raise PaceError(
            f"the document {'lacks ' + ', '.join(missing) if missing else 'has unknown fields ' + ', '.join(unknown)}"
            f"; a PACE configuration has exactly: {', '.join(_TOP_KEYS)}"
        )
    if d["kind"] != EXPORT_KIND:
        raise PaceError(f"the field kind={d['kind']!r} is not allowed; allowed: {EXPORT_KIND!r}")
    for key in ("producer", "provenance"):
        if not isinstance(d[key], dict):
            raise PaceError(f"the field {key} must be an object; got {type(d[key]).__name__}")
    if "evidence" in d["provenance"]:
        check_evidence(d["provenance"]["evidence"])
    shape = _model(d["model"])
    pace = d["pace"]
    if not isinstance(pace, dict):
        raise PaceError(f"the field pace must be an object; got {type(pace).__name__}")
    names = {st.json for st in SETTINGS if st.section == "pace"}
    misplaced = [k for k in pace if k in _SCHEME_FIELDS]
    if misplaced:
        raise PaceError(f"the field pace.{misplaced[0]} is not allowed: it is state_cache_scheme."
                        f"{_SCHEME_FIELDS[misplaced[0]]} (a setting is written once); remove pace.{misplaced[0]}")
    unknown = [k for k in pace if k not in names]
    if unknown:
        raise PaceError(f"the field{'s' if len(unknown) > 1 else ''} {', '.join('pace.' + k for k in unknown)} "
                        f"{'are' if len(unknown) > 1 else 'is'} unknown; allowed: {', '.join(sorted(names))}")
    model = d["model"]
    if pace.get("high_heads") is not None and model is None:
        raise PaceError("the field pace.high_heads is not allowed without the field model: 8-bit heads are chosen "
                        "per decoder layer of one model; export the file with the model they were calibrated on")
    defaults = config_to_dict(PaceConfig())["pace"]
    full = {**defaults, **pace, "high_heads": None}
    if full["calibrated"] is not None:
        full["calibrated"] = Calibrated.from_json(full["calibrated"], "pace.calibrated")
    cfg = config_from_sections(d["state_cache_scheme"], full, high_heads=_high_heads(pace.get("high_heads"), model))
    expected = {SETTING_OF[f].json for f in used_fields(cfg)}
    missing = sorted(expected - set(pace))
    if missing:
        raise PaceError(f"the field pace.{missing[0]} is missing; method {cfg.method!r} reads "
                        f"{', '.join(sorted(expected))}")
    unread = [k for k in pace if k not in expected]
    if unread:
        raise PaceError(f"the field pace.{unread[0]} is not read by these settings (method {cfg.method!r}, dP "
                        f"{cfg.decode_period}, buffer {cfg.buffer}); allowed in pace: {', '.join(sorted(expected))}. "
                        f"Remove it, or change the settings that would read it")
    _check_sections(d, cfg, shape, migrated=d["schema_version"] < PACKING_SINCE)
    return ConfigDocument(cfg, model["source"] if model else None, d["provenance"], model)


def _check_sections(d: dict, cfg: PaceConfig, shape: ModelShape | None, migrated: bool = False) -> None:
    """The state layout and the resident bits a document records are those its settings give on its model,
    and its settings fit that model (group sizes, 8-bit heads: one entry per GDN layer). ``migrated``: a file of a
    schema before :data:`PACKING_SINCE`, whose layout names no packing and whose resident bits may count its codes
    padded (module docstring)."""
    layout = d["state_layout"]
    if not isinstance(layout, dict):
        raise PaceError(f"the field state_layout must be an object; got {type(layout).__name__}")
    want = state_layout(cfg)
    if migrated:
        if "packing" in layout:
            raise PaceError(f"the field state_layout.packing is not allowed in a schema {d['schema_version']} file "
                            f"(it came with schema {PACKING_SINCE}); export the file again")
        layout = {**layout, "packing": want["packing"]}
    for key in _LAYOUT_KEYS:
        if layout.get(key) != want[key]:
            raise _disagree(f"state_layout.{key}", layout.get(key), want[key])
    if shape is None:
        if d["resident_bits"] is not None:
            raise PaceError("the field resident_bits is set but the field model is null: resident bits are counted on "
                            "a model's shape; export the file with the model it is for")
        return
    try:
        cfg.validate_for(shape)
    except PaceError as e:
        raise PaceError(f"the settings do not fit the file's own model ({shape.name!r}): {e}; export it again on "
                        "the model it is for") from None
    recorded, want = d["resident_bits"], _resident_block(cfg, shape)
    if not isinstance(recorded, dict) or set(recorded) != set(want):
        raise PaceError(f"the field resident_bits is not allowed; allowed: an object with exactly "
                        f"{', '.join(want)} (the bits these settings give on the file's model)")
    padding = 0.0
    if migrated and _number(recorded["resident_bits"]):  # the padded codes of an older file, counted as metadata
        padding = max(recorded["resident_bits"] - want["resident_bits"], 0.0)
    for key, value in want.items():
        # written from the same formula; the tolerance only admits another writer's float printing
        have, value = recorded[key], value + (padding if key in ("metadata_bits", "resident_bits") else 0.0)
        if not _number(have) or not math.isclose(have, value, rel_tol=1e-9, abs_tol=1e-12):
            if padding and key in ("metadata_bits", "resident_bits"):
                raise PaceError(f"the field resident_bits.{key}={have!r} of this schema {d['schema_version']} file is "
                                f"neither the bits these settings store now ({want[key]!r}) nor those of its padded "
                                "2-, 3-, 5-, 6- or 7-bit codes (the same padding in metadata_bits and resident_bits); "
                                "export it again instead of editing one part")
            raise _disagree(f"resident_bits.{key}", have, value)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def export_json(cfg: PaceConfig, **kwargs: Any) -> str:
    """JSON text of :func:`export_document` (same arguments), indented."""
    return json.dumps(export_document(cfg, **kwargs), indent=2)


