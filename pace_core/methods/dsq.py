"""Q-Mamba DSQ (method ``dsq``): decoupled row and column fp16 scales per head, symmetric b-bit codes
(:func:`pace_core.outliers.dsq_quantize`, PACE_SPEC §6)."""

from __future__ import annotations

from fractions import Fraction

import torch

from pace_core.checkpoint import StateFormat
from pace_core.methods.base import Method, register
from pace_core.outliers import DSQTensor, dsq_dequantize, dsq_quantize_with_values
from pace_core.quant import check_finite, packed_last_dim

SCALE_BITS = 16


class DSQFormat(StateFormat):
    """Codes with a row scale per key row and a column scale per value column (:class:`DSQTensor`), of the
    key-rotated state with ``key_hadamard``.

    Of the combinations (pace_core.methods.COMBINATIONS) DSQ takes stochastic rounding and the key rotation;
    static scales would fix the row and column scales that Q-Mamba fits to each checkpoint by definition."""

    def store_loaded(self, S: torch.Tensor) -> tuple[DSQTensor, torch.Tensor]:
        if self.cfg.key_hadamard:
            check_finite(S, self.name)  # before the rotation spreads a bad value over its column
        c, values = dsq_quantize_with_values(self.rotate(S), self.cfg.bits, name=self.name, generator=self.generator)
        return c, self.unrotate(values)

    def load(self, c: DSQTensor) -> torch.Tensor:
        return self.unrotate(dsq_dequantize(c))


METHOD = register(Method(
    name="dsq", order=40, label="Q-Mamba DSQ", description="Q-Mamba DSQ: decoupled row and column fp16 scales",
    symmetric_only=True, strategy="channel", format=DSQFormat, composes=("rounding", "key_hadamard"),
    payload=lambda cfg, shape: (Fraction(cfg.bits), Fraction(SCALE_BITS * (shape.d_k + shape.d_v),
                                                              shape.d_k * shape.d_v)),
    layer_bytes=lambda cfg, shape, n, layer: n * shape.num_v_heads * (
        shape.d_k * packed_last_dim(cfg.bits, shape.d_v) + 2 * shape.d_k + 2 * shape.d_v),
    groups_along=lambda cfg: "rows and columns",
    named={"qmamba-dsq": dict(bits=4, symmetric=True, group_axis="value", group_size=32, decode_period=1,
                              buffer="int8")}))
