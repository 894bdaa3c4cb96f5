"""Side-by-side generations of several configurations (spec §7).

Every configuration continues the same prompt, all of them (and the fp32 reference) as rows of one
``generate`` batch, each row with its own PACE state (:func:`pace_core.model.patch.stacked`): greedily,
and/or by sampling with common random numbers **[ours]**: at step t every row draws its token as the argmax
of its temperature-scaled, top-p-filtered logits plus the same Gumbel noise vector (seeded by ``seed``
and t), which is an exact sample of each row's own distribution, so sampled texts differ only where the
states do. Every continuation is then scored by the fp32 reference model, teacher-forced on prompt +
continuation (one batch): the mean NLL of the generated tokens under the reference and the share of them
that the reference would also pick as its top-1 token. The first divergent token is counted against the
reference's continuation of the same mode. A continuation ends at the end-of-text token (kept) or after
``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import pandas as pd
import torch
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from pace_core.analysis.quality import config_map
from pace_core.config import PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.model.patch import pace, stacked
from pace_core.model.teacher import Member

if TYPE_CHECKING:
    from pace_core.model.loading import LoadedModel

MODES = ("greedy", "sampled")


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first token where ``other`` differs from ``reference``; the shorter length when
    one is a strict prefix of the other; None when they are identical."""
    for i, (r, o) in enumerate(zip(reference, other)):
        if r != o:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


class _CommonGumbel(LogitsProcessor):
    """Adds to every row the same Gumbel(0, 1) noise vector of step t (from ``seed`` and t): the argmax of
    the processed logits is then a sample of each row's distribution with common random numbers; calls
    ``progress(1)`` per step."""

    def __init__(self, seed: int, progress: Callable[[int], None] | None) -> None:
        self.seed, self.step, self.progress = seed, 0, progress

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.step)
        u = torch.rand(scores.shape[-1], generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0)
        self.step += 1
        if self.progress is not None:
            self.progress(1)
        return scores + (-torch.log(-torch.log(u))).to(scores.device, scores.dtype)


class _Progress(LogitsProcessor):
    """Calls ``progress(1)`` per generated step (greedy)."""

    def __init__(self, progress: Callable[[int], None] | None) -> None:
        self.progress = progress

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.progress is not None:
            self.progress(1)
        return scores


def _continuations(loaded: LoadedModel, members: list[Member], ids: torch.Tensor, mode: str, max_new_tokens: int,
                   seed: int, temperature: float, top_p: float,
                   progress: Callable[[int], None] | None) -> list[list[int]]:
    """Each member's new token ids for prompt ids [1, T]: one generate call, one row per member."""
    model, tok = loaded.model, loaded.tokenizer
    rows = ids.repeat(len(members), 1)
    if mode == "greedy":
        processors = [_Progress(progress)]
    else:
        processors = [TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p), _CommonGumbel(seed, progress)]
    with stacked(model, [m.cfg for m in members], 1, device=loaded.device) as (cache, _), torch.no_grad():
        out = model.generate(input_ids=rows, attention_mask=torch.ones_like(rows), past_key_values=cache,
                             max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                             logits_processor=LogitsProcessorList(processors), pad_token_id=tok.pad_token_id)
    eos = model.generation_config.eos_token_id
    ends = {eos} if isinstance(eos, int) else set(eos or ())
    new = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in ends), len(row))
        new.append(row[:cut])
    return new


def _scores(loaded: LoadedModel, reference: PaceConfig, ids: torch.Tensor, news: list[list[int]]
            ) -> list[tuple[float, float]]:
    """(mean NLL, top-1 agreement) of each continuation after prompt ids [1, T] under ``reference``, one
    forward for all (right-padded; the padding is never scored)."""
    T = ids.shape[1]
    width = max((len(n) for n in news), default=0)
    if width == 0:
        return [(float("nan"), float("nan"))] * len(news)
    pad = loaded.tokenizer.pad_token_id
    batch = torch.full((len(news), T + width), pad, dtype=ids.dtype, device=ids.device)
    batch[:, :T] = ids
    for i, n in enumerate(news):
        batch[i, T:T + len(n)] = torch.tensor(n, dtype=ids.dtype)
    with pace(loaded.model, reference), torch.no_grad():
        logits = loaded.model(input_ids=batch).logits[:, T - 1:-1]
    out = []
    for i, n in enumerate(news):
        if not n:
            out.append((float("nan"), float("nan")))
            continue
        logp = torch.log_softmax(logits[i, :len(n)].double(), dim=-1)
        target = batch[i, T:T + len(n)].to(logp.device)  # the logits' device: the last GPU under device_map
        out.append((float(-logp.gather(1, target[:, None]).mean()), float((logp.argmax(-1) == target).double().mean())))
    return out


