"""STEPQuant (method ``stepquant``; arXiv 2609.38169, public code ``Dreamer-Toby/STEPQuant``): one width per GDN
head, from {2, 4, 6, 8} bits (stepquant-4) or {4, 6, 8} (stepquant-6), or an fp16 "pivot" head; integer heads
store ``x̂ = r[k] · c[v] · z`` with a row scale weighted by the key row's impact and a least-squares column
scale; the widths are allocated over all heads of all layers by an exact knapsack under the nominal budget,
the costliest heads becoming pivots. Its arithmetic is :mod:`pace_core.methods.stepquant.algorithm`; this module makes
it a
method: the layer's storage, its bytes, its calibration and its settings.

- **Calibrated per layer** on the model: ``widths`` int16 ``[HV]`` (16: a pivot) and ``impact`` float32
  ``[HV, K]`` (the impact weights w of :func:`pace_core.methods.stepquant.algorithm.impact_weights`), from the
  calibration's
  recorded ``q, k, beta, g`` and its states (:func:`calibrate`).
- **Schedule**: STEPQuant rounds after every decode token (dP = 1, the token's output read from the unrounded
  state, PACE's own per-token step) and prefill once at the prompt's end (P = 2^20); both are settings, so
  the same storage also runs under PACE's periodic rounding with a decode buffer (``pace-stepquant-4``: a
  configuration none of the papers has).
- **Calibration samples** [ours] (``stepquant_calibration``): by default the shared samples every method
  calibrates on (the calibration text's first 2,048 tokens, a state every 64 tokens), or the authors' protocol
  (:data:`AUTHORS`: 32 × 2,048 tokens, a state every 8, a 64-state reservoir). Both read the calibration text,
  WikiText-2 valid: the authors' train split is not in the shared corpus.
- **Pivots** [ours]: the paper's 32 of 2304 heads (Qwen3.x-27B) as a share of the model's GDN heads
  (``stepquant_pivot_share``, default 1/72; 0 on a model of fewer than 36 heads).
- **Bytes**: codes packed densely (2-bit four per byte, 6-bit four per three bytes), fp16 row and column
  scales, fp16 pivots per sequence; once per layer the head map (one int16 per head), the widths (int16 per
  head) and the impact weights (float32 per head and key row). Before a calibration the accounting counts
  every head at the nominal width.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from pace_core.checkpoint import StateFormat
from pace_core.errors import PaceError
from pace_core.methods.base import LayerCalibration, Method, Sampling, register
from pace_core.methods.stepquant import algorithm as sq
from pace_core.settings import Setting

PIVOT_SHARES = (0.0, 1 / 144, 1 / 72, 1 / 36, 1 / 18)
"""The pivot shares offered: none, half, the paper's 32/2304, twice, four times."""
ONCE = 1 << 20
"""The prefill period that rounds a prompt once, at its end (pace_core.config.MAX_PREFILL_PERIOD)."""


class StepQuantFormat(StateFormat):
    """Per-head widths with row x column scales (:class:`pace_core.methods.stepquant.algorithm.StepQuantState`), of
    the layer's
    calibrated ``widths`` and ``impact``."""

    def __init__(self, cfg, bits_per_head, layer=None, name="state", gdn_index=0) -> None:
        super().__init__(cfg, bits_per_head, layer, name, gdn_index)
        if layer is None or set(layer) != {"widths", "impact"}:
            raise PaceError(f"STEPQuant's head widths and impact weights for {name} are not calibrated on the model; "
                            "allowed: a configuration calibrated on it (pace_core.analysis.calibration.calibrate, or "
                            "an exported file)")
        self.widths = tuple(int(b) for b in layer["widths"].tolist())
        self._impact: dict[torch.device, torch.Tensor] = {}

    def store_loaded(self, S: torch.Tensor) -> tuple[sq.StepQuantState, torch.Tensor]:
        if S.device not in self._impact:  # copied once per device: a copy inside a CUDA graph's capture is refused
            self._impact[S.device] = self.layer["impact"].to(S.device)
        return sq.quantize_with_values(S, self.widths, self._impact[S.device], name=self.name)

    def load(self, c: sq.StepQuantState) -> torch.Tensor:
        return sq.dequantize(c)

    def nbytes(self, c: sq.StepQuantState) -> tuple[int, int]:
        """The checkpoint's ``(payload, metadata)`` bytes, the layer's widths and impact weights in the metadata."""
        payload, metadata = c.split_bytes()
        return payload, metadata + sum(t.numel() * t.element_size() for t in self.layer.values())


