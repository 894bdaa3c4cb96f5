"""The state geometry of a Gated DeltaNet hybrid: built-in shapes of the Qwen models (no download)
and the same from any Hugging Face ``config.json``.

A :class:`ModelShape` holds what the accounting needs: decoder layers, GDN layers, key heads ``H``,
value heads ``HV`` (``γ = HV / H``), head dims ``d_k``, ``d_v``, and the weight parameters that a
server keeps next to the states. ``weight_params`` counts the parameters of the text causal LM that
transformers loads for the checkpoint (``AutoModelForCausalLM``: a composite ``qwen3_5`` /
``qwen3_5_moe`` checkpoint loads as its text model, without the vision tower and without the
multi-token-prediction head) **[ours]**; :func:`count_weight_params` counts them by building that
model on the meta device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pace_core.errors import PaceError

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
GDN_LAYER_TYPE = "linear_attention"
WEIGHT_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Checkpoint dtype -> bytes per weight parameter (anything else counts as 2, bf16 serving)."""


@dataclass(frozen=True)
class ModelShape:
    """State geometry and weight size of one hybrid model.

    ``gdn_layers``: decoder-layer indices of the GDN layers (ascending), or None when unknown.
    ``attention_kv_heads``, ``attention_head_dim``: the full-attention layers' key / value heads and head
    size (0 when unknown), for their KV cache in capacity planning.
    """

    name: str
    num_layers: int
    num_gdn_layers: int
    num_k_heads: int
    num_v_heads: int
    d_k: int
    d_v: int
    weight_params: int
    weight_bytes_per_param: int = 2
    gdn_layers: tuple[int, ...] | None = None
    attention_kv_heads: int = 0
    attention_head_dim: int = 0

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_gdn_layers", "num_k_heads", "num_v_heads", "d_k", "d_v",
                      "weight_bytes_per_param"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PaceError(f"{field}={value!r} is not allowed for shape {self.name!r}; allowed: an integer >= 1")
        if isinstance(self.weight_params, bool) or not isinstance(self.weight_params, int) or self.weight_params < 0:
            raise PaceError(f"weight_params={self.weight_params!r} is not allowed; allowed: an integer >= 0")
        if self.num_gdn_layers > self.num_layers:
            raise PaceError(f"num_gdn_layers={self.num_gdn_layers} exceeds num_layers={self.num_layers}; "
                            f"allowed: 1..{self.num_layers}")
        if self.num_v_heads % self.num_k_heads:
            raise PaceError(f"num_v_heads={self.num_v_heads} is not a multiple of num_k_heads={self.num_k_heads}; "
                            "allowed: HV = γ · H for an integer γ")
        if self.gdn_layers is not None and (
                len(self.gdn_layers) != self.num_gdn_layers or list(self.gdn_layers) != sorted(set(self.gdn_layers))
                or self.gdn_layers[0] < 0 or self.gdn_layers[-1] >= self.num_layers):
            raise PaceError(f"gdn_layers={self.gdn_layers!r} is not allowed; allowed: {self.num_gdn_layers} "
                            f"ascending distinct indices in 0..{self.num_layers - 1}")

    @property
    def gamma(self) -> int:
        """γ = HV / H: value heads per key head."""
        return self.num_v_heads // self.num_k_heads

    @property
    def state_values_per_layer(self) -> int:
        """State values of one GDN layer of one sequence: HV · d_k · d_v."""
        return self.num_v_heads * self.d_k * self.d_v

    @property
    def state_values(self) -> int:
        """State values of one sequence over all GDN layers."""
        return self.num_gdn_layers * self.state_values_per_layer

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of the full-attention layers' bf16 KV cache per token of one sequence (0 when unknown)."""
        return 2 * 2 * self.attention_kv_heads * self.attention_head_dim * (self.num_layers - self.num_gdn_layers)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights: weight_params · weight_bytes_per_param."""
        return self.weight_params * self.weight_bytes_per_param


def _interval_layers(num_layers: int, interval: int = 4) -> tuple[int, ...]:
    """GDN layers of transformers' default pattern: every `interval`-th layer is full attention."""
    return tuple(i for i in range(num_layers) if (i + 1) % interval)


