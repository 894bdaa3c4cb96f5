"""Teacher-forced runs of several configurations in one batch: the engine under state capture, drift,
quality and calibration.

A run feeds token ids ``[N, T]`` to the model once per member configuration, stacked in the batch (member
``i`` holds rows ``[i·N, (i+1)·N)``, each member its own state, scales and buffer:
:func:`pace_core.model.patch.stacked`):

1. one forward over the prompt ``ids[:, :decode_from]`` (PACE: P-token segments);
2. then the remaining tokens, teacher-forced through the decode path (the buffer, a flush every dP) in a
   few forwards of up to ``decode_chunk`` tokens each: attention, convolution and MLP compute all of a
   forward's positions at once, which is the same function as ``generate``'s one token per forward, while
   every GDN layer runs PACE's decode on its tokens one at a time (the fp32 reference, which rounds
   nothing, as chunks).

So a run costs two forwards (or a few), not one per token, and the fp32 reference and every configuration
share them. States and logits stay on the model's device: ``on_state`` sees the effective state of each
member and GDN layer at the requested token counts, ``on_logits`` each forward's logits, and callers reduce
them there (errors, NLL, KL); only what they return crosses to the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pace_core.config import PaceConfig
from pace_core.errors import PaceError
from pace_core.graphs import GRAPHS_ENV
from pace_core.model.patch import new_stack, stacked
from pace_core.schedule import Capture
from pace_core.state_store import StoreStack

if TYPE_CHECKING:
    from pace_core.model.loading import LoadedModel

StateHook = Callable[[int, int, int, torch.Tensor], None]
"""``on_state(member, layer, step, S [N, HV, K, V])``: member index, GDN layer, token count, effective state."""
LogitsHook = Callable[[torch.Tensor, int], None]
"""``on_logits(logits [M·N, t, vocab], first)``: a forward's logits, float32 on the device, for positions
``first .. first + t - 1`` (position p predicts token p + 1)."""


@dataclass(frozen=True)
class Member:
    """One configuration of a run: its name and configuration."""

    name: str
    cfg: PaceConfig


def _check(ids: torch.Tensor, decode_from: int, capture_steps: Collection[int]) -> list[int]:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long or 0 in ids.shape:
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise PaceError(f"input_ids: {got} not allowed; allowed: a LongTensor [B, T] with B, T >= 1")
    T = ids.shape[1]
    if isinstance(decode_from, bool) or not isinstance(decode_from, int) or not 1 <= decode_from <= T:
        raise PaceError(f"decode_from: {decode_from!r} not allowed; allowed: an integer in 1..{T}")
    steps = sorted(set(capture_steps))
    bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= T]
    if bad:
        raise PaceError(f"capture_steps: {bad} not allowed; allowed: token counts in 1..{T}")
    return steps


DECODE_CHUNK = 64
"""Teacher-forced tokens per decode forward (:func:`teacher_forced`'s default). Attention and MLP cost the same in
total whatever the chunk; short chunks let a run's later chunks replay the CUDA graphs its second chunk recorded
(:mod:`pace_core.graphs`: a window's 512 decoded tokens are 8 chunks, 6 of them replays, where 256 gave none)."""


def forwards(T: int, decode_from: int, decode_chunk: int = DECODE_CHUNK) -> int:
    """The forwards of a run of ``T`` tokens: the prompt's and the decode chunks'."""
    return 1 + -(-(T - decode_from) // decode_chunk)


def progress_total(members: int, gdn_layers: int, T: int, decode_from: int, decode_chunk: int = DECODE_CHUNK) -> int:
    """The units :func:`teacher_forced` reports to ``progress``: one per member, GDN layer and forward."""
    return members * gdn_layers * forwards(T, decode_from, decode_chunk)


@torch.no_grad()
def teacher_forced(loaded: LoadedModel, members: Sequence[Member], ids: torch.Tensor, decode_from: int, *,
                   capture_steps: Collection[int] = (), on_state: StateHook | None = None,
                   on_logits: LogitsHook | None = None, logits_from: int = 0, decode_chunk: int = DECODE_CHUNK,
                   progress: Callable[[int], None] | None = None,
                   stacks: dict[tuple, StoreStack] | None = None) -> list[dict[int, dict[str, int]]]:
    """Run ``ids [N, T]`` through ``loaded.model`` under every member at once (module docstring): prefill
    ``ids[:, :decode_from]``, teacher-force the rest through the decode path.

    ``capture_steps``: token counts (``1..T``) at which ``on_state`` gets every member's state of every GDN
    layer; counts below ``decode_from`` fall inside the prompt, which only exact members (the fp32
    reference) allow. ``on_logits`` gets the logits of positions ``logits_from`` (at most
    ``decode_from - 1``) to ``T - 1``, one call per forward. ``progress(n)``: units of
    :func:`progress_total`. ``stacks``: the caller's store stacks by members and rows, kept between runs so that
    a later run of the same shape replays the CUDA graphs an earlier one recorded (:mod:`pace_core.graphs`).
    Returns each member's state bytes per GDN layer at the end (``{"payload", "metadata", "buffer"}``).

    A run whose graphs report a failed check (a state that overflowed or turned non-finite) is run again
    without graphs, which raises that check's error where it happens."""
    steps = _check(ids, decode_from, capture_steps)
    if not 0 <= logits_from <= decode_from - 1:
        raise PaceError(f"logits_from: {logits_from} not allowed; allowed: 0..{decode_from - 1}")
    if decode_chunk < 1:
        raise PaceError(f"decode_chunk: {decode_chunk} not allowed; allowed: an integer >= 1")
    cfgs = [m.cfg for m in members]
    key = (tuple(cfgs), ids.shape[0])
    stack = None if stacks is None else stacks.get(key)
    if stack is None:
        stack = new_stack(loaded.model, cfgs, ids.shape[0], device=loaded.device)
        if stacks is not None:
            stacks[key] = stack
    run = functools.partial(_run, loaded, members, ids, decode_from, steps, on_state, on_logits, logits_from,
                            decode_chunk, progress)
    sizes = run(stack)
    if stack.graphs is not None and stack.graphs.check():
        run(new_stack(loaded.model, cfgs, ids.shape[0], device=loaded.device, graphs=False))
        raise PaceError("a state check failed in a run recorded as CUDA graphs and passed when the run was "
                        f"repeated without them; allowed: runs that agree (set {GRAPHS_ENV}=off and report this)")
    return sizes


def _run(loaded: LoadedModel, members: Sequence[Member], ids: torch.Tensor, decode_from: int, steps: list[int],
         on_state: StateHook | None, on_logits: LogitsHook | None, logits_from: int, decode_chunk: int,
         progress: Callable[[int], None] | None, stack: StoreStack) -> list[dict[int, dict[str, int]]]:
    """One :func:`teacher_forced` run on ``stack`` (reset to zero states first)."""
    N, T = ids.shape
    model = loaded.model
    rows = ids.repeat(len(members), 1).to(loaded.device)

    def hook(lo: int, hi: int):
        """Captures for a forward over tokens ``lo..hi-1`` (counts ``lo+1..hi``)."""
        wanted = frozenset(s - lo for s in steps if lo < s <= hi)
        if on_state is None or not wanted:
            return None
        return lambda i, layer: Capture(wanted, lambda c, S, i=i, layer=layer: on_state(i, layer, lo + c, S))

    with stacked(model, [m.cfg for m in members], N, stack=stack) as (cache, stack):
        stack.progress = progress
        stack.teacher_forcing = False
        stack.capture = hook(0, decode_from)
        out = model(input_ids=rows[:, :decode_from], past_key_values=cache, use_cache=True,
                    logits_to_keep=decode_from - logits_from)
        if on_logits is not None:
            on_logits(out.logits.float(), logits_from)
        del out
        stack.teacher_forcing = True
        for start in range(decode_from, T, decode_chunk):
            end = min(start + decode_chunk, T)
            stack.capture = hook(start, end)
            out = model(input_ids=rows[:, start:end], past_key_values=cache, use_cache=True)
            if on_logits is not None:
                on_logits(out.logits.float(), start)
            del out
        return [{layer: store.layer_nbytes(layer) for layer in store.layers} for store in stack.stores]
