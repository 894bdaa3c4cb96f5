"""Test support of the dashboard tests: which model the app tests load.

The tests use the embedded model (data/models/pace-tiny-qwen35) when it exists. Until it does they
build a tiny random Qwen3.5 checkpoint with `save_pretrained` (and a byte-level BPE tokenizer trained
by scripts/train/tokenizer.py) and pass its folder to the app through the URL parameter `model`;
PACE_APP_TEST_RANDOM_MODEL=1 forces that tiny checkpoint even when the embedded model exists.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_DIR = REPO_ROOT / "data" / "models" / "pace-tiny-qwen35"
TEXT = ("The lobster is a large crustacean of the eastern Atlantic Ocean. It may grow to a length of "
        "sixty centimetres and bears a conspicuous pair of claws. In life the lobsters are blue. ") * 20


def tiny_checkpoint(folder: Path) -> Path:
    """Save a seeded random Qwen3.5 text model (3 GDN layers + 1 full-attention layer, d_k = d_v = 128
    as in the real models, 2 key heads, 4 value heads: γ = 2) with a 300-token tokenizer into
    `folder` (once) and return it."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from scripts.train.tokenizer import train_tokenizer

    tok = train_tokenizer([TEXT], vocab_size=300, min_frequency=1)
    cfg = Qwen3_5TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def app_model_param(cache_dir: Path) -> dict[str, str]:
    """URL parameters that select the test model: {} for the embedded model, else {'model': folder}."""
    if (EMBEDDED_DIR / "config.json").exists() and not os.environ.get("PACE_APP_TEST_RANDOM_MODEL"):
        return {}
    return {"model": str(tiny_checkpoint(cache_dir / "tiny-qwen35"))}
