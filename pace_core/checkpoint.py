"""How one GDN layer's checkpoint ``Ŝ [B, HV, K, V]`` is stored, per method (PACE_SPEC §2, §6): the one
place that quantises, dequantises, counts, reorders and lists the tensors of a checkpoint.

- ``none``: the plain tensor in ``cfg.reference_dtype`` (float32 or bfloat16); its "rounding" is that
  cast (none at all for float32), applied where a quantised method rounds;
- ``rtn`` / ``pace``: :func:`pace_core.quant.quantize` (a ``PackedTensor``), or, when some heads are
  promoted, :func:`pace_core.quant.quantize_heads` (a ``MixedPackedState``): the heads of
  ``cfg.high_heads[i]`` (i = the layer's position among the GDN layers) at ``cfg.high_bits``, the rest at
  ``cfg.bits`` (:meth:`PaceConfig.head_bits`);
- ``dsq``: :func:`pace_core.outliers.dsq_quantize` at ``cfg.bits``;
- ``damp``: :class:`pace_core.outliers.DampQuantizer` with the layer's calibrated outlier rows
  (``[HV, cfg.damp_outlier_rows]``), ``cfg.bits``, ``cfg.damp_hadamard``, value-axis groups of
  ``cfg.group_size``.

Bytes (:meth:`StateFormat.nbytes`), counted from the stored tensors: ``payload`` = the tensors that hold
state values (codes; DAMP's fp16 outlier rows; the plain tensor of ``none``), ``metadata`` = scales, zero
points, PACE-4/8's head map, DSQ row/column scales, DAMP row indices. These are :class:`pace_core.accounting.ResidentBits`'s
``code_bits`` and ``scale_bits`` (plus DAMP's row indices), whose ``payload_bits`` is their sum, the
seeds' "payload".

A :class:`RoundingFormat` stores a dense tensor rounded by any function (the layer-local sweep runs
several quantisers on slices of one stacked batch this way).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Union

import torch

from pace_core import quant
from pace_core.config import PaceConfig
from pace_core.errors import PaceError
from pace_core.outliers import (DampQuantizer, DampTensor, DSQTensor, dsq_dequantize, dsq_quantize_with_values)

Checkpoint = Union[torch.Tensor, quant.PackedTensor, quant.MixedPackedState, DSQTensor, DampTensor]


def _nb(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def checkpoint_bytes(c: Checkpoint) -> tuple[int, int]:
    """``(payload, metadata)`` real bytes of a stored checkpoint (see the module docstring)."""
    if isinstance(c, torch.Tensor):
        return _nb(c), 0
    if isinstance(c, quant.PackedTensor):
        return _nb(c.codes), _nb(c.scale) + _nb(c.zero)
    if isinstance(c, quant.MixedPackedState):
        parts = [checkpoint_bytes(p) for p in c.parts.values()]
        return sum(p for p, _ in parts), sum(m for _, m in parts) + c.map_nbytes()
    if isinstance(c, DSQTensor):
        return _nb(c.codes), _nb(c.row_scale) + _nb(c.col_scale)
    if isinstance(c, DampTensor):
        payload, metadata = checkpoint_bytes(c.rest)
        return payload + _nb(c.outliers), metadata + _nb(c.rows)
    raise PaceError(f"checkpoint: type {type(c).__name__} not allowed; allowed: Tensor, PackedTensor, "
                    "MixedPackedState, DSQTensor, DampTensor")


def checkpoint_tensors(c: Checkpoint) -> dict[str, torch.Tensor]:
    """The per-sequence tensors of a stored checkpoint by name, batch axis first (what a pool row holds:
    :mod:`pace_core.vllm.slots`). What is kept once per layer (PACE-4/8's head map, DAMP's outlier-row
    indices) is not among them."""
    if isinstance(c, torch.Tensor):
        return {"state": c}
    if isinstance(c, quant.PackedTensor):
        return {name: t for name, t in (("codes", c.codes), ("scale", c.scale), ("zero", c.zero)) if t is not None}
    if isinstance(c, quant.MixedPackedState):
        return {f"{name}@{bits}": t for bits, part in c.parts.items() for name, t in checkpoint_tensors(part).items()}
    if isinstance(c, DSQTensor):
        return {"codes": c.codes, "row_scale": c.row_scale, "col_scale": c.col_scale}
    if isinstance(c, DampTensor):
        return {"outliers": c.outliers, **checkpoint_tensors(c.rest)}
    raise PaceError(f"checkpoint: type {type(c).__name__} not allowed; allowed: Tensor, PackedTensor, "
                    "MixedPackedState, DSQTensor, DampTensor")


def with_tensors(template: Checkpoint, tensors: dict[str, torch.Tensor]) -> Checkpoint:
    """``template`` (a checkpoint of this structure) holding ``tensors`` instead (n sequences, named as
    :func:`checkpoint_tensors` names them)."""
    if isinstance(template, torch.Tensor):
        return tensors["state"]
    n = next(iter(tensors.values())).shape[0]
    if isinstance(template, quant.PackedTensor):
        return replace(template, codes=tensors["codes"], scale=tensors["scale"], zero=tensors.get("zero"),
                       shape=(n, *template.shape[1:]))
    if isinstance(template, DSQTensor):
        return replace(template, codes=tensors["codes"], row_scale=tensors["row_scale"],
                       col_scale=tensors["col_scale"], shape=(n, *template.shape[1:]))
    if isinstance(template, DampTensor):
        rest = with_tensors(template.rest, {k: t for k, t in tensors.items() if k != "outliers"})
        return replace(template, outliers=tensors["outliers"], rest=rest, shape=(n, *template.shape[1:]))
    parts = {bits: with_tensors(part, {name.split("@")[0]: t for name, t in tensors.items()
                                        if name.endswith(f"@{bits}")})
             for bits, part in template.parts.items()}
    return replace(template, parts=parts, shape=(n, *template.shape[1:]))


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


class StateFormat:
    """The storage of one GDN layer's checkpoint under ``cfg`` (module docstring).

    ``bits_per_head`` ``[HV]``: the layer's per-head widths (:meth:`PaceConfig.head_bits`, the
    reference's bits for method ``none``); ``damp_rows`` ``[HV, r]`` long: DAMP's calibrated outlier
    rows (method ``damp`` only); ``name`` names the state in errors.
    """

    def __init__(self, cfg: PaceConfig, bits_per_head: tuple[int, ...], damp_rows: torch.Tensor | None = None,
                 name: str = "state") -> None:
        self.cfg, self.bits_per_head, self.name = cfg, tuple(bits_per_head), name
        self.dtype = getattr(torch, cfg.reference_dtype) if cfg.method == "none" else None
        self.damp = None
        if cfg.method == "damp":
            expected = (len(bits_per_head), cfg.damp_outlier_rows)
            if not isinstance(damp_rows, torch.Tensor) or tuple(damp_rows.shape) != expected:
                got = None if damp_rows is None else tuple(getattr(damp_rows, "shape", ()))
                raise PaceError(
                    f"damp_rows: {got} for {name} not allowed; allowed: calibrated outlier rows [HV, "
                    f"damp_outlier_rows] = {list(expected)} per GDN layer (pace_core.outliers.rank_outlier_rows)")
            self.damp = DampQuantizer(damp_rows, cfg.bits, cfg.damp_hadamard, cfg.group_size)

    @property
    def exact(self) -> bool:
        """True when storing changes nothing (:attr:`PaceConfig.exact`): the state is the reference's."""
        return self.cfg.exact

    @property
    def spec(self) -> quant.QuantSpec | None:
        """The group quantiser of rtn / pace (at the low bits), else None."""
        return self.cfg.quant_spec() if self.cfg.method in ("rtn", "pace") else None

    def to(self, device: torch.device) -> StateFormat:
        """This format with its calibrated rows on ``device``."""
        if self.damp is not None:
            self.damp = DampQuantizer(self.damp.rows.to(device), self.cfg.bits, self.cfg.damp_hadamard,
                                      self.cfg.group_size)
        return self

    def store(self, S: torch.Tensor) -> Checkpoint:
        """``S [B, HV, K, V]`` in this format (non-finite values raise PaceError naming the state)."""
        return self.store_loaded(S)[0]

    def store_loaded(self, S: torch.Tensor) -> tuple[Checkpoint, torch.Tensor | None]:
        """:meth:`store` and, where it comes for free, the dequantised checkpoint (float32, bit-identical to
        :meth:`load` of it), else None."""
        method = self.cfg.method
        if method in ("rtn", "pace") and len(set(self.bits_per_head)) == 1:  # it checks S itself
            return quant.quantize_with_values(S, self.cfg.quant_spec(self.bits_per_head[0]), name=self.name)
        quant.check_finite(S, self.name)
        if method == "none":
            c = S.to(self.dtype)
            return c, c.float()
        if method == "dsq":
            return dsq_quantize_with_values(S, self.cfg.bits, name=self.name)
        if method == "damp":
            return self.damp.quantize_with_values(S, name=self.name)
        return quant.quantize_heads(S, self.bits_per_head, self.cfg.quant_spec(), name=self.name), None

    def load(self, c: Checkpoint) -> torch.Tensor:
        """The dequantised checkpoint ``Ŝ [B, HV, K, V]`` float32."""
        if isinstance(c, torch.Tensor):
            return c.float()
        if isinstance(c, quant.PackedTensor):
            return quant.dequantize(c)
        if isinstance(c, quant.MixedPackedState):
            return c.dequantize()
        if isinstance(c, DSQTensor):
            return dsq_dequantize(c)
        return self.damp.dequantize(c)

    def zeros(self, shape: tuple[int, int, int, int], device: torch.device) -> Checkpoint:
        """The checkpoint of the zero state ``[B, HV, K, V]``."""
        return self.store(torch.zeros(shape, device=device))

    nbytes = staticmethod(checkpoint_bytes)


class RoundingFormat:
    """A dense checkpoint in ``dtype`` rounded by ``round_fn(S [B, HV, K, V]) -> S`` (e.g. fake quantisation,
    bit-identical to storing and loading :mod:`pace_core.quant`'s format)."""

    exact = False
    spec = None

    def __init__(self, round_fn: Callable[[torch.Tensor], torch.Tensor], name: str = "state",
                 dtype: torch.dtype = torch.float32) -> None:
        self.round_fn, self.name, self.dtype = round_fn, name, dtype

    def to(self, device: torch.device) -> RoundingFormat:
        return self

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
