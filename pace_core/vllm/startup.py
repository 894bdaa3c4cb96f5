"""Where vLLM builds its configuration (``vllm serve``'s API server process, before any engine starts): the
served PACE configuration is checked there, and published on ``/metrics``.

vLLM gives a model architecture a configuration hook (``MODELS_CONFIG_MAP``: ``verify_and_update_config``,
called while ``VllmConfig`` is built, in the process that builds it); :func:`install` wraps the hooks of
:data:`pace_core.vllm.architectures.ARCHITECTURES` so that :func:`check` runs there, after vLLM's own. A configuration
the plugin refuses (:func:`pace_core.vllm.settings.served`) stops ``vllm serve`` at once with one line,
``PACE: <what to change>``, and exit status 1; an in-process engine (``LLM(...)``) gets the
:class:`~pace_core.errors.PaceError`. The engine's workers check again (a setting vLLM resolves later).

The Prometheus metrics (``/metrics`` of the API server, the process whose registry vLLM serves):

- ``pace_config_info{config, method, bits, high_share, high_bits, decode_period, source}``: 1 for the served
  configuration (``high_bits`` empty without 8-bit heads);
- ``pace_state_bytes_per_sequence``: the PACE state of one sequence over the GDN layers
  (:func:`pace_core.accounting.state_bytes_per_sequence`; vLLM's conv state is beside it);
- ``pace_state_slots``: the sequences whose states the pool holds (vLLM's blocks of the state groups, one
  per sequence without prefix caching), once the engine has allocated them (0 before).
"""

from __future__ import annotations

import sys
from typing import Any

from pace_core import accounting
from pace_core.errors import PaceError
from pace_core.vllm.architectures import ARCHITECTURES
from pace_core.vllm.settings import Served, config_source, served

METRICS: dict[str, Any] = {}
"""The plugin's Prometheus collectors of this process by name (created once: the registry refuses a name twice)."""


def install() -> None:
    """Run :func:`check` from vLLM's configuration hook of each served architecture (once per process)."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    for arch in ARCHITECTURES:
        original = MODELS_CONFIG_MAP.get(arch, VerifyAndUpdateConfig)
        if not getattr(original, "pace_checked", False):
            MODELS_CONFIG_MAP[arch] = _checked(original)


def _checked(original: type) -> type:
    """vLLM's hook class ``original`` with :func:`check` after its own ``verify_and_update_config``."""
    class PaceChecked(original):
        pace_checked = True

        @staticmethod
        def verify_and_update_config(vllm_config: Any) -> None:
            original.verify_and_update_config(vllm_config)
            check(vllm_config)

    PaceChecked.__name__ = PaceChecked.__qualname__ = f"Pace{original.__name__}"
    return PaceChecked


def check(vllm_config: Any) -> None:
    """Refuse what the plugin cannot serve before the engine starts (module docstring) and publish the served
    configuration's metrics; nothing when no configuration is asked for."""
    if config_source(vllm_config.additional_config) is None:
        return
    try:
        s = served(vllm_config)
    except PaceError as err:
        if _vllm_cli():
            raise SystemExit(f"PACE: {err}") from None
        raise
    publish(s, vllm_config)


def _vllm_cli() -> bool:
    """Whether this process is vLLM's command line (``vllm serve ...``), where a refusal ends the process."""
    return "vllm.entrypoints.cli.main" in sys.modules


def publish(s: Served, vllm_config: Any) -> None:
    """Set the metrics (module docstring) to ``s`` served by the engine of ``vllm_config``."""
    from prometheus_client import Gauge

    if not METRICS:
        METRICS["info"] = Gauge("pace_config_info", "The PACE configuration the state pool serves",
                                ["config", "method", "bits", "high_share", "high_bits", "decode_period", "source"])
        METRICS["bytes"] = Gauge("pace_state_bytes_per_sequence",
                                 "Bytes of one sequence's PACE state over the GDN layers")
        METRICS["slots"] = Gauge("pace_state_slots", "Sequences whose PACE states the state pool holds")
    cfg, cache = s.cfg, vllm_config.cache_config
    METRICS["info"].clear()
    METRICS["info"].labels(config=cfg.name, method=cfg.method, bits=str(cfg.bits), high_share=str(cfg.high_share),
                           high_bits=str(cfg.high_bits) if cfg.high_share else "", decode_period=str(cfg.decode_period),
                           source=config_source(vllm_config.additional_config)).set(1)
    METRICS["bytes"].set(accounting.state_bytes_per_sequence(cfg, s.shape))
    METRICS["slots"].set_function(lambda: cache.num_gpu_blocks or 0)