def _widths(cfg, shape) -> list[tuple[int, ...]]:
    """Each GDN layer's head widths: the calibrated ones, else every head at the nominal width."""
    if cfg.calibrated is None:
        return [(cfg.bits,) * shape.num_v_heads] * shape.num_gdn_layers
    return [tuple(int(b) for b in layer["widths"].tolist()) for layer in cfg.calibrated.layers]


def payload(cfg, shape) -> tuple[Fraction, Fraction]:
    """Code bits (pivots' 16 included) and scale bits (row and column scales) per state value, over all heads."""
    bits = sq.resident_bits([b for layer in _widths(cfg, shape) for b in layer], shape.d_k, shape.d_v)
    return bits.code_bits + bits.pivot_bits, bits.row_scale_bits + bits.column_scale_bits


def layer_bytes(cfg, shape, n_seq: int, layer: int) -> int:
    """Codes, scales and pivots of one layer for ``n_seq`` sequences (the head map: :func:`fixed_bytes`)."""
    widths = _widths(cfg, shape)[layer]
    return sq.stepquant_nbytes((n_seq, shape.num_v_heads, shape.d_k, shape.d_v), widths) - 2 * shape.num_v_heads


def fixed_bytes(cfg, shape, layer: int) -> int:
    """Once per layer: the head map and the widths (int16 per head), the impact weights (float32 per key row)."""
    hv = shape.num_v_heads
    return 2 * hv + 2 * hv + 4 * hv * shape.d_k


def check(cfg) -> None:
    if cfg.bits not in sq.CANDIDATES:
        raise PaceError(f"bits={cfg.bits} is not allowed for method 'stepquant'; allowed: "
                        f"{', '.join(map(str, sq.CANDIDATES))} (the nominal widths: stepquant-4, stepquant-6)")


def check_for(cfg, shape) -> None:
    if cfg.calibrated is None:
        return
    allowed = set(sq.CANDIDATES[cfg.bits]) | {sq.PIVOT}
    for i, layer in enumerate(cfg.calibrated.layers):
        widths, impact = layer.get("widths"), layer.get("impact")
        ok = (set(layer) == {"widths", "impact"} and widths.dtype == torch.int16
              and tuple(widths.shape) == (shape.num_v_heads,) and set(widths.tolist()) <= allowed
              and impact.dtype == torch.float32 and tuple(impact.shape) == (shape.num_v_heads, shape.d_k)
              and bool(torch.isfinite(impact).all()) and bool((impact > 0).all()))
        if not ok:
            raise PaceError(f"calibrated[{i}] is not STEPQuant's calibration for {shape.name}; allowed: widths int16 "
                            f"[{shape.num_v_heads}] of {sorted(allowed)} and impact float32 [{shape.num_v_heads}, "
                            f"{shape.d_k}] > 0: calibrate the configuration on this model")


