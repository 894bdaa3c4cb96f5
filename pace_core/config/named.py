"""The named configurations of PACE_SPEC §6, each declared by its method (:attr:`pace_core.methods.Method.named`)."""

from __future__ import annotations

from pace_core.config.fields import PaceConfig
from pace_core.errors import PaceError
from pace_core.methods import METHODS as _METHODS

NAMED_CONFIGS: dict[str, PaceConfig] = {
    name: PaceConfig.make(name=name, method=method.name, **values)
    for method in _METHODS.values() for name, values in method.named.items()}
"""The named configurations of PACE_SPEC §6, each declared by its method (:mod:`pace_core.methods`); starting
points: every field can be changed."""


def get_config(name: str) -> PaceConfig:
    """The named configuration `name` (case-insensitive); unknown names raise PaceError listing them."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in NAMED_CONFIGS:
        raise PaceError(f"config {name!r} is unknown; allowed: {', '.join(NAMED_CONFIGS)}")
    return NAMED_CONFIGS[key]

