"""Shared fixtures: tiny random checkpoints of every supported hybrid model type (and one
non-hybrid model), written with ``save_pretrained`` into a session temp dir, each with a small
character-level tokenizer, so loading goes through ``from_pretrained`` like a real checkpoint."""

from __future__ import annotations

import os
import random
import shutil
import string
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
VOCAB = 128

_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    max_position_embeddings=512,
    initializer_range=0.3,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=1,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: ids 0 pad, 1 eos, 2 unk, then the printable ASCII characters."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in string.printable:
        if ch not in "\r\x0b\x0c":
            vocab[ch] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of ``model_type`` (the composite types as their conditional-generation
    class, as the real Qwen3.5 checkpoints are saved). The GDN decays are set to a long memory
    (``A = exp(A_log)`` in [0.01, 0.1], ``dt_bias`` -2: ``α_t`` mostly 0.9..1) like trained models,
    instead of the init's near-zero ``α_t`` that would erase every state within a few tokens."""
    torch.manual_seed(seed)
    model = _build(model_type)
    for module in model.modules():
        if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
            with torch.no_grad():
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 0.1).log())
                module.dt_bias.fill_(-2.0)
    return model


def _build(model_type: str) -> torch.nn.Module:
    if model_type == "qwen3_5":
        return Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=_TEXT, vision_config=_VISION))
    if model_type == "qwen3_5_text":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_TEXT))
    if model_type == "qwen3_5_moe":
        return Qwen3_5MoeForConditionalGeneration(
            Qwen3_5MoeConfig(text_config={**_TEXT, **_MOE}, vision_config=_VISION)
        )
    if model_type == "qwen3_5_moe_text":
        return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**_TEXT, **_MOE))
    if model_type == "qwen3_next":
        return Qwen3NextForCausalLM(Qwen3NextConfig(**_TEXT, **_MOE, decoder_sparse_step=1))
    if model_type == "qwen3":
        text = {k: v for k, v in _TEXT.items() if not k.startswith("linear_") and k != "layer_types"}
        return Qwen3ForCausalLM(Qwen3Config(**text))
    raise KeyError(model_type)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """model type -> checkpoint directory, for the hybrid types and a non-hybrid ``qwen3``."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    tokenizer = tiny_tokenizer()
    out = {}
    for model_type in (*HYBRID_TYPES, "qwen3"):
        path = root / model_type
        build_model(model_type).save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[model_type] = path
    return out


def _edit_config(folder: Path, **fields) -> None:
    import json

    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _truncate_weights(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _resize_a_weight(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    name = sorted(k for k in tensors if k.endswith("in_proj_a.weight"))[0]
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _drop_a_weight(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors[sorted(k for k in tensors if k.endswith("in_proj_a.weight"))[0]]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _delete_the_tokenizer(folder: Path) -> None:
    for path in folder.glob("tokenizer*"):
        path.unlink()


BROKEN_CHECKPOINTS = {
    "truncated weights": (_truncate_weights, "model.safetensors (Error while deserializing header"),
    "a resized weight": (_resize_a_weight, "in_proj_a.weight is [5, 64] in the weights file, [4, 64] by the config"),
    "a missing weight": (_drop_a_weight, "lacks weights its config.json needs (model.layers.0.linear_attn.in_proj_a"),
    "short layer_types": (lambda f: _edit_config(f, layer_types=["linear_attention"] * 3),
                          "layer_types has 3 entries for num_hidden_layers = 4"),
    "no tokenizer": (_delete_the_tokenizer, "has no tokenizer"),
    "10^7 layers": (lambda f: _edit_config(f, num_hidden_layers=10**7, layer_types=None),
                    "num_hidden_layers = 10000000 is not allowed; allowed: an integer in 1..1,024"),
    "head dims 2^40": (lambda f: _edit_config(f, linear_key_head_dim=2**40, linear_value_head_dim=2**40),
                       "linear_key_head_dim = 1099511627776 is not allowed; allowed: an integer in 1..1,024"),
}
"""Ways a checkpoint breaks: what is done to a copy of the tiny qwen3_5_text checkpoint, and the part of the
load's PaceError that names the problem."""


@pytest.fixture(scope="session")
def broken_checkpoints(tiny_checkpoints, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (a broken copy of the tiny qwen3_5_text checkpoint, the part of its PaceError naming the problem)."""
    root = tmp_path_factory.mktemp("broken_checkpoints")
    out = {}
    for i, (name, (breaks, message)) in enumerate(BROKEN_CHECKPOINTS.items()):
        folder = root / f"broken{i}"
        shutil.copytree(tiny_checkpoints["qwen3_5_text"], folder)
        breaks(folder)
        out[name] = (folder, message)
    return out


THREADS_ENV = "PACE_TEST_THREADS"


@pytest.fixture(scope="session", autouse=True)
def torch_threads():
    """Run the tests on one torch thread (``$PACE_TEST_THREADS`` sets another count: the numerics guard
    of ``make test`` runs on two): on the small, shared CPU machine two intra-op threads oversubscribe
    the cores and tiny kernels get 10-20x slower. The previous setting is restored."""
    previous = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def seeded_random(request):
    """Seed torch's, numpy's and Python's global generators before every test, from the test's own
    id: a random input drawn without its own generator is still the same on every run and every
    worker order."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.fixture(scope="session", autouse=True)
def results_copy(tmp_path_factory):
    """The tests read the shipped results (``data/results``) from a copy ($PACE_RESULTS_DIR), so that what
    they store (the card every model load writes, results of the commands) never lands in the repository."""
    from pace_core.results import DEFAULT_RESULTS_ROOT, RESULTS_ENV

    root = tmp_path_factory.mktemp("results") / "results"
    shutil.copytree(DEFAULT_RESULTS_ROOT, root)
    patch = pytest.MonkeyPatch()
    patch.setenv(RESULTS_ENV, str(root))
    yield root
    patch.undo()
