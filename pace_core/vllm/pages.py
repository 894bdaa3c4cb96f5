"""How vLLM 0.32 sizes a hybrid model's state pages, and the attention block size the plugin asks for.

vLLM keeps one page per sequence and layer for the GDN state (conv state + recurrent state) and one
per block of tokens for attention, from one pool, so both pages must be equal
(``Platform._align_hybrid_block_size``): the attention block becomes the smallest multiple of
``align = max(smallest kernel block of the attention backends, cache_config.block_size)`` tokens whose page
holds the state, and the state page is padded up to it ("Padding mamba page size by ..."). A state page
therefore comes in steps of ``align`` tokens of attention (:func:`padded_page`). vLLM's CPU platform sets
``block_size`` to 128 tokens while its attention kernels take multiples of 32; on the embedded model (1 KiB
of attention per token and layer) that is a step of 128 KiB, which pads a PACE page of 47-62 KB to 128 KiB
and vLLM's own 262 KB to 384 KiB (3x, whatever the PACE row). :func:`finest_blocks` lowers ``block_size`` to
the backends' smallest kernel block when the user has not chosen one (``--block-size``), so the PACE page is
padded in steps of 32 KiB there.
"""

from __future__ import annotations

import math
from typing import Any

from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, which has the handlers


def padded_page(state_bytes: int, token_bytes: int, align_tokens: int) -> int:
    """The page vLLM gives a state of ``state_bytes``: whole steps of ``align_tokens`` tokens of attention at
    ``token_bytes`` per token (module docstring)."""
    step = align_tokens * token_bytes
    return step * math.ceil(state_bytes / step)


def smallest_kernel_block(vllm_config: Any) -> int:
    """The smallest attention block (tokens) every attention backend of the model takes (the least common
    multiple of their smallest kernel blocks, as vLLM aligns them)."""
    from vllm.config.vllm import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backend import MultipleOf

    sizes = []
    with set_current_vllm_config(vllm_config):
        for layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase).values():
            backend = layer.get_attn_backend()
            if not backend.is_ssm():
                sizes.append(min(s.base if isinstance(s, MultipleOf) else s
                                 for s in backend.get_supported_kernel_block_sizes()))
    return math.lcm(*sizes)


def finest_blocks(vllm_config: Any) -> None:
    """Lower the attention block size to :func:`smallest_kernel_block` unless the user chose one, before vLLM
    pads the state pages to whole blocks (module docstring)."""
    cache = vllm_config.cache_config
    finest = smallest_kernel_block(vllm_config)
    if cache.user_specified_block_size or cache.block_size <= finest:
        return
    logger.info("PACE: attention blocks in steps of %d tokens (vLLM chose %d): vLLM pads each state page to whole "
                "attention blocks, and finer blocks pad the smaller PACE page less; --block-size chooses them",
                finest, cache.block_size)
    cache.block_size = finest
