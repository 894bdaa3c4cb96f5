"""Q-Mamba DSQ (method ``dsq``, PACE_SPEC §6): decoupled row and column fp16 scales per head, symmetric b-bit
codes; its quantiser (:func:`dsq_quantize`), its storage format, bytes and named configuration.

Q-Mamba DSQ (decoupled scale quantisation) **[ours: the exact definition]**, for one matrix
`x [K, V]` (leading dims are independent matrices), symmetric b bits, `qmax = 2^(b-1) - 1`:
- row scale `r_k = fp16(row amax_k)`, `row amax_k = max_v |x[k, v]|`;
- column scale `c_v = fp16(max_k |x[k, v] / r_k| / qmax)`: the column amax of the row-normalised
  matrix, divided by qmax;
- code `q = clamp(round(x / (r_k c_v)), -qmax, qmax)`, stored as `q + 2^(b-1)` and packed like
  `quant.pack_codes`; value `q * r_k * c_v`.
Arithmetic in the working dtype of `quant` (float64 for float64 input, else float32); amax / qmax
in float32; both scales are clamped into fp16's normal range `[2^-14, 65504]` (0 for an all-zero
row or column, whose values dequantise to 0). `r_k c_v` is exact in float32, so the bound is
`|x - x̂| <= r_k c_v / 2`, up to a float32 rounding of the dequantised value; a row whose max |x| exceeds
65504 is refused (PaceError), never saturated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

import torch

from pace_core.checkpoint import StateFormat
from pace_core.methods.base import Method, register
from pace_core.quant import (
    check_bits,
    check_finite,
    check_fp16,
    check_state,
    div_by_int,
    fp16_scale,
    pack_codes,
    packed_last_dim,
    round_codes,
    safe_divisor,
    unpack_codes,
    work_dtype,
)

SCALE_BITS = 16


@dataclass
class DSQTensor:
    """A DSQ-quantised `[..., K, V]` tensor: codes packed densely uint8 [..., K, ceil(V b / 8)]
    (`quant.pack_codes`); row_scale fp16 [..., K]; col_scale fp16 [..., V]."""

    codes: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor
    bits: int
    shape: tuple[int, ...]

    def nbytes(self) -> int:
        """Real bytes of codes + row scales + column scales."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.row_scale, self.col_scale))

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name, batch axis first."""
        return {"codes": self.codes, "row_scale": self.row_scale, "col_scale": self.col_scale}

    def with_stored(self, tensors: dict[str, torch.Tensor]) -> DSQTensor:
        """This structure holding ``tensors`` (named as :meth:`stored_tensors`)."""
        return replace(self, **tensors, shape=(tensors["codes"].shape[0], *self.shape[1:]))

    def split_bytes(self) -> tuple[int, int]:
        """``(payload, metadata)`` bytes: the codes; the row and column scales."""
        codes = self.codes.numel() * self.codes.element_size()
        return codes, self.nbytes() - codes


def dsq_quantize(x: torch.Tensor, bits: int = 4, *, name: str = "state") -> DSQTensor:
    """Q-Mamba DSQ of `x [..., K, V]` (any float dtype) with row and column fp16 scales."""
    return _dsq(x, bits, name, with_values=False)[0]


def dsq_quantize_with_values(x: torch.Tensor, bits: int = 4, *, name: str = "state",
                             generator: torch.Generator | None = None) -> tuple[DSQTensor, torch.Tensor]:
    """:func:`dsq_quantize` and its float32 values at once (bit-identical to ``dsq_dequantize`` of it: the
    same integer codes times the same float32 step, without packing and unpacking them). ``generator``:
    stochastic rounding of the codes (:func:`pace_core.quant.round_codes`), else round half to even."""
    return _dsq(x, bits, name, with_values=True, generator=generator)


def _dsq(x: torch.Tensor, bits: int, name: str, with_values: bool,
         generator: torch.Generator | None = None) -> tuple[DSQTensor, torch.Tensor | None]:
    check_bits(bits)
    check_state(x, name, 2)
    qmax = 2 ** (bits - 1) - 1
    w = work_dtype(x.dtype)
    xw = x.to(w)
    row_amax = xw.abs().amax(-1)
    check_fp16(row_amax, name, "row")
    r = fp16_scale(row_amax.float(), row_amax > 0)
    col_amax = (xw / safe_divisor(r, w).unsqueeze(-1)).abs().amax(-2)
    c = fp16_scale(div_by_int(col_amax.float(), qmax), col_amax > 0)
    step = r.to(w).unsqueeze(-1) * c.to(w).unsqueeze(-2)
    q = round_codes(xw / safe_divisor(step, w), generator).clamp_(-qmax, qmax)
    values = None
    if with_values:  # dsq_dequantize's arithmetic in float32
        values = q.to(torch.float32) * (r.float().unsqueeze(-1) * c.float().unsqueeze(-2))
    return DSQTensor(pack_codes((q + (qmax + 1)).to(torch.uint8), bits), r, c, bits, tuple(x.shape)), values


def dsq_dequantize(t: DSQTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values `q * r_k * c_v` [..., K, V] in `dtype` (one rounding of the exact product)."""
    w = work_dtype(dtype)
    q = unpack_codes(t.codes, t.bits, t.shape[-1]).to(w) - 2 ** (t.bits - 1)
    step = t.row_scale.to(w).unsqueeze(-1) * t.col_scale.to(w).unsqueeze(-2)
    return (q * step).to(dtype)


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
                              buffer="int8")},
    tags={"qmamba-dsq": ("all", "paper-table", "memory-page")}))
