"""Which PACE configuration a vLLM engine serves, checked once against the engine's model and settings.

The configuration comes from ``additional_config={"pace_config": ...}`` (``vllm serve ...
--additional-config '{"pace_config": "my-config.json"}'``) or, when that is absent, the environment
variable ``PACE_CONFIG``: the path of an exported JSON file, its text, or a configuration name. Without
either, the plugin changes nothing.

Refused at start-up with a :class:`~pace_core.errors.PaceError` saying what to change: whatever
:func:`pace_core.export.admit` refuses against the engine's model (a file made for another model: layer
count, GDN layers, head shape; sections that disagree; PACE-4/8 without chosen heads), a state a pool row
cannot hold (:func:`pace_core.vllm.slots.pool_refusal`), and engine settings the state pool does not follow
yet (CUDA graphs, prefix caching, speculative decoding, KV transfer, a tensor parallel size that does not divide
the key heads). torch.compile is served (the state step is one custom operator), and tensor parallelism (each
rank's pool holds its own heads). A chunked prefill is served, with a rounding at the end of each part of a
prompt (logged at start-up).
"""

from __future__ import annotations

import functools
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pace_core.config import NAMED_CONFIGS, PaceConfig
from pace_core.errors import PaceError
from pace_core.export import admit
from pace_core.shapes import ModelShape, shape_from_hf_config
from pace_core.vllm.slots import SlotLayout, pool_refusal

CONFIG_ENV = "PACE_CONFIG"
CONFIG_KEY = "pace_config"


@dataclass(frozen=True)
class Served:
    """The configuration an engine serves: ``cfg`` for the model of ``shape`` at tensor parallel size ``tp``, one
    :class:`SlotLayout` per GDN layer and rank ((model layer index, rank) -> the layout of the rank's heads) and
    the bytes of a pool row (the largest layout: vLLM's pages are one size on every rank)."""

    cfg: PaceConfig
    shape: ModelShape
    tp: int
    layouts: dict[tuple[int, int], SlotLayout]

    @property
    def row_bytes(self) -> int:
        return max(layout.nbytes for layout in self.layouts.values())


def serve_command(model: str, config_file: str | None) -> str:
    """The ``vllm serve`` command line that serves ``model`` with the exported ``config_file`` (None: the same
    engine settings with vLLM's own state, as benchmarks compare)."""
    line = f"vllm serve {shlex.quote(model)} --enforce-eager --no-enable-prefix-caching"
    return (
        line
        if config_file is None
        else f"{line} --additional-config {shlex.quote(json.dumps({CONFIG_KEY: config_file}))}"
    )


def config_source(additional_config: Any) -> str | None:
    """The configuration named by vLLM's ``additional_config`` or ``$PACE_CONFIG`` (None: not asked for)."""
    if isinstance(additional_config, dict) and additional_config.get(CONFIG_KEY):
        return str(additional_config[CONFIG_KEY])
    return os.environ.get(CONFIG_ENV) or None


def _refuse_settings(vllm_config: Any) -> None:
    cache, parallel = vllm_config.cache_config, vllm_config.parallel_config
    if cache.enable_prefix_caching or cache.mamba_cache_mode != "none":
        raise PaceError("PACE states are not prefix-cached: start vLLM with --no-enable-prefix-caching "
                        "(LLM(..., enable_prefix_caching=False))")
    if _graphs_captured(vllm_config):
        raise PaceError("PACE states are not stepped inside CUDA graphs yet (the pool gathers each step's rows by "
                        "their buffered-record count on the host); torch.compile is served (the step is one custom "
                        "operator): start vLLM with --enforce-eager, or -cc.cudagraph_mode=NONE to keep compiling")
    if vllm_config.speculative_config is not None:
        raise PaceError("PACE states do not follow speculative decoding yet: start vLLM without "
                        "--speculative-config")
    if vllm_config.kv_transfer_config is not None:
        raise PaceError("PACE states do not travel through vLLM's KV connectors (their state layout is vLLM's, "
                        "and each row's buffered-record count stays beside the pool): start vLLM without "
                        "--kv-transfer-config")
    tp, hf = parallel.tensor_parallel_size, vllm_config.model_config.hf_config
    shape = shape_from_hf_config(json.loads(hf.to_json_string(use_diff=False)))
    if shape.num_k_heads % tp:
        raise PaceError(f"tensor parallel size {tp} does not divide the model's {shape.num_k_heads} key heads, "
                        "which each rank's share of the PACE state follows; allowed: a divisor of it")


def _graphs_captured(vllm_config: Any) -> bool:
    """Whether the engine captures its forwards in CUDA graphs (never on a CPU)."""
    if vllm_config.model_config.enforce_eager:
        return False
    mode = vllm_config.compilation_config.cudagraph_mode  # vllm.config.CUDAGraphMode, compared by name
    return mode is not None and getattr(mode, "name", str(mode)) != "NONE"


def _refuse_unknown(source: str) -> None:
    """Refuse a configuration that is no name, JSON text or file, or a name a pool row cannot hold (before
    asking for its calibration), offering only what a pool row holds."""
    text = source.strip()
    if text.lower() in NAMED_CONFIGS:
        refused = pool_refusal(NAMED_CONFIGS[text.lower()])
        if refused:
            raise PaceError(refused)
        return
    if text.startswith("{") or Path(text).expanduser().is_file():
        return
    names = [name for name, cfg in NAMED_CONFIGS.items() if pool_refusal(cfg) is None]
    raise PaceError(f"the PACE configuration {text!r} is neither a file nor a configuration name; allowed: the path "
                    "of a JSON file written by the Export page or `python -m pace_core export`, or one of "
                    f"{', '.join(names)}")


@functools.lru_cache(maxsize=8)
def served_for(source: str, hf_config_json: str, tp: int = 1) -> Served:
    """The configuration ``source`` (a name, JSON text or an exported file) admitted for the model of
    ``hf_config_json`` (its ``config.json`` text) at tensor parallel size ``tp``: what an engine with those settings
    serves."""
    shape = shape_from_hf_config(json.loads(hf_config_json))
    cfg = admit(source, shape)  # no weights fingerprint here: the engine has not loaded them yet
    layouts = {(layer, rank): SlotLayout(cfg, shape.num_k_heads // tp, shape.num_v_heads // tp, shape.d_k, shape.d_v,
                                         i, (rank, tp))
               for i, layer in enumerate(shape.gdn_layers) for rank in range(tp)}
    return Served(cfg, shape, tp, layouts)


def served(vllm_config: Any) -> Served | None:
    """The configuration ``vllm_config``'s engine serves (None when none is asked for), checked against
    its model and settings (module docstring); the same object for the same engine."""
    source = config_source(vllm_config.additional_config)
    if source is None:
        return None
    _refuse_unknown(source)
    _refuse_settings(vllm_config)
    hf = vllm_config.model_config.hf_config
    return served_for(source, hf.to_json_string(use_diff=False), vllm_config.parallel_config.tensor_parallel_size)
