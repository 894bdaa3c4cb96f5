"""Side-by-side generations of several configurations (spec §7).

Each configuration generates from the same prompt, greedily and/or by seeded sampling (the same seed
for every configuration, so sampled texts differ only where the state does). Every continuation is
then scored by the fp32 reference model, teacher-forced on prompt + continuation: the mean NLL of the
generated tokens under the reference and the share of them that the reference would also pick as its
top-1 token. The first divergent token is counted against the reference configuration's
continuation of the same mode.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import pandas as pd
import torch

from pace_core.analysis.quality import config_map, damp_rows_of
from pace_core.config import PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.model.loading import LoadedModel
from pace_core.model.patch import pace

MODES = ("greedy", "sampled")


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first token where ``other`` differs from ``reference``; the shorter length when
    one is a strict prefix of the other; None when they are identical."""
    for i, (r, o) in enumerate(zip(reference, other)):
        if r != o:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def _generate(loaded: LoadedModel, cfg: PaceConfig, ids: torch.Tensor, mode: str, max_new_tokens: int,
              seed: int, temperature: float, top_p: float, pace_kwargs: dict) -> list[int]:
    """New token ids of one generation: ids [1, T] -> list of <= max_new_tokens ids (``pace_kwargs``:
    the DAMP outlier rows of a damp configuration, else empty)."""
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=loaded.tokenizer.pad_token_id)
    if mode == "greedy":
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=None)
    devices = [loaded.device] if loaded.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), pace(loaded.model, cfg, **pace_kwargs), torch.no_grad():
        torch.manual_seed(seed)
        out = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, ids.shape[1]:].tolist()


def _score(loaded: LoadedModel, reference: PaceConfig, ids: torch.Tensor, new: list[int]) -> tuple[float, float]:
    """(mean NLL, top-1 agreement) of the tokens ``new`` after prompt ids [1, T] under ``reference``."""
    if not new:
        return float("nan"), float("nan")
    full = torch.cat([ids, torch.tensor([new], dtype=ids.dtype, device=ids.device)], dim=1)
    with pace(loaded.model, reference), torch.no_grad():
        logits = loaded.model(input_ids=full).logits[0, ids.shape[1] - 1 : -1].double()
    logp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(new, device=logp.device)
    nll = float(-logp.gather(1, target[:, None]).mean())
    agreement = float((logp.argmax(-1) == target).double().mean())
    return nll, agreement


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
    damp_rows: Mapping[str, list[torch.Tensor]] | list[torch.Tensor] | None = None,
    progress: Callable[[int], None] | None = None,
) -> pd.DataFrame:
    """One row per (mode, configuration), the reference first in each mode: mode, config, tokens
    (new ids), pieces (their texts), text, first_divergence (Int64, <NA> when identical to the reference's continuation),
    ref_nll (mean nats per generated token under the reference), ref_agreement. ``damp_rows``: the
    calibrated outlier rows [HV, r] per GDN layer of the damp configurations (one list for all, or
    a mapping by configuration name), as in :func:`pace_core.analysis.drift.drift`."""
    cfgs = config_map(configs)
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
    run = {ref.name: ref, **{n: c for n, c in cfgs.items() if n != ref.name}}
    rows = []
    for mode in modes:
        ref_tokens: list[int] | None = None
        for name, cfg in run.items():
            pace_kwargs = {"damp_rows": damp_rows_of(damp_rows, name)} if cfg.method == "damp" else {}
            new = _generate(loaded, cfg, ids, mode, max_new_tokens, seed, temperature, top_p, pace_kwargs)
            if ref_tokens is None:
                ref_tokens = new
            nll, agreement = _score(loaded, ref, ids, new)
            rows.append(
                {
                    "mode": mode,
                    "config": name,
                    "tokens": new,
                    "pieces": [loaded.tokenizer.decode([t]) for t in new],
                    "text": loaded.tokenizer.decode(new),
                    "first_divergence": first_divergence(ref_tokens, new),
                    "ref_nll": nll,
                    "ref_agreement": agreement,
                }
            )
            if progress is not None:
                progress(1)
    table = pd.DataFrame(rows)
    table["first_divergence"] = table["first_divergence"].astype("Int64")
    return table
