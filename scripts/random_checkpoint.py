"""A random-initialised checkpoint at a published shape, saved with ``save_pretrained``.

    python scripts/random_checkpoint.py --shape qwen3.5-4b --out /tmp/qwen35-4b [--device cuda]

No hub is reachable here, so the app's and the CLI's loading path (``from_pretrained`` of a local
folder) is measured on checkpoints of the published shapes (:data:`pace_core.shapes.PUBLISHED_CONFIGS`)
with random weights in the published dtype. The tokenizer is the embedded model's (its ids are a prefix
of the published vocabulary; the model keeps the published vocabulary size, so its logits cost what the
real model's do). The numbers such a model produces say nothing about quality, only about time and memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from pace_core.shapes import PUBLISHED_CONFIGS  # noqa: E402

EMBEDDED = REPO_ROOT / "data" / "models" / "pace-tiny-qwen35"


def save_random_checkpoint(shape: str, out: Path, device: str = "cpu", seed: int = 0) -> Path:
    """Build the causal LM of ``PUBLISHED_CONFIGS[shape]`` with random weights on ``device`` and save it
    (safetensors, bf16 as published) with the embedded model's tokenizer to ``out``; returns ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    fields = dict(PUBLISHED_CONFIGS[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    dtype = getattr(torch, fields["dtype"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(EMBEDDED))
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", required=True, choices=sorted(PUBLISHED_CONFIGS))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cpu", help="where the weights are initialised (cuda is faster)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(save_random_checkpoint(args.shape, args.out, args.device, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
