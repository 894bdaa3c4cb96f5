"""Quality against the fp32 reference: sliding-window perplexity, bits per byte, next-token top-1
agreement and KL divergence (spec §7).

Sliding windows follow the usual transformers recipe: windows of ``window`` tokens start every
``stride`` tokens; each window scores only the tokens not scored by an earlier window (so with
``stride < window`` every token after the first is scored exactly once, with up to ``window - stride``
tokens of context before the first scored one; with ``stride == window`` each window's first token has
no context in its window and is not scored). Each window is one independent run from an empty state. With
``decode_from``
set, a window's first ``decode_from`` tokens are the prompt (prefill, P-token segments) and the rest
is teacher-forced token by token through the decode path (buffer, flush every dP); without it the
whole window is prefilled. Note that a prefill rounds the state only at P-token segment ends, after
the logits of the segment's tokens are computed, so with P >= window a prefill-only evaluation
cannot see the state quantisation at all: ``decode_from = window - stride``, at least 1 (the CLI
default), decodes every scored token after the first window.

Windows of equal length can run together as one batch (``batch``), and the reference and every
configuration run each group of windows together: every sequence of a batch has its own state, scales and
buffer, so a batched run scores the same as window-by-window runs up to floating-point summation order
(tested); it only saves time, above all on a GPU.

Bits per byte = total NLL in bits / UTF-8 bytes of the scored tokens' text.

Every figure is also kept per window (:class:`QualityRun`: the sums over each window's scored tokens, which add
up to the totals), so a difference between configurations can be given a spread over the windows
(:mod:`pace_core.analysis.claims`).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from pace_core.analysis.text import read_text, tokenize
from pace_core.config import PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.model.teacher import DECODE_CHUNK, Member, progress_total, teacher_forced

if TYPE_CHECKING:
    from pace_core.model.loading import LoadedModel


@dataclass(frozen=True)
class Window:
    """Tokens ``[begin, end)`` run together; tokens ``[first_target, end)`` are scored."""

    begin: int
    end: int
    first_target: int


def sliding_windows(n_tokens: int, window: int, stride: int) -> list[Window]:
    """Windows covering ``n_tokens`` tokens; every token but the first is scored once, except the first
    token of each window when ``stride == window`` (no context in its window)."""
    if window < 2:
        raise PaceError(f"window: must be >= 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise PaceError(f"stride: must be in [1, window={window}], got {stride}")
    if n_tokens < 2:
        raise PaceError(f"text: need at least 2 tokens, got {n_tokens}")
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + window, n_tokens)
        out.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n_tokens:
            break
    return out


def config_map(configs: Mapping[str, PaceConfig] | list[PaceConfig]) -> dict[str, PaceConfig]:
    """``{name: config}`` of a mapping or a list of configurations (names must be unique)."""
    if isinstance(configs, Mapping):
        out = dict(configs)
    else:
        out = {}
        for cfg in configs:
            if cfg.name in out:
                raise PaceError(f"configs: two configurations are named {cfg.name!r}; names must be unique")
            out[cfg.name] = cfg
    if not out:
        raise PaceError("configs: need at least one configuration")
    for name, cfg in out.items():
        if not isinstance(cfg, PaceConfig):
            raise PaceError(f"configs[{name!r}]: {type(cfg).__name__} not allowed; allowed: a PaceConfig")
    return out


def prompt_tokens(decode_from: int | None, window: int) -> int:
    """The tokens of a ``window``-token window that are prefilled: ``decode_from`` when set and shorter, else
    all of them."""
    return decode_from if decode_from is not None and decode_from < window else window


MOST_WINDOWS_PER_BATCH = 16
"""The most windows :func:`windows_per_batch` runs together."""


def windows_per_batch(loaded: LoadedModel, members: int, window: int, decode_from: int | None) -> int:
    """The default ``batch`` of :func:`evaluate_quality` **[ours]**: 1 on the CPU (memory there is the
    host's, shared with everything else); on a GPU the most windows, up to :data:`MOST_WINDOWS_PER_BATCH`,
    whose largest logits tensor fits in half of the free memory of the device the logits appear on (the
    last under ``device_map``): ``members`` (configurations and the reference) x windows x positions of one
    forward (the prompt's, or a decode chunk's) x vocabulary, in float32 and, for another weight dtype, its
    copy in that dtype."""
    where = loaded.output_device
    if where.type != "cuda":
        return 1
    d = prompt_tokens(decode_from, window)
    positions = max(d, min(DECODE_CHUNK, window - d))
    item = 4 + (0 if loaded.dtype == torch.float32 else loaded.dtype.itemsize)
    per_window = members * positions * loaded.model.config.get_text_config(decoder=True).vocab_size * item
    free, _ = torch.cuda.mem_get_info(where)
    return max(1, min(MOST_WINDOWS_PER_BATCH, int(free // 2 // per_window)))


def batched_windows(windows: list[Window], batch: int) -> list[list[Window]]:
    """Consecutive windows grouped into runs of at most ``batch`` windows of equal length."""
    if batch < 1:
        raise PaceError(f"batch: must be >= 1 window, got {batch}")
    groups: list[list[Window]] = []
    for w in windows:
        last = groups[-1] if groups else None
        if last is not None and len(last) < batch and last[0].end - last[0].begin == w.end - w.begin:
            last.append(w)
        else:
            groups.append([w])
    return groups


@dataclass(frozen=True)
class QualityRun:
    """The quality of configurations on one text. ``table``: one row per configuration (the reference first):
    config, tokens, nll (mean nats per scored token), ppl, agreement, kl (and bpb from :func:`perplexity_run`).
    ``windows``: one row per configuration and window, in window order: config, window (its index), begin, end
    (its tokens), tokens (scored), nll (nats), agreed (scored tokens whose top-1 is the reference's), kl (nats),
    sums over the window's scored tokens whose totals are the table's (a window scores disjoint tokens)."""

    table: pd.DataFrame
    windows: pd.DataFrame


WINDOW_COLUMNS = ("config", "window", "begin", "end", "tokens", "nll", "agreed", "kl")
"""The columns of :attr:`QualityRun.windows`."""


def evaluate_quality(
    loaded: LoadedModel,
    configs: Mapping[str, PaceConfig] | list[PaceConfig],
    ids: torch.Tensor,
    *,
    window: int = 512,
    stride: int = 256,
    decode_from: int | None = None,
    reference: PaceConfig | None = None,
    batch: int = 1,
    progress: Callable[[int], None] | None = None,
) -> pd.DataFrame:
    """Perplexity, NLL, top-1 agreement and KL(reference ‖ config) per configuration.

    ids [1, T] int64; ``configs`` may be empty (the reference alone), each calibrated on the model where its
    method needs it; ``batch``: at most this many windows of equal length run
    together. The reference and every configuration run each group of windows in one teacher-forced batch
    (:func:`pace_core.model.teacher.teacher_forced`), their log-probabilities compared on the model's device.
    Returns one row per configuration (the reference first, named as given, with agreement 1 and KL 0):
    config, tokens, nll (mean nats per scored token), ppl, agreement, kl. ``progress(n)``: units of
    :func:`quality_progress_total`. The table of :func:`quality_run`.
    """
    return quality_run(loaded, configs, ids, window=window, stride=stride, decode_from=decode_from,
                       reference=reference, batch=batch, progress=progress).table


def quality_run(
    loaded: LoadedModel,
    configs: Mapping[str, PaceConfig] | list[PaceConfig],
    ids: torch.Tensor,
    *,
    window: int = 512,
    stride: int = 256,
    decode_from: int | None = None,
    reference: PaceConfig | None = None,
    batch: int = 1,
    progress: Callable[[int], None] | None = None,
) -> QualityRun:
    """:func:`evaluate_quality` (same arguments, ids [1, T] int64) with the figures of every window
    (:class:`QualityRun`)."""
    cfgs = config_map(configs) if configs else {}
    ref = reference if reference is not None else get_config("fp32")
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise PaceError(f"ids: expected shape [1, T], got {tuple(ids.shape)}")
    if decode_from is not None and decode_from < 1:
        raise PaceError(f"decode_from: must be >= 1 (prompt tokens per window), got {decode_from}")
    windows = sliding_windows(ids.shape[1], window, stride)
    if ref.name in cfgs and cfgs[ref.name] != ref:
        raise PaceError(f"configs: {ref.name!r} names the reference; allowed: another name for a different config")
    names = [ref.name] + [n for n in cfgs if n != ref.name]
    members = [Member(ref.name, ref)] + [Member(n, c) for n, c in cfgs.items() if n != ref.name]
    device = loaded.device
    # reduced where the logits appear (under device_map the last GPU, the ids go to the first)
    totals = torch.zeros(len(members), 3, dtype=torch.float64, device=loaded.output_device)  # nll, agreement, kl
    per_window = torch.zeros(len(members), len(windows), 3, dtype=torch.float64, device=loaded.output_device)
    count, done = 0, 0
    stacks: dict = {}  # batches of one shape run on one store stack (its CUDA graphs recorded once)
    for group in batched_windows(windows, batch):
        chunk = torch.cat([ids[:, w.begin : w.end] for w in group]).to(device)
        W = chunk.shape[1]
        d = prompt_tokens(decode_from, W)
        first_scored = [w.first_target - w.begin for w in group]  # window positions of the first target
        count += sum(W - f for f in first_scored)

        def on_logits(logits: torch.Tensor, first: int, chunk=chunk, first_scored=first_scored, done=done) -> None:
            sums = window_sums(logits, first, chunk, first_scored)
            per_window[:, done:done + len(first_scored)] += sums
            totals.add_(sums.sum(1))

        teacher_forced(loaded, members, chunk, d, on_logits=on_logits, logits_from=min(first_scored) - 1,
                       progress=progress, stacks=stacks)
        done += len(group)
    totals, per_window = totals.cpu(), per_window.cpu()
    table = pd.DataFrame([{"config": name, "tokens": count, "nll": float(totals[m, 0]) / count,
                           "ppl": math.exp(float(totals[m, 0]) / count), "agreement": float(totals[m, 1]) / count,
                           "kl": max(float(totals[m, 2]) / count, 0.0)} for m, name in enumerate(names)])
    rows = [{"config": name, "window": j, "begin": w.begin, "end": w.end, "tokens": w.end - w.first_target,
             "nll": float(per_window[m, j, 0]), "agreed": int(per_window[m, j, 1]), "kl": float(per_window[m, j, 2])}
            for m, name in enumerate(names) for j, w in enumerate(windows)]
    return QualityRun(table, pd.DataFrame(rows, columns=list(WINDOW_COLUMNS)))


REDUCE_BYTES = 1 << 28
"""The most bytes of float64 log-probabilities :func:`window_sums` holds at once per member (it takes the windows
in slices of this size)."""


def window_sums(logits: torch.Tensor, first: int, ids: torch.Tensor, first_scored: list[int]) -> torch.Tensor:
    """``[M, N, 3]`` float64 on the logits' device: each member's and window's sums over the targets a forward's
    logits predict: NLL (nats), top-1 agreement with the reference (member 0) and KL(reference ‖ member) (nats).

    ``logits [M·N, t, vocab]`` of positions ``first .. first + t - 1`` (member ``m``'s window ``i`` in row
    ``m·N + i``), ``ids [N, W]`` the windows' tokens, ``first_scored[i]`` the position of window ``i``'s first
    target; a position ``p`` counts when it predicts a target (``first_scored[i] - 1 <= p < W - 1``). Consecutive
    windows of one first target are reduced together, in slices of at most :data:`REDUCE_BYTES` of float64 log-
    probabilities per member."""
    N, W = ids.shape
    M, t, vocab = logits.shape[0] // N, logits.shape[1], logits.shape[2]
    by_member, ids = logits.view(M, N, t, vocab), ids.to(logits.device)
    out = torch.zeros(M, N, 3, dtype=torch.float64, device=logits.device)
    i = 0
    for f, run in itertools.groupby(first_scored):
        end = i + len(list(run))
        lo, hi = max(f - 1, first), min(W - 1, first + t)  # positions predicting targets
        step = max(1, REDUCE_BYTES // (max(hi - lo, 1) * vocab * 8))
        for a in range(i, end, step) if lo < hi else ():
            b = min(a + step, end)
            targets = ids[a:b, lo + 1:hi + 1].unsqueeze(-1)  # [n, L, 1]
            ref = torch.log_softmax(by_member[0, a:b, lo - first:hi - first].double(), dim=-1)
            ref_top, ref_p = ref.argmax(-1), ref.exp()
            for m in range(M):
                logp = ref if m == 0 else torch.log_softmax(by_member[m, a:b, lo - first:hi - first].double(), dim=-1)
                out[m, a:b, 0] = -logp.gather(-1, targets).sum((1, 2))
                out[m, a:b, 1] = (logp.argmax(-1) == ref_top).sum(1)
                out[m, a:b, 2] = (ref_p * (ref - logp)).sum((1, 2))
        i = end
    return out


def quality_progress_total(loaded: LoadedModel, configs: int, n_tokens: int, window: int, stride: int,
                           decode_from: int | None, batch: int) -> int:
    """The progress units of :func:`evaluate_quality` (and :func:`perplexity`) with ``configs``
    configurations besides the reference on ``n_tokens`` tokens."""
    total = 0
    for group in batched_windows(sliding_windows(n_tokens, window, stride), batch):
        W = group[0].end - group[0].begin
        total += progress_total(configs + 1, len(loaded.gdn_layers), W, prompt_tokens(decode_from, W))
    return total


def scored_bytes(tokenizer, ids: torch.Tensor, windows: list[Window]) -> int:
    """UTF-8 bytes of the text of the tokens the windows score (ids [1, T]); consecutive scored
    spans are decoded together."""
    spans: list[list[int]] = []
    for w in windows:
        if spans and spans[-1][1] == w.first_target:
            spans[-1][1] = w.end
        else:
            spans.append([w.first_target, w.end])
    return sum(len(tokenizer.decode(ids[0, a:b].tolist()).encode("utf-8")) for a, b in spans)


def perplexity(loaded: LoadedModel, configs: Mapping[str, PaceConfig] | list[PaceConfig],
               text_path: str | os.PathLike, **options: Any) -> pd.DataFrame:
    """The table of :func:`perplexity_run` (same arguments)."""
    return perplexity_run(loaded, configs, text_path, **options).table


def perplexity_run(
    loaded: LoadedModel,
    configs: Mapping[str, PaceConfig] | list[PaceConfig],
    text_path: str | os.PathLike,
    *,
    window: int = 512,
    stride: int = 256,
    max_tokens: int | None = None,
    decode_from: int | None = None,
    reference: PaceConfig | None = None,
    batch: int = 1,
    progress: Callable[[int], None] | None = None,
) -> QualityRun:
    """Quality on a text file (first ``max_tokens`` tokens): the rows of :func:`evaluate_quality` plus ``bpb``
    (bits per UTF-8 byte of the scored text) as its table, with the figures of every window (:class:`QualityRun`)."""
    ids = tokenize(loaded.tokenizer, read_text(text_path), max_tokens)
    run = quality_run(
        loaded, configs, ids.to(loaded.device), window=window, stride=stride, decode_from=decode_from,
        reference=reference, batch=batch, progress=progress,
    )
    n_bytes = scored_bytes(loaded.tokenizer, ids, sliding_windows(ids.shape[1], window, stride))
    if n_bytes == 0:
        raise PaceError(f"text: {str(text_path)!r} gives no scored bytes")
    run.table["bpb"] = run.table["nll"] * run.table["tokens"] / (math.log(2) * n_bytes)
    return run
