"""Train, evaluate and export the embedded default model (a small Qwen3.5-architecture hybrid).

Commands (``python scripts/train/train.py ...``, from the repository root):

``prepare --out DIR``
    Train the byte-level BPE tokenizer on the training text and write token ids as uint16
    ``train.bin`` / ``val.bin`` plus ``meta.json`` and ``tokenizer/`` into DIR, so that a GPU run needs
    only DIR. Training text: ``tinyshakespeare.txt``, ``python311-docs.txt`` and the first 90 % (by
    lines) of ``wikitext2-valid.txt``; the last 10 % of the valid split is the held-out set for early
    stopping. ``wikitext2-test.txt`` is never read here. Each file becomes ``<|endoftext|>`` + its ids.

``[train] --out DIR --data DIR [--resume DIR] [--minutes M] [--total-minutes T] [--max-steps N] [--seed S] ...``
    Train a ``Qwen3_5ForCausalLM`` from scratch (or resume). Random windows of ``seq_len + 1`` tokens
    from ``train.bin`` (a generator seeded by ``(seed, step)``), AdamW, bf16 autocast on CUDA, residual
    dropout on every mixer/MLP output (training only), gradient clipping. LR: linear warm-up, then
    warmup-stable-decay: constant until progress ``1 - decay_fraction``, then linear decay to
    ``min_lr_ratio * lr`` at progress 1. Progress is the training time spent so far (all runs
    together) over ``--total-minutes`` or, without it, the step over ``--max-steps``. Every
    ``--eval-every`` steps the mean token loss on ``val.bin`` (non-overlapping ``seq_len`` windows) is
    measured; each improvement is saved (bf16 safetensors, sharded) to ``OUT/best``; ``--patience``
    evaluations without improvement stop the run. ``OUT/run_log.json`` holds the config, the loss
    curve and the best evaluation. With ``--state-dir``, the fp32 weights and AdamW state are saved
    there at the end (``full_state.pt``).
    ``--resume DIR`` takes DIR/full_state.pt when it exists (weights, optimizer, step, time, curve:
    an exact continuation), else DIR/best + DIR/run_log.json (bf16 weights, the step, time and curve
    of that best checkpoint). The second form has no optimizer state (it is too large to bring back
    from the GPU machine), so AdamW starts from zero moments and the LR warms up again over
    ``--warmup-steps``.

``bpb --model DIR --text FILE [--window W --stride S]``
    Bits per byte of a text under a saved model in fp32: :func:`pace_core.analysis.quality.perplexity`'s
    sliding windows, as ``python -m pace_core perplexity`` measures every configuration.

``generate --model DIR --prompt TEXT [--new-tokens N]``
    Greedy continuation of a prompt.

``export --run DIR --data DIR --out DIR``
    Package a run's best checkpoint for shipping: bf16 safetensors in shards of at most 14 MB,
    config, generation config, tokenizer, ``training_config.json``, ``loss_curve.csv`` and
    ``loss_curve.png``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import hashlib
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel
from transformers.models.qwen3_5 import Qwen3_5TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: pace_core

from pace_core.errors import PaceError
from scripts.train.tokenizer import EOS_TOKEN, save_tokenizer, train_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = REPO_ROOT.parent / "shared" / "corpus"
TRAIN_FILES = ("tinyshakespeare.txt", "python311-docs.txt")
VALID_FILE = "wikitext2-valid.txt"
HELD_OUT_FRACTION = 0.1
GDN_PER_ATTENTION = 3  # layer pattern: 3 linear_attention (GDN) layers, then 1 full_attention layer
CHECKPOINT_SHARD = "14MB"  # every shipped file stays under 15 MB


# ----------------------------------------------------------------------------------------- data


def split_valid_lines(text: str, held_out_fraction: float = HELD_OUT_FRACTION) -> tuple[str, str]:
    """Split a text by lines: the first ``1 - held_out_fraction`` for training, the rest held out."""
    if not 0.0 < held_out_fraction < 1.0:
        raise PaceError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    lines = text.splitlines(keepends=True)
    cut = int(len(lines) * (1.0 - held_out_fraction))
    return "".join(lines[:cut]), "".join(lines[cut:])


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with no special tokens (the whole text in one pass)."""
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def _read(path: Path) -> str:
    if not path.is_file():
        raise PaceError(f"corpus file {path} not found (corpus folder must hold {TRAIN_FILES + (VALID_FILE,)})")
    return path.read_text(encoding="utf-8")


