"""What RTN and PACE share: the group quantiser of :mod:`pace_core.quant` (b-bit codes with fp16 scales, and
integer zero points unless symmetric, in groups of ``group_size`` along the key or the value axis), with a share
of heads kept at ``high_bits`` (PACE-4/8: :func:`pace_core.quant.quantize_heads`, the heads of
``cfg.high_heads[i]`` for the i-th GDN layer)."""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

import torch

from pace_core import quant
from pace_core.checkpoint import StateFormat
from pace_core.quant import QuantSpec, packed_nbytes

if TYPE_CHECKING:
    from pace_core.config import PaceConfig
    from pace_core.shapes import ModelShape

SCALE_BITS = 16
READS = ("group_axis", "high_bits", "high_share", "high_heads")
"""The settings of a group quantiser beyond the scheme's (bits, symmetric, group size); the high-bit heads' are
read when their share is above 0 (pace_core.export.used_fields)."""


class GroupFormat(StateFormat):
    """Packed groups (:func:`pace_core.quant.quantize`), per head width where some heads keep ``high_bits``."""

    @property
    def spec(self) -> QuantSpec:
        return self.cfg.quant_spec()

    def store_loaded(self, S: torch.Tensor):
        if len(set(self.bits_per_head)) == 1:  # it checks S itself
            return quant.quantize_with_values(S, self.cfg.quant_spec(self.bits_per_head[0]), name=self.name)
        quant.check_finite(S, self.name)
        return quant.quantize_heads(S, self.bits_per_head, self.cfg.quant_spec(), name=self.name), None

    def load(self, c) -> torch.Tensor:
        return quant.dequantize(c) if isinstance(c, quant.PackedTensor) else c.dequantize()


def high_head_counts(cfg: PaceConfig, shape: ModelShape) -> tuple[int, ...]:
    """Heads kept at ``high_bits`` in each GDN layer: from ``high_heads`` when calibrated, else
    ``num_high_heads(high_share, HV)`` (0 for methods without high-bit heads)."""
    from pace_core.config import num_high_heads

    if cfg.high_share == 0:
        return (0,) * shape.num_gdn_layers
    if cfg.high_heads is not None:
        return tuple(len(layer) for layer in cfg.high_heads)
    return (num_high_heads(cfg.high_share, shape.num_v_heads),) * shape.num_gdn_layers


def payload(cfg: PaceConfig, shape: ModelShape) -> tuple[Fraction, Fraction]:
    """Code bits ``(1 − s)·b + s·b_high`` (``s`` the share of high-bit heads over all layers) and scale bits
    ``16/g`` plus, with zero points, the codes' bits over ``g``."""
    s = Fraction(sum(high_head_counts(cfg, shape)), shape.num_gdn_layers * shape.num_v_heads)
    codes = (1 - s) * cfg.bits + s * cfg.high_bits
    zero = Fraction(0) if cfg.symmetric else codes / cfg.group_size
    return codes, Fraction(SCALE_BITS, cfg.group_size) + zero


def layer_bytes(cfg: PaceConfig, shape: ModelShape, n_seq: int, layer: int) -> int:
    """Bytes of one layer's packed parts (low- and high-bit heads) for ``n_seq`` sequences."""
    hv, k, v = shape.num_v_heads, shape.d_k, shape.d_v
    high = high_head_counts(cfg, shape)[layer]
    total = 0
    for heads, bits in ((hv - high, cfg.bits), (high, cfg.high_bits)):
        if heads:
            spec = QuantSpec(bits=bits, symmetric=cfg.symmetric, axis=cfg.group_axis, group_size=cfg.group_size)
            total += packed_nbytes((n_seq, heads, k, v), spec)
    return total


def fixed_bytes(cfg: PaceConfig, shape: ModelShape, layer: int) -> int:
    """The head map of a layer that mixes two widths (one int16 per value head, kept once), else 0."""
    return 2 * shape.num_v_heads if 0 < high_head_counts(cfg, shape)[layer] < shape.num_v_heads else 0


def groups_along(cfg: PaceConfig) -> str:
    return cfg.group_axis
