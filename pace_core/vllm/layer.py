"""vLLM's Qwen Gated DeltaNet layer with its recurrent state in PACE form (registered out of tree under
vLLM's own layer name, so every Qwen3.5 / Qwen3.6 / Qwen3-Next model builds this one).

Without a served configuration (:func:`pace_core.vllm.settings.served`) the layer is vLLM's, unchanged.
With one, its state pool holds, per sequence, vLLM's conv state and a row of bytes with the PACE state
(:class:`pace_core.vllm.slots.SlotLayout`), and its forward is vLLM's projections, vLLM's causal conv
(the CPU or the Triton one, by platform), then the state step of :class:`pace_core.pool.StatePool` over the pages:
the same q, k, v, g, beta and the same schedule and arithmetic as the transformers path
(:mod:`pace_core.model.patch`): on a CPU vLLM's own CPU conv (its C++ one where vLLM uses it) and the pool's fused CPU
step (:mod:`pace_core.pool_cpu`: the projections in, every decode row or every prompt of the batch in one operator),
the project's Triton kernels for CUDA tensors (:mod:`pace_core.backend`).

The state step is one custom operator, ``torch.ops.vllm.pace_gdn_state`` (as vLLM's own GDN core is), which
reads vLLM's forward context for the batch's metadata: torch.compile keeps it an opaque node of the compiled
graph (``vllm serve`` without ``--enforce-eager``); CUDA graphs are refused (the pool gathers a step's rows by
their record count on the host). Under tensor parallelism each rank's pool holds its own heads
(:class:`pace_core.vllm.slots.SlotLayout`'s ``tp``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.platforms import current_platform
from vllm.utils.torch_utils import LayerNameType, _encode_layer_name, _resolve_layer_name, direct_register_custom_op
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from pace_core import accounting
from pace_core.errors import PaceError
from pace_core.memory import keep_freed_memory
from pace_core.pool import StatePool
from pace_core.vllm.architectures import ARCHITECTURES
from pace_core.vllm.pages import padded_page, smallest_kernel_block
from pace_core.vllm.settings import served

if current_platform.is_cpu():
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu as conv_prefill
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu as conv_decode
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _causal_conv1d_fwd_cpu as cpp_conv_prefill
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _causal_conv1d_update_cpu as cpp_conv_decode
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import is_arm_bf16
else:
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn as conv_prefill
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update as conv_decode

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, which has the handlers


class PaceGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
    """``QwenGatedDeltaNetAttention`` whose state is stored as the served PACE configuration says."""

    def __init__(self, config: Any, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(config, vllm_config, prefix, **kwargs)
        self.served = served(vllm_config)
        self.pool: StatePool | None = None
        if self.served is not None:
            architecture = vllm_config.model_config.architecture
            if architecture not in ARCHITECTURES:
                raise PaceError(f"PACE states are served for {', '.join(ARCHITECTURES)}; this model is "
                                f"{architecture}: serve it without a PACE configuration")
            self.layout = self.served.layouts[(self.layer_idx, get_tensor_model_parallel_rank())]
            self.vllm_config = vllm_config
            self.vllm_block_size = vllm_config.cache_config.block_size
            """The attention block size before the plugin chose finer ones (pace_core.vllm.pages): vLLM's own."""
            self.chunked_prefill = bool(vllm_config.scheduler_config.enable_chunked_prefill)
            self.kept_freed_memory = current_platform.is_cpu() and keep_freed_memory()
            self._forward_method = self._forward_pace

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        """vLLM's conv state shape and, when serving PACE, a row of ``row_bytes`` (else vLLM's state)."""
        shapes = super().get_state_shape()
        s = getattr(self, "served", None)
        return shapes if s is None else (shapes[0], (s.row_bytes,))

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        """vLLM's conv state dtype and, when serving PACE, uint8 (else vLLM's state dtype)."""
        dtypes = super().get_state_dtype()
        return dtypes if getattr(self, "served", None) is None else (dtypes[0], torch.uint8)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        super().bind_kv_cache(kv_cache)
        if self.served is None:
            return
        self.pool = self.layout.pool(self.kv_cache[1], name=f"state of GDN layer {self.layer_idx}")
        step = self.pool.step  # the fused CPU step is built (once per process) here, before any request
        if self.layer_idx == self.served.shape.gdn_layers[0]:
            self._log_pool(kv_cache)
            logger.info("PACE: the state pool steps on the %s", step)

    def _log_pool(self, kv_cache: torch.Tensor) -> None:
        """Say at start-up how many sequences' states the pool holds, and how many vLLM's own state would in the
        same memory, both after vLLM pads the pages to whole attention blocks (:mod:`pace_core.vllm.pages`)."""
        cfg, shape, row = self.served.cfg, self.served.shape, self.served.row_bytes
        base_shapes, base_dtypes = super().get_state_shape(), super().get_state_dtype()
        conv = self.kv_cache[0][0].numel() * self.kv_cache[0].element_size()
        base = conv + math.prod(base_shapes[1]) * base_dtypes[1].itemsize
        slots, page = kv_cache.shape[0], kv_cache.stride(0) * kv_cache.element_size()  # padded: vLLM's stride
        block = self.vllm_config.cache_config.block_size
        token_bytes, finest = page // block, smallest_kernel_block(self.vllm_config)
        own = padded_page(base, token_bytes, max(finest, self.vllm_block_size))
        own_finest = padded_page(base, token_bytes, finest)
        logger.info(
            "PACE %s: %d state slots per GDN layer, in pages of %d bytes (conv state %d + a PACE row of %d bytes, "
            "the largest GDN layer's, padded to an attention block of %d tokens; pace_core.accounting: %d bytes "
            "per sequence over the %d GDN layers). vLLM's own %s state (%d bytes) in the same memory: %d slots "
            "in pages of %d bytes (%.2fx as many with PACE), %d at attention blocks in steps of %d tokens "
            "(--block-size %d: %.2fx)",
            cfg.name, slots, page, conv, row, block, accounting.state_bytes_per_sequence(cfg, shape),
            shape.num_gdn_layers, base_dtypes[1], base, slots * page // own, own, own / page,
            slots * page // own_finest, finest, finest, own_finest / page)
        if self.kept_freed_memory:
            logger.info("PACE: glibc malloc keeps freed memory for the next step (pace_core.memory.keep_freed_memory)")
        if self.chunked_prefill:
            logger.warning(
                "PACE: chunked prefill is on: a prompt that vLLM splits into parts is rounded at the end of "
                "each part, and a part of one token goes through the decode path, as when the transformers "
                "path gets a prompt in several calls; --no-enable-chunked-prefill keeps prompts whole")

    def _forward_pace(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """vLLM's projections and output, the PACE core between them: ``hidden_states [T, D]``."""
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        mixed_ba, _ = self.in_proj_ba(hidden_states)
        n = hidden_states.shape[0]
        if current_platform.is_cpu() and not self.gqa_interleaved_layout:
            mixed_qkv, z, b, a = self._split_projections(mixed_qkvz, mixed_ba)
        else:
            mixed_qkv, z, b, a = self.prepare_gdn_attention_core_inputs(mixed_qkvz, mixed_ba, n)
        out = torch.zeros(n, self.num_v_heads // self.tp_size, self.head_v_dim, dtype=hidden_states.dtype,
                          device=hidden_states.device)
        torch.ops.vllm.pace_gdn_state(mixed_qkv, b, a, out, _encode_layer_name(self.prefix))
        return self._output_projection(out, z)

    def _split_projections(self, mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Qwen3.5's ``[q, k, v, z]`` and ``[b, a]`` projections as ``mixed_qkv [T, 2 key + value]``, ``z [T, HV, V]``,
        ``b, a [T, HV]`` views, in eager mode as vLLM's own CPU forward takes them: its
        ``prepare_gdn_attention_core_inputs`` is a ``torch.compile`` region whose guards and call cost about 80 us per
        layer and step on a CPU, some 7 % of a decode step of the embedded model at 8 sequences."""
        qkv = (self.key_dim * 2 + self.value_dim) // self.tp_size
        mixed_qkv, z = mixed_qkvz.split([qkv, self.value_dim // self.tp_size], dim=-1)
        b, a = mixed_ba.chunk(2, dim=-1)
        return mixed_qkv, z.reshape(z.size(0), -1, self.head_v_dim), b, a

    def _conv_weight(self) -> torch.Tensor:
        """The conv weight ``[dim, width]`` (vLLM packs it in place on some CPUs and keeps this copy)."""
        unpacked = getattr(self.conv1d, "_cpu_unpacked_conv_weight", None)
        if unpacked is not None:
            return unpacked
        w = self.conv1d.weight
        return w.view(w.size(0), w.size(2))

    def _cpp_conv(self) -> bool:
        """Whether vLLM's CPU path convolves with its C++ operator and packed weights (as its own layer does:
        ``vllm.model_executor.layers.mamba.ops.cpu.gdn_attention``)."""
        return current_platform.is_cpu() and (torch.cpu._is_avx512_bf16_supported() or is_arm_bf16())

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output ``x [T, conv_dim]`` as views ``q, k [T, H, K]``, ``v [T, HV, V]`` (vLLM's
        ``rearrange_mixed_qkv`` without its copy: the pool's step reads strided rows)."""
        key, value = self.key_dim // self.tp_size, self.value_dim // self.tp_size
        q, k, v = x.split([key, key, value], dim=-1)
        return (q.unflatten(-1, (-1, self.head_k_dim)), k.unflatten(-1, (-1, self.head_k_dim)),
                v.unflatten(-1, (-1, self.head_v_dim)))

    def state_step(self, meta: GDNAttentionMetadata, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                  out: torch.Tensor) -> None:
        """Conv and state step of one forward (decode tokens first, then the prompts, as vLLM orders them);
        writes ``out [T, HV, V]``. The state step takes the projections (``q, k`` before their l2norm, ``a, b``
        before the gates: :meth:`pace_core.pool.StatePool.decode_projected`, ``prefill_projected``)."""
        cpp = self._cpp_conv()
        if cpp:
            mixed_qkv = mixed_qkv.contiguous()  # vLLM's C++ conv reads contiguous rows (its own layer copies too)
        conv_state = self.kv_cache[0] if is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)
        weight, activation = self._conv_weight(), self.activation
        slots, starts = meta.non_spec_state_indices_tensor, meta.non_spec_query_start_loc
        nd, ndt, npf = meta.num_decodes, meta.num_decode_tokens, meta.num_prefills
        if nd:
            if cpp:
                x = cpp_conv_decode(x=mixed_qkv[:ndt], conv_states=conv_state, weight=self.conv1d.weight,
                                    bias=self.conv1d.bias, silu_activation=activation == "silu",
                                    conv_state_indices=slots[:nd], is_weight_packed=True)
            else:
                x = conv_decode(mixed_qkv[:ndt], conv_state, weight, self.conv1d.bias, activation,
                                conv_state_indices=slots[:nd])
            self.pool.decode_projected(slots[:nd], *self._split(x), a[:ndt], b[:ndt], self.A_log, self.dt_bias,
                                       out[:ndt])
        if npf:
            end = ndt + meta.num_prefill_tokens
            local = starts[nd:nd + npf + 1] - ndt
            rows, initial = slots[nd:nd + npf], meta.has_initial_state[nd:nd + npf]
            if cpp:
                x = cpp_conv_prefill(x=mixed_qkv[ndt:end].transpose(0, 1), weight=self.conv1d.weight,
                                     bias=self.conv1d.bias, conv_states=conv_state, query_start_loc=local,
                                     cache_indices=rows, has_initial_state=initial,
                                     silu_activation=activation == "silu", is_weight_packed=True).transpose(0, 1)
            else:
                x = conv_prefill(mixed_qkv[ndt:end].transpose(0, 1), weight, self.conv1d.bias, conv_state, local,
                                 cache_indices=rows, has_initial_state=initial, activation=activation).transpose(0, 1)
            self.pool.prefill_projected(rows, local, initial, *self._split(x), a[ndt:end], b[ndt:end], self.A_log,
                                        self.dt_bias, out[ndt:end])


def pace_gdn_state(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, out: torch.Tensor,
                   layer_name: LayerNameType) -> None:
    """The state step of the layer named ``layer_name`` (:meth:`PaceGatedDeltaNetAttention.state_step`) on this
    forward's batch, writing ``out [T, HV, V]``; nothing in vLLM's profiling runs (no metadata, nothing stored)."""
    context = get_forward_context()
    layer = context.no_compile_layers[_resolve_layer_name(layer_name)]
    if context.attn_metadata is not None:
        meta = context.attn_metadata[layer.prefix]
        if meta.num_actual_tokens:
            layer.state_step(meta, mixed_qkv, b, a, out)


direct_register_custom_op(op_name="pace_gdn_state", op_func=pace_gdn_state, mutates_args=["out"])