def prepare(out_dir: str | Path, corpus: str | Path = DEFAULT_CORPUS, vocab_size: int = 12288) -> dict:
    """Train the tokenizer and write ``train.bin``, ``val.bin`` (uint16), ``meta.json``, ``tokenizer/``.

    Returns the metadata written to ``meta.json`` (token and byte counts, sources and their sha256).
    """
    corpus, out = Path(corpus), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sources = {name: _read(corpus / name) for name in TRAIN_FILES + (VALID_FILE,)}
    valid_train, valid_held_out = split_valid_lines(sources[VALID_FILE])
    train_texts = [sources[name] for name in TRAIN_FILES] + [valid_train]
    tokenizer = train_tokenizer(train_texts, vocab_size)
    save_tokenizer(tokenizer, out / "tokenizer")
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    train_ids: list[int] = []
    for text in train_texts:
        train_ids += [eos] + encode(tokenizer, text)
    val_ids = [eos] + encode(tokenizer, valid_held_out)
    np.asarray(train_ids, dtype=np.uint16).tofile(out / "train.bin")
    np.asarray(val_ids, dtype=np.uint16).tofile(out / "val.bin")
    meta = {
        "vocab_size": len(tokenizer),
        "eos_token_id": eos,
        "pad_token_id": tokenizer.pad_token_id,
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
        "train_bytes": sum(len(t.encode("utf-8")) for t in train_texts),
        "val_bytes": len(valid_held_out.encode("utf-8")),
        "train_sources": list(TRAIN_FILES) + [f"{VALID_FILE} lines [0, 90%)"],
        "val_source": f"{VALID_FILE} lines [90%, 100%)",
        "sha256": {name: hashlib.sha256(text.encode("utf-8")).hexdigest() for name, text in sources.items()},
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def load_tokens(path: str | Path) -> torch.Tensor:
    """The uint16 ids of a ``.bin`` file as an int64 tensor ``[N]``."""
    arr = np.fromfile(Path(path), dtype=np.uint16)
    if arr.size < 2:
        raise PaceError(f"token file {path} must hold at least 2 tokens, has {arr.size}")
    return torch.from_numpy(arr.astype(np.int64))


def sample_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len + 1`` consecutive tokens: ``[B, seq_len + 1]``."""
    if tokens.numel() <= seq_len + 1:
        raise PaceError(f"seq_len must be below the number of training tokens ({tokens.numel()}), got {seq_len}")
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])


# ---------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelSize:
    """Shape of the model; GDN heads are d_k = d_v = 128 with twice as many value as key heads."""

    hidden_size: int = 512
    num_layers: int = 8
    intermediate_size: int = 768
    gdn_key_heads: int = 2
    attention_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 128
    max_position_embeddings: int = 8192


def build_config(
    vocab_size: int, eos_token_id: int, pad_token_id: int, size: ModelSize = ModelSize()
) -> Qwen3_5TextConfig:
    """A ``Qwen3_5TextConfig`` with 3 GDN layers per full-attention layer, d_k = d_v = 128, γ = 2."""
    if size.num_layers % (GDN_PER_ATTENTION + 1):
        raise PaceError(f"num_layers must be a multiple of {GDN_PER_ATTENTION + 1}, got {size.num_layers}")
    layer_types = [
        "full_attention" if (i + 1) % (GDN_PER_ATTENTION + 1) == 0 else "linear_attention"
        for i in range(size.num_layers)
    ]
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.attention_heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=size.gdn_key_heads,
        linear_num_value_heads=2 * size.gdn_key_heads,
        layer_types=layer_types,
        max_position_embeddings=size.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def add_residual_dropout(model: PreTrainedModel, p: float) -> list:
    """Dropout (training mode only) on the output of every token mixer and MLP; returns the hook handles."""

    def hook(_module, _inputs, output):
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, model.training),) + output[1:]
        return F.dropout(output, p, model.training)

    handles = []
    for layer in model.model.layers:
        mixer = layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn
        handles += [mixer.register_forward_hook(hook), layer.mlp.register_forward_hook(hook)]
    return handles


def save_bf16(model: PreTrainedModel, out_dir: str | Path, max_shard_size: str | int) -> None:
    """Save a bf16 copy of ``model`` (safetensors, sharded at ``max_shard_size``) to ``out_dir``."""
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    copy.deepcopy(model).to(device="cpu", dtype=torch.bfloat16).save_pretrained(str(out), max_shard_size=max_shard_size)


def next_token_loss(model: PreTrainedModel, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``batch[:, 1:]`` from ``batch[:, :-1]`` (``batch [B, T+1]``)."""
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


@torch.no_grad()
def evaluate(
    model: PreTrainedModel, tokens: torch.Tensor, seq_len: int, batch_size: int, device: torch.device
) -> float:
    """Mean token loss (nats) over non-overlapping ``seq_len`` windows of ``tokens [N]``.

    Every token after the first is predicted once, from the tokens before it in its window.
    """
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    n_full = (tokens.numel() - 1) // seq_len
    full = tokens[: n_full * seq_len + 1]
    starts = list(range(0, n_full * seq_len, seq_len))
    groups = [
        torch.stack([full[s : s + seq_len + 1] for s in starts[i : i + batch_size]])
        for i in range(0, len(starts), batch_size)
    ]
    if tokens.numel() - 1 > n_full * seq_len:
        groups.append(tokens[n_full * seq_len :].unsqueeze(0))
    for batch in groups:
        batch = batch.to(device)
        with _autocast(device):
            logits = model(input_ids=batch[:, :-1]).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    model.train(was_training)
    return total / count


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


# ------------------------------------------------------------------------------------- training


@dataclass
class TrainArgs:
    out: str
    data: str = ".train_data"
    resume: str | None = None
    state_dir: str | None = None
    minutes: float | None = None
    total_minutes: float | None = None
    max_steps: int | None = None
    seed: int = 0
    seq_len: int = 1024
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 200
    decay_fraction: float = 0.3
    weight_decay: float = 0.1
    beta2: float = 0.95
    grad_clip: float = 1.0
    dropout: float = 0.1
    eval_every: int = 500
    eval_batch_size: int = 16
    log_every: int = 50
    patience: int = 20
    max_shard_size: str = CHECKPOINT_SHARD
    device: str = "auto"
    hidden_size: int = ModelSize.hidden_size
    num_layers: int = ModelSize.num_layers
    intermediate_size: int = ModelSize.intermediate_size
    gdn_key_heads: int = ModelSize.gdn_key_heads
    attention_heads: int = ModelSize.attention_heads
    kv_heads: int = ModelSize.kv_heads

    def validate(self) -> TrainArgs:
        if self.minutes is None and self.max_steps is None:
            raise PaceError("minutes or max_steps must be given (a run needs a stopping point)")
        if self.total_minutes is None and self.max_steps is None:
            raise PaceError("total_minutes or max_steps must be given (the LR schedule needs an end)")
        if not 0.0 <= self.dropout < 1.0:
            raise PaceError(f"dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise PaceError(f"decay_fraction must be in [0, 1], got {self.decay_fraction}")
        return self

    def model_size(self) -> ModelSize:
        return ModelSize(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            intermediate_size=self.intermediate_size,
            gdn_key_heads=self.gdn_key_heads,
            attention_heads=self.attention_heads,
            kv_heads=self.kv_heads,
        )


def learning_rate(args: TrainArgs, run_step: int, progress: float, warm: bool) -> float:
    """LR at a step: linear warm-up over ``warmup_steps`` steps of this run (when ``warm``), then WSD.

    ``progress`` in [0, 1] is the share of the planned training done; the LR is ``args.lr`` until
    ``1 - decay_fraction`` and falls linearly to ``min_lr_ratio * lr`` at progress 1.
    """
    start = 1.0 - args.decay_fraction
    if progress <= start or args.decay_fraction == 0.0:
        factor = 1.0
    else:
        frac = min(1.0, (progress - start) / args.decay_fraction)
        factor = 1.0 - frac * (1.0 - args.min_lr_ratio)
    if warm and run_step < args.warmup_steps:
        factor *= (run_step + 1) / args.warmup_steps
    return args.lr * factor


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _gdn_kernel() -> str:
    """Which chunked gated-delta-rule implementation the model uses: fla's Triton kernel or torch's."""
    return "fla" if "fla.ops.gated_delta_rule" in sys.modules else "torch"


def _run_summary(log: dict) -> dict:
    """What a later run keeps of an earlier one: its arguments, where it stopped and its best evaluation."""
    keys = ("args", "device", "resumed_from", "stop_reason", "final_step", "run_steps", "run_seconds", "best")
    return {k: log[k] for k in keys}


def train(args: TrainArgs) -> dict:
    """Run training as described in the module docstring; returns the run log (also in OUT/run_log.json)."""
    args.validate()
    device = _pick_device(args.device)
    torch.manual_seed(args.seed)
    data = Path(args.data)
    meta = json.loads((data / "meta.json").read_text())
    train_tokens = load_tokens(data / "train.bin")
    val_tokens = load_tokens(data / "val.bin")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    step, train_seconds, curve, best, optimizer_state = 0, 0.0, [], None, None
    resumed_from, history = None, []
    if args.resume:
        resume = Path(args.resume)
        full = resume / "full_state.pt"
        if full.is_file():
            state = torch.load(full, map_location="cpu", weights_only=False)
            config = Qwen3_5TextConfig.from_dict(state["config"])
            model = AutoModelForCausalLM.from_config(config)
            model.load_state_dict(state["model"])
            optimizer_state = state["optimizer"]
            step, train_seconds, curve, best = state["step"], state["train_seconds"], state["curve"], state["best"]
            history = state["history"]
            resumed_from = {"path": str(resume), "kind": "full_state", "step": step}
        else:
            prior = json.loads((resume / "run_log.json").read_text())
            if prior["best"] is None:
                raise PaceError(f"resume folder {resume} has no best checkpoint (run_log.json best is null)")
            model = AutoModelForCausalLM.from_pretrained(str(resume / "best"), dtype=torch.float32)
            best = prior["best"]
            step, train_seconds = best["step"], best["train_seconds"]
            curve = [row for row in prior["curve"] if row["step"] <= step]
            history = prior["history"] + [_run_summary(prior)]
            resumed_from = {"path": str(resume), "kind": "best_bf16_weights", "step": step}
    else:
        config = build_config(meta["vocab_size"], meta["eos_token_id"], meta["pad_token_id"], args.model_size())
        model = AutoModelForCausalLM.from_config(config)
    model.to(device)
    model.train()
    add_residual_dropout(model, args.dropout)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, args.beta2),
        fused=device.type == "cuda",
    )
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    warm = optimizer_state is None

    n_params = sum(p.numel() for p in model.parameters())
    log = {
        "args": dataclasses.asdict(args),
        "model_config": model.config.to_dict(),
        "parameters": n_params,
        "data": meta,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "resumed_from": resumed_from,
        "history": history,
        "curve": curve,
        "best": best,
    }
    tokens_per_step = args.batch_size * args.seq_len
    run_start = time.perf_counter()
    run_step, stale, window_loss, window_steps = 0, 0, torch.zeros((), device=device), 0
    stop_reason = "max_steps"
    while True:
        elapsed = time.perf_counter() - run_start
        if args.max_steps is not None and step >= args.max_steps:
            break
        if args.minutes is not None and elapsed >= args.minutes * 60:
            stop_reason = "minutes"
            break
        if args.total_minutes is not None:
            progress = (train_seconds + elapsed) / (args.total_minutes * 60)
        else:
            progress = step / args.max_steps
        lr = learning_rate(args, run_step, progress, warm)
        for group in optimizer.param_groups:
            group["lr"] = lr
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        batch = sample_batch(train_tokens, args.batch_size, args.seq_len, generator).to(device, non_blocking=True)
        with _autocast(device):
            loss = next_token_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        step += 1
        run_step += 1
        window_loss += loss.detach()
        window_steps += 1
        evaluate_now = step % args.eval_every == 0
        if step % args.log_every == 0 or evaluate_now:
            row = {
                "step": step,
                "tokens": step * tokens_per_step,
                "train_seconds": round(train_seconds + time.perf_counter() - run_start, 3),
                "lr": lr,
                "train_loss": (window_loss / window_steps).item(),
                "val_loss": None,
            }
            window_loss.zero_()
            window_steps = 0
            if evaluate_now:
                row["val_loss"] = evaluate(model, val_tokens, args.seq_len, args.eval_batch_size, device)
                if best is None or row["val_loss"] < best["val_loss"]:
                    best = {k: row[k] for k in ("step", "tokens", "train_seconds", "val_loss")}
                    save_bf16(model, out / "best", args.max_shard_size)
                    stale = 0
                else:
                    stale += 1
            curve.append(row)
            log.update(curve=curve, best=best, gdn_kernel=_gdn_kernel())
            (out / "run_log.json").write_text(json.dumps(log, indent=1))
            print(json.dumps(row), flush=True)
            if evaluate_now and stale >= args.patience:
                stop_reason = "patience"
                break
    run_seconds = time.perf_counter() - run_start
    train_seconds += run_seconds
    if not curve or curve[-1]["step"] != step or curve[-1]["val_loss"] is None:
        row = {
            "step": step,
            "tokens": step * tokens_per_step,
            "train_seconds": round(train_seconds, 3),
            "lr": lr if run_step else None,
            "train_loss": (window_loss / window_steps).item() if window_steps else None,
            "val_loss": evaluate(model, val_tokens, args.seq_len, args.eval_batch_size, device),
        }
        if best is None or row["val_loss"] < best["val_loss"]:
            best = {k: row[k] for k in ("step", "tokens", "train_seconds", "val_loss")}
            save_bf16(model, out / "best", args.max_shard_size)
        curve.append(row)
    log.update(
        curve=curve,
        best=best,
        gdn_kernel=_gdn_kernel(),
        stop_reason=stop_reason,
        final_step=step,
        tokens_seen=step * tokens_per_step,
        run_seconds=round(run_seconds, 3),
        run_steps=run_step,
        train_seconds_total=round(train_seconds, 3),
    )
    (out / "run_log.json").write_text(json.dumps(log, indent=1))
    if args.state_dir:
        state_dir = Path(args.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "config": model.config.to_dict(),
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "train_seconds": train_seconds,
                "curve": curve,
                "best": best,
                "history": history + [_run_summary(log)],
            },
            state_dir / "full_state.pt",
        )
    return log


