"""One call to run a transformers hybrid model with an exported PACE configuration."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from pace_core.config import NAMED_CONFIGS, ConfigDocument, PaceConfig, document_from_json
from pace_core.errors import PaceError
from pace_core.export import check_model
from pace_core.model.loading import weights_fingerprint
from pace_core.model.patch import apply_pace
from pace_core.shapes import shape_from_hf_config


def load_document(config: str | os.PathLike | PaceConfig) -> ConfigDocument:
    """The configuration document named by ``config``: the path of an exported JSON file, its text, a
    configuration name or a PaceConfig (PaceError naming the problem for anything else)."""
    if isinstance(config, PaceConfig):
        return ConfigDocument(config, None, {}, {})
    if not isinstance(config, (str, os.PathLike)):
        raise PaceError(f"config: {type(config).__name__} is not allowed; allowed: the path of an exported JSON "
                        "file, JSON text, a configuration name or a PaceConfig")
    text = str(config).strip()
    if text.lower() in NAMED_CONFIGS:
        return ConfigDocument(NAMED_CONFIGS[text.lower()], None, {}, {})
    if text.startswith("{"):
        return document_from_json(text)
    path = Path(text).expanduser()
    try:
        return document_from_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise PaceError(f"the configuration file {text!r} cannot be read ({e}); pass the path of a JSON file "
                        f"written by the Export page or `python -m pace_core export`, or one of "
                        f"{', '.join(NAMED_CONFIGS)}") from None


def require_heads(cfg: PaceConfig) -> None:
    """PaceError when ``cfg`` keeps heads at its high width without saying which (not yet calibrated)."""
    if cfg.high_share > 0 and cfg.high_heads is None:
        raise PaceError(f"configuration {cfg.name!r} keeps {cfg.high_share:.0%} of the heads at {cfg.high_bits} bits "
                        "but does not say which: export it on this model (Export page, or `python -m pace_core "
                        f"export --config {cfg.name}`), which calibrates them, and use the exported file")


def apply(model: nn.Module, config: str | os.PathLike | PaceConfig) -> PaceConfig:
    """Store ``model``'s recurrent states as ``config`` says from now on (generate, forward with a cache).

    ``config``: the path of an exported JSON file (:mod:`pace_core.export`), its text, a configuration
    name (``pace-4``) or a PaceConfig. A file made for another model (layer count, GDN layers, head
    shape, or the recorded weights fingerprint) is refused with a PaceError saying what differs, as is a
    configuration that still needs calibrating on the model (8-bit heads not chosen, DAMP's outlier rows).
    Returns the configuration applied; ``pace_core.model.patch.remove_pace(model)`` undoes it."""
    doc = load_document(config)
    cfg = doc.config
    shape = shape_from_hf_config(model.config)
    recorded = doc.model_info["weights_fingerprint"] if doc.model_info else None
    check_model(doc, shape, weights_fingerprint(model) if recorded else None)
    require_heads(cfg)
    if cfg.method == "damp":
        raise PaceError("DAMP needs its outlier rows calibrated on the model; use "
                        "pace_core.model.patch.apply_pace(model, cfg, damp_rows=...) with "
                        "pace_core.analysis.calibration's rows")
    apply_pace(model, cfg)
    return cfg
