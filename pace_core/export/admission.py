"""The one way a configuration enters a run (:func:`admit`), whichever way it arrives (a name, a file, JSON text, a
parsed object, a PaceConfig): read (:func:`read_config`: a complete record, :mod:`pace_core.export.record`, or a
deployable export, :mod:`pace_core.export.document`; every field, and the sections against each other), checked
against the model it is to run on (:func:`check_model`), and completed by a calibration on that model or refused when
it needs one."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pace_core.config import NAMED_CONFIGS, PaceConfig, is_int
from pace_core.errors import PaceError
from pace_core.export.document import document_from_export
from pace_core.export.record import (
    READ_SCHEMA_VERSION,
    SCHEMA_VERSION,
    ConfigDocument,
    parse_json,
    record_from_dict,
)
from pace_core.methods import method_of
from pace_core.names import check_name
from pace_core.shapes import ModelShape


def document_from_dict(d: Any) -> ConfigDocument:
    """A configuration document: a complete record (:func:`pace_core.export.record.config_to_dict`, schema 1..3, 5,
    6) or a deployable export (schema 4 to 7 with ``kind``, :func:`pace_core.export.document.export_document`).

    Malformed documents raise PaceError naming the field and what is allowed; a document of a newer
    schema version is rejected (written by a newer PACE Studio)."""
    newest = READ_SCHEMA_VERSION
    if not isinstance(d, dict):
        raise PaceError(f"config JSON must be an object; got {type(d).__name__}")
    if "schema_version" not in d:
        raise PaceError(f"config JSON field schema_version is missing; allowed: 1..{newest}")
    version = d["schema_version"]
    if not is_int(version) or version < 1:
        raise PaceError(f"config JSON field schema_version={version!r} is not allowed; allowed: 1..{newest}")
    if version > newest:
        raise PaceError(f"config JSON field schema_version={version} is newer than this PACE Studio "
                        f"understands; allowed: 1..{newest} (update pace-studio)")
    if version == 4 or (version >= 5 and "kind" in d):
        return document_from_export(d)
    if version > SCHEMA_VERSION:
        raise PaceError(f"config JSON field schema_version={version} without a kind is newer than this PACE Studio's "
                        f"complete record (schema {SCHEMA_VERSION}); allowed: 1..{SCHEMA_VERSION}, or an export "
                        f"(kind 'pace-state-config') up to {newest}")
    return record_from_dict(d, version)


def config_from_dict(d: Any) -> PaceConfig:
    """The PaceConfig of a configuration document (:func:`document_from_dict`)."""
    return document_from_dict(d).config


def document_from_json(s: str) -> ConfigDocument:
    """Parse config JSON text (any schema :func:`document_from_dict` reads)."""
    return document_from_dict(parse_json(s))


def config_from_json(s: str) -> PaceConfig:
    """The PaceConfig of JSON text; malformed JSON raises PaceError with the line and column."""
    return document_from_json(s).config


ConfigSource = str | os.PathLike | dict | PaceConfig | ConfigDocument
"""Whatever a configuration arrives as: see :func:`read_config`."""


def read_config(config: ConfigSource) -> ConfigDocument:
    """The configuration document named by ``config``: a configuration name (``pace-4``, any case), the path
    of a JSON file (an export or a complete record), JSON text, a parsed JSON object, a PaceConfig or a
    document already read. Every field is checked, and the sections against each other (PaceError naming
    the field and what to do); the name of a document read here follows :data:`pace_core.names.NAME_RULE`."""
    if isinstance(config, ConfigDocument):
        return config
    if isinstance(config, PaceConfig):
        return ConfigDocument(config, None, {})
    if isinstance(config, dict):
        return _named(document_from_dict(config))
    if not isinstance(config, (str, os.PathLike)):
        raise PaceError(f"config: {type(config).__name__} is not allowed; allowed: a configuration name, the path "
                        "of a JSON file, JSON text or a PaceConfig")
    text = str(config).strip()
    if text.lower() in NAMED_CONFIGS:
        return ConfigDocument(NAMED_CONFIGS[text.lower()], None, {})
    if text.startswith("{"):
        return _named(document_from_json(text))
    path = Path(text).expanduser()
    if path.suffix.lower() != ".json" and not path.is_file():
        raise PaceError(f"config {text!r} is unknown; allowed: {', '.join(NAMED_CONFIGS)} or the path of a config "
                        "JSON file")
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PaceError(f"config {text!r} cannot be read ({e}); allowed: {', '.join(NAMED_CONFIGS)} or the path of "
                        "a JSON file written by the Export page or `python -m pace_core export`") from None
    return _named(document_from_json(content))


def _named(doc: ConfigDocument) -> ConfigDocument:
    """``doc``, read from outside, once its configuration's name follows the rule
    (:func:`pace_core.names.check_name`)."""
    check_name(doc.config.name)
    return doc


Calibrate = Callable[[PaceConfig], PaceConfig]
"""Completes a configuration on the model it is to run on: its 8-bit heads chosen (DAMP's outlier rows are
kept by the caller, which runs them beside the configuration)."""
ReadyFor = Literal["run", "settings"]
"""What an admitted configuration must be complete for: ``run`` (everything chosen on the model: 8-bit heads,
a method's calibrated tensors such as DAMP's outlier rows; a run, an export) or ``settings`` (nothing
calibrated: the app's sidebar and import, which calibrate when a view runs, and ``bits``, which counts the
share)."""


def admit(config: ConfigSource, shape: ModelShape | None = None, weights_fingerprint: str | None = None, *,
          calibrate: Calibrate | None = None, ready_for: ReadyFor = "run") -> PaceConfig:
    """The one admission of a configuration, whichever way it arrives (:data:`ConfigSource`): returns it
    ready to run on the model of ``shape`` and ``weights_fingerprint``, or raises PaceError in the user's
    words naming the field and what to do.

    1. Read (:func:`read_config`): every field, and the sections against each other.
    2. When ``shape`` is given, the model (:func:`check_model`): a file made for another model (layer
       count, GDN layers, head shape, and the weights fingerprint when both are known) is refused, and the
       settings must fit the model (group sizes, DAMP's rows, 8-bit heads).
    3. Complete for ``ready_for``: a configuration that needs a calibration on the model for it (8-bit
       heads not chosen, a method's tensors not calibrated) goes through ``calibrate``, or is refused without
       one."""
    if ready_for not in ("run", "settings"):
        raise PaceError(f"ready_for={ready_for!r} is not allowed; allowed: 'run', 'settings'")
    doc = read_config(config)
    if shape is not None:
        check_model(doc, shape, weights_fingerprint)
    cfg = doc.config
    if ready_for == "run" and cfg.needs_calibration:
        if calibrate is None:
            raise PaceError(_uncalibrated(cfg))
        cfg = calibrate(cfg)
        if shape is not None:
            cfg.validate_for(shape)
    return cfg


def _uncalibrated(cfg: PaceConfig) -> str:
    method = method_of(cfg)
    calibration = method.calibration(cfg)
    if calibration is not None and cfg.calibrated is None:
        what = "; ".join(calibration.tensors.values())
        return (f"configuration {cfg.name!r} ({method.label}) needs what is calibrated on the model ({what}): "
                f"export it on this model (Export page, or `python -m pace_core export --config {cfg.name}`), which "
                "calibrates it, and use the exported file")
    return (f"configuration {cfg.name!r} keeps {cfg.high_share:.0%} of the heads at {cfg.high_bits} bits but does not "
            "say which: export it on this model (Export page, or `python -m pace_core export --config "
            f"{cfg.name}`), which calibrates them, and use the exported file")


def check_model(doc: ConfigDocument, shape: ModelShape, weights_fingerprint: str | None = None) -> None:
    """Refuse to apply ``doc`` to a model it was not made for: its layer count, GDN layers (where the shape
    knows them) or head shape differ, or (when both are known) its weights fingerprint; and settings that do
    not fit the model (:meth:`PaceConfig.validate_for`). PaceError naming what differs."""
    model = doc.model_info
    if model is not None:
        have = {
            "num_layers": shape.num_layers,
            "gdn_layers": None if shape.gdn_layers is None else list(shape.gdn_layers),
            "num_k_heads": shape.num_k_heads,
            "num_v_heads": shape.num_v_heads,
            "d_k": shape.d_k,
            "d_v": shape.d_v,
        }
        wrong = [f"{k} {model[k]} in the file, {v} in the model" for k, v in have.items()
                 if v is not None and model[k] != v]
        if wrong:
            raise PaceError(f"this configuration was made for {model['source']!r} and does not fit this model: "
                            + "; ".join(wrong) + ". Export it again on this model.")
        if weights_fingerprint and model["weights_fingerprint"] and weights_fingerprint != model["weights_fingerprint"]:
            raise PaceError(f"this configuration was calibrated on other weights than the model's (fingerprint "
                            f"{model['weights_fingerprint']} in the file, {weights_fingerprint} here); export it "
                            "again on these weights")
    doc.config.validate_for(shape)
