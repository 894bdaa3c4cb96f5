"""One sequence's PACE state of one GDN layer as a row of bytes, the form a serving engine's state pool
holds (vLLM: one page per sequence and layer), and the schedule run on rows of such a pool.

A :class:`SlotLayout` lays out, for one layer under a configuration, the tensors that
:class:`~pace_core.schedule.PeriodicState` keeps per sequence: the checkpoint's stored tensors
(:mod:`pace_core.checkpoint`: the plain state of ``none``; codes, fp16 scales and zero points of
``rtn`` / ``pace``, one packed part per bit width for PACE-4/8) and, at dP >= 2, the decode buffer's
storage for dP records (:meth:`pace_core.buffer.DecodeBuffer.storage`). Its :attr:`~SlotLayout.nbytes`
is what :func:`pace_core.accounting.state_bytes` counts per sequence for the layer. What is kept once
per layer, not per sequence (PACE-4/8's head map), and the number of records in each row's buffer
stay beside the pool (:class:`SlotPool`).

:class:`SlotPool` runs the schedule on pool rows whose sequences are at different positions of it
(continuous batching): it gathers the rows of one step into a :class:`~pace_core.state_store.LayerState`
(rows with the same number of buffered records together, so that the flush falls on each sequence's own
dP-th token), runs the same prefill / decode as the transformers path, and writes the rows back. The
arithmetic is therefore the reference's (or the kernels', by the backend setting), bit for bit per
batch, only the batch composition differs.

Only the methods ``none``, ``rtn`` and ``pace`` are laid out here (DSQ and DAMP keep per-model
calibration the engines do not carry), without stochastic rounding (whose generator a per-step layer state would
start again every step); static scales keep their calibrated ranges once per layer, beside the pool, as the head
map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from pace_core import quant
from pace_core.checkpoint import Checkpoint, checkpoint_tensors, with_tensors
from pace_core.config import PaceConfig
from pace_core.errors import PaceError
from pace_core.methods import METHODS
from pace_core.state_store import LayerState

SLOT_METHODS = tuple(name for name, method in METHODS.items() if method.pool)
"""Methods whose per-sequence state a pool row can hold."""


@dataclass(frozen=True)
class Field:
    """One tensor of a row: ``shape`` (without the row axis) in ``dtype`` at byte ``offset``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _on_device(c: Checkpoint, device: torch.device) -> Checkpoint:
    """``c`` with PACE-4/8's head map on ``device`` (the rows' tensors come from the pool)."""
    if isinstance(c, quant.MixedPackedState):
        return replace(c, heads={b: h.to(device) for b, h in c.heads.items()})
    return c


