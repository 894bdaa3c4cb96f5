"""Published baselines of PACE_SPEC §6: Q-Mamba DSQ and DAMP-style outlier rows.

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

DAMP **[ours: 16 of 128 rows ranked on calibration by error × persistence, Hadamard on the
rest]**: per value head, `r` outlier key rows of the state `S [..., HV, K, V]` are kept in fp16
(a value beyond ±65504 is refused); the other `K - r` rows are (optionally) rotated by the orthonormal Sylvester
Hadamard matrix along the value axis, `Y = X H`, quantised with `quant` (INT-b, value-axis groups
of `group_size` = 32, symmetric) and rotated back after dequantisation, `X̂ = Ŷ H` (H = Hᵀ = H⁻¹).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import math

from pace_core.checkpoint import hadamard
from pace_core.errors import PaceError
from pace_core.heads import retained_error
from pace_core.quant import (
    FP16_MAX,
    PackedTensor,
    QuantSpec,
    check_bits,
    check_finite,
    div_by_int,
    dequantize,
    fp16_scale,
    pack_codes,
    packed_nbytes,
    quantize,
    quantize_with_values,
    round_codes,
    safe_divisor,
    unpack_codes,
    work_dtype,
)

@dataclass
class DSQTensor:
    """A DSQ-quantised `[..., K, V]` tensor: codes packed uint8 [..., K, ceil(V/2)] (bits <= 4) or
    [..., K, V]; row_scale fp16 [..., K]; col_scale fp16 [..., V]."""

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


def _check_state(x: torch.Tensor, name: str, min_dim: int) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < min_dim:
        layout = "[..., K, V]" if min_dim == 2 else "[..., HV, K, V]"
        raise PaceError(f"{name} must be a floating-point tensor {layout}; got "
                        f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}")
    check_finite(x, name)


def _check_fp16(amax: torch.Tensor, name: str, what: str) -> None:
    """PaceError naming the first entry of ``amax [..., n]`` (a row's max |x|, stored in fp16) beyond fp16's
    largest value 65504 (never saturated)."""
    over = amax > FP16_MAX
    if bool(over.any()):
        at = [int(i) for i in torch.nonzero(over)[0]]
        raise PaceError(f"{name}: a {what} scale overflows fp16 (index {tuple(at)}): |x| up to "
                        f"{float(amax[tuple(at)]):.4g} > 65504; allowed: values within fp16's range (another "
                        "quantiser, or inputs that keep the state in range)")


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
    _check_state(x, name, 2)
    qmax = 2 ** (bits - 1) - 1
    w = work_dtype(x.dtype)
    xw = x.to(w)
    row_amax = xw.abs().amax(-1)
    _check_fp16(row_amax, name, "row")
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


@dataclass
class DampTensor:
    """A DAMP-quantised state `[..., HV, K, V]` as stored.

    outliers fp16 [..., HV, r, V] (rows in the order of `rows`); rest: PackedTensor of the other
    rows [..., HV, K - r, V] in ascending row order (Hadamard-rotated when `hadamard`); rows int16
    [HV, r] outlier row indices.
    """

    outliers: torch.Tensor
    rest: PackedTensor
    rows: torch.Tensor
    hadamard: bool
    shape: tuple[int, ...]

    def nbytes(self) -> int:
        """Real bytes of fp16 outlier rows + row indices + codes + scales."""
        return (self.outliers.numel() * self.outliers.element_size()
                + self.rows.numel() * self.rows.element_size() + self.rest.nbytes())

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """The fp16 outlier rows and the rest's stored tensors, batch axis first (the row indices are kept once)."""
        return {"outliers": self.outliers, **self.rest.stored_tensors()}

    def with_stored(self, tensors: dict[str, torch.Tensor]) -> DampTensor:
        """This structure (and row indices) holding ``tensors`` (named as :meth:`stored_tensors`)."""
        rest = self.rest.with_stored({k: t for k, t in tensors.items() if k != "outliers"})
        return replace(self, outliers=tensors["outliers"], rest=rest,
                       shape=(tensors["outliers"].shape[0], *self.shape[1:]))

    def split_bytes(self) -> tuple[int, int]:
        """``(payload, metadata)`` bytes: outlier rows and codes; scales and the row indices."""
        payload, metadata = self.rest.split_bytes()
        return (payload + self.outliers.numel() * self.outliers.element_size(),
                metadata + self.rows.numel() * self.rows.element_size())


def _rest_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices [HV, K - r] of the rows not in `rows [HV, r]`."""
    keep = torch.ones(rows.shape[0], k, dtype=torch.bool, device=rows.device)
    keep.scatter_(1, rows, False)
    return keep.nonzero()[:, 1].view(rows.shape[0], k - rows.shape[1])


class DampQuantizer:
    """DAMP-style quantiser: `outlier_rows [HV, r]` key rows per head in fp16, the rest INT-`bits`
    (value-axis groups of `group_size`, symmetric), optionally Hadamard-rotated along V."""

    def __init__(self, outlier_rows: torch.Tensor, bits: int, hadamard: bool = True, group_size: int = 32) -> None:
        check_bits(bits)
        if not isinstance(hadamard, bool):
            raise PaceError(f"hadamard={hadamard!r} is not supported; allowed: True, False")
        if (not isinstance(outlier_rows, torch.Tensor) or outlier_rows.dim() != 2
                or outlier_rows.is_floating_point() or outlier_rows.dtype == torch.bool):
            raise PaceError("outlier_rows must be an integer tensor [HV, r]; allowed: a LongTensor of row indices per head")
        rows = outlier_rows.long()
        if rows.numel() and (int(rows.min()) < 0 or (rows.sort(1).values.diff(dim=1) == 0).any()):
            raise PaceError("outlier_rows must hold distinct non-negative row indices per head; "
                            "allowed: distinct integers 0..K-1 in each row")
        if rows.numel() and int(rows.max()) >= 2**15:
            raise PaceError(f"outlier_rows index {int(rows.max())} is out of range; allowed: at most 32767 (int16 "
                            "row indices)")
        self.rows = outlier_rows if outlier_rows.dtype == torch.int16 else rows.to(torch.int16)
        """The outlier rows as stored (int16 ``[HV, r]``, once per layer: the metadata the accounting counts)."""
        self.bits = bits
        self.hadamard = hadamard
        self.spec = QuantSpec(bits=bits, symmetric=True, axis="value", group_size=group_size)
        self._checked: set[tuple[int, ...]] = set()

    @staticmethod
    def _indices(rows16: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(outlier rows [HV, r] long, head index [HV, 1], rest rows [HV, K - r]) of stored rows ``rows16``:
        gather indices of one call (made per call, so the layer holds only the int16 rows)."""
        rows = rows16.long()
        heads = torch.arange(rows.shape[0], device=rows.device).unsqueeze(1)
        return rows, heads, _rest_rows(rows, k)

    def _check_shape(self, shape: tuple[int, ...], name: str) -> None:
        if shape[-3:] in self._checked:
            return
        hv, k = shape[-3], shape[-2]
        r = self.rows.shape[1]
        if hv != self.rows.shape[0]:
            raise PaceError(f"{name} has {hv} value heads but outlier_rows has {self.rows.shape[0]}; "
                            "allowed: one row of outlier_rows per value head")
        if self.rows.numel() and int(self.rows.max()) >= k:
            raise PaceError(f"outlier_rows index {int(self.rows.max())} is out of range; allowed: 0..{k - 1}")
        if r > k:
            raise PaceError(f"outlier_rows holds {r} rows per head; allowed: at most K={k}")
        if k > 2**15:
            raise PaceError(f"{name} has K={k} rows; allowed: at most 32768 (int16 row indices)")
        if self.hadamard:
            hadamard(shape[-1])
        self._checked.add(shape[-3:])

    def quantize(self, S: torch.Tensor, *, name: str = "state") -> DampTensor:
        """Quantise `S [..., HV, K, V]` (any float dtype)."""
        return self._quantize(S, name, with_values=False)[0]

    def quantize_with_values(self, S: torch.Tensor, *, name: str = "state",
                             generator: torch.Generator | None = None) -> tuple[DampTensor, torch.Tensor]:
        """:meth:`quantize` and the float32 state it stores (bit-identical to :meth:`dequantize` of it,
        without unpacking the codes again). ``generator``: stochastic rounding of the rest's codes
        (:func:`pace_core.quant.round_codes`; the fp16 outlier rows are a cast), else round half to even."""
        return self._quantize(S, name, with_values=True, generator=generator)

    def _quantize(self, S: torch.Tensor, name: str, with_values: bool,
                  generator: torch.Generator | None = None) -> tuple[DampTensor, torch.Tensor | None]:
        _check_state(S, name, 3)
        self._check_shape(tuple(S.shape), name)
        rows16 = self.rows if self.rows.device == S.device else self.rows.to(S.device)
        rows, heads, rest_rows = self._indices(rows16, S.shape[-2])
        outliers = S[..., heads, rows, :]
        _check_fp16(outliers.abs().amax(-1), name, "fp16 outlier row")
        rest = S[..., heads, rest_rows, :]
        if self.hadamard:
            rest = rest.to(torch.float64) @ hadamard(S.shape[-1], device=S.device)
        rest_name = f"{name} (non-outlier rows)"
        if with_values:
            packed, values = quantize_with_values(rest, self.spec, name=rest_name, generator=generator,
                                                  dtype=torch.float64 if self.hadamard else torch.float32)
        else:
            packed, values = quantize(rest, self.spec, name=rest_name), None
        t = DampTensor(outliers.to(torch.float16), packed, rows16, self.hadamard, tuple(S.shape))
        return t, None if values is None else self._assemble(t, values, rows, heads, rest_rows, torch.float32)

    def dequantize(self, t: DampTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantised state [..., HV, K, V] in `dtype`."""
        rows, heads, rest_rows = self._indices(t.rows, t.shape[-2])
        return self._assemble(t, dequantize(t.rest, torch.float64 if t.hadamard else dtype), rows, heads,
                              rest_rows, dtype)

    @staticmethod
    def _assemble(t: DampTensor, rest: torch.Tensor, rows: torch.Tensor, heads: torch.Tensor,
                  rest_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The state [..., HV, K, V] in `dtype` of `t`'s outlier rows and the dequantised rest rows `rest`
        (rotated back when `t.hadamard`)."""
        if t.hadamard:
            rest = rest @ hadamard(t.shape[-1], device=rest.device)
        out = torch.empty(t.shape, dtype=dtype, device=rest.device)
        out[..., heads, rows, :] = t.outliers.to(dtype)
        out[..., heads, rest_rows, :] = rest.to(dtype)
        return out

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes that `quantize` stores for a state of `shape [..., HV, K, V]`."""
        self._check_shape(tuple(shape), "shape")
        *lead, hv, k, v = shape
        r = self.rows.shape[1]
        return (2 * math.prod(lead) * hv * r * v + 2 * hv * r
                + packed_nbytes((*lead, hv, k - r, v), self.spec))


def rank_outlier_rows(states: torch.Tensor, decays: torch.Tensor, r: int, *, bits: int = 4,
                      hadamard: bool = True, group_size: int = 32) -> torch.LongTensor:
    """Outlier rows [HV, r] per head, highest score first, from calibration `states [N, HV, K, V]`.

    score[h, k] = e[h, k] / (1 - a^2) **[ours]**, the retained error of per-token rounding
    (:func:`pace_core.heads.retained_error` at dP = 1): `e` is the mean over the N states of the squared
    error of row k under the DAMP rest-quantiser (`bits`, `group_size`, `hadamard`); `decays` is
    either the per-head mean decay a_h [HV] or a per-row decay [HV, K], values in [0, 1]. A per-head
    decay scales a whole head and so leaves its order to `e`. Ties go to the lower row.
    """
    _check_state(states, "states", 4)
    n, hv, k, v = states.shape
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= k:
        raise PaceError(f"r={r!r} is not supported; allowed: integers 0..{k} (K)")
    if not isinstance(decays, torch.Tensor) or tuple(decays.shape) not in ((hv,), (hv, k)):
        raise PaceError(f"decays must have shape [HV]=[{hv}] or [HV, K]=[{hv}, {k}]; got "
                        f"{tuple(getattr(decays, 'shape', ()))}")
    check_finite(decays, "decays")
    if bool(((decays < 0) | (decays > 1)).any()):
        raise PaceError("decays hold values outside [0, 1]; allowed: decays in [0, 1]")
    plain = DampQuantizer(torch.empty(hv, 0, dtype=torch.long), bits, hadamard, group_size)
    x = states.to(torch.float64)
    err = (plain.dequantize(plain.quantize(x, name="states"), torch.float64) - x).square().sum(-1).mean(0)
    a = decays.to(device=states.device, dtype=torch.float64).reshape(hv, -1).expand(hv, k)
    score = retained_error(err, a, 1)
    return torch.sort(score, dim=1, descending=True, stable=True).indices[:, :r]