# Published configs (Hugging Face config.json, text part), and the text causal LM's parameter count
# from count_weight_params on exactly these values (transformers 5.23, meta device); the test suite
# recomputes every count. Sources:
# - Qwen/Qwen3.5-4B: text_config hidden 2560, intermediate 9216, 32 layers (full_attention_interval 4
#   -> 24 GDN), 16 attention / 4 KV heads, head_dim 256, linear 16 key / 32 value heads of 128 x 128,
#   vocab 248320, tie_word_embeddings true (config.json as quoted in public test fixtures; the
#   project issues state 32 layers, 24 GDN, 16 / 32 heads, 128 x 128).
# - Qwen/Qwen3.5-9B: hidden 4096, intermediate 12288, 32 layers, 16 / 4 heads, head_dim 256, linear
#   16 / 32 heads of 128, vocab 248320, untied (model card: "8.95B", d_state 128, 16 groups, 32 heads).
# - Qwen/Qwen3.5-27B: hidden 5120, intermediate 17408, 64 layers, 24 / 4 heads, head_dim 256, linear
#   16 key / 48 value heads (γ = 3) of 128, vocab 248320, untied (config.json; the MAX Qwen3_5Config
#   defaults are the same numbers).
# - Qwen/Qwen3.6-35B-A3B (= Qwen3.5-35B-A3B architecture, model_type qwen3_5_moe): hidden 2048, 40
#   layers, 16 / 2 heads, head_dim 256, linear 16 / 32 heads of 128, 256 experts (8 routed + 1
#   shared) of intermediate 512, vocab 248320, untied (model card "Hidden Layout: 10 × (3 × (Gated
#   DeltaNet → MoE) → 1 × (Gated Attention → MoE))", "32 for V and 16 for QK", head dim 128).
# - Qwen/Qwen3-Next-80B-A3B (model_type qwen3_next): hidden 2048, intermediate 5120, 48 layers,
#   16 / 2 heads, head_dim 256, linear 16 / 32 heads of 128, 512 experts (top 10) of intermediate
#   512 + shared 512, vocab 151936, untied (config.json).
PUBLISHED_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3.5-4b": {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 2560, "intermediate_size": 9216,
                   "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
                   "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                   "linear_key_head_dim": 128, "linear_value_head_dim": 128, "tie_word_embeddings": True,
                   "dtype": "bfloat16"},
    "qwen3.5-9b": {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
                   "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
                   "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                   "linear_key_head_dim": 128, "linear_value_head_dim": 128, "tie_word_embeddings": False,
                   "dtype": "bfloat16"},
    "qwen3.5-27b": {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120,
                    "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24,
                    "num_key_value_heads": 4, "head_dim": 256, "full_attention_interval": 4,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "tie_word_embeddings": False, "dtype": "bfloat16"},
    "qwen3.6-35b-a3b": {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
                        "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                        "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_experts": 256,
                        "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                        "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "dtype": "bfloat16"},
    "qwen3-next-80b-a3b": {"model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
                           "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
                           "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
                           "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                           "linear_value_head_dim": 128, "num_experts": 512, "num_experts_per_tok": 10,
                           "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                           "tie_word_embeddings": False, "dtype": "bfloat16"},
}

PUBLISHED_WEIGHT_PARAMS: dict[str, int] = {
    "qwen3.5-4b": 4_205_751_296,
    "qwen3.5-9b": 8_953_803_264,
    "qwen3.5-27b": 26_895_998_464,
    "qwen3.6-35b-a3b": 34_660_610_688,
    "qwen3-next-80b-a3b": 79_674_391_296,
}
"""count_weight_params of each PUBLISHED_CONFIGS entry (kept here: counting builds the model on the meta
device, seconds each; tests/test_shapes.py recomputes every count)."""


def _published_shape(name: str, config: dict[str, Any]) -> ModelShape:
    layers = config["num_hidden_layers"]
    gdn = _interval_layers(layers, config["full_attention_interval"])
    return ModelShape(name, layers, len(gdn), config["linear_num_key_heads"], config["linear_num_value_heads"],
                      config["linear_key_head_dim"], config["linear_value_head_dim"], PUBLISHED_WEIGHT_PARAMS[name],
                      WEIGHT_BYTES[config["dtype"]], gdn, config["num_key_value_heads"], config["head_dim"])


