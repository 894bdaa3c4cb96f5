"""What RTN and PACE share: the group quantiser of :mod:`pace_core.quant` (b-bit codes with fp16 scales, and
integer zero points unless symmetric, in groups of ``group_size`` along the key or the value axis), with a share
of heads kept at ``high_bits`` (PACE-4/8: :func:`pace_core.quant.quantize_heads`, the heads of
``cfg.high_heads[i]`` for the i-th GDN layer), and the three combinations the PACE paper lists as untested, each
under any periodic rounding (dP, P) and any head widths:

- **stochastic rounding** (``rounding`` "stochastic", ``rounding_seed``): codes ``floor(x/s + u)``, ``u ~ U[0, 1)``
  from the layer state's generator (:class:`pace_core.checkpoint.StateFormat`), instead of round half to even; the
  scales (and zero points) are the group's own as before. The decode buffer's records keep round to nearest
  [ours]: they are rounded once each, read by every later token of the period and folded exactly, so their noise
  is not the accumulated per-checkpoint bias that stochastic rounding exists to remove.
- **key rotation** (``key_hadamard``): the format stores ``Q(H S)`` and loads ``Hᵀ Q(H S)``, H the orthonormal
  Sylvester Hadamard of size d_k on the key axis of each head's ``[K, V]`` state
  (:func:`pace_core.checkpoint.rotate_keys`; d_k a power of two). Its bytes are the plain format's.
- **static scales** (``scales`` "static", ``static_margin``): each group's range is calibrated once per layer
  (:func:`calibrate`: the group's max |x| over the calibration snapshots, or its min and max with 0, in the
  rotated basis with ``key_hadamard``; :func:`pace_core.quant.group_ranges`) and kept once per layer in fp16
  (:class:`StaticCodes`: a sequence stores its codes alone); every store derives the scales from it widened by
  ``static_margin`` (:func:`pace_core.quant.static_scales`) and saturates codes beyond them
  (:func:`pace_core.quant.quantize_fixed`; the format counts the saturated values, :attr:`GroupFormat.saturated`).
  The margin **[ours]**: 0.625 by default (:data:`STATIC_MARGIN`, chosen by measurement: it clips the ranges).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING

import torch

from pace_core import quant
from pace_core.checkpoint import StateFormat, checkpoint_bytes, rotate_keys
from pace_core.errors import PaceError
from pace_core.heads import num_high_heads
from pace_core.methods.base import LayerCalibration
from pace_core.quant import QuantSpec, packed_last_dim, packed_nbytes, scale_shape
from pace_core.settings import Configuration

if TYPE_CHECKING:
    from pace_core.shapes import ModelShape

SCALE_BITS = 16
RANGE_BITS = 16
"""Bits of a calibrated range entry kept per layer (fp16: max |x|, or the min and the max)."""
COUNTS_BYTES = 16
"""The counts static scales keep per layer: values stored and values saturated, one int64 each."""
STATIC_MARGIN = 0.625
"""The default factor on the calibrated ranges of static scales **[ours]**: below 1, it clips the rare extremes of
the calibration snapshots. Measured on held-out text (WikiText-2 validation, first 8,192 tokens, embedded model,
PACE-4 with static scales; KL to fp32): 0.375: 9.8e-4, 0.5: 6.6e-4, **0.625: 6.6e-4**, 0.75: 8.2e-4, 1.0: 1.33e-3,
1.25: 2.0e-3 (per-checkpoint scales: 3.2e-4); the wider of the two best saturates less."""
READS = ("group_axis", "high_bits", "high_share", "high_heads")
"""The settings of a group quantiser beyond the scheme's (bits, symmetric, group size); the high-bit heads' are
read when their share is above 0 (pace_core.export.used_fields)."""
COMPOSES = ("rounding", "key_hadamard", "scales")
"""The combinations (pace_core.methods.COMBINATIONS) RTN and PACE take: all three."""


def range_names(cfg: Configuration) -> tuple[str, ...]:
    """The calibrated tensors of static scales (:data:`pace_core.quant.RANGE_NAMES`), ``rotated_`` in front when
    they were taken in the key-rotated basis: the names tell a calibration of the other basis apart."""
    return tuple(("rotated_" if cfg.key_hadamard else "") + n for n in quant.RANGE_NAMES[cfg.symmetric])


def calibration(cfg: Configuration) -> LayerCalibration | None:
    """Static scales need each group's range calibrated on the model; per-checkpoint scales need nothing."""
    if cfg.scales != "static":
        return None
    what = {"amax": "max |x|", "low": "min(x, 0)", "high": "max(x, 0)"}
    basis = " of the key-rotated state H S" if cfg.key_hadamard else ""
    return LayerCalibration({name: f"each scale group's {what[name.removeprefix('rotated_')]}{basis} over the "
                                   "calibration states, float16 [HV, groups]" for name in range_names(cfg)})


