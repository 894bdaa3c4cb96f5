import json

import pytest
from transformers import AutoModelForCausalLM, Qwen3_5Config, Qwen3_5TextConfig

from pace_core.errors import PaceError
from pace_core.shapes import (
    BUILTIN_SHAPES,
    PUBLISHED_CONFIGS,
    ModelShape,
    count_weight_params,
    get_shape,
    load_shape,
    shape_from_hf_config,
)

# (layers, GDN layers, key heads, value heads, d_k, d_v, γ) from the published configs / model cards
EXPECTED = {
    "qwen3.5-4b": (32, 24, 16, 32, 128, 128, 2),
    "qwen3.5-9b": (32, 24, 16, 32, 128, 128, 2),
    "qwen3.5-27b": (64, 48, 16, 48, 128, 128, 3),
    "qwen3.6-35b-a3b": (40, 30, 16, 32, 128, 128, 2),
    "qwen3-next-80b-a3b": (48, 36, 16, 32, 128, 128, 2),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_builtin_shapes(name):
    s = get_shape(name)
    assert (s.num_layers, s.num_gdn_layers, s.num_k_heads, s.num_v_heads, s.d_k, s.d_v, s.gamma) == EXPECTED[name]
    assert s.gdn_layers == tuple(i for i in range(s.num_layers) if i % 4 != 3)
    assert s.state_values == s.num_gdn_layers * s.num_v_heads * 128 * 128
    assert s.weight_bytes == 2 * s.weight_params
    # the built-in parameter counts are what transformers builds from the published config values
    assert shape_from_hf_config(PUBLISHED_CONFIGS[name], name=name) == s


def test_builtin_weight_counts_are_near_the_model_names():
    billions = {k: s.weight_params / 1e9 for k, s in BUILTIN_SHAPES.items()}
    assert 4.0 < billions["qwen3.5-4b"] < 4.7 and 8.5 < billions["qwen3.5-9b"] < 9.5
    assert 26 < billions["qwen3.5-27b"] < 28 and 34 < billions["qwen3.6-35b-a3b"] < 36
    assert 79 < billions["qwen3-next-80b-a3b"] < 82


def test_get_shape_unknown_lists_names():
    with pytest.raises(PaceError) as e:
        get_shape("qwen3.5-2b")
    assert all(n in str(e.value) for n in BUILTIN_SHAPES)


def test_count_weight_params_equals_a_real_model():
    text = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
                linear_key_head_dim=16, linear_value_head_dim=8, tie_word_embeddings=True)
    cfg = {"model_type": "qwen3_5_text", **text}
    real = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**text))
    n_real = sum(p.numel() for p in real.parameters())
    assert count_weight_params(cfg) == n_real
    assert count_weight_params({**cfg, "tie_word_embeddings": False}) == n_real + 50 * 32
    s = shape_from_hf_config(cfg, name="tiny")
    assert (s.num_layers, s.num_gdn_layers, s.num_k_heads, s.num_v_heads, s.d_k, s.d_v, s.gamma) == \
           (4, 3, 2, 6, 16, 8, 3)
    assert s.gdn_layers == (0, 1, 2) and s.weight_params == n_real


def test_composite_config_and_pretrained_config_objects():
    text = PUBLISHED_CONFIGS["qwen3.5-27b"]
    composite = {"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 1}}
    s = shape_from_hf_config(composite, name="qwen3.5-27b")
    assert s == BUILTIN_SHAPES["qwen3.5-27b"]
    obj = Qwen3_5Config(text_config=PUBLISHED_CONFIGS["qwen3.5-4b"])
    assert shape_from_hf_config(obj, name="qwen3.5-4b") == BUILTIN_SHAPES["qwen3.5-4b"]


def test_explicit_layer_types_and_dtype():
    cfg = {**PUBLISHED_CONFIGS["qwen3.5-4b"], "num_hidden_layers": 5, "dtype": "float32",
           "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention",
                           "linear_attention"]}
    s = shape_from_hf_config(cfg)
    assert (s.num_layers, s.num_gdn_layers, s.gdn_layers, s.weight_bytes_per_param) == (5, 3, (1, 2, 4), 4)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"])
def test_shapes_of_saved_checkpoints(tiny_checkpoints, model_type):
    path = tiny_checkpoints[model_type]
    for source in (str(path), str(path / "config.json")):
        s = load_shape(source)
        assert s.name == model_type
        assert (s.num_layers, s.num_gdn_layers, s.gdn_layers, s.num_k_heads, s.num_v_heads, s.d_k, s.d_v) == \
               (4, 3, (0, 1, 3), 2, 4, 64, 32)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert s.weight_params == sum(p.numel() for p in model.parameters())


def test_non_hybrid_models_are_rejected(tiny_checkpoints):
    with pytest.raises(PaceError, match="model_type 'qwen3' is not a hybrid Gated DeltaNet model; allowed"):
        load_shape(str(tiny_checkpoints["qwen3"]))
    no_gdn = {**PUBLISHED_CONFIGS["qwen3.5-4b"], "num_hidden_layers": 2,
              "layer_types": ["full_attention", "full_attention"]}
    with pytest.raises(PaceError, match="no linear_attention .* not a hybrid Gated DeltaNet model"):
        shape_from_hf_config(no_gdn)
    with pytest.raises(PaceError, match="config must be a dict"):
        shape_from_hf_config([1, 2])


def test_load_shape_errors(tmp_path):
    assert load_shape(" Qwen3.5-27B ") is BUILTIN_SHAPES["qwen3.5-27b"]
    with pytest.raises(PaceError, match="neither a built-in shape nor an existing config.json"):
        load_shape(str(tmp_path / "missing"))
    with pytest.raises(PaceError, match="neither a built-in shape"):
        load_shape(str(tmp_path))  # a folder without config.json
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(PaceError, match="is not a readable JSON config"):
        load_shape(str(tmp_path))
    bad.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(PaceError, match="'llama' is not a hybrid Gated DeltaNet model"):
        load_shape(str(bad))
    with pytest.raises(PaceError, match="allowed: qwen3.5-4b"):
        load_shape("")


def test_model_shape_validation():
    with pytest.raises(PaceError, match="num_v_heads=24 is not a multiple of num_k_heads=16"):
        ModelShape("x", 4, 3, 16, 24, 128, 128, 10)
    with pytest.raises(PaceError, match="num_gdn_layers=5 exceeds num_layers=4"):
        ModelShape("x", 4, 5, 16, 32, 128, 128, 10)
    with pytest.raises(PaceError, match="d_k=0 is not allowed"):
        ModelShape("x", 4, 3, 16, 32, 0, 128, 10)
    with pytest.raises(PaceError, match="weight_params=-1"):
        ModelShape("x", 4, 3, 16, 32, 128, 128, -1)
    with pytest.raises(PaceError, match="gdn_layers="):
        ModelShape("x", 4, 2, 16, 32, 128, 128, 10, gdn_layers=(1, 4))
    assert ModelShape("x", 4, 2, 16, 32, 128, 128, 10, gdn_layers=(1, 3)).gamma == 2