def generate_side_by_side(
    loaded: LoadedModel,
    configs: Mapping[str, PaceConfig] | list[PaceConfig],
    prompt: str,
    *,
    max_new_tokens: int = 64,
    modes: Sequence[str] = MODES,
    seed: int = 0,
    temperature: float = 0.8,
    top_p: float = 0.95,
    reference: PaceConfig | None = None,
    reference_rows: pd.DataFrame | None = None,
    progress: Callable[[int], None] | None = None,
) -> pd.DataFrame:
    """One row per (mode, configuration), the reference first in each mode: mode, config, tokens
    (new ids), pieces (their texts), text, first_divergence (Int64, <NA> when identical to the reference's
    continuation),
    ref_nll (mean nats per generated token under the reference), ref_agreement. Each configuration is
    calibrated on the model where its method needs it.

    ``reference_rows``: the reference's rows of an earlier call with the same prompt, modes and settings;
    the reference is then not generated again and the table holds only the configurations' rows."""
    cfgs = config_map(configs) if configs else {}
    ref = reference if reference is not None else get_config("fp32")
    if not prompt:
        raise PaceError("prompt: must be non-empty text")
    if not 1 <= max_new_tokens <= 4096:
        raise PaceError(f"max_new_tokens: must be in [1, 4096], got {max_new_tokens}")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise PaceError(f"modes: {bad or list(modes)} not allowed; allowed: {', '.join(MODES)}")
    if not (temperature > 0 and 0 < top_p <= 1):
        raise PaceError(f"temperature/top_p: need temperature > 0 and top_p in (0, 1], got {temperature}, {top_p}")
    ids = loaded.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(loaded.device)
    if ids.shape[1] == 0:
        raise PaceError("prompt: gives no tokens")
    kept = {}
    if reference_rows is not None:
        kept = {row["mode"]: list(row["tokens"]) for _, row in reference_rows.iterrows() if row["config"] == ref.name}
        if sorted(kept) != sorted(modes):
            raise PaceError(f"reference_rows: hold the modes {sorted(kept)}, this call asks for {sorted(modes)}; "
                            "allowed: the reference rows of a call with the same prompt, modes and settings")
    run = {**({} if kept else {ref.name: ref}), **{n: c for n, c in cfgs.items() if n != ref.name}}
    members = [Member(n, c) for n, c in run.items()]
    rows = []
    for mode in modes:
        news = _continuations(loaded, members, ids, mode, max_new_tokens, seed, temperature, top_p,
                              progress) if members else []
        ref_new = kept[mode] if kept else news[0]
        for (name, new), (nll, agreement) in zip(zip(run, news), _scores(loaded, ref, ids, news)):
            rows.append({"mode": mode, "config": name, "tokens": new,
                         "pieces": [loaded.tokenizer.decode([t]) for t in new], "text": loaded.tokenizer.decode(new),
                         "first_divergence": first_divergence(ref_new, new), "ref_nll": nll,
                         "ref_agreement": agreement})
    table = pd.DataFrame(rows, columns=["mode", "config", "tokens", "pieces", "text", "first_divergence", "ref_nll",
                                        "ref_agreement"])
    table["first_divergence"] = table["first_divergence"].astype("Int64")
    return table


def generation_progress_total(modes: Sequence[str], max_new_tokens: int) -> int:
    """The progress units of :func:`generate_side_by_side`: one per generated step and mode."""
    return len(modes) * max_new_tokens
