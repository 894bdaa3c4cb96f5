"""Tests of scripts/train (train.py, tokenizer.py) on CPU with tiny models and synthetic data."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from numerics import assert_same_parameters, fp32_bound, rel
from transformers import AutoModelForCausalLM, AutoTokenizer

from pace_core.errors import PaceError
from scripts.train.tokenizer import EOS_TOKEN, PAD_TOKEN, save_tokenizer, train_tokenizer
from scripts.train.train import (
    REPO_ROOT,
    TRAIN_FILES,
    VALID_FILE,
    ModelSize,
    TrainArgs,
    build_config,
    encode,
    learning_rate,
    prepare,
    save_bf16,
    split_valid_lines,
    train,
)

pytestmark = pytest.mark.numerics

SHIPPED = REPO_ROOT / "data" / "models" / "pace-tiny-qwen35"
TINY = ModelSize(
    hidden_size=64, num_layers=4, intermediate_size=96, gdn_key_heads=1, attention_heads=2, kv_heads=1, head_dim=32
)
TINY_ARGS = dict(
    hidden_size=64, num_layers=4, intermediate_size=96, gdn_key_heads=1, attention_heads=2, kv_heads=1
)


def _tiny_model(vocab: int = 64, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(build_config(vocab, 0, 1, TINY)).eval()


def _write_data(folder: Path, vocab: int, n_train: int, n_val: int, seed: int) -> None:
    """A learnable synthetic stream: a random cycle of 12 tokens, so the next token is predictable."""
    rng = np.random.default_rng(seed)
    cycle = rng.choice(np.arange(2, vocab), size=12, replace=False)
    folder.mkdir(parents=True, exist_ok=True)
    np.resize(cycle, n_train).astype(np.uint16).tofile(folder / "train.bin")
    np.resize(np.roll(cycle, 5), n_val).astype(np.uint16).tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps({"vocab_size": vocab, "eos_token_id": 0, "pad_token_id": 1}))


def test_split_valid_lines_is_a_line_split() -> None:
    text = "".join(f"line {i}\n" for i in range(20))
    head, tail = split_valid_lines(text)
    assert head + tail == text
    assert head.count("\n") == 18 and tail == "line 18\nline 19\n"
    with pytest.raises(PaceError, match="held_out_fraction"):
        split_valid_lines(text, 1.0)


def test_learning_rate_warmup_stable_decay() -> None:
    args = TrainArgs(out="x", max_steps=100, lr=1e-3, warmup_steps=10, decay_fraction=0.4, min_lr_ratio=0.1)
    assert learning_rate(args, 0, 0.0, warm=True) == pytest.approx(1e-4)
    assert learning_rate(args, 9, 0.09, warm=True) == pytest.approx(1e-3)
    assert learning_rate(args, 0, 0.3, warm=False) == pytest.approx(1e-3)
    assert learning_rate(args, 50, 0.6, warm=True) == pytest.approx(1e-3)
    assert learning_rate(args, 80, 0.8, warm=True) == pytest.approx(1e-3 * (1 - 0.5 * 0.9))
    assert learning_rate(args, 100, 1.0, warm=True) == pytest.approx(1e-4)
    with pytest.raises(PaceError, match="minutes or max_steps"):
        TrainArgs(out="x").validate()


def test_build_config_shape() -> None:
    config = build_config(500, 0, 1, ModelSize(num_layers=8))
    assert config.model_type == "qwen3_5_text"
    assert config.linear_key_head_dim == config.linear_value_head_dim == 128
    assert config.linear_num_value_heads == 2 * config.linear_num_key_heads
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]
    with pytest.raises(PaceError, match="num_layers"):
        build_config(500, 0, 1, ModelSize(num_layers=6))


def test_training_reduces_loss_saves_and_resumes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _write_data(data, vocab=64, n_train=600, n_val=130, seed=int(torch.randint(0, 10_000, ()).item()))
    common = dict(data=str(data), seq_len=32, batch_size=4, lr=1e-2, warmup_steps=3, eval_every=6, log_every=3,
                  eval_batch_size=8, dropout=0.0, device="cpu", **TINY_ARGS)
    log = train(TrainArgs(out=str(tmp_path / "a"), max_steps=18, state_dir=str(tmp_path / "state"), **common))
    losses = [row["train_loss"] for row in log["curve"] if row["train_loss"] is not None]
    vals = [row["val_loss"] for row in log["curve"] if row["val_loss"] is not None]
    assert losses[-1] < 0.8 * losses[0]
    assert vals[-1] < vals[0] < math.log(64) + 1.0
    assert log["final_step"] == 18 and log["tokens_seen"] == 18 * 4 * 32
    assert log["best"]["val_loss"] == min(vals)
    best = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a" / "best"))
    assert best.config.model_type == "qwen3_5_text"
    assert all(p.dtype == torch.bfloat16 for p in best.parameters())

    resumed = train(TrainArgs(out=str(tmp_path / "b"), max_steps=21, resume=str(tmp_path / "state"), **common))
    assert resumed["resumed_from"]["kind"] == "full_state" and resumed["final_step"] == 21
    assert resumed["curve"][: len(log["curve"])] == log["curve"]
    assert [h["final_step"] for h in resumed["history"]] == [18] and resumed["history"][0]["args"]["max_steps"] == 18

    from_best = train(
        TrainArgs(out=str(tmp_path / "c"), max_steps=log["best"]["step"] + 3, resume=str(tmp_path / "a"), **common)
    )
    assert from_best["resumed_from"] == {
        "path": str(tmp_path / "a"),
        "kind": "best_bf16_weights",
        "step": log["best"]["step"],
    }
    assert from_best["curve"][0]["step"] <= log["best"]["step"] < from_best["curve"][-1]["step"]
    assert from_best["history"] == [{k: log[k] for k in from_best["history"][0]}]


def test_save_and_reload_give_identical_logits(tmp_path: Path) -> None:
    model = _tiny_model(seed=int(torch.randint(0, 10_000, ()).item()))
    ids = torch.randint(0, 64, (2, 40))
    model.save_pretrained(str(tmp_path / "fp32"))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp32"), dtype=torch.float32).eval()
    # The reloaded weights equal the saved ones bit for bit; their logits agree to float32 rounding
    # (other tensors, memory-mapped from the file: MKL may take other kernels for them). Longest chain per
    # layer: the 64-wide projections, the GDN state over 40 tokens of 128-wide keys, the 256-wide value
    # heads, the MLP (64 + 96); 4 layers, then the 64-wide LM head.
    tol = fp32_bound(4 * (64 + 40 * 128 + 256 + 64 + 96) + 64)
    assert_same_parameters(again, model)
    with torch.no_grad():
        assert rel(model(input_ids=ids).logits, again(input_ids=ids).logits) <= tol
    save_bf16(model, tmp_path / "bf16", "14MB")
    stored = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32).eval()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        assert_same_parameters(stored, reference)
        assert rel(reference(input_ids=ids).logits, stored(input_ids=ids).logits) <= tol
        assert not torch.equal(model(input_ids=ids).logits, stored(input_ids=ids).logits)  # bf16 weights differ


@pytest.fixture(scope="module")
def small_tokenizer():
    text = "The quick brown fox jumps over the lazy dog.\n def f(x):\n    return x + 1\n" * 20
    return train_tokenizer([text], vocab_size=300)


def test_tokenizer_round_trip_and_specials(tmp_path: Path, small_tokenizer) -> None:
    save_tokenizer(small_tokenizer, tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert tok.eos_token == tok.bos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert len(tok) == 300
    text = "Ünïcode ✓ and\ttabs  \n\n = Heading = \n"
    assert tok.decode(encode(tok, text)) == text
    with pytest.raises(PaceError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)


def test_prepare_writes_split_token_files(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = {
        TRAIN_FILES[0]: "ROMEO:\nWherefore art thou?\n" * 30,
        TRAIN_FILES[1]: "def spam(eggs):\n    return eggs\n" * 30,
        VALID_FILE: "".join(f" = Article {i} = \n text {i}\n" for i in range(50)),
    }
    for name, text in texts.items():
        (corpus / name).write_text(text, encoding="utf-8")
    meta = prepare(tmp_path / "out", corpus, vocab_size=300)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out" / "tokenizer"))
    head, tail = split_valid_lines(texts[VALID_FILE])
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    expected_train = []
    for text in (texts[TRAIN_FILES[0]], texts[TRAIN_FILES[1]], head):
        expected_train += [eos] + encode(tok, text)
    assert np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16).tolist() == expected_train
    assert np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint16).tolist() == [eos] + encode(tok, tail)
    assert meta["train_tokens"] == len(expected_train) and meta["vocab_size"] == 300
    assert "wikitext2-test.txt" not in meta["sha256"]


@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="shipped model not present")
def test_shipped_model_loads_with_the_required_shape() -> None:
    model = AutoModelForCausalLM.from_pretrained(str(SHIPPED))
    tok = AutoTokenizer.from_pretrained(str(SHIPPED))
    config = model.config
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and config.model_type == "qwen3_5_text"
    assert config.linear_key_head_dim == config.linear_value_head_dim == 128
    assert config.linear_num_value_heads == 2 * config.linear_num_key_heads
    types = config.layer_types
    assert types.count("linear_attention") == 3 * types.count("full_attention") > 0
    assert all(types[i] == ("full_attention" if i % 4 == 3 else "linear_attention") for i in range(len(types)))
    assert 20e6 <= sum(p.numel() for p in model.parameters()) <= 30e6
    assert tok.eos_token == tok.bos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN and len(tok) == config.vocab_size
    sizes = [f.stat().st_size for f in SHIPPED.iterdir() if f.is_file()]
    assert max(sizes) < 15e6 and sum(sizes) <= 60e6
    ids = torch.tensor([[tok.eos_token_id] + encode(tok, "The Python tutorial")])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size) and torch.isfinite(logits).all()
