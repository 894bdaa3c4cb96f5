"""How one GDN layer's checkpoint ``Ŝ [B, HV, K, V]`` is stored: :class:`StateFormat`, whose subclass each
method declares (:mod:`pace_core.methods`: the plain tensor of the references, PACE's and RTN's packed
groups, DSQ's row and column scales, DAMP's fp16 rows, STEPQuant's per-head widths), and what every stored
checkpoint answers alike: its per-sequence tensors (a serving pool's rows hold them), its bytes, writing it
into another's storage, reordering its batch.

A stored checkpoint is a plain tensor or an object with ``stored_tensors()`` (the per-sequence tensors by
name, batch axis first), ``with_stored(tensors)`` (the same structure holding others) and ``split_bytes()``
(``(payload, metadata)``: the tensors that hold state values, and the scales, zero points, head maps and row
indices; :class:`pace_core.accounting.ResidentBits`' ``code_bits`` and ``scale_bits`` plus what is kept once
per layer).

A :class:`RoundingFormat` stores a dense tensor rounded by any function (the layer-local sweep runs
several quantisers on slices of one stacked batch this way).
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from pace_core import quant
from pace_core.errors import PaceError
from pace_core.settings import Configuration

Checkpoint = Any
"""A stored checkpoint: a plain tensor, or an object of the protocol of the module docstring."""


def checkpoint_bytes(c: Checkpoint) -> tuple[int, int]:
    """``(payload, metadata)`` real bytes of a stored checkpoint (see the module docstring)."""
    if isinstance(c, torch.Tensor):
        return c.numel() * c.element_size(), 0
    return c.split_bytes()


def checkpoint_tensors(c: Checkpoint) -> dict[str, torch.Tensor]:
    """The per-sequence tensors of a stored checkpoint by name, batch axis first (what a pool row holds:
    :mod:`pace_core.vllm.slots`). What is kept once per layer (a head map, DAMP's outlier-row indices) is not
    among them."""
    return {"state": c} if isinstance(c, torch.Tensor) else c.stored_tensors()


def with_tensors(template: Checkpoint, tensors: dict[str, torch.Tensor]) -> Checkpoint:
    """``template`` (a checkpoint of this structure) holding ``tensors`` instead (n sequences, named as
    :func:`checkpoint_tensors` names them)."""
    return tensors["state"] if isinstance(template, torch.Tensor) else template.with_stored(tensors)


def copy_into(dst: Checkpoint, src: Checkpoint) -> None:
    """Write checkpoint ``src`` into the storage of ``dst`` (the same structure and shapes), in place."""
    if dst is src:
        return
    source = checkpoint_tensors(src)
    for name, t in checkpoint_tensors(dst).items():
        t.copy_(source[name])


def reorder(c: Checkpoint, index: torch.Tensor) -> None:
    """Batch row ``b`` of ``c`` becomes old row ``index[b]`` (``index [B]`` long), in place."""
    for t in checkpoint_tensors(c).values():
        t.copy_(t.index_select(0, index))


def hadamard(n: int, *, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix H [n, n] (n a power of two): H = Hᵀ, H Hᵀ = I. Kept per size,
    dtype and device (a decode step rotates with it twice per layer): shared, never to be written."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise PaceError(f"hadamard size (the rotated head dim)={n!r} is not supported; allowed: powers of two "
                        "1, 2, 4, ..., or no rotation")
    return _hadamard(n, dtype, torch.device("cpu") if device is None else torch.device(device))


@functools.lru_cache(maxsize=16)
def _hadamard(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype)


def rotate_keys(S: torch.Tensor) -> torch.Tensor:
    """``H S`` along the key axis of ``S [..., K, V]`` (H the orthonormal Sylvester Hadamard of size K, a power of
    two), computed in float64 and rounded once to float32: the state a key-rotated format quantises."""
    return torch.matmul(hadamard(S.shape[-2], device=S.device), S.to(torch.float64)).to(torch.float32)


def unrotate_keys(Y: torch.Tensor) -> torch.Tensor:
    """``Hᵀ Y`` along the key axis of ``Y [..., K, V]`` (the inverse of :func:`rotate_keys`; ``Hᵀ = H``), computed
    in float64 and rounded once to float32."""
    return torch.matmul(hadamard(Y.shape[-2], device=Y.device).T, Y.to(torch.float64)).to(torch.float32)


class StateFormat(ABC):
    """The storage of one GDN layer's checkpoint under ``cfg``; each method's subclass implements
    :meth:`store_loaded` and :meth:`load`.

    ``bits_per_head`` ``[HV]``: the layer's per-head widths (:meth:`PaceConfig.head_bits`, the reference's
    bits for method ``none``); ``layer`` the layer's calibrated tensors for a method that has them
    (:attr:`pace_core.methods.Method.calibration`), else None; ``name`` names the state in errors;
    ``gdn_index`` the layer's position among the GDN layers.

    The combinations a method composes with (:data:`pace_core.methods.COMBINATIONS`) are applied by its format
    with these helpers: :attr:`generator` for stochastic rounding (``rounding`` "stochastic"), one per layer
    state, seeded with ``rounding_seed · 2^16 + gdn_index`` on the layer's device when the state starts
    (:meth:`restart`, the same generator seeded again: a CUDA graph that draws from it holds it) and advanced by
    each rounding, so the same configuration, seed, inputs (batch included) and device give the same codes;
    :meth:`rotate` and :meth:`unrotate` for the Hadamard rotation along the key axis (``key_hadamard``).
    """

    dtype: torch.dtype | None = None
    """The dtype of a plain-tensor checkpoint (method ``none``), else None."""

    def __init__(self, cfg: Configuration, bits_per_head: tuple[int, ...], layer: dict[str, torch.Tensor] | None = None,
                 name: str = "state", gdn_index: int = 0) -> None:
        self.cfg, self.bits_per_head, self.layer, self.name = cfg, tuple(bits_per_head), layer, name
        self.gdn_index, self.device = gdn_index, torch.device("cpu")
        self.generator: torch.Generator | None = None
        self.restart()

    @property
    def exact(self) -> bool:
        """True when storing changes nothing (:attr:`PaceConfig.exact`): the state is the reference's."""
        return self.cfg.exact

    @property
    def spec(self) -> quant.QuantSpec | None:
        """The group quantiser of a packed-groups format (rtn, pace) at the low bits, else None."""
        return None

    def to(self, device: torch.device) -> StateFormat:
        """This format with its calibrated tensors (and its rounding's generator, started again) on ``device``."""
        if self.layer is not None:
            self.layer = {k: t.to(device) for k, t in self.layer.items()}
        self.device = torch.empty(0, device=device).device  # with its index ("cuda" is cuda:0), as tensors name it
        self.restart()
        return self

    def restart(self) -> None:
        """The start of the layer's sequences (:meth:`pace_core.schedule.PeriodicState.reset`): stochastic
        rounding's generator seeded again (class docstring)."""
        if self.cfg.rounding != "stochastic":
            return
        if self.generator is None or self.generator.device != self.device:
            self.generator = torch.Generator(self.device)
        self.generator.manual_seed(self.cfg.rounding_seed * 2**16 + self.gdn_index)  # in place: graphs hold it

    def rotate(self, S: torch.Tensor) -> torch.Tensor:
        """``S [B, HV, K, V]`` in the basis the format quantises: ``H S`` along the key axis with ``key_hadamard``
        (:func:`rotate_keys`), else ``S`` itself."""
        return rotate_keys(S) if self.cfg.key_hadamard else S

    def unrotate(self, Y: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`rotate` (``Hᵀ Y`` with ``key_hadamard``, else ``Y``)."""
        return unrotate_keys(Y) if self.cfg.key_hadamard else Y

    def store(self, S: torch.Tensor) -> Checkpoint:
        """``S [B, HV, K, V]`` in this format (non-finite values raise PaceError naming the state)."""
        return self.store_loaded(S)[0]

    @abstractmethod
    def store_loaded(self, S: torch.Tensor) -> tuple[Checkpoint, torch.Tensor | None]:
        """:meth:`store` and, where it comes for free, the dequantised checkpoint (float32, bit-identical to
        :meth:`load` of it), else None."""

    @abstractmethod
    def load(self, c: Checkpoint) -> torch.Tensor:
        """The dequantised checkpoint ``Ŝ [B, HV, K, V]`` float32."""

    def zeros(self, shape: tuple[int, int, int, int], device: torch.device) -> Checkpoint:
        """The checkpoint of the zero state ``[B, HV, K, V]``."""
        return self.store(torch.zeros(shape, device=device))

    nbytes = staticmethod(checkpoint_bytes)


class RoundingFormat:
    """A dense checkpoint in ``dtype`` rounded by ``round_fn(S [B, HV, K, V]) -> S`` (e.g. fake quantisation,
    bit-identical to storing and loading :mod:`pace_core.quant`'s format). ``dtype`` has no default: a float64
    analysis keeps float64 checkpoints, a float32 one float32 (the caller says which)."""

    exact = False
    spec = None

    def __init__(self, round_fn: Callable[[torch.Tensor], torch.Tensor], name: str = "state", *,
                 dtype: torch.dtype) -> None:
        self.round_fn, self.name, self.dtype = round_fn, name, dtype

    def to(self, device: torch.device) -> RoundingFormat:
        return self

    def restart(self) -> None:
        """Nothing to start again (:meth:`StateFormat.restart`)."""

    def store(self, S: torch.Tensor) -> torch.Tensor:
        quant.check_finite(S, self.name)
        return self.round_fn(S).to(self.dtype)

    def store_loaded(self, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.store(S)
        return c, c

    def load(self, c: torch.Tensor) -> torch.Tensor:
        return c

    def zeros(self, shape: tuple[int, int, int, int], device: torch.device) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=device)

    nbytes = staticmethod(checkpoint_bytes)
