"""The file a configuration exports to (the Export page's download and the Compare page's one-click export):
the configuration admitted for the model as every configuration is (:func:`pace_core.export.admit`), written by
:func:`pace_core.export.export_json` with the model's reference, shape and weights fingerprint and the app's
provenance, and, for the configuration the Compare page picked, what it was picked on (``provenance.evidence``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import streamlit as st

from app_state import session
from app_state.controls import hide_paths
from pace_core.config import PaceConfig
from pace_core.export import admit, export_filename, export_json
from pace_core.results import config_hash, make_provenance
from pace_core.shapes import ModelShape

PICK_KEY = "compare_pick"
"""Session state: (settings hash, evidence) of the configuration the Compare page picked last."""


def export_file(cfg: PaceConfig, shape: ModelShape | None = None, reference: str | None = None,
                fingerprint: str | None = None,
                calibrate: Callable[[PaceConfig], PaceConfig] | None = None,
                evidence: dict[str, Any] | None = None) -> tuple[PaceConfig, str, str]:
    """(configuration as exported, file name, JSON) of ``cfg`` for the model of ``shape`` (named ``reference``, its
    weights ``fingerprint``; in operator mode a folder of the models folder by its name there, never a server path:
    :func:`app_state.controls.hide_paths`): admitted for it, completed by ``calibrate`` where it needs a calibration
    (PACE-4/8's 8-bit heads, a method's per-layer tensors; PaceError when it cannot be), with ``evidence``, what it
    was picked on, in its provenance. Without a ``shape`` (no model): its settings alone, what a calibration would
    choose on a model left out."""
    provenance = make_provenance(session.model_label(), configs=[cfg], command="PACE Studio export")
    if shape is None:
        cfg = cfg.uncalibrated()
        return cfg, export_filename(cfg), export_json(cfg, provenance=provenance, evidence=evidence)
    cfg = admit(cfg, shape, fingerprint, calibrate=calibrate)
    reference = None if reference is None else hide_paths(reference)
    return cfg, export_filename(cfg), export_json(cfg, shape=shape, source=reference, weights_fingerprint=fingerprint,
                                                  provenance=provenance, evidence=evidence)


def _settings(cfg: PaceConfig) -> str:
    """A configuration's settings without its name and calibration: what the Compare page's pick and the
    sidebar's configuration are matched by."""
    return config_hash(cfg.uncalibrated().replace(name="settings"))


def remember_pick(cfg: PaceConfig, evidence: dict[str, Any]) -> None:
    """Keep what the Compare page picked ``cfg`` on for this session (:func:`picked_evidence`)."""
    st.session_state[PICK_KEY] = (_settings(cfg), dict(evidence))


def picked_evidence(cfg: PaceConfig) -> dict[str, Any] | None:
    """What the Compare page picked a configuration of ``cfg``'s settings on in this session, or None."""
    pick = st.session_state.get(PICK_KEY)
    return pick[1] if pick is not None and pick[0] == _settings(cfg) else None
