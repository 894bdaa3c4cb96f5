"""Independent references of the rounding schedule, written out plainly from the tested recurrence
functions (pace_core.recurrence) as PACE_SPEC §3 states it: what pace_core.schedule.PeriodicState must
compute, for the tests to compare it with."""

from __future__ import annotations

import torch

from pace_core.buffer import DecodeBuffer
from pace_core.recurrence import buffered_step, buffered_window, fold, gdn_recurrent, gdn_segment


def segmented_prefill(q, k, v, g, beta, S0, period, round_fn, chunk_size=64):
    """Prompt ``[B, T, ...]`` in ``period``-token segments, each run from the rounded state (chunked, or as the
    plain recurrence when short: :func:`pace_core.recurrence.gdn_segment`), each segment's end rounded by
    ``round_fn``: ``(o [B, T, HV, V], last rounded state)``."""
    S, outputs = S0, []
    for start in range(0, q.shape[1], period):
        part = slice(start, start + period)
        o, S = gdn_segment(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], S, chunk_size)
        outputs.append(o)
        S = round_fn(S)
    return torch.cat(outputs, 1), S


def per_token_decode(q, k, v, g, beta, S0, round_fn):
    """dP = 1: one plain recurrence step per token, then ``round_fn``: ``(o, S)``."""
    S, outputs = S0, []
    for t in range(q.shape[1]):
        o, S = gdn_recurrent(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], S)
        S = round_fn(S)
        outputs.append(o)
    return torch.cat(outputs, 1), S


def periodic_decode(q, k, v, g, beta, S0, period, round_fn, precision, windows=True):
    """Buffered decode into a buffer of ``period`` records in ``precision``; when full, ``Ŝ ← round_fn(fold(Ŝ,
    buffer))`` and the buffer is cleared. ``windows``: the tokens up to each flush through
    :func:`buffered_window` (a single token through :func:`buffered_step`), as a call of many tokens runs;
    else every token through :func:`buffered_step`, as one token per call runs. Returns ``(o, fold of the
    last checkpoint and buffer, the buffer)``."""
    B, T, H, K = k.shape
    HV, V = v.shape[2:]
    buf = DecodeBuffer(B, H, HV, K, V, period, precision, q.device)
    S_hat, outputs, t = S0, [], 0
    while t < T:
        end = min(T, t + period - len(buf)) if windows else t + 1
        x = [y[:, t:end] for y in (q, k, v, g, beta)]
        if end - t == 1:
            outputs.append(buffered_step(S_hat, buf, *(y[:, 0] for y in x))[:, None])
        else:
            outputs.append(buffered_window(S_hat, buf, *x))
        if len(buf) == period:
            S_hat = round_fn(fold(S_hat, buf))
            buf.clear()
        t = end
    return torch.cat(outputs, 1), fold(S_hat, buf), buf
