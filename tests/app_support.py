"""Test support of the dashboard tests: which model the app tests load, and the app served as the README
starts it.

The tests use the embedded model (data/models/pace-tiny-qwen35) when it exists. Until it does they
build a tiny random Qwen3.5 checkpoint with `save_pretrained` (and a byte-level BPE tokenizer trained
by scripts/train/tokenizer.py) and pass its folder to the app through the URL parameter `model`, with its
parent as the operator's models folder (a link opens nothing else); PACE_APP_TEST_RANDOM_MODEL=1 forces that
tiny checkpoint even when the embedded model exists.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
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
    from app_state.controls import MODELS_DIR_ENV

    os.environ[MODELS_DIR_ENV] = str(cache_dir)  # this process's AppTests and the servers it starts
    return {"model": str(tiny_checkpoint(cache_dir / "tiny-qwen35"))}


OUTBOUND = REPO_ROOT / "tests" / "outbound"
"""A folder whose sitecustomize.py records and refuses every outbound network attempt of a Python process
started with it on PYTHONPATH (into $PACE_OUTBOUND_LOG)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served_app(folder: Path, timeout_s: float = 90) -> Iterator[tuple[str, int, Path]]:
    """``streamlit run app.py --server.headless true --server.port PORT`` exactly as the README starts it on a
    server (no other option: the rest is .streamlit/config.toml), on a free port, with every outbound network
    attempt recorded and refused (:data:`OUTBOUND`). Yields (base URL, server pid, outbound log); the log of the
    server's output is ``folder/streamlit.log``."""
    port = free_port()
    outbound = folder / "outbound.jsonl"
    # one torch thread: on the shared 2-core CI box two intra-op threads oversubscribe the cores
    env = dict(os.environ, OMP_NUM_THREADS="1", PACE_OUTBOUND_LOG=str(outbound),
               PYTHONPATH=os.pathsep.join(p for p in (str(OUTBOUND), os.environ.get("PYTHONPATH")) if p))
    log = folder / "streamlit.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
                                 "--server.port", str(port)], cwd=REPO_ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if urllib.request.urlopen(f"{base}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"streamlit did not become healthy:\n{log.read_text()}")
            time.sleep(0.5)
        yield base, proc.pid, outbound
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def plain(markdown: str) -> str:
    """The text a reader sees of Markdown whose values went through app_state.markup.escape: its backslash escapes
    undone and its invisible word joiners removed (what AppTest gives is the Markdown source)."""
    return re.sub(r"\\(.)", r"\1", markdown).replace("\u2060", "")


def outbound_attempts(log: Path) -> list[str]:
    """The outbound network attempts recorded in ``log`` (:func:`served_app`), each with where it came from."""
    return log.read_text(encoding="utf-8").splitlines() if log.exists() else []