def token_sums(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the calibration keeps of one window's recorded inputs (:attr:`Sampling.reduce`): the impact ω times the
    window's tokens and the sum of its log decays ``g``, float64 (added up over the windows, then divided by all
    their tokens: the authors' ω and mean log decay over every calibration token)."""
    return {"omega": sq.impact_omega(x["q"], x["k"], x["beta"], x["g"].exp()) * x["q"].shape[0],
            "g": x["g"].double().sum(0)}


AUTHORS = Sampling("the authors' calibration samples", segments=32, tokens=2048, every=8, reservoir=64, seed=0,
                   reduce=token_sums)
"""STEPQuant's own calibration protocol (the repository's ``configs/calibration/paper.json`` and
``LayerStatistics``): 32 windows of 2,048 tokens at offsets drawn by a generator seeded 0, each GDN layer's state
after every 8th token offered to a 64-state reservoir (its own generator seeded 0), ω and ḡ over all 65,536 tokens.
The authors read WikiText-2 *train*; the shared corpus holds its validation split, the calibration text here."""
CALIBRATIONS = ("shared", "authors")
"""The values of ``stepquant_calibration``: PACE's shared samples, or :data:`AUTHORS`."""


def sampling(cfg) -> Sampling | None:
    """The samples ``cfg`` calibrates on: :data:`AUTHORS` with ``stepquant_calibration`` "authors", else the
    shared ones (None)."""
    return AUTHORS if cfg.stepquant_calibration == "authors" else None


def _statistics(samples, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ω [HV, K], ḡ [HV])`` of a layer, float64: from the sums of a method's sampling (:func:`token_sums`), or
    from the shared samples' recorded inputs."""
    if samples.sums is not None:
        sums = samples.sums[layer]
        return sums["omega"] / samples.tokens, sums["g"] / samples.tokens
    x = samples.inputs[layer]
    return sq.impact_omega(x["q"], x["k"], x["beta"], x["g"].exp()), x["g"].double().mean(0)


def calibrate(cfg, samples, layers: list[int]) -> list[dict[str, torch.Tensor]]:
    """Impact weights per layer from the recorded inputs, the cost of every candidate width per head from the
    calibration states, and the widths of all heads of all layers allocated at once (module docstring)."""
    candidates = sq.CANDIDATES[cfg.bits]
    impact, costs = [], []
    for layer in layers:
        omega, mean_log_decay = _statistics(samples, layer)
        w = sq.impact_weights(omega)
        lifetime = sq.lifetime_weights(mean_log_decay)
        impact.append(w.float().cpu())
        costs.append(sq.cost_table(samples.states[layer], w, lifetime, candidates))
    cost = torch.stack(costs)
    pivots = sq.pivot_count(cfg.stepquant_pivot_share, cost.shape[0] * cost.shape[1])
    widths = sq.allocate(cost, cfg.bits, pivots, candidates)
    return [{"widths": widths[i].to(torch.int16), "impact": impact[i]} for i in range(len(layers))]


CALIBRATION = LayerCalibration({
    "widths": "each value head's width, int16 [HV] (16: an fp16 pivot)",
    "impact": "the impact weight of each key row of each head, float32 [HV, d_k]"})
"""What STEPQuant calibrates per layer. It takes none of the combinations (pace_core.methods.COMBINATIONS): its column
scales are a least-squares refit to its first codes and its 2-bit levels are odd integers (stochastic codes would
change the fit it is defined by), its impact weights belong to the unrotated key rows, and its scales are fitted to
each checkpoint by definition."""


def _share(x: float) -> str:
    return "0" if x == 0 else f"{x:.2%} (1/{round(1 / x)})"


METHOD = register(Method(
    name="stepquant", order=50, label="STEPQuant",
    description="STEPQuant (2026): one width per head from a knapsack over all heads (2-8 bits or an fp16 pivot), "
                "impact-weighted row scales and least-squares column scales",
    symmetric_only=True, strategy="channel", format=StepQuantFormat, payload=payload, layer_bytes=layer_bytes,
    fixed_bytes=fixed_bytes, check=check, check_for=check_for, calibrate=calibrate, sampling=sampling,
    groups_along=lambda cfg: "rows and columns",
    reads=("calibrated", "stepquant_pivot_share", "stepquant_calibration"), calibration=lambda cfg: CALIBRATION,
    settings=(Setting("stepquant_pivot_share", schema=5, before=1 / 72, default=1 / 72, allowed=PIVOT_SHARES,
                      allowed_text=", ".join(map(_share, PIVOT_SHARES)), url="piv",
                      label="STEPQuant pivot share (heads in fp16)", options=PIVOT_SHARES, fmt=_share,
                      help="Our choice: the share of all GDN heads kept as fp16 pivots, the costliest after the "
                           "first knapsack (the paper keeps 32 of the 27B model's 2304 heads, 1/72), rounded to "
                           "the nearest whole head, halves up (1/72 of 36 heads: 1). Each pivot takes 8 bits of "
                           "the nominal budget."),
              Setting("stepquant_calibration", schema=7, before="shared", default="shared", allowed=CALIBRATIONS,
                      allowed_text="'shared' (PACE's calibration samples), 'authors' (STEPQuant's own protocol)",
                      url="sqc", label="STEPQuant calibration samples", options=CALIBRATIONS,
                      fmt=lambda x: {"shared": "shared (2,048 tokens, a state every 64)",
                                     "authors": "the authors' (32 × 2,048 tokens, a state every 8)"}[x],
                      help="Our choice: the states and inputs STEPQuant's widths and impact weights are calibrated on. "
                           "'shared' (default): the samples every method calibrates on here, the calibration text's "
                           "first 2,048 tokens (WikiText-2 valid) with a state every 64 tokens, so STEPQuant and PACE "
                           "see the same data and a calibration takes seconds on the embedded model. 'authors': "
                           "STEPQuant's own protocol, 32 segments of 2,048 tokens at seeded random offsets, a state "
                           "every 8 tokens into a 64-state reservoir per layer: 32 times the tokens. The authors read "
                           "WikiText-2 train, which the shared corpus does not hold; both read its validation split, "
                           "the closest text there."),),
    named={"stepquant-4": dict(bits=4, decode_period=1, prefill_period=ONCE, buffer="int8", symmetric=True),
           "stepquant-6": dict(bits=6, decode_period=1, prefill_period=ONCE, buffer="int8", symmetric=True),
           "pace-stepquant-4": dict(bits=4, decode_period=8, prefill_period=256, buffer="int8", symmetric=True)},
    tags={"stepquant-4": ("all", "memory-page", "equal-bits-rival", "tasks")}))