BUILTIN_SHAPES: dict[str, ModelShape] = {name: _published_shape(name, c) for name, c in PUBLISHED_CONFIGS.items()}
"""Shapes of the Qwen hybrids (from PUBLISHED_CONFIGS; no download)."""

PAPER_BACKBONES: tuple[str, ...] = ("qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.6-35b-a3b")
"""The four backbones the PACE paper evaluates (seeds)."""


def get_shape(name: str) -> ModelShape:
    """The built-in shape `name` (case-insensitive); unknown names raise PaceError listing them."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in BUILTIN_SHAPES:
        raise PaceError(f"model {name!r} is not a built-in shape; allowed: {', '.join(BUILTIN_SHAPES)}")
    return BUILTIN_SHAPES[key]


ATTENTION_LAYER_TYPE = "full_attention"

SIZE_LIMITS: dict[str, int] = {
    "num_hidden_layers": 1024,            # Llama 3.1 405B: 126
    "hidden_size": 131_072,               # Llama 3.1 405B: 16,384
    "intermediate_size": 524_288,         # Llama 3.1 405B: 53,248
    "moe_intermediate_size": 524_288,
    "shared_expert_intermediate_size": 524_288,
    "vocab_size": 2_097_152,              # Gemma 3: 262,144
    "num_attention_heads": 1024,          # Llama 3.1 405B: 128
    "num_key_value_heads": 1024,
    "head_dim": 2048,                     # Gemma, Qwen3.5: 256
    "linear_num_key_heads": 128,          # Qwen3.5, Qwen3-Next: 16
    "linear_num_value_heads": 512,        # Qwen3.5-27B: 48
    "linear_key_head_dim": 1024,          # Qwen3.5, Qwen3-Next: 128
    "linear_value_head_dim": 1024,        # Qwen3.5, Qwen3-Next: 128
    "linear_conv_kernel_dim": 32,         # Qwen3.5, Qwen3-Next: 4
    "num_experts": 4096,                  # Qwen3-Next: 512
    "num_experts_per_tok": 4096,
}
"""The largest value a config field may take: 8 times the largest in published configs (the comments; rounded up
to a power of two). No real checkpoint comes near, while a damaged or hostile ``config.json`` is refused before
transformers builds (a list per layer: 10^7 layers take minutes), allocates or multiplies anything from it (at
the limits one sequence's fp32 GDN state is at most 2 TiB, where a head dim of 2^40 gave a number of 10^18 GiB)."""

_MAY_BE_ZERO = frozenset({"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "shared_expert_intermediate_size"})


def check_config_values(config: Any, label: str) -> None:
    """Refuse a config (the ``config.json`` dict, or a PretrainedConfig) whose text part has a size field that is
    not an integer in its range (:data:`SIZE_LIMITS`), or ``layer_types`` that are not one ``linear_attention`` /
    ``full_attention`` entry per decoder layer; PaceError naming ``label``, the field and what is allowed."""
    from transformers import PretrainedConfig

    if isinstance(config, PretrainedConfig):
        text = config.get_text_config(decoder=True)
        fields = {name: getattr(text, name, None) for name in (*SIZE_LIMITS, "layer_types")}
    elif isinstance(config, dict):
        fields = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    else:
        raise PaceError(f"config must be a dict or a transformers PretrainedConfig; got {type(config).__name__}")
    for name, limit in SIZE_LIMITS.items():
        value, low = fields.get(name), 0 if name in _MAY_BE_ZERO else 1
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= limit:
            raise PaceError(f"{label}: {name} = {value!r} is not allowed; allowed: an integer in {low}..{limit:,} "
                            "(8x the largest published model's; the file is damaged or not a model's config: use "
                            "the checkpoint's original config.json)")
    layer_types, layers = fields.get("layer_types"), fields.get("num_hidden_layers")
    if layer_types is None:
        return
    if not isinstance(layer_types, (list, tuple)) or (layers is not None and len(layer_types) != layers):
        count = f"{len(layer_types)} entries" if isinstance(layer_types, (list, tuple)) else repr(layer_types)
        raise PaceError(f"{label}: layer_types has {count} for num_hidden_layers = {layers}; allowed: one entry per "
                        "decoder layer (use the checkpoint's original config.json)")
    bad = sorted({str(t) for t in layer_types} - {GDN_LAYER_TYPE, ATTENTION_LAYER_TYPE})
    if bad:
        raise PaceError(f"{label}: layer_types holds {', '.join(map(repr, bad))}; allowed: {GDN_LAYER_TYPE!r}, "
                        f"{ATTENTION_LAYER_TYPE!r}")


def _hf_config(config: Any):
    """A transformers PretrainedConfig of `config` (a dict or a PretrainedConfig); model_type checked."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        model_type = config.model_type
    elif isinstance(config, dict):
        model_type = config.get("model_type")
    else:
        raise PaceError(f"config must be a dict or a transformers PretrainedConfig; got {type(config).__name__}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise PaceError(f"model_type {model_type!r} is not a hybrid Gated DeltaNet model; allowed model types: "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    check_config_values(config, f"config of model_type {model_type!r}")
    if isinstance(config, PretrainedConfig):
        return config
    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # transformers' own validation: TypeError, ValueError, huggingface_hub's errors
        raise PaceError(f"config of model_type {model_type!r} is malformed: {e}") from None


def count_weight_params(config: Any) -> int:
    """Parameters of the text causal LM transformers builds for `config` (dict or PretrainedConfig),
    counted on the meta device (no memory, no download; tied embeddings count once)."""
    import torch
    from transformers import AutoModelForCausalLM

    text = _hf_config(config).get_text_config(decoder=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text)
    return sum(p.numel() for p in model.parameters())


def shape_from_hf_config(config: Any, *, name: str | None = None) -> ModelShape:
    """The ModelShape of a Hugging Face config (the ``config.json`` dict or a PretrainedConfig).

    Model types qwen3_5 / qwen3_5_moe (composite: the nested ``text_config`` is read),
    qwen3_5_text, qwen3_5_moe_text and qwen3_next. Missing fields take transformers' defaults;
    the GDN layers are the ``linear_attention`` entries of ``layer_types`` (derived from
    ``full_attention_interval`` when absent). A config of another type, or one without GDN layers,
    raises PaceError saying it is not a hybrid Gated DeltaNet model.
    """
    hf = _hf_config(config)
    text = hf.get_text_config(decoder=True)
    layer_types = list(getattr(text, "layer_types", None) or [])
    gdn = tuple(i for i, t in enumerate(layer_types) if t == GDN_LAYER_TYPE)
    label = name or getattr(hf, "_name_or_path", "") or hf.model_type
    if not gdn:
        raise PaceError(f"{label} has no linear_attention (Gated DeltaNet) layers: it is not a hybrid Gated "
                        "DeltaNet model; allowed: a config whose layer_types include 'linear_attention'")
    dtype = getattr(text, "dtype", None) or getattr(hf, "dtype", None)
    dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else "bfloat16"
    try:
        return ModelShape(
            name=label, num_layers=len(layer_types), num_gdn_layers=len(gdn),
            num_k_heads=text.linear_num_key_heads, num_v_heads=text.linear_num_value_heads,
            d_k=text.linear_key_head_dim, d_v=text.linear_value_head_dim,
            weight_params=count_weight_params(hf), weight_bytes_per_param=WEIGHT_BYTES.get(dtype_name, 2),
            gdn_layers=gdn, attention_kv_heads=getattr(text, "num_key_value_heads", 0) or 0,
            attention_head_dim=getattr(text, "head_dim", 0) or 0)
    except PaceError as e:
        raise PaceError(f"config of {label}: {e}") from None


def load_shape(source: str) -> ModelShape:
    """A shape from a built-in name, a ``config.json`` path or a checkpoint folder holding one."""
    if not isinstance(source, str) or not source.strip():
        raise PaceError(f"model={source!r} is not allowed; allowed: {', '.join(BUILTIN_SHAPES)}, "
                        "a path to a config.json or a checkpoint folder")
    if source.strip().lower() in BUILTIN_SHAPES:
        return get_shape(source)
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PaceError(f"model {source!r} is neither a built-in shape nor an existing config.json or checkpoint "
                        f"folder with one; allowed: {', '.join(BUILTIN_SHAPES)}, or such a path")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PaceError(f"{path} is not a readable JSON config: {e}; allowed: a Hugging Face config.json") from None
    check_config_values(config, str(path))
    name = path.parent.name if path.name == "config.json" else path.stem
    return shape_from_hf_config(config, name=name)
