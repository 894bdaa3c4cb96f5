"""The named configurations of PACE_SPEC §6, each declared by its method (:attr:`pace_core.methods.Method.named`),
and their tags (:attr:`pace_core.methods.Method.tags`): every list of configurations the study, the CLI, the app and
the serving checks take is the configurations of a tag (:func:`tagged`), in the registry's order."""

from __future__ import annotations

from pace_core.config.fields import PaceConfig
from pace_core.errors import PaceError
from pace_core.methods import METHODS as _METHODS

NAMED_CONFIGS: dict[str, PaceConfig] = {
    name: PaceConfig.make(name=name, method=method.name, **values)
    for method in _METHODS.values() for name, values in method.named.items()}
"""The named configurations of PACE_SPEC §6, each declared by its method (:mod:`pace_core.methods`); starting
points: every field can be changed."""


TAGS: dict[str, str] = {
    "cli-default": "the CLI's default --configs (drift, perplexity, generate, structure, bits)",
    "all": "python -m pace_core all: each method's main configurations",
    "paper-table": "the baselines of the PACE paper's main table (claims)",
    "equal-bits-rival": "claim (e)'s rival of PACE-4 at equal resident bits (claims)",
    "memory-page": "the Memory page's default comparison",
    "dp-curve": "the Memory page's resident bits against dP",
    "capacity-baseline": "what the Memory and Export pages count a configuration's sequences per GPU against",
    "pool": "served from a vLLM pool by the serving benchmark (pace_core.vllm.bench)",
    "serve-check": "checked against vLLM's own state by pace_core.vllm.check",
}
"""Every tag a named configuration may carry, and what takes the configurations of it."""
TAGGED: dict[str, tuple[str, ...]] = {name: method.tags.get(name, ()) for method in _METHODS.values()
                                      for name in method.named}
"""Each named configuration's tags, in the order of :data:`NAMED_CONFIGS`."""
_unknown = sorted({t for tags in TAGGED.values() for t in tags} - set(TAGS))
if _unknown:
    raise PaceError(f"tags {_unknown} are unknown; allowed: {', '.join(TAGS)}")


def tagged(tag: str) -> tuple[str, ...]:
    """The named configurations tagged ``tag`` (:data:`TAGS`), in the order of :data:`NAMED_CONFIGS`."""
    if tag not in TAGS:
        raise PaceError(f"tag {tag!r} is unknown; allowed: {', '.join(TAGS)}")
    return tuple(name for name, tags in TAGGED.items() if tag in tags)


def get_config(name: str) -> PaceConfig:
    """The named configuration `name` (case-insensitive); unknown names raise PaceError listing them."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in NAMED_CONFIGS:
        raise PaceError(f"config {name!r} is unknown; allowed: {', '.join(NAMED_CONFIGS)}")
    return NAMED_CONFIGS[key]