# ----------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def greedy_generate(model: PreTrainedModel, tokenizer, prompt: str, new_tokens: int = 48) -> str:
    """The greedy continuation (argmax decoding) of ``prompt``, without the prompt."""
    ids = torch.tensor([[tokenizer.convert_tokens_to_ids(EOS_TOKEN)] + encode(tokenizer, prompt)])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :].tolist())


# ---------------------------------------------------------------------------------------- export


def write_curve_csv(curve: list[dict], path: str | Path) -> None:
    """The loss curve rows (step, tokens, train_seconds, lr, train_loss, val_loss) as CSV."""
    fields = ["step", "tokens", "train_seconds", "lr", "train_loss", "val_loss"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in curve:
            writer.writerow({k: "" if row[k] is None else row[k] for k in fields})


def plot_loss_curve(curve: list[dict], path: str | Path, size: tuple[int, int] = (900, 540)) -> None:
    """Draw train loss (blue) and validation loss (orange) against tokens seen as a PNG (Pillow)."""
    from PIL import Image, ImageDraw

    width, height = size
    left, right, top, bottom = 70, 20, 40, 50
    series = {
        "train": [(r["tokens"], r["train_loss"]) for r in curve if r["train_loss"] is not None],
        "validation": [(r["tokens"], r["val_loss"]) for r in curve if r["val_loss"] is not None],
    }
    points = series["train"] + series["validation"]
    if not points:
        raise PaceError("curve must hold at least one loss value to plot")
    x_max = max(x for x, _ in points) or 1
    y_lo = math.floor(min(y for _, y in points) * 2) / 2
    y_hi = math.ceil(min(max(y for _, y in points), y_lo + 8.0) * 2) / 2
    y_hi = max(y_hi, y_lo + 0.5)

    def xy(x: float, y: float) -> tuple[float, float]:
        y = min(max(y, y_lo), y_hi)
        return (left + (width - left - right) * x / x_max, top + (height - top - bottom) * (y_hi - y) / (y_hi - y_lo))

    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    for k in range(int((y_hi - y_lo) / 0.5) + 1):
        y = y_lo + 0.5 * k
        _, py = xy(0, y)
        draw.line([left, py, width - right, py], fill=(225, 225, 225))
        draw.text((8, py - 6), f"{y:.1f}", fill="black")
    for k in range(6):
        x = x_max * k / 5
        px, _ = xy(x, y_lo)
        draw.text((px - 20, height - bottom + 8), f"{x / 1e6:.0f}M", fill="black")
    draw.text((width // 2 - 60, height - 20), "tokens seen", fill="black")
    draw.text((left, 12), "loss (nats/token): train (blue), held-out wikitext2-valid 10% (orange)", fill="black")
    for name, colour in (("train", (31, 119, 180)), ("validation", (255, 127, 14))):
        pts = [xy(x, y) for x, y in series[name]]
        if len(pts) > 1:
            draw.line(pts, fill=colour, width=2)
        for px, py in pts if name == "validation" else []:
            draw.ellipse([px - 3, py - 3, px + 3, py + 3], fill=colour)
    img.save(path)


def export(run_dir: str | Path, data_dir: str | Path, out_dir: str | Path) -> dict:
    """Package ``run_dir/best`` (with ``run_dir/run_log.json``) into a shippable model folder."""
    run, data, out = Path(run_dir), Path(data_dir), Path(out_dir)
    log = json.loads((run / "run_log.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(run / "best"), dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(data / "tokenizer"))
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    model.generation_config = GenerationConfig(
        bos_token_id=eos, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    model.save_pretrained(str(out), max_shard_size=CHECKPOINT_SHARD)
    tokenizer.save_pretrained(str(out))
    training = {k: log[k] for k in ("args", "parameters", "data", "device", "torch", "resumed_from", "history", "best")}
    training.update(
        {k: log.get(k) for k in ("gdn_kernel", "stop_reason", "final_step", "tokens_seen", "train_seconds_total")}
    )
    (out / "training_config.json").write_text(json.dumps(training, indent=1))
    write_curve_csv(log["curve"], out / "loss_curve.csv")
    plot_loss_curve(log["curve"], out / "loss_curve.png")
    return training


# ------------------------------------------------------------------------------------------- CLI


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python scripts/train/train.py", description="train the embedded model")
    for field in dataclasses.fields(TrainArgs):
        flag = "--" + field.name.replace("_", "-")
        kind = {"int": int, "float": float, "str": str}[str(field.type).split(" |")[0]]
        if field.name == "out":
            parser.add_argument(flag, required=True)
        else:
            parser.add_argument(flag, type=kind, default=field.default)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in ("prepare", "bpb", "generate", "export", "train") else "train"
    rest = argv[1:] if argv and argv[0] == command else argv
    if command == "train":
        log = train(TrainArgs(**vars(_train_parser().parse_args(rest))))
        print(
            json.dumps(
                {
                    k: log.get(k)
                    for k in ("best", "stop_reason", "final_step", "tokens_seen", "run_seconds", "gdn_kernel")
                }
            )
        )
        return
    parser = argparse.ArgumentParser(prog=f"python scripts/train/train.py {command}")
    if command == "prepare":
        parser.add_argument("--out", required=True)
        parser.add_argument("--corpus", default=str(DEFAULT_CORPUS))
        parser.add_argument("--vocab-size", type=int, default=12288)
        a = parser.parse_args(rest)
        print(json.dumps(prepare(a.out, a.corpus, a.vocab_size), indent=1))
    elif command == "export":
        parser.add_argument("--run", required=True)
        parser.add_argument("--data", default=".train_data")
        parser.add_argument("--out", required=True)
        a = parser.parse_args(rest)
        print(json.dumps(export(a.run, a.data, a.out)["best"]))
    else:
        parser.add_argument("--model", required=True)
        if command == "bpb":
            parser.add_argument("--text", required=True)
            parser.add_argument("--window", type=int, default=1024)
            parser.add_argument("--stride", type=int, default=512)
        else:
            parser.add_argument("--prompt", required=True)
            parser.add_argument("--new-tokens", type=int, default=48)
        a = parser.parse_args(rest)
        if command == "bpb":
            from pace_core.analysis.quality import perplexity
            from pace_core.model.loading import load_model

            row = perplexity(load_model(a.model), {}, a.text, window=a.window, stride=a.stride).iloc[0]
            print(json.dumps({k: row[k] for k in ("bpb", "ppl", "nll", "tokens")} | {"window": a.window,
                                                                                    "stride": a.stride}, default=float))
        else:
            model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(a.model)
            print(greedy_generate(model, tokenizer, a.prompt, a.new_tokens))


if __name__ == "__main__":
    main()