@dataclass
class StaticCodes:
    """A state ``[..., HV, K, V]`` stored as its codes alone, its scales fixed per layer (static scales, kept by the
    format): ``codes[b]`` the packed codes (as :class:`pace_core.quant.PackedTensor`'s) of the heads ``heads[b]``
    (int16, ascending; None when all heads have one width) at ``b`` bits."""

    codes: dict[int, torch.Tensor]
    heads: dict[int, torch.Tensor] | None
    shape: tuple[int, ...]

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """The codes of each width, named ``codes@<bits>``, batch axis first (the head map is kept once)."""
        return {f"codes@{b}": t for b, t in self.codes.items()}

    def with_stored(self, tensors: dict[str, torch.Tensor]) -> StaticCodes:
        """This structure (and head map) holding ``tensors`` (named as :meth:`stored_tensors`)."""
        n = next(iter(tensors.values())).shape[0]
        return replace(self, codes={int(name.split("@")[1]): t for name, t in tensors.items()},
                       shape=(n, *self.shape[1:]))

    def split_bytes(self) -> tuple[int, int]:
        """``(payload, metadata)`` bytes: the codes; the head map."""
        heads = self.heads or {}
        return (sum(t.numel() * t.element_size() for t in self.codes.values()),
                sum(t.numel() * t.element_size() for t in heads.values()))


