"""Text inputs of the analyses: corpus paths, reading a text file, tokenising it.

The corpora live outside the repository in ``<repo>/../shared/corpus/`` (see its README): the
WikiText-2 validation split is for calibration and tuning, the test split only for held-out
perplexity.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pace_core.errors import PaceError

REPO_ROOT = Path(__file__).resolve().parents[2]
CORPUS_DIR = REPO_ROOT.parent / "shared" / "corpus"
CALIBRATION_TEXT = CORPUS_DIR / "wikitext2-valid.txt"
TEST_TEXT = CORPUS_DIR / "wikitext2-test.txt"


def read_text(path: str | os.PathLike, field: str = "text") -> str:
    """The UTF-8 content of ``path``; PaceError (naming ``field``) if it is missing, not a file,
    not UTF-8 or has no non-whitespace character."""
    p = Path(path)
    if not p.exists():
        raise PaceError(f"{field}: file {str(p)!r} does not exist; allowed: a path to a UTF-8 text file")
    if not p.is_file():
        raise PaceError(f"{field}: {str(p)!r} is not a file; allowed: a path to a UTF-8 text file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise PaceError(f"{field}: {str(p)!r} is not UTF-8 text ({err}); allowed: a UTF-8 text file") from err
    if not text.strip():
        raise PaceError(f"{field}: {str(p)!r} is empty; allowed: a text file with at least 2 tokens of text")
    return text


def tokenize(
    tokenizer, text: str, max_tokens: int | None = None, min_tokens: int = 2, field: str = "text"
) -> torch.Tensor:
    """Token ids of ``text`` (no special tokens added), truncated to ``max_tokens``: -> [1, T] int64.

    PaceError if fewer than ``min_tokens`` tokens remain.
    """
    if max_tokens is not None and max_tokens < min_tokens:
        raise PaceError(f"max_tokens: must be >= {min_tokens}, got {max_tokens}")
    if max_tokens is not None:
        # Tokenise a prefix that certainly holds max_tokens tokens when the text is long enough
        # (a token covers at least one character), so huge files are not tokenised whole.
        text = text[: max(max_tokens * 64, 4096)]
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < min_tokens:
        raise PaceError(f"{field}: the text gives {len(ids)} tokens; need at least {min_tokens}")
    return torch.tensor([ids], dtype=torch.long)


def is_test_split(path: str | os.PathLike) -> bool:
    """True when ``path`` is the WikiText-2 test split (by name, or by content when the shared test
    file exists), which must never be used for calibration or tuning."""
    p = Path(path)
    if p.name == TEST_TEXT.name:
        return True
    if TEST_TEXT.is_file() and p.is_file() and p.stat().st_size == TEST_TEXT.stat().st_size:
        return p.read_bytes() == TEST_TEXT.read_bytes()
    return False
