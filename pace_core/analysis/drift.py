"""Drift over decode steps (spec §7), teacher-forced through the whole model.

One token sequence ``ids [1, T]``: the first ``decode_from`` tokens are prefilled, the rest are fed
one by one through the decode path (:func:`pace_core.model.capture.run_with_states`). Decode step
``j`` (0 = right after the prefill) is the state after ``decode_from + j`` tokens. At each captured
step and for every GDN layer the relative state error is ``‖S̃ − S‖_F / ‖S‖_F`` with ``S`` the fp32
reference run's state and ``S̃`` the configuration's effective state (checkpoint + folded buffer);
"overall" pools all GDN layers: ``sqrt(Σ_l ‖S̃_l − S_l‖²) / sqrt(Σ_l ‖S_l‖²)``. The excess NLL at
step ``j`` is the configuration's NLL of the next token (``ids[decode_from + j]``, predicted from the
state at step ``j``) minus the reference's, so steps run ``0 .. T − decode_from − 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pandas as pd
import torch

from pace_core.analysis.metrics import relative_errors
from pace_core.analysis.quality import config_map, damp_rows_of
from pace_core.config import PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.model.capture import run_with_states
from pace_core.model.loading import LoadedModel


@dataclass
class DriftResult:
    """``table``: config, step, rel_error (all GDN layers pooled), excess_nll (one row per captured
    step); ``layer_table``: config, step, layer, rel_error; ``summary``: per config the mean relative
    error over the captured steps (every ``every`` decode steps and the last, so it depends on
    ``every``), the final relative error, and the mean excess NLL over all decode steps."""

    table: pd.DataFrame
    layer_table: pd.DataFrame
    summary: pd.DataFrame


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """NLL of each next token: logits [1, T, vocab], ids [1, T] -> [T − 1] float64 (position t predicts t + 1)."""
    logp = torch.log_softmax(logits[0, :-1].double(), dim=-1)
    return -logp.gather(1, ids[0, 1:].cpu()[:, None])[:, 0]


def drift(
    loaded: LoadedModel,
    configs: Mapping[str, PaceConfig] | list[PaceConfig],
    ids: torch.Tensor,
    decode_from: int,
    *,
    every: int = 1,
    reference: PaceConfig | None = None,
    damp_rows: list[torch.Tensor] | Mapping[str, list[torch.Tensor]] | None = None,
    progress: Callable[[int], None] | None = None,
) -> DriftResult:
    """Drift of each configuration against the reference on ``ids [1, T]``.

    States are captured every ``every`` decode steps (and at the last step); the excess NLL is
    averaged over all decode steps in the summary. ``damp_rows``: the calibrated outlier rows per GDN
    layer (:func:`pace_core.analysis.calibration.calibrate`) for every damp configuration, or a
    mapping from damp configuration name to its rows.
    """
    cfgs = config_map(configs)
    ref_cfg = reference if reference is not None else get_config("fp32")
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise PaceError(f"ids: expected shape [1, T], got {tuple(ids.shape)}")
    T = ids.shape[1]
    if not 1 <= decode_from <= T - 2:
        raise PaceError(f"decode_from: must be in 1..T-2 = 1..{T - 2} (at least 2 decoded tokens), got {decode_from}")
    if every < 1:
        raise PaceError(f"every: must be >= 1, got {every}")
    last = T - decode_from - 1
    steps = sorted(set(range(0, last + 1, every)) | {last})
    capture = [decode_from + j for j in steps]
    ref = run_with_states(loaded, ref_cfg, ids, decode_from=decode_from, capture_steps=capture)
    if progress is not None:
        progress(1)
    ref_nll = token_nll(ref.logits, ids)[decode_from - 1 :]
    rows, layer_rows, summary = [], [], []
    for name, cfg in cfgs.items():
        rows_before = len(rows)
        kwargs = {"damp_rows": damp_rows_of(damp_rows, name)} if cfg.method == "damp" else {}
        run = run_with_states(loaded, cfg, ids, decode_from=decode_from, capture_steps=capture, **kwargs)
        excess = token_nll(run.logits, ids)[decode_from - 1 :] - ref_nll  # [last + 1] steps 0..last
        for j, step in zip(steps, capture):
            per, pooled = relative_errors(run.states[step], ref.states[step])
            rows.append({"config": name, "step": j, "rel_error": pooled, "excess_nll": float(excess[j])})
            layer_rows += [{"config": name, "step": j, "layer": layer, "rel_error": e} for layer, e in per.items()]
        mine = pd.DataFrame(rows[rows_before:])
        summary.append(
            {
                "config": name,
                "mean_rel_error": float(mine["rel_error"].mean()),
                "final_rel_error": float(mine["rel_error"].iloc[-1]),
                "mean_excess_nll": float(excess.mean()),
                "decode_steps": last + 1,
            }
        )
        if progress is not None:
            progress(1)
    return DriftResult(pd.DataFrame(rows), pd.DataFrame(layer_rows), pd.DataFrame(summary))
