"""PACE inside transformers' Qwen hybrid models: loading, patching the GDN layers, state capture.

The names below are imported on first use (PEP 562), so importing ``pace_core.model`` (the CLI, the embedded
model's path) does not import transformers.
"""

import importlib
from pathlib import Path

DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parents[2] / "data" / "models" / "pace-tiny-qwen35"
"""The embedded model, used when no source is given (here, so naming it imports no model code)."""

_EXPORTS: dict[str, str] = {
    "LoadedModel": "loading",
    "load_config": "loading",
    "load_model": "loading",
    "apply_pace": "patch",
    "current_config": "patch",
    "get_state_store": "patch",
    "pace": "patch",
    "remove_pace": "patch",
    "RunResult": "capture",
    "run_with_states": "capture",
}

__all__ = sorted([*_EXPORTS, "DEFAULT_MODEL_DIR"])


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pace_core.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pace_core.model.{_EXPORTS[name]}"), name)
