"""Periodic rounding (PACE_SPEC §3): the one place that decides when a state is rounded.

A :class:`PeriodicState` is one GDN layer's state for ``B`` sequences: the rounded checkpoint ``Ŝ`` (in
a :mod:`pace_core.checkpoint` format), the decode buffer of ``dP`` records (none at dP = 1) and the
schedule:

- **prefill**: the prompt in P-token segments (``prefill_period``); each segment runs the chunked GDN
  from the dequantised state and its final state is stored (rounded), including a last, shorter one.
  The segments count from the start of each prefill call.
- **decode**: token by token; at dP = 1 each token is a plain recurrence step whose state is stored
  (per-token rounding); at dP >= 2 each token's record ``(k_t, u_t, g_t)`` goes into the buffer and the
  token that fills it is followed by a flush (``S = e^G Ŝ + Σ e^{G-G_i} k_i u_iᵀ``, stored, buffer
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

from typing import TYPE_CHECKING

import torch

from pace_core.buffer import DecodeBuffer

if TYPE_CHECKING:
    from pace_core.backend import Steps
    from pace_core.checkpoint import Checkpoint, RoundingFormat, StateFormat


class PeriodicState:
    """One GDN layer's state for ``batch`` sequences under periodic rounding (module docstring).

    ``fmt``: how the checkpoint is stored; ``steps``: the backend; ``shape = (B, H, HV, K, V)``;
    ``prefill_period`` P >= 1; ``decode_period`` dP >= 1 (the buffer's capacity); ``buffer_precision``
    (:mod:`pace_core.buffer`); ``after_decode`` ``flush`` or ``carry``; ``chunk_size``: the chunked
    GDN's chunk length.
    """

    def __init__(self, fmt: StateFormat | RoundingFormat, steps: Steps, shape: tuple[int, int, int, int, int],
                 device: torch.device, *, prefill_period: int, decode_period: int, buffer_precision: str = "fp32",
                 after_decode: str = "flush", chunk_size: int = 64) -> None:
        self.fmt, self.steps, self.shape, self.device = fmt, steps, shape, device
        self.prefill_period, self.decode_period, self.after_decode = prefill_period, decode_period, after_decode
        self.chunk_size = chunk_size
        B, H, HV, K, V = shape
        self.buffer = None if decode_period == 1 else DecodeBuffer(B, H, HV, K, V, decode_period, buffer_precision,
                                                                   device)
        self.reset()

    def reset(self) -> None:
        """Zero state, empty buffer."""
        B, _, HV, K, V = self.shape
        self.set_checkpoint(self.fmt.zeros((B, HV, K, V), self.device))
        if self.buffer is not None:
            self.buffer.clear()

    def set_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Replace the stored checkpoint (the dequantised copy is made again when next needed)."""
        self.checkpoint = checkpoint
        self._loaded = None

    def store(self, S: torch.Tensor) -> None:
        """Round and store ``S [B, HV, K, V]`` as the checkpoint."""
        self.set_checkpoint(self.steps.store(self.fmt, S))

    def loaded(self) -> torch.Tensor:
        """The dequantised checkpoint ``Ŝ [B, HV, K, V]`` float32 (kept until the checkpoint changes)."""
        if self._loaded is None:
            self._loaded = self.steps.load(self.fmt, self.checkpoint)
        return self._loaded

    def effective_state(self) -> torch.Tensor:
        """Checkpoint plus folded buffer: ``S [B, HV, K, V]`` float32."""
        return self.loaded() if self.buffer is None else self.steps.fold(self)

    def flush(self) -> None:
        """Fold the buffered records into the checkpoint, store it and clear the buffer (no-op when empty)."""
        if self.buffer is not None and len(self.buffer):
            self.steps.flush(self)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
        """Prompt tokens ``q, k [B, T, H, K]`` (prepared), ``v [B, T, HV, V]``, ``g, beta [B, T, HV]`` in
        P-token segments; returns ``o [B, T, HV, V]`` float32."""
        T = q.shape[1]
        carry = self.after_decode == "carry" and self.buffer is not None and len(self.buffer) > 0
        if carry and T == 0:
            return torch.zeros(self.shape[0], 0, self.shape[2], self.shape[4], device=self.device)
        if carry:
            S = self.effective_state()
        else:
            self.flush()
            S = self.loaded()
        outputs = []
        for start in range(0, T, self.prefill_period):
            part = slice(start, start + self.prefill_period)
            o, S = self.steps.chunk(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], S, self.chunk_size)
            outputs.append(o)
            self.store(S)
            if self.buffer is not None:  # carry: the checkpoint now holds the buffered tokens too
                self.buffer.clear()
            S = self.loaded()
        if not outputs:
            return torch.zeros(self.shape[0], 0, self.shape[2], self.shape[4], device=self.device)
        return torch.cat(outputs, dim=1)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor) -> torch.Tensor:
        """Decode tokens one by one (shapes as :meth:`prefill`), flushing after the token that fills the
        buffer; returns ``o [B, T, HV, V]`` float32."""
        outputs = []
        for t in range(q.shape[1]):
            x = (q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
            if self.buffer is None:
                outputs.append(self.steps.recurrent_step(self, *x))
            else:
                outputs.append(self.steps.step(self, *x, flush=len(self.buffer) + 1 == self.decode_period))
        if not outputs:
            return torch.zeros(self.shape[0], 0, self.shape[2], self.shape[4], device=self.device)
        return torch.stack(outputs, dim=1)

    def reorder(self, index: torch.Tensor) -> None:
        """Batch row ``b`` becomes old row ``index[b]``."""
        self.set_checkpoint(self.fmt.reorder(self.checkpoint, index))
        if self.buffer is not None:
            self.buffer.reorder(index)
