"""Train the project's byte-level BPE tokenizer (Hugging Face ``tokenizers``).

The tokenizer is a GPT-2 style byte-level BPE: every UTF-8 byte is in the base alphabet, so any text
round-trips exactly (needed for bits-per-byte). It is saved through ``PreTrainedTokenizerFast`` so that
``AutoTokenizer.from_pretrained(dir)`` loads it, with ``<|endoftext|>`` as bos/eos (the document
separator used in training) and ``<|pad|>`` as pad.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from pace_core.errors import PaceError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)


def _batches(texts: Iterable[str], lines_per_batch: int = 1000) -> Iterator[list[str]]:
    """Yield the texts as batches of lines (newlines kept), the unit the BPE trainer counts words in."""
    batch: list[str] = []
    for text in texts:
        for line in text.splitlines(keepends=True):
            batch.append(line)
            if len(batch) == lines_per_batch:
                yield batch
                batch = []
    if batch:
        yield batch


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` tokens (special tokens included) on ``texts``.

    Returns the ``PreTrainedTokenizerFast`` wrapper with bos/eos = ``<|endoftext|>`` and
    pad = ``<|pad|>``; no special tokens are added when encoding (the training code places them).
    """
    base = 256 + len(SPECIAL_TOKENS)
    if vocab_size <= base or vocab_size > 65535:
        raise PaceError(f"vocab_size must be in ({base}, 65535] (token ids are stored as uint16), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_batches(texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=1_000_000,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    """Save ``tokenizer`` so that ``AutoTokenizer.from_pretrained(out_dir)`` loads it; returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    return out
