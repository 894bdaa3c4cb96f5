"""pace_core.model.loading: tiny random checkpoints of every hybrid model type, saved with
save_pretrained and loaded back through AutoModelForCausalLM / AutoTokenizer."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import BROKEN_CHECKPOINTS, HYBRID_TYPES, build_model
from numerics import assert_same_parameters, fp32_bound, rel

from pace_core.errors import PaceError
from pace_core.model import loading
from pace_core.model.loading import load_config, load_model
from pace_core.shapes import PUBLISHED_CONFIGS, SUPPORTED_MODEL_TYPES, check_config_values

pytestmark = pytest.mark.numerics


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_loads_every_hybrid_type_with_its_weights(tiny_checkpoints, model_type):
    loaded = load_model(str(tiny_checkpoints[model_type]))
    assert type(loaded.model).__name__.endswith("ForCausalLM")
    assert loaded.gdn_layers == [0, 1, 3]
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    assert not loaded.model.training
    assert loaded.tokenizer.padding_side == "left" and loaded.tokenizer.pad_token_id == 0
    shape = loaded.shape
    assert (shape.num_layers, shape.num_gdn_layers, shape.num_k_heads, shape.num_v_heads, shape.d_k, shape.d_v) == (
        4, 3, 2, 4, 64, 32)
    # the loaded weights are the saved ones, bit for bit (a composite checkpoint's text model is saved
    # under model.language_model), and they compute what the saved model computes. The logits are
    # compared to float32 rounding, not bit for bit: the loaded weights are other tensors (memory-mapped
    # from the safetensors file, so aligned differently), and MKL picks its GEMM kernels by alignment and
    # CPU model (the MoE types differed in their last bits on an AMD EPYC). Longest chain: 4 layers of at
    # most 8 dependent products of length <= 96 (intermediate size), then the 64-wide LM head.
    original = build_model(model_type).eval()
    composite = model_type in ("qwen3_5", "qwen3_5_moe")
    assert_same_parameters(loaded.model, original,
                           (lambda n: n.replace("model.", "model.language_model.", 1)) if composite else (lambda n: n))
    ids = torch.randint(3, 100, (2, 11))
    with torch.no_grad():
        assert rel(loaded.model(ids).logits, original(ids).logits) <= fp32_bound(4 * 8 * 96 + 64)


def test_summary_from_the_loaded_config(tiny_checkpoints):
    loaded = load_model(tiny_checkpoints["qwen3_5"])
    s = loaded.summary()
    assert s["model_type"] == "qwen3_5_text"  # the composite checkpoint loads as its text causal LM
    assert (s["layers"], s["gdn_layers"], s["attention_layers"], s["gdn_layer_indices"]) == (4, 3, 1, [0, 1, 3])
    assert (s["num_k_heads"], s["num_v_heads"], s["d_k"], s["d_v"], s["gamma"]) == (2, 4, 64, 32, 2)
    # 3 GDN layers x 4 value heads x 64 x 32 fp32 values x 4 bytes
    assert s["state_bytes_per_sequence_fp32"] == 3 * 4 * 64 * 32 * 4
    assert s["params"] == sum(p.numel() for p in loaded.model.parameters())
    assert s["vocab_size"] == 128 and s["hidden_size"] == 64


def test_dtype_and_device_map_options(tiny_checkpoints):
    path = tiny_checkpoints["qwen3_5_text"]
    bf16 = load_model(path, dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    mapped = load_model(path, device_map={"": "cpu"})
    assert mapped.device == torch.device("cpu")
    assert load_model(path, dtype=torch.float16).dtype == torch.float16


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"dtype": "float8"}, "dtype"),
        ({"dtype": "fp32"}, "dtype"),
        ({"device": "tpu:0"}, "device"),
        ({"device": "cuda:7" if torch.cuda.device_count() < 8 else "cuda:99"}, "device"),
    ],
)
def test_bad_options_name_the_field(tiny_checkpoints, kwargs, field):
    with pytest.raises(PaceError, match=field):
        load_model(tiny_checkpoints["qwen3_5_text"], **kwargs)


def test_non_hybrid_checkpoint_is_refused(tiny_checkpoints):
    with pytest.raises(PaceError) as err:
        load_model(tiny_checkpoints["qwen3"])
    message = str(err.value)
    assert "not a hybrid Gated DeltaNet model" in message and "'qwen3'" in message
    assert all(t in message for t in SUPPORTED_MODEL_TYPES)


def test_hybrid_type_without_gdn_layers_is_refused(tmp_path):
    config = build_model("qwen3_5_text").config.to_dict()
    config["layer_types"] = ["full_attention"] * 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PaceError, match="not a hybrid Gated DeltaNet model.*no linear_attention layers"):
        load_config(str(tmp_path))


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(PaceError, match=re.escape(str(missing))):
        load_model(str(missing))
    with pytest.raises(PaceError, match="does not exist"):
        load_model("./not-here")


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(PaceError, match="is a file"):
        load_model(str(f))


def test_default_source_is_the_embedded_model(tiny_checkpoints, monkeypatch, tmp_path):
    monkeypatch.setattr(loading, "DEFAULT_MODEL_DIR", tiny_checkpoints["qwen3_next"])
    loaded = load_model()
    assert loaded.source == str(tiny_checkpoints["qwen3_next"]) and loaded.model_type == "qwen3_next"
    monkeypatch.setattr(loading, "DEFAULT_MODEL_DIR", tmp_path / "pace-tiny-qwen35")
    with pytest.raises(PaceError, match="embedded model"):
        load_model(None)


def test_weights_fingerprint_names_the_weights(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["qwen3_5_text"]
    first, again = load_model(path), load_model(path)
    assert re.fullmatch(r"[0-9a-f]{16}", first.fingerprint)
    assert first.fingerprint == again.fingerprint == loading.weights_fingerprint(first.model)
    params = dict(first.model.named_parameters())
    name = list(params)[int(torch.randint(0, len(params), ()))]
    with torch.no_grad():
        params[name].view(-1)[-1] += 1.0  # one retrained value, saved as another checkpoint
    first.model.save_pretrained(tmp_path / "edited")
    first.tokenizer.save_pretrained(tmp_path / "edited")
    assert load_model(tmp_path / "edited").fingerprint != again.fingerprint


def test_weights_fingerprint_counts_offloaded_parameters_by_name_and_shape():
    offloaded = torch.nn.Linear(4, 3, device="meta")  # as accelerate leaves CPU/disk-offloaded weights
    assert loading.weights_fingerprint(offloaded) == loading.weights_fingerprint(torch.nn.Linear(4, 3, device="meta"))
    assert loading.weights_fingerprint(offloaded) != loading.weights_fingerprint(torch.nn.Linear(3, 4, device="meta"))


def test_out_of_memory_while_moving_to_the_device_is_not_a_missing_device(tiny_checkpoints, monkeypatch):
    """An OOM in model.to(device) stays an OutOfMemoryError (the app says: ask for less), instead of
    'device not available'."""
    def full(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(torch.nn.Module, "to", full)
    with pytest.raises(torch.OutOfMemoryError):
        load_model(tiny_checkpoints["qwen3_5_text"])


@pytest.mark.parametrize("broken", list(BROKEN_CHECKPOINTS))
def test_every_broken_checkpoint_is_a_clear_error(broken_checkpoints, broken):
    """A damaged or inconsistent checkpoint is a PaceError naming the file or field and what to do, before
    anything is built from an absurd config value (10^7 layers made transformers' config take minutes)."""
    folder, message = broken_checkpoints[broken]
    with pytest.raises(PaceError) as err:
        load_model(folder)
    assert message in str(err.value) and "allowed:" in str(err.value)


def test_config_values_are_checked_for_every_published_shape():
    """No published configuration is refused by the bounds (each is 8x the largest published value)."""
    for name, config in PUBLISHED_CONFIGS.items():
        check_config_values(config, name)
    with pytest.raises(
        PaceError, match=r"linear_num_value_heads = 513 is not allowed; allowed: an integer in 1\.\.512"
    ):
        check_config_values({**PUBLISHED_CONFIGS["qwen3.5-27b"], "linear_num_value_heads": 513}, "qwen3.5-27b")
    with pytest.raises(PaceError, match="hidden_size = True is not allowed"):
        check_config_values({"text_config": {"hidden_size": True}}, "composite")
