"""vLLM's Qwen hybrid model classes, sizing the state pool's pages for the served PACE state.

vLLM sizes a hybrid model's pages (and the attention block size that matches them) from the model
class's ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config`` before any layer
exists. These subclasses answer with the layout :class:`pace_core.vllm.layer.PaceGatedDeltaNetAttention`
binds (vLLM's conv state and a uint8 row of ``Served.row_bytes``), so a smaller state means smaller pages
and more of them; without a served configuration they answer as vLLM's. vLLM asks for the shape only where it
pads the state pages to whole attention blocks, and the plugin chooses those blocks there too
(:func:`pace_core.vllm.pages.finest_blocks`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
)
from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

from pace_core.vllm.pages import finest_blocks
from pace_core.vllm.settings import served


class PaceStatePages:
    """The page-sizing classmethods for a served PACE configuration (module docstring)."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: Any) -> tuple[tuple[int, ...], ...]:
        """vLLM's conv state shape and, when serving PACE, the pool row (else vLLM's state shape); when serving
        PACE, the attention blocks the pages are padded to become the finest the backends take."""
        shapes = super().get_mamba_state_shape_from_config(vllm_config)
        s = served(vllm_config)
        if s is None:
            return shapes
        finest_blocks(vllm_config)
        return shapes[0], (s.row_bytes,)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: Any) -> tuple[torch.dtype, ...]:
        """vLLM's conv state dtype and, when serving PACE, uint8 (else vLLM's state dtype)."""
        dtypes = super().get_mamba_state_dtype_from_config(vllm_config)
        return dtypes if served(vllm_config) is None else (dtypes[0], torch.uint8)


class PaceQwen3_5ForCausalLM(PaceStatePages, Qwen3_5ForCausalLM):
    pass


class PaceQwen3_5MoeForCausalLM(PaceStatePages, Qwen3_5MoeForCausalLM):
    pass


class PaceQwen3_5ForConditionalGeneration(PaceStatePages, Qwen3_5ForConditionalGeneration):
    pass


class PaceQwen3_5MoeForConditionalGeneration(PaceStatePages, Qwen3_5MoeForConditionalGeneration):
    pass


class PaceQwen3NextForCausalLM(PaceStatePages, Qwen3NextForCausalLM):
    pass

