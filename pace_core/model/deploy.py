"""One call to run a transformers hybrid model with an exported PACE configuration."""

from __future__ import annotations

from torch import nn

from pace_core.config import PaceConfig
from pace_core.errors import PaceError
from pace_core.export import ConfigSource, admit
from pace_core.model.loading import weights_fingerprint
from pace_core.model.patch import apply_pace
from pace_core.shapes import shape_from_hf_config


def apply(model: nn.Module, config: ConfigSource) -> PaceConfig:
    """Store ``model``'s recurrent states as ``config`` says from now on (generate, forward with a cache).

    ``config``: the path of an exported JSON file (:mod:`pace_core.export`), its text, a configuration
    name (``pace-4``) or a PaceConfig, admitted by :func:`pace_core.export.admit` against this model: a
    file made for another model (layer count, GDN layers, head shape, or the recorded weights fingerprint)
    or whose sections disagree is refused with a PaceError saying what differs, as is a configuration that
    still needs calibrating on the model (8-bit heads not chosen, DAMP's outlier rows).
    Returns the configuration applied; ``pace_core.model.patch.remove_pace(model)`` undoes it."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise PaceError(f"model: {type(model).__name__} is not allowed; allowed: a transformers model of a Qwen3.5 / "
                        "Qwen3.6 / Qwen3-Next hybrid (an nn.Module with its config), e.g. "
                        "AutoModelForCausalLM.from_pretrained(...)")
    cfg = admit(config, shape_from_hf_config(model.config), weights_fingerprint(model))
    apply_pace(model, cfg)
    return cfg
