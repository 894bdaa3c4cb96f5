"""DAMP-style (method ``damp``) **[ours: the exact definition; no public code]**: per value head ``r`` outlier key
rows of the state kept in fp16, the other rows quantised to INT-b in value-axis groups, optionally rotated by a
Hadamard transform along the value axis (:class:`pace_core.outliers.DampQuantizer`); the rows are chosen per
layer on calibration text by error x persistence (:func:`pace_core.outliers.rank_outlier_rows`)."""

from __future__ import annotations

from fractions import Fraction

import torch

from pace_core.checkpoint import StateFormat
from pace_core.errors import PaceError
from pace_core.heads import head_decay
from pace_core.methods.base import LayerCalibration, Method, register
from pace_core.outliers import DampQuantizer, DampTensor, rank_outlier_rows
from pace_core.quant import QuantSpec, packed_nbytes

OUTLIER_ROW_BITS = 16
SCALE_BITS = 16


class DampFormat(StateFormat):
    """fp16 outlier rows plus the INT-b rest (:class:`pace_core.outliers.DampTensor`); the layer's calibrated
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
    rounding (:func:`pace_core.outliers.rank_outlier_rows` on the calibration states and the heads' mean decays),
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
    check_for=check_for, groups_along=lambda cfg: cfg.group_axis, calibrate=calibrate,
    named={f"damp-int{b}": dict(bits=b, group_axis="value", group_size=32, symmetric=True, decode_period=1,
                                buffer="int8", damp_outlier_rows=16, damp_hadamard=True) for b in (8, 4)}))
