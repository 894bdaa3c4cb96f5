"""Teacher-forced runs that capture the recurrent state of every GDN layer (spec §7: drift).

A run prefills ``input_ids[:, :decode_from]`` (PACE: P-token segments), then feeds the remaining tokens
through the decode path (PACE: the decode buffer, a flush every dP) as ``generate`` would, but with the
given tokens instead of sampled ones (:func:`pace_core.model.teacher.teacher_forced`).

A *step* is the number of tokens consumed: step ``decode_from`` is the state right after the prefill,
step ``decode_from + j`` the state after ``j`` decoded tokens, step ``T`` the final state. The state
captured is the effective state (the dequantised checkpoint with the decode buffer folded in; for the fp32
reference its exact state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from pace_core.config import PaceConfig
from pace_core.errors import PaceError
from pace_core.model.teacher import Member, teacher_forced

if TYPE_CHECKING:
    from pace_core.model.loading import LoadedModel


@dataclasses.dataclass
class RunResult:
    """Logits and captured states of one teacher-forced run.

    ``logits [B, T, vocab]`` float32 on the CPU (position t predicts token t + 1);
    ``states[step][gdn_layer]`` = ``S [B, HV, K, V]`` float32 on the CPU; ``state_nbytes[gdn_layer]``
    the real ``{"payload", "metadata", "buffer"}`` bytes of that layer's state at the end of the run.
    """

    config: PaceConfig
    logits: torch.Tensor
    states: dict[int, dict[int, torch.Tensor]]
    decode_from: int
    state_nbytes: dict[int, dict[str, int]]


def _check_inputs(input_ids, decode_from, capture_steps: Iterable[int], exact: bool) -> tuple[int, list[int]]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise PaceError(f"input_ids: {got} not allowed; allowed: a LongTensor [B, T] with B, T >= 1")
    B, T = input_ids.shape
    if B < 1 or T < 1:
        raise PaceError(f"input_ids: shape {(B, T)} not allowed; allowed: [B, T] with B, T >= 1")
    start = T if decode_from is None else decode_from
    if isinstance(start, bool) or not isinstance(start, int) or not 1 <= start <= T:
        raise PaceError(f"decode_from: {decode_from!r} not allowed; allowed: None or an integer in 1..{T}")
    steps = sorted(set(capture_steps))
    first = 1 if exact else start  # the exact reference can be captured inside its prompt
    bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or not first <= s <= T]
    if bad:
        allowed = f"1..T = 1..{T}" if exact else f"decode_from..T = {start}..{T} (inside the prompt only for fp32)"
        raise PaceError(f"capture_steps: {bad} not allowed; allowed: integers in {allowed}")
    return start, steps


def run_with_states(
    loaded: LoadedModel,
    cfg: PaceConfig,
    input_ids: torch.Tensor,
    *,
    decode_from: int | None = None,
    capture_steps: Iterable[int] = (),
) -> RunResult:
    """Teacher-force ``input_ids [B, T]`` through ``loaded.model`` under ``cfg``.

    Prefill ``input_ids[:, :decode_from]`` (all of it when None), then decode the rest; capture every GDN
    layer's state at each step of ``capture_steps`` (token counts in ``decode_from..T``; see the module
    docstring; the fp32 reference also inside its prompt, ``1..T``). The model's PACE configuration is restored
    afterwards.
    """
    start, steps = _check_inputs(input_ids, decode_from, capture_steps, cfg.exact)
    states: dict[int, dict[int, torch.Tensor]] = {s: {} for s in steps}
    logits: list[torch.Tensor] = []

    def keep(member: int, layer: int, step: int, S: torch.Tensor) -> None:
        states[step][layer] = S.float().cpu()

    nbytes = teacher_forced(loaded, [Member(cfg.name, cfg)], input_ids, start, capture_steps=steps,
                            on_state=keep, on_logits=lambda x, first: logits.append(x.cpu()))[0]
    return RunResult(config=cfg, logits=torch.cat(logits, dim=1), states=states, decode_from=start,
                     state_nbytes=nbytes)
