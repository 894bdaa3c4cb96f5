"""One sequence's PACE state of one GDN layer as a row of bytes, the form a serving engine's state pool
holds (vLLM: one page per sequence and layer).

A :class:`SlotLayout` lays out, for one layer under a configuration, the per-slot tensors of a
:class:`pace_core.pool.StatePool` (:func:`pace_core.pool.pool_fields`: the checkpoint's stored tensors and, at
dP >= 2, the decode buffer's storage for dP records; a row's record count is read from its storage) one after
another in a row of bytes. Its :attr:`~SlotLayout.nbytes` is what :func:`pace_core.accounting.state_bytes` counts
per sequence for the layer; what is kept once per layer (PACE-4/8's head map) stays with the pool's format. The
engine's pages become the pool's tensors through :meth:`SlotLayout.views` and the pool steps them in place by the
engine's slot indices (:meth:`pace_core.pool.StatePool.decode` / ``prefill``): the arithmetic is the transformers
path's (the reference, or the kernels by the backend setting), only the batch composition differs.

Only the methods whose :attr:`pace_core.methods.Method.pool` is set are laid out here (DSQ, DAMP and STEPQuant keep
per-model calibration the engines do not carry, or have not been served yet), without stochastic rounding (its
generator draws for the whole pool, so a sequence's codes would depend on the sequences that share its steps);
static scales keep their calibrated ranges once per layer, with the pool's format, as the head map.
"""

from __future__ import annotations

import torch

from pace_core.config import PaceConfig
from pace_core.errors import PaceError
from pace_core.methods import METHODS
from pace_core.pool import StatePool, pool_fields

SLOT_METHODS = tuple(name for name, method in METHODS.items() if method.pool)
"""Methods whose per-sequence state a pool row can hold."""


def pool_refusal(cfg: PaceConfig) -> str | None:
    """Why a pool row cannot hold ``cfg``'s state, in the user's words (None: it can)."""
    if cfg.method not in SLOT_METHODS:
        return (f"method {cfg.method!r} ({cfg.name}) cannot be served from a state pool; allowed: "
                f"{', '.join(SLOT_METHODS)}")
    if cfg.rounding == "stochastic":  # one generator per pool: a row's draws would follow the batch it shares
        return (f"rounding='stochastic' ({cfg.name}) cannot be served from a state pool: its generator draws for "
                "the whole pool, so a sequence's codes would depend on which other sequences share its steps; "
                "allowed: rounding='nearest'")
    return None


class SlotLayout:
    """Where one sequence's state of one GDN layer lies in a row of bytes (module docstring).

    ``cfg`` validated for the model; ``gdn_index``: the layer's position among the GDN layers (selects
    ``cfg.high_heads``); heads and dims of the heads tensor-parallel rank ``tp = (rank, size)`` holds, as
    :class:`~pace_core.pool.StatePool`. Fields are ordered by decreasing element size, so each starts aligned to
    its dtype.
    """

    def __init__(self, cfg: PaceConfig, num_k_heads: int, num_v_heads: int, d_k: int, d_v: int,
                 gdn_index: int = 0, tp: tuple[int, int] = (0, 1)) -> None:
        refused = pool_refusal(cfg)
        if refused:
            raise PaceError(refused)
        self.cfg, self.gdn_index, self.tp = cfg, gdn_index, tp
        self.dims = (num_k_heads, num_v_heads, d_k, d_v)
        self.fields = pool_fields(cfg, self.dims, gdn_index, tp)
        self.offsets = {}
        offset = 0
        for f in self.fields:
            self.offsets[f.name] = offset
            offset += f.nbytes
        self.nbytes = offset
        """Bytes of one sequence's state of this layer (checkpoint and buffer)."""

    def pool(self, rows: torch.Tensor, name: str = "state") -> StatePool:
        """The state pool over ``rows [N, >= nbytes]`` uint8 (an engine's pages), stepped in place."""
        return StatePool(self.cfg, self.dims, rows.shape[0], rows.device, gdn_index=self.gdn_index, tp=self.tp,
                         tensors=self.views(rows), name=name)

    def views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views ``[N, *shape]`` of every field into ``rows [N, >= nbytes]`` uint8 (a pool's pages)."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] < self.nbytes:
            raise PaceError(f"rows: {rows.dtype} {tuple(rows.shape)} not allowed; allowed: uint8 [N, >= {self.nbytes}]")
        return {f.name: rows[:, self.offsets[f.name]:self.offsets[f.name] + f.nbytes].view(f.dtype)
                .view(rows.shape[0], *f.shape) for f in self.fields}
