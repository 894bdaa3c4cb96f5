"""Periodic rounding (PACE_SPEC §3): the one place that decides when a state is rounded.

A :class:`PeriodicState` is one GDN layer's state for ``B`` sequences: the rounded checkpoint ``Ŝ`` (in
a :mod:`pace_core.checkpoint` format), the decode buffer of ``dP`` records (none at dP = 1) and the
schedule:

- **prefill**: the prompt in P-token segments (``prefill_period``); each segment runs the chunked GDN
  from the dequantised state and its final state is stored (rounded), including a last, shorter one.
  The segments count from the start of each prefill call.
- **decode**: token by token; at dP = 1 each token is a plain recurrence step whose state is stored
  (per-token rounding; the tokens of a call up to the next capture as one run, which the backend may
  compute in one pass); at dP >= 2 each token's record ``(k_t, u_t, g_t)`` goes into the buffer (the tokens
  of a call up to the next flush or capture as one window, whose independent work the backend may batch)
  and the token that fills it is followed by a flush (``S = e^G Ŝ + Σ e^{G-G_i} k_i u_iᵀ``, stored, buffer
  cleared). The buffer's capacity is dP.
- a prompt after decoded tokens (``after_decode`` **[ours]**): ``flush`` flushes the partial buffer
  first (one extra rounding, at a point that need not be a multiple of dP); ``carry`` runs the prompt
  from the exact state (checkpoint plus folded buffer), and the buffer is cleared once the first segment
  is stored (an empty prompt keeps it).

The arithmetic of each step is a backend's (:mod:`pace_core.backend`: the PyTorch reference or the
Triton kernels); the schedule only sequences the steps. Inputs are trusted here (shapes, devices and
finiteness are checked once per call at :class:`pace_core.state_store.LayerState`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pace_core.buffer import BufferFormat, DecodeBuffer
from pace_core.checkpoint import copy_into, reorder
from pace_core.errors import PaceError

if TYPE_CHECKING:
    from pace_core.backend import Steps
    from pace_core.checkpoint import Checkpoint, RoundingFormat, StateFormat


@dataclass(frozen=True)
class Capture:
    """States wanted during a prefill or decode call: after each token count in ``at`` (of that call),
    ``on_state(count, S [B, HV, K, V])`` is called with the effective state (float32, on the device)."""

    at: frozenset[int]
    on_state: Callable[[int, torch.Tensor], None]


class PeriodicState:
    """One GDN layer's state for ``batch`` sequences under periodic rounding (module docstring).

    ``fmt``: how the checkpoint is stored; ``steps``: the backend; ``shape = (B, H, HV, K, V)``;
    ``prefill_period`` P >= 1; ``decode_period`` dP >= 1 (the buffer's capacity); ``buffer``: how records
    are stored (:class:`pace_core.buffer.BufferFormat`, or a precision name); ``after_decode`` ``flush`` or
    ``carry``; ``exact_current``: the current token's output from its exact record
    (:func:`pace_core.recurrence.buffered_step`); ``chunk_size``: the chunked GDN's chunk length.

    ``checkpoint`` and ``records``: a stored checkpoint of B sequences and the buffer's storage tensors
    (:meth:`pace_core.buffer.DecodeBuffer.storage`) to run on as they are (a state pool's rows,
    :class:`pace_core.pool.StatePool`), else a zero state of their own.
    """

    def __init__(self, fmt: StateFormat | RoundingFormat, steps: Steps, shape: tuple[int, int, int, int, int],
                 device: torch.device, *, prefill_period: int, decode_period: int,
                 buffer: BufferFormat | str = "fp32", after_decode: str = "flush", exact_current: bool = True,
                 chunk_size: int = 64, checkpoint: Checkpoint | None = None,
                 records: dict[str, torch.Tensor] | None = None) -> None:
        self.fmt, self.steps, self.shape, self.device = fmt, steps, shape, device
        self.prefill_period, self.decode_period, self.after_decode = prefill_period, decode_period, after_decode
        self.exact_current, self.chunk_size = exact_current, chunk_size
        B, H, HV, K, V = shape
        self.buffer = None if decode_period == 1 else DecodeBuffer(B, H, HV, K, V, decode_period, buffer, device,
                                                                   records)
        self.checkpoint = fmt.zeros((B, HV, K, V), device) if checkpoint is None else checkpoint
        """The stored checkpoint: allocated once, every later store writes into its tensors (so a kernel's launch
        plan of it stays valid and no earlier checkpoint outlives a store)."""
        self._loaded: torch.Tensor | None = None
        self._calls = 0
        if checkpoint is None:
            self.reset()

    def reset(self) -> None:
        """Zero state, empty buffer, the format started again (:meth:`pace_core.checkpoint.StateFormat.restart`)."""
        B, _, HV, K, V = self.shape
        self.set_checkpoint(self.fmt.zeros((B, HV, K, V), self.device))
        self.fmt.restart()
        if self.buffer is not None:
            self.buffer.clear()

    @contextmanager
    def call(self) -> Iterator[None]:
        """One call from outside (a prefill, decode, flush or read of the state): the dequantised checkpoint
        made during it is a workspace of the call, dropped when the outermost call ends, so that between calls
        the layer holds only its stored checkpoint and buffer (the bytes :mod:`pace_core.accounting` counts)."""
        self._calls += 1
        try:
            yield
        finally:
            self._calls -= 1
            if self._calls == 0:
                self._loaded = None

    def set_checkpoint(self, checkpoint: Checkpoint, loaded: torch.Tensor | None = None) -> None:
        """Store ``checkpoint`` (this layer's structure and shapes; written into the layer's own storage unless
        it is that storage, updated in place); ``loaded``: its dequantised copy when at hand (else it is made
        when next needed)."""
        copy_into(self.checkpoint, checkpoint)
        self._loaded = loaded

    def store(self, S: torch.Tensor) -> None:
        """Round and store ``S [B, HV, K, V]`` as the checkpoint."""
        self.set_checkpoint(*self.steps.store(self.fmt, S))

    def loaded(self) -> torch.Tensor:
        """The dequantised checkpoint ``Ŝ [B, HV, K, V]`` float32 (kept until the checkpoint changes or the
        outermost :meth:`call` ends; for a dense float32 format the checkpoint's storage itself: read it within
        the call, or take :meth:`dequantized`)."""
        if self._loaded is None:
            self._loaded = self.steps.load(self.fmt, self.checkpoint)
        return self._loaded

    def effective_state(self) -> torch.Tensor:
        """Checkpoint plus folded buffer: ``S [B, HV, K, V]`` float32, the caller's own."""
        return self._owned(self.loaded() if self.buffer is None else self.steps.fold(self))

    def dequantized(self) -> torch.Tensor:
        """The dequantised checkpoint ``Ŝ [B, HV, K, V]`` float32, the caller's own."""
        return self._owned(self.loaded())

    def _owned(self, S: torch.Tensor) -> torch.Tensor:
        """``S``, or a copy where it is the checkpoint's storage, which a later store writes into (the loaded
        checkpoint of a dense format in float32)."""
        ckpt = self.checkpoint
        shared = isinstance(ckpt, torch.Tensor) and S.untyped_storage().data_ptr() == ckpt.untyped_storage().data_ptr()
        return S.clone() if shared else S

    def flush(self) -> None:
        """Fold the buffered records into the checkpoint, store it and clear the buffer (no-op when empty)."""
        if self.buffer is not None and len(self.buffer):
            self.steps.flush(self)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                capture: Capture | None = None) -> torch.Tensor:
        """Prompt tokens ``q, k [B, T, H, K]`` (prepared), ``v [B, T, HV, V]``, ``g, beta [B, T, HV]`` in
        P-token segments; returns ``o [B, T, HV, V]`` float32. ``capture``: states after the given token
        counts of this call: its end for any format, any count for an exact one (whose segments may be split
        anywhere: it rounds nothing)."""
        T = q.shape[1]
        if capture is not None and not self.fmt.exact and any(c < T for c in capture.at):
            raise PaceError("capture inside a prompt: only for the exact fp32 reference; allowed: capture while "
                            "decoding, or at the prompt's end")
        carry = self.after_decode == "carry" and self.buffer is not None and len(self.buffer) > 0
        if carry and T == 0:
            return self._empty()
        if carry:
            S = self.effective_state()
        else:
            self.flush()
            S = self.loaded()
        bounds = set(range(0, T, self.prefill_period)) | set(capture.at if capture is not None else ())
        cuts = sorted(b for b in bounds if b < T) + [T]
        outputs = []
        for start, end in zip(cuts, cuts[1:]):
            o, S = self.steps.chunk(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                                    beta[:, start:end], S, self.chunk_size)
            outputs.append(o)
            self.store(S)
            if self.buffer is not None:  # carry: the checkpoint now holds the buffered tokens too
                self.buffer.clear()
            S = self.loaded()
            if capture is not None and end in capture.at:
                capture.on_state(end, self.effective_state())
        return torch.cat(outputs, dim=1) if outputs else self._empty()

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               capture: Capture | None = None) -> torch.Tensor:
        """Decode tokens one by one (shapes as :meth:`prefill`), flushing after the token that fills the
        buffer; returns ``o [B, T, HV, V]`` float32. ``capture``: the effective state after the given token
        counts of this call. An exact format at dP = 1 (the fp32 reference) has no rounding between tokens:
        its tokens run as segments between capture points (:func:`pace_core.recurrence.gdn_segment`: chunks,
        or the plain recurrence over a short one), the same function in fewer operations.
        """
        T = q.shape[1]
        at = set(capture.at) if capture is not None else set()
        if self.fmt.exact and self.buffer is None:
            cuts = sorted(j for j in at if 0 < j < T) + [T]
            outputs, S, start = [], self.loaded(), 0
            for end in cuts:
                o, S = self.steps.chunk(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                                        beta[:, start:end], S, self.chunk_size)
                outputs.append(o)
                self.store(S)
                S = self.loaded()
                if end in at:
                    capture.on_state(end, self.effective_state())
                start = end
            return _joined(outputs) if T else self._empty()
        outputs, t = [], 0
        while t < T:
            if self.buffer is None:  # the tokens up to the next capture, each rounded
                end = min([T] + [c for c in at if c > t])
                outputs.append(self.steps.recurrent_run(self, q[:, t:end], k[:, t:end], v[:, t:end], g[:, t:end],
                                                        beta[:, t:end]))
            else:  # the tokens up to the next flush or capture, together
                end = min([T, t + self.decode_period - len(self.buffer)] + [c for c in at if c > t])
                outputs.append(self.steps.window(self, q[:, t:end], k[:, t:end], v[:, t:end], g[:, t:end],
                                                 beta[:, t:end], flush=self.fills_buffer(end - t)))
            if end in at:
                capture.on_state(end, self.effective_state())
            t = end
        return _joined(outputs) if outputs else self._empty()

    def fills_buffer(self, tokens: int) -> bool:
        """Whether ``tokens`` more buffered tokens fill the buffer: the flush follows the last of them."""
        return len(self.buffer) + tokens == self.decode_period

    def _empty(self) -> torch.Tensor:
        return torch.zeros(self.shape[0], 0, self.shape[2], self.shape[4], device=self.device)

    def reorder(self, index: torch.Tensor) -> None:
        """Batch row ``b`` becomes old row ``index[b]``."""
        reorder(self.checkpoint, index)
        self._loaded = None
        if self.buffer is not None:
            self.buffer.reorder(index)


def _joined(outputs: list[torch.Tensor]) -> torch.Tensor:
    """``o [B, T, HV, V]`` of consecutive pieces along T: a single contiguous piece as it is (decoding one
    token per call, as a server does, would otherwise copy every layer's output once more)."""
    return outputs[0] if len(outputs) == 1 and outputs[0].is_contiguous() else torch.cat(outputs, dim=1)
