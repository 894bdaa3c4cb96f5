"""DAMP-style (method ``damp``) **[ours: the exact definition; no public code]**: per value head ``r`` outlier key
rows of the state kept in fp16, the other rows quantised to INT-b in value-axis groups, optionally rotated by a
Hadamard transform along the value axis (:class:`DampQuantizer`); the rows are chosen per layer on calibration
text by error x persistence (:func:`rank_outlier_rows`). Its quantiser, storage format, bytes, calibration,
settings and named configurations.

DAMP **[ours: 16 of 128 rows ranked on calibration by error × persistence, Hadamard on the
rest]**: per value head, `r` outlier key rows of the state `S [..., HV, K, V]` are kept in fp16
(a value beyond ±65504 is refused); the other `K - r` rows are (optionally) rotated by the orthonormal Sylvester
Hadamard matrix along the value axis, `Y = X H`, quantised with `quant` (INT-b, value-axis groups
of `group_size` = 32, symmetric) and rotated back after dequantisation, `X̂ = Ŷ H` (H = Hᵀ = H⁻¹).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

import torch

from pace_core.checkpoint import StateFormat, hadamard
from pace_core.errors import PaceError
from pace_core.heads import head_decay, retained_error
from pace_core.methods.base import LayerCalibration, Method, register
from pace_core.quant import (
    PackedTensor,
    QuantSpec,
    check_bits,
    check_finite,
    check_fp16,
    check_state,
    dequantize,
    packed_nbytes,
    quantize,
    quantize_with_values,
)
from pace_core.settings import Setting

OUTLIER_ROW_BITS = 16
MAX_OUTLIER_ROWS = 128
"""Outlier rows allowed before a model is known (at most d_k, checked by :func:`check_for`)."""
SETTINGS = (
    Setting("damp_outlier_rows", default=16, allowed=range(MAX_OUTLIER_ROWS + 1),
            allowed_text=f"integers 0..{MAX_OUTLIER_ROWS} (at most d_k)", cli="--outlier-rows",
            cli_help="DAMP outlier key rows in fp16"),
    Setting("damp_hadamard", default=True, allowed=(True, False), allowed_text="True, False"),
)
"""DAMP's own settings [ours]: the outlier key rows kept in fp16 per value head (16 of 128), and the Hadamard rotation
of the rest along the value axis."""
SCALE_BITS = 16


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
    outlier = torch.zeros(rows.shape[0], k, dtype=torch.uint8, device=rows.device)
    outlier.scatter_(1, rows, 1)
    # a stable sort puts each head's kept rows first, in ascending order (nonzero() would read the device)
    return outlier.sort(dim=-1, stable=True).indices[:, :k - rows.shape[1]]


class DampQuantizer:
    """DAMP-style quantiser: `outlier_rows [HV, r]` key rows per head in fp16, the rest INT-`bits`
    (value-axis groups of `group_size`, symmetric), optionally Hadamard-rotated along V."""

    def __init__(self, outlier_rows: torch.Tensor, bits: int, hadamard: bool = True, group_size: int = 32) -> None:
        check_bits(bits)
        if not isinstance(hadamard, bool):
            raise PaceError(f"hadamard={hadamard!r} is not supported; allowed: True, False")
        if (not isinstance(outlier_rows, torch.Tensor) or outlier_rows.dim() != 2
                or outlier_rows.is_floating_point() or outlier_rows.dtype == torch.bool):
            raise PaceError(
                "outlier_rows must be an integer tensor [HV, r]; allowed: a LongTensor of row indices per head"
            )
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
        check_state(S, name, 3)
        self._check_shape(tuple(S.shape), name)
        rows16 = self.rows if self.rows.device == S.device else self.rows.to(S.device)
        rows, heads, rest_rows = self._indices(rows16, S.shape[-2])
        outliers = S[..., heads, rows, :]
        check_fp16(outliers.abs().amax(-1), name, "fp16 outlier row")
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
    check_state(states, "states", 4)
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


class DampFormat(StateFormat):
    """fp16 outlier rows plus the INT-b rest (:class:`DampTensor`); the layer's calibrated
    ``rows [HV, damp_outlier_rows]``."""

    def __init__(self, cfg, bits_per_head, layer=None, name="state", gdn_index=0) -> None:
        super().__init__(cfg, bits_per_head, layer, name, gdn_index)
        expected = (len(bits_per_head), cfg.damp_outlier_rows)
        rows = None if layer is None else layer.get("rows")
        if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != expected:
            got = None if rows is None else tuple(rows.shape)
            raise PaceError(f"DAMP's outlier rows for {name}: {got} not allowed (not calibrated on the model); "
                            f"allowed: rows {list(expected)} of a configuration calibrated on the model "
                            "(pace_core.analysis.calibration.calibrate, or an exported file)")
        self._quantizer(rows)

    def _quantizer(self, rows: torch.Tensor) -> None:
        """The quantiser of ``rows``; the layer keeps its int16 rows alone (the bytes the accounting counts)."""
        self.quantizer = DampQuantizer(rows, self.cfg.bits, self.cfg.damp_hadamard, self.cfg.group_size)
        self.layer = {"rows": self.quantizer.rows}

    def to(self, device: torch.device) -> DampFormat:
        super().to(device)
        self._quantizer(self.layer["rows"])
        return self

    def store_loaded(self, S: torch.Tensor) -> tuple[DampTensor, torch.Tensor]:
        return self.quantizer.quantize_with_values(S, name=self.name, generator=self.generator)

    def load(self, c: DampTensor) -> torch.Tensor:
        return self.quantizer.dequantize(c)


CALIBRATION = LayerCalibration({"rows": "the outlier key rows of each value head, int16 [HV, damp_outlier_rows]"})
"""What DAMP calibrates per layer. Of the combinations (pace_core.methods.COMBINATIONS) it takes stochastic rounding
(of its INT-b rest); a rotation along the key axis would mix its fp16 outlier rows (key rows chosen in the
unrotated basis) into the rest, and its own rotation runs along the value axis (``damp_hadamard``); static scales
would fix the scales of rows whose set it calibrates per head, which it keeps per checkpoint by definition."""


def payload(cfg, shape) -> tuple[Fraction, Fraction]:
    """``((d_k − r)·b + r·16) / d_k`` code bits, ``16/g`` scale bits on the ``d_k − r`` quantised rows."""
    kept = Fraction(shape.d_k - cfg.damp_outlier_rows, shape.d_k)
    return kept * cfg.bits + (1 - kept) * OUTLIER_ROW_BITS, kept * Fraction(SCALE_BITS, cfg.group_size)


def layer_bytes(cfg, shape, n_seq: int, layer: int) -> int:
    """fp16 outlier rows and the packed rest of ``n_seq`` sequences (the row indices: :func:`fixed_bytes`)."""
    hv, k, v, r = shape.num_v_heads, shape.d_k, shape.d_v, cfg.damp_outlier_rows
    spec = QuantSpec(bits=cfg.bits, symmetric=True, axis="value", group_size=cfg.group_size)
    return 2 * n_seq * hv * r * v + packed_nbytes((n_seq, hv, k - r, v), spec)


def calibrate(cfg, samples, layers: list[int]) -> list[dict[str, torch.Tensor]]:
    """Per GDN layer the ``damp_outlier_rows`` rows of each head with the largest retained error of per-token
    rounding (:func:`rank_outlier_rows` on the calibration states and the heads' mean decays),
    as int16 ``[HV, r]``."""
    return [{"rows": rank_outlier_rows(samples.states[layer], head_decay(samples.decays[layer]),
                                       cfg.damp_outlier_rows, bits=cfg.bits, hadamard=cfg.damp_hadamard,
                                       group_size=cfg.group_size).to(torch.int16).cpu()}
            for layer in layers]


def check_for(cfg, shape) -> None:
    if cfg.calibrated is not None:
        want = (shape.num_v_heads, cfg.damp_outlier_rows)
        for i, layer in enumerate(cfg.calibrated.layers):
            rows = layer.get("rows")
            if (set(layer) != {"rows"} or rows.dtype != torch.int16 or tuple(rows.shape) != want
                    or (rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < shape.d_k)):
                raise PaceError(f"calibrated[{i}] is not DAMP's outlier rows for {shape.name}; allowed: rows int16 "
                                f"{list(want)} in 0..{shape.d_k - 1}: calibrate the configuration on this model")
    if cfg.damp_outlier_rows > shape.d_k:
        raise PaceError(f"damp_outlier_rows={cfg.damp_outlier_rows} exceeds d_k={shape.d_k} of {shape.name}; "
                        f"allowed: 0..{shape.d_k}")
    if cfg.damp_hadamard and shape.d_v & (shape.d_v - 1):
        raise PaceError(f"damp_hadamard=True needs a power-of-two d_v; {shape.name} has d_v={shape.d_v}; "
                        "allowed: damp_hadamard=False")


METHOD = register(Method(
    name="damp", order=30, label="DAMP",
    description="DAMP-style: 16 outlier key rows in fp16, Hadamard on the rest (our choice)",
    reads=("group_axis", "damp_outlier_rows", "damp_hadamard", "calibrated"), group_axes=("value",),
    symmetric_only=True,
    calibration=lambda cfg: CALIBRATION, composes=("rounding",),
    format=DampFormat, payload=payload, layer_bytes=layer_bytes,
    fixed_bytes=lambda cfg, shape, layer: 2 * shape.num_v_heads * cfg.damp_outlier_rows,
    check_for=check_for, groups_along=lambda cfg: cfg.group_axis, calibrate=calibrate, settings=SETTINGS,
    named={f"damp-int{b}": dict(bits=b, group_axis="value", group_size=32, symmetric=True, decode_period=1,
                                buffer="int8", damp_outlier_rows=16, damp_hadamard=True) for b in (8, 4)},
    tags={f"damp-int{b}": ("all", "paper-table", "memory-page") for b in (8, 4)}))