class GroupFormat(StateFormat):
    """Packed groups (:func:`pace_core.quant.quantize`), per head width where some heads keep ``high_bits``, with
    the configuration's combinations (module docstring). With static scales: ``layer`` holds the calibrated ranges
    (:func:`range_names`); :attr:`saturated` counts the values stored beyond their range and :attr:`stored` all
    values stored, since the layer's sequences started (:meth:`restart`). The counts are a tensor on the layer's
    device, added to in place by each store (no host read per store; a CUDA graph's replay counts too)."""

    _counts: torch.Tensor | None = None
    """``[saturated, stored]`` int64 with static scales (:data:`COUNTS_BYTES`), else None."""

    def __init__(self, cfg, bits_per_head, layer=None, name="state", gdn_index=0) -> None:
        super().__init__(cfg, bits_per_head, layer, name, gdn_index)
        self.widths = sorted(set(self.bits_per_head))
        if cfg.scales != "static":
            return
        if layer is None or set(layer) != set(range_names(cfg)):
            raise PaceError(f"the static scales of {name} are not calibrated on the model (calibrated tensors "
                            f"{sorted(layer or ())}); allowed: {', '.join(range_names(cfg))} of a configuration "
                            "calibrated on it (pace_core.analysis.calibration.calibrate, or an exported file)")
        self.heads = None if len(self.widths) == 1 else {
            b: torch.tensor([h for h, hb in enumerate(self.bits_per_head) if hb == b], dtype=torch.int16)
            for b in self.widths}

    def restart(self) -> None:
        super().restart()
        if self.cfg.scales != "static":
            return
        if self._counts is not None and self._counts.device == self.device:
            self._counts.zero_()  # in place: a recorded graph adds into this tensor
        else:
            self._counts = torch.zeros(COUNTS_BYTES // 8, dtype=torch.int64, device=self.device)

    @property
    def saturated(self) -> int:
        """Values stored beyond their static range since :meth:`restart` (one device read)."""
        return int(self._counts[0]) if self._counts is not None else 0

    @property
    def stored(self) -> int:
        """Values stored with static scales since :meth:`restart` (one device read)."""
        return int(self._counts[1]) if self._counts is not None else 0

    def count(self, saturated: int | torch.Tensor, stored: int) -> None:
        """Add ``saturated`` and ``stored`` values to the counts (also the fused CPU pool's stores)."""
        self._counts[0].add_(saturated)
        self._counts[1].add_(stored)

    def to(self, device: torch.device) -> GroupFormat:
        if self.cfg.scales == "static" and self.heads is not None:
            self.heads = {b: h.to(device) for b, h in self.heads.items()}
        return super().to(device)

    @property
    def spec(self) -> QuantSpec:
        return self.cfg.quant_spec()

    def store_loaded(self, S: torch.Tensor):
        if self.cfg.key_hadamard:
            quant.check_finite(S, self.name)  # before the rotation spreads a bad value over its column
        Y = self.rotate(S)
        if self.cfg.scales == "static":
            c, values = self._store_static(Y)
        elif len(self.widths) == 1:  # it checks Y itself
            c, values = quant.quantize_with_values(Y, self.cfg.quant_spec(self.widths[0]), name=self.name,
                                                   generator=self.generator)
        else:
            quant.check_finite(Y, self.name)
            c, values = quant.quantize_heads(Y, self.bits_per_head, self.cfg.quant_spec(), name=self.name,
                                             generator=self.generator), None
        return c, None if values is None else self.unrotate(values)

    def load(self, c) -> torch.Tensor:
        if isinstance(c, StaticCodes):
            Y = None
            for b, codes in c.codes.items():
                spec, heads = self.cfg.quant_spec(b), self._heads(b)
                part = quant.dequantize_fixed(codes, spec, *self._scales(spec, heads),
                                              (*c.shape[:-3], codes.shape[-3], *c.shape[-2:]))
                Y = _joined(Y, part, heads, c.shape)
        else:
            Y = quant.dequantize(c) if isinstance(c, quant.PackedTensor) else c.dequantize()
        return self.unrotate(Y)

    def nbytes(self, c) -> tuple[int, int]:
        """The checkpoint's ``(payload, metadata)`` bytes, with static scales the layer's calibrated ranges and its
        counts in the metadata."""
        payload, metadata = checkpoint_bytes(c)
        kept = [*(self.layer or {}).values(), *([] if self._counts is None else [self._counts])]
        return payload, metadata + sum(t.numel() * t.element_size() for t in kept)

    def _heads(self, bits: int) -> torch.Tensor | None:
        """The heads at ``bits`` (long), or None when every head has that width."""
        return None if self.heads is None else self.heads[bits].long()

    def _scales(self, spec: QuantSpec, heads: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The static scales and zero points of ``heads`` (all: None) at ``spec``'s width."""
        ranges = {name.removeprefix("rotated_"): t if heads is None else t.index_select(0, heads)
                  for name, t in self.layer.items()}
        return quant.static_scales(ranges, spec, self.cfg.static_margin)

    def _store_static(self, Y: torch.Tensor) -> tuple[StaticCodes, torch.Tensor]:
        """Codes of ``Y [B, HV, K, V]`` under the layer's static scales, and their dequantised values (float32)."""
        quant.check_finite(Y, self.name)
        codes, saturated, values = {}, 0, None
        for b in self.widths:
            spec, heads = self.cfg.quant_spec(b), self._heads(b)
            x = Y if heads is None else Y.index_select(Y.dim() - 3, heads)
            codes[b], part, sat = quant.quantize_fixed(x, spec, *self._scales(spec, heads), name=self.name,
                                                       checked=True, generator=self.generator)
            values = _joined(values, part, heads, tuple(Y.shape))
            saturated = saturated + sat
        self.count(saturated, Y.numel())
        return StaticCodes(codes, self.heads, tuple(Y.shape)), values


def _joined(out: torch.Tensor | None, part: torch.Tensor, heads: torch.Tensor | None,
            shape: tuple[int, ...]) -> torch.Tensor:
    """``part [..., n, K, V]`` (float32) as the heads ``heads`` of the state ``out [..., HV, K, V]`` (``shape``; made on
    the first part), or ``part`` itself when it holds every head (``heads`` None)."""
    if heads is None:
        return part
    out = torch.empty(shape, dtype=torch.float32, device=part.device) if out is None else out
    return out.index_copy_(len(shape) - 3, heads, part)


def high_head_counts(cfg: Configuration, shape: ModelShape) -> tuple[int, ...]:
    """Heads kept at ``high_bits`` in each GDN layer: from ``high_heads`` when calibrated, else
    ``num_high_heads(high_share, HV)`` (0 for methods without high-bit heads)."""
    if cfg.high_share == 0:
        return (0,) * shape.num_gdn_layers
    if cfg.high_heads is not None:
        return tuple(len(layer) for layer in cfg.high_heads)
    return (num_high_heads(cfg.high_share, shape.num_v_heads),) * shape.num_gdn_layers


def payload(cfg: Configuration, shape: ModelShape) -> tuple[Fraction, Fraction]:
    """Code bits ``(1 − s)·b + s·b_high`` (``s`` the share of high-bit heads over all layers) and scale bits
    ``16/g`` plus, with zero points, the codes' bits over ``g``; none per sequence with static scales (they are kept
    once per layer: :func:`fixed_bytes`)."""
    s = Fraction(sum(high_head_counts(cfg, shape)), shape.num_gdn_layers * shape.num_v_heads)
    codes = (1 - s) * cfg.bits + s * cfg.high_bits
    if cfg.scales == "static":
        return codes, Fraction(0)
    zero = Fraction(0) if cfg.symmetric else codes / cfg.group_size
    return codes, Fraction(SCALE_BITS, cfg.group_size) + zero


def layer_bytes(cfg: Configuration, shape: ModelShape, n_seq: int, layer: int) -> int:
    """Bytes of one layer's packed parts (low- and high-bit heads) for ``n_seq`` sequences: codes, scales and zero
    points, or the codes alone with static scales."""
    hv, k, v = shape.num_v_heads, shape.d_k, shape.d_v
    high = high_head_counts(cfg, shape)[layer]
    total = 0
    for heads, bits in ((hv - high, cfg.bits), (high, cfg.high_bits)):
        if heads and cfg.scales == "static":
            total += n_seq * heads * k * packed_last_dim(bits, v)
        elif heads:
            spec = QuantSpec(bits=bits, symmetric=cfg.symmetric, axis=cfg.group_axis, group_size=cfg.group_size)
            total += packed_nbytes((n_seq, heads, k, v), spec)
    return total


def fixed_bytes(cfg: Configuration, shape: ModelShape, layer: int) -> int:
    """Kept once per layer: the head map of a layer that mixes two widths (one int16 per value head; none where the
    high-bit heads have the others' width), and with static scales the calibrated ranges (one or two fp16 per scale
    group of every head) and the counts of values stored and saturated (:data:`COUNTS_BYTES`)."""
    hv = shape.num_v_heads
    total = 2 * hv if 0 < high_head_counts(cfg, shape)[layer] < hv and cfg.high_bits != cfg.bits else 0
    if cfg.scales == "static":
        groups = len(quant.RANGE_NAMES[cfg.symmetric]) * hv * (shape.d_k * shape.d_v // cfg.group_size)
        total += groups * RANGE_BITS // 8 + COUNTS_BYTES
    return total


def groups_along(cfg: Configuration) -> str:
    return cfg.group_axis


def calibrate(cfg: Configuration, samples, layers: list[int]) -> list[dict[str, torch.Tensor]]:
    """Static scales' ranges per GDN layer (:func:`pace_core.quant.group_ranges` of the calibration states
    ``[N, HV, K, V]``, key-rotated with ``key_hadamard``), named by :func:`range_names`, on the CPU."""
    spec = cfg.quant_spec()
    out = []
    for layer in layers:
        states = samples.states[layer]
        ranges = quant.group_ranges(
            rotate_keys(states) if cfg.key_hadamard else states, spec, name="calibration states"
        )
        out.append({("rotated_" if cfg.key_hadamard else "") + n: t.cpu() for n, t in ranges.items()})
    return out


def check_for(cfg: Configuration, shape: ModelShape) -> None:
    """Static scales' calibrated ranges fit the model: :func:`range_names`, float16 ``[HV, groups]``, amax >= 0,
    low <= 0 <= high."""
    if cfg.calibrated is None:
        return
    want = (shape.num_v_heads, *scale_shape((shape.d_k, shape.d_v), cfg.quant_spec()))
    for i, layer in enumerate(cfg.calibrated.layers):
        ok = set(layer) == set(range_names(cfg)) and all(
            t.dtype == torch.float16 and tuple(t.shape) == want and bool(torch.isfinite(t).all())
            for t in layer.values()
        )
        signs = {"amax": 1, "high": 1, "low": -1}
        if ok and not all(bool((signs[n.removeprefix("rotated_")] * t >= 0).all()) for n, t in layer.items()):
            ok = False
        if not ok:
            raise PaceError(f"calibrated[{i}] is not the static scales' ranges of these settings for {shape.name}; "
                            f"allowed: {', '.join(range_names(cfg))} float16 {list(want)} (amax, high >= 0, low <= 0): "
                            "calibrate the configuration on this model")
