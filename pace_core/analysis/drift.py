"""Drift over decode steps (spec §7), teacher-forced through the whole model.

One token sequence ``ids [1, T]``: the first ``decode_from`` tokens are prefilled, the rest are fed
one by one through the decode path (teacher forcing, :mod:`pace_core.model.teacher`). Decode step
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
from typing import TYPE_CHECKING

import pandas as pd
import torch

from pace_core.analysis.metrics import relative_error
from pace_core.analysis.quality import config_map
from pace_core.config import PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.model.teacher import Member, progress_total, teacher_forced

if TYPE_CHECKING:
    from pace_core.model.loading import LoadedModel


@dataclass
class DriftReference:
    """The reference run of :func:`drift` on one text, kept to score further configurations against it
    without running the reference again: ``states[(layer, step)]`` the reference state ``[1, HV, K, V]``
    at each captured decode step (on the model's device), ``nll [steps]`` the reference's NLL of each
    decode step's next token (float64, on the device)."""

    name: str
    decode_from: int
    T: int
    steps: list[int]
    states: dict[tuple[int, int], torch.Tensor]
    nll: torch.Tensor


@dataclass
class DriftResult:
    """``table``: config, step, rel_error (all GDN layers pooled), excess_nll (one row per captured
    step); ``layer_table``: config, step, layer, rel_error; ``summary``: per config the mean relative
    error over the captured steps (every ``every`` decode steps and the last, so it depends on
    ``every``), the final relative error, and the mean excess NLL over all decode steps; ``reference``: the
    reference run the configurations were scored against, when it was given or kept (else None)."""

    table: pd.DataFrame
    layer_table: pd.DataFrame
    summary: pd.DataFrame
    reference: DriftReference | None = None


def _captured_steps(ids: torch.Tensor, decode_from: int, every: int) -> list[int]:
    """The decode steps whose states are compared: every ``every`` and the last (validates the inputs)."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise PaceError(f"ids: expected shape [1, T], got {tuple(ids.shape)}")
    T = ids.shape[1]
    if not 1 <= decode_from <= T - 2:
        raise PaceError(f"decode_from: must be in 1..T-2 = 1..{T - 2} (at least 2 decoded tokens), got {decode_from}")
    if every < 1:
        raise PaceError(f"every: must be >= 1, got {every}")
    last = T - decode_from - 1
    return sorted(set(range(0, last + 1, every)) | {last})


def drift_reference(loaded: LoadedModel, ids: torch.Tensor, decode_from: int, *, every: int = 1,
                    reference: PaceConfig | None = None,
                    progress: Callable[[int], None] | None = None) -> DriftReference:
    """The reference run of :func:`drift` alone (its states at the captured steps stay on the device: about
    ``steps x`` the fp32 state of the model, so keep ``every`` coarse on large models)."""
    return drift(loaded, {}, ids, decode_from, every=every, reference=reference, keep_reference=True,
                 progress=progress).reference


def drift(
    loaded: LoadedModel,
    configs: Mapping[str, PaceConfig] | list[PaceConfig],
    ids: torch.Tensor,
    decode_from: int,
    *,
    every: int = 1,
    reference: PaceConfig | DriftReference | None = None,
    keep_reference: bool = False,
    progress: Callable[[int], None] | None = None,
) -> DriftResult:
    """Drift of each configuration against the reference on ``ids [1, T]``: errors and NLL reduced on the
    model's device, a few numbers per step to the CPU.

    ``reference``: the reference configuration (default fp32), run in the same teacher-forced batch as the
    configurations (:func:`pace_core.model.teacher.teacher_forced`), each reference state compared and
    dropped as soon as it is made; or a :class:`DriftReference` of an earlier :func:`drift_reference` on the
    same ids, decode_from and every, which is not run again. ``keep_reference``: the reference run in the
    batch is kept as the result's ``reference`` (its states stay on the device) to score further
    configurations later. States are compared every ``every`` decode
    steps (and at the last step); the excess NLL is averaged over all decode steps in the summary. Each
    configuration is calibrated on the model where its method needs it. ``progress(n)``: units of
    :func:`drift_progress_total`.
    """
    cfgs = {} if keep_reference and not configs else config_map(configs)  # the reference alone, to keep
    steps = _captured_steps(ids, decode_from, every)
    kept = reference if isinstance(reference, DriftReference) else None
    if kept is not None and (kept.decode_from, kept.T, kept.steps) != (decode_from, ids.shape[1], steps):
        raise PaceError(f"reference: a run of decode_from {kept.decode_from}, {kept.T} tokens and {len(kept.steps)} "
                        f"captured steps does not match this one ({decode_from}, {ids.shape[1]}, {len(steps)}); "
                        "allowed: the drift_reference of the same ids, decode_from and every")
    members = [Member(n, c) for n, c in cfgs.items()]
    if kept is None:
        members.insert(0, Member("reference", reference if reference is not None else get_config("fp32")))
    first = 0 if kept is not None else 1  # index of the first configuration among the members
    layers, device, T = list(loaded.gdn_layers), loaded.device, ids.shape[1]
    sums = torch.zeros(len(members), len(layers), len(steps), 2, dtype=torch.float64,
                       device=device)  # ‖S̃-S‖², ‖S‖²
    where = {j: i for i, j in enumerate(steps)}
    ref_states = kept.states if kept is not None else {}
    hold = kept is not None or keep_reference

    def on_state(m: int, layer: int, step: int, S: torch.Tensor) -> None:
        key, li, si = (layer, step - decode_from), layers.index(layer), where[step - decode_from]
        if m < first:
            ref_states[key] = S
            return
        R = ref_states[key].double()
        sums[m, li, si, 0] = (S.double() - R).square().sum()
        sums[m, li, si, 1] = R.square().sum()
        if not hold and m == len(members) - 1:
            del ref_states[key]

    # the next token of steps 0 .. last, and the NLL, where the logits appear (the last GPU under device_map)
    targets = ids[0, decode_from:].to(loaded.output_device)
    nll = torch.zeros(len(members), T - decode_from, dtype=torch.float64, device=loaded.output_device)

    def on_logits(logits: torch.Tensor, first_position: int) -> None:
        # positions p .. p + t - 1 predict tokens p + 1 ..; step j is position decode_from - 1 + j
        t = logits.shape[1]
        lo, hi = max(first_position, decode_from - 1), min(first_position + t, T - 1)
        if lo >= hi:
            return
        logp = torch.log_softmax(logits[:, lo - first_position:hi - first_position].double(), dim=-1)
        want = targets[lo - decode_from + 1:hi - decode_from + 1]
        nll[:, lo - decode_from + 1:hi - decode_from + 1] = -logp.gather(2, want[None, :, None].expand(
            len(members), -1, 1))[..., 0]

    teacher_forced(loaded, members, ids, decode_from, capture_steps=[decode_from + j for j in steps],
                   on_state=on_state, on_logits=on_logits, logits_from=decode_from - 1, progress=progress)
    ref_nll = kept.nll if kept is not None else nll[0]
    sums, excess = sums.cpu(), (nll[first:] - ref_nll).cpu()
    rows, layer_rows, summary = [], [], []
    for m, name in enumerate(cfgs, start=first):
        pooled = [relative_error(sums[m, :, si, 0].sum(), sums[m, :, si, 1].sum()) for si in range(len(steps))]
        rows += [{"config": name, "step": j, "rel_error": pooled[si], "excess_nll": float(excess[m - first, j])}
                 for si, j in enumerate(steps)]
        layer_rows += [{"config": name, "step": j, "layer": layer,
                        "rel_error": relative_error(sums[m, li, si, 0], sums[m, li, si, 1])}
                       for si, j in enumerate(steps) for li, layer in enumerate(layers)]
        summary.append({"config": name, "mean_rel_error": sum(pooled) / len(pooled), "final_rel_error": pooled[-1],
                        "mean_excess_nll": float(excess[m - first].mean()), "decode_steps": len(excess[m - first])})
    if keep_reference and kept is None:
        kept = DriftReference(members[0].cfg.name, decode_from, T, steps, ref_states, nll[0])
    return DriftResult(pd.DataFrame(rows), pd.DataFrame(layer_rows), pd.DataFrame(summary), kept)


def drift_progress_total(loaded: LoadedModel, configs: int, T: int, decode_from: int, *,
                         with_reference: bool = True) -> int:
    """The progress units of :func:`drift` with ``configs`` configurations on ``T`` tokens (and the reference
    in the batch unless ``with_reference`` is False; :func:`drift_reference` alone: ``configs=0``)."""
    return progress_total(configs + with_reference, len(loaded.gdn_layers), T, decode_from)