class SlotLayout:
    """Where one sequence's state of one GDN layer lies in a row of bytes (module docstring).

    ``cfg`` validated for the model; ``gdn_index``: the layer's position among the GDN layers (selects
    ``cfg.high_heads``); heads and dims as :class:`~pace_core.state_store.LayerState`. Fields are ordered
    by decreasing element size, so each starts aligned to its dtype.
    """

    def __init__(self, cfg: PaceConfig, num_k_heads: int, num_v_heads: int, d_k: int, d_v: int,
                 gdn_index: int = 0) -> None:
        if cfg.method not in SLOT_METHODS:
            raise PaceError(f"method {cfg.method!r} ({cfg.name}) cannot be served from a state pool; allowed: "
                            f"{', '.join(SLOT_METHODS)}")
        if cfg.rounding == "stochastic":  # the pool makes a layer state per step: its generator would start again
            raise PaceError(f"rounding='stochastic' ({cfg.name}) cannot be served from a state pool: its generator "
                            "belongs to one layer state, which the pool makes anew for every step (each step would draw "
                            "the same numbers); allowed: rounding='nearest'")
        self.cfg, self.gdn_index = cfg, gdn_index
        self.dims = (num_k_heads, num_v_heads, d_k, d_v)
        one = self.state(1, torch.device("cpu")).state
        self.template = one.checkpoint
        """A one-sequence checkpoint of this layer: the structure (and PACE-4/8's head map) rows fill in."""
        tensors = checkpoint_tensors(self.template)
        self.checkpoint_names = tuple(tensors)
        if one.buffer is not None:
            tensors.update(one.buffer.storage())
        order = sorted(tensors, key=lambda name: -tensors[name].element_size())
        fields, offset = [], 0
        for name in order:
            f = Field(name, tuple(tensors[name].shape[1:]), tensors[name].dtype, offset)
            fields.append(f)
            offset += f.nbytes
        self.fields = tuple(fields)
        self.nbytes = offset
        """Bytes of one sequence's state of this layer (checkpoint and buffer)."""

    def state(self, batch: int, device: torch.device, name: str = "state", backend: str | None = None) -> LayerState:
        """A zero :class:`~pace_core.state_store.LayerState` of this layer for ``batch`` sequences."""
        H, HV, K, V = self.dims
        return LayerState(self.cfg, batch, H, HV, K, V, device, gdn_index=self.gdn_index, name=name, backend=backend)

    def views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views ``[N, *shape]`` of every field into ``rows [N, >= nbytes]`` uint8 (a pool's pages)."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] < self.nbytes:
            raise PaceError(f"rows: {rows.dtype} {tuple(rows.shape)} not allowed; allowed: uint8 [N, >= {self.nbytes}]")
        return {f.name: rows[:, f.offset:f.offset + f.nbytes].view(f.dtype).view(rows.shape[0], *f.shape)
                for f in self.fields}


class SlotPool:
    """The schedule on the rows of a state pool (module docstring).

    ``layout``: the layer's :class:`SlotLayout`; ``rows [N, >= layout.nbytes]`` uint8: the pool's pages
    of this layer (written in place); ``name`` names the layer in errors; ``backend`` as
    :class:`~pace_core.state_store.LayerState`. :attr:`counts` ``[N]`` holds each row's buffered records.
    """

    def __init__(self, layout: SlotLayout, rows: torch.Tensor, name: str = "state", backend: str | None = None) -> None:
        self.layout, self.name, self.backend = layout, name, backend
        self.views = layout.views(rows)
        self.device = rows.device
        self.template = _on_device(layout.template, rows.device)
        self.counts = torch.zeros(rows.shape[0], dtype=torch.int32)

    def _state(self, rows: torch.Tensor, count: int | None) -> LayerState:
        """A LayerState of ``rows`` (long [n]): their stored state with ``count`` buffered records each, or the
        zero state (``count`` None)."""
        state = self.layout.state(rows.numel(), self.device, self.name, self.backend)
        if count is None:
            return state
        state.used = True
        ps = state.state
        ps.set_checkpoint(with_tensors(self.template, {n: self.views[n].index_select(0, rows)
                                                        for n in self.layout.checkpoint_names}))
        if ps.buffer is not None:
            for n, t in ps.buffer.storage().items():
                t.copy_(self.views[n].index_select(0, rows))
            ps.buffer.clear()
            ps.buffer.mark_appended(count)
        return state

    def _write(self, rows: torch.Tensor, state: LayerState) -> None:
        """Store ``state`` (one row per entry of ``rows``) into the pool rows and their record counts."""
        ps = state.state
        tensors = checkpoint_tensors(ps.checkpoint)
        if ps.buffer is not None:
            tensors.update(ps.buffer.storage())
        for n, t in tensors.items():
            self.views[n].index_copy_(0, rows, t.to(self.views[n].dtype))
        self.counts[rows.cpu()] = 0 if ps.buffer is None else len(ps.buffer)

    def decode(self, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor) -> torch.Tensor:
        """One decode token for each of ``rows [n]`` (long): ``q, k [n, H, K]`` prepared, ``v [n, HV, V]``,
        ``g, beta [n, HV]`` float32; returns ``o [n, HV, V]`` float32 and updates the rows (a row whose
        buffer this token fills is flushed)."""
        rows = rows.long()
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        counts = self.counts[rows.cpu()]
        for count in counts.unique().tolist():
            pick = (counts == count).nonzero().squeeze(1).to(rows.device)
            sub = rows.index_select(0, pick)
            state = self._state(sub, count)
            o = state.decode(*(x.index_select(0, pick).unsqueeze(1) for x in (q, k, v, g, beta)))
            out.index_copy_(0, pick, o[:, 0])
            self._write(sub, state)
        return out

    def prefill(self, row: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, initial: bool) -> torch.Tensor:
        """Prompt tokens of one sequence in ``row``: ``q, k [T, H, K]`` prepared, ``v [T, HV, V]``,
        ``g, beta [T, HV]`` float32, from its stored state (``initial``: a prompt continued, e.g. a chunked
        prefill) or from zero; returns ``o [T, HV, V]`` float32."""
        rows = torch.tensor([row], device=q.device)
        state = self._state(rows, int(self.counts[row]) if initial else None)
        o = state.prefill(*(x.unsqueeze(0) for x in (q, k, v, g, beta)))
        self._write(rows, state)
        return o[0]
