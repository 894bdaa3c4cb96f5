"""Every configuration as a point of resident bits against quality, the Pareto frontier, and the best
configuration under a memory budget (issue 38: ``python -m pace_core compare`` and the Compare page).

A point is one configuration measured on one model: its exact resident bits per state value on the model's
shape (:func:`pace_core.accounting.resident_bits` of the configuration as calibrated on the model) and its
quality against the fp32 reference on held-out text (:func:`pace_core.analysis.quality.perplexity`: KL, top-1
agreement, bits per byte). The frontier holds the points no other point dominates: none has at most its bits
and at most its KL with one of the two strictly less. :func:`best_under` picks, among the points whose bits fit
a budget, the one of lowest KL (ties: fewer bits), which is always a frontier point. A budget is bits per state
value, given directly or made by :func:`budget_bits` from a memory size, the model's shape, a context length and
a number of sequences: the states' share of the memory left after the weights and the attention KV cache.

Quality is KL unless another :class:`Axis` is named (issue 47): perplexity (:data:`PERPLEXITY`), or a task score
stored by ``python -m pace_core tasks`` (:func:`pace_core.analysis.task_scores.task_axes`), higher better. The
frontier and the best point are then those of that axis, over the points it has a value for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from pace_core.accounting import capacity, resident_bits
from pace_core.config import PaceConfig, config_from_dict, config_to_dict, get_config
from pace_core.errors import PaceError
from pace_core.shapes import ModelShape


@dataclass(frozen=True)
class Point:
    """One configuration's cost and quality on one model: resident bits per state value, KL to fp32 (nats per
    token), top-1 agreement with fp32, bits per byte and perplexity of the text."""

    config: str
    resident_bits: float
    kl: float
    agreement: float
    bpb: float
    ppl: float = math.nan

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Point:
        """The point of a stored point (:func:`point`) or a row with the same fields."""
        return cls(str(row["config"]), float(row["resident_bits"]), float(row["kl"]), float(row["agreement"]),
                   float(row["bpb"]), float(row.get("ppl", math.nan)))


@dataclass(frozen=True)
class Axis:
    """A quality axis points are judged on beside their bits: a :class:`Point` field (``key``: ``kl``, ``ppl``) or,
    with ``scores``, a value per configuration name (a task score; a configuration without one is not on the
    axis), ``higher_is_better`` or lower, shown with ``fmt``; ``stderr`` the values' standard errors where known;
    ``evidence`` what the values are, as the exported file records it (:func:`evidence`)."""

    key: str
    label: str
    higher_is_better: bool = False
    fmt: str = ".3f"
    scores: Mapping[str, float] | None = None
    stderr: Mapping[str, float | None] | None = None
    evidence: Mapping[str, Any] | None = None

    def value(self, p: Point) -> float | None:
        """``p``'s value on this axis; None where it has none (not measured, or not a finite number)."""
        v = getattr(p, self.key) if self.scores is None else self.scores.get(p.config)
        return None if v is None or not math.isfinite(v) else float(v)

    def loss(self, p: Point) -> float:
        """The value, negated where higher is better: lower is better."""
        v = self.value(p)
        if v is None:
            raise PaceError(f"{p.config} has no value on the axis {self.label!r}")
        return -v if self.higher_is_better else v

    def measured(self, points: Sequence[Point]) -> list[Point]:
        """The points this axis has a value for, in their order."""
        return [p for p in points if self.value(p) is not None]

    def shown(self, p: Point) -> str:
        """``p``'s value as text, with its standard error where known."""
        v, se = self.value(p), (self.stderr or {}).get(p.config)
        return f"{v:{self.fmt}}" + (f" ± {se:{self.fmt}}" if se is not None and math.isfinite(se) else "")

    def describe(self, p: Point) -> str:
        """``p``'s quality in words: its value on this axis, then its KL (KL: its top-1 agreement)."""
        if self.key == "kl" and self.scores is None:
            return f"KL {p.kl:.1e} to fp32 (top-1 agreement {p.agreement:.1%})"
        return f"{self.label} {self.shown(p)} (KL {p.kl:.1e} to fp32)"


KL = Axis("kl", "KL to fp32 (nats per token)", fmt=".2e")
PERPLEXITY = Axis("ppl", "perplexity", fmt=".3f")
"""The axes every stored comparison has (the perplexity of comparisons made before it was a point's field: none)."""


def point(cfg: PaceConfig, shape: ModelShape, row: Mapping[str, Any]) -> dict[str, Any]:
    """The stored point of ``cfg`` (as run on the model of ``shape``, calibrated where its method needs it) and its
    perplexity ``row`` (:func:`pace_core.analysis.quality.perplexity`): config, method, resident_bits, kl,
    agreement, bpb, ppl, tokens, and ``configuration``, the configuration's record (:func:`config_to_dict`,
    its calibration included: what the Compare page exports and counts the capacity of)."""
    return {"config": cfg.name, "method": cfg.method, "resident_bits": resident_bits(cfg, shape).resident_bits,
            **{k: float(row[k]) for k in ("kl", "agreement", "bpb", "ppl")}, "tokens": int(row["tokens"]),
            "configuration": config_to_dict(cfg)}


def dominates(a: Point, b: Point, axis: Axis = KL) -> bool:
    """True when ``a`` has at most ``b``'s bits and is at least as good on ``axis``, one of the two strictly."""
    return (a.resident_bits <= b.resident_bits and axis.loss(a) <= axis.loss(b)
            and (a.resident_bits < b.resident_bits or axis.loss(a) < axis.loss(b)))


def frontier(points: Sequence[Point], axis: Axis = KL) -> list[Point]:
    """The Pareto frontier of resident bits against ``axis`` (default KL): the points with a value on it that no
    other such point dominates, fewest bits first."""
    on = axis.measured(points)
    return sorted((p for p in on if not any(dominates(q, p, axis) for q in on)),
                  key=lambda p: (p.resident_bits, axis.loss(p), p.config))


def best_under(points: Sequence[Point], budget_bits: float, axis: Axis = KL) -> Point | None:
    """The point best on ``axis`` (default: lowest KL) whose resident bits fit ``budget_bits`` per state value
    (ties: fewer bits, then the name); None when none with a value on the axis fits."""
    fits = [p for p in axis.measured(points) if p.resident_bits <= budget_bits]
    return min(fits, key=lambda p: (axis.loss(p), p.resident_bits, p.config)) if fits else None


def budget_bits(shape: ModelShape, memory_bytes: int, sequences: int, *, context: int = 0,
                weight_bits: int | None = None) -> float:
    """Bits per state value that ``sequences`` sequences' recurrent states may take in ``memory_bytes``: what is
    left after the weights (``weight_bits`` per parameter, default the shape's own) and, at ``context`` tokens
    each, the sequences' bf16 attention KV cache (the terms of :func:`pace_core.accounting.capacity`), divided by
    their state values (0 when nothing is left). A configuration whose resident bits fit it holds ``sequences``
    sequences by :func:`~pace_core.accounting.capacity` (exactly the budget when it stores nothing once per
    layer)."""
    if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 1:
        raise PaceError(f"sequences={sequences!r} is not allowed; allowed: an integer >= 1")
    room = capacity(get_config("fp32"), shape, memory_bytes, weight_bits=weight_bits, context=context)
    left = memory_bytes - room.weight_bytes - sequences * room.kv_bytes_per_sequence
    return max(left, 0) * 8 / (sequences * shape.state_values)


def comparison(points: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], pd.DataFrame]:
    """The stored comparison of the stored points (:func:`point`): ``({"points": points, "frontier": names fewest
    bits first}, table)``, the table one row per point (config, method, resident_bits, kl, agreement, bpb, ppl,
    tokens, frontier), fewest bits first."""
    on = [p.config for p in frontier([Point.of(p) for p in points])]
    table = pd.DataFrame([{k: v for k, v in p.items() if k != "configuration"} | {"frontier": p["config"] in on}
                          for p in points]).sort_values(["resident_bits", "kl"], kind="stable").reset_index(drop=True)
    return {"points": [dict(p) for p in points], "frontier": on}, table


def stored_config(data: Mapping[str, Any], name: str) -> PaceConfig:
    """The configuration (as calibrated on the model) of the point ``name`` of a stored comparison."""
    for p in data["points"]:
        if p["config"] == name:
            return config_from_dict(p["configuration"])
    raise PaceError(f"config {name!r} is not a point of this comparison; allowed: "
                    f"{', '.join(p['config'] for p in data['points'])}")


def recommendation(p: Point, cfg: PaceConfig, shape: ModelShape, memory_bytes: int, where: str, *,
                   context: int, weight_bits: int, axis: Axis = KL) -> str:
    """One sentence on what the chosen point ``p`` (its configuration ``cfg``) costs and gains: its bits, its quality
    on ``axis`` (:meth:`Axis.describe`; KL: KL and agreement), and how many sequences ``memory_bytes`` (named
    ``where``) holds with its states against fp32 states at ``context`` tokens of context and ``weight_bits``-bit
    weights (:func:`pace_core.accounting.capacity`)."""
    n, fp32 = (capacity(c, shape, memory_bytes, weight_bits=weight_bits, context=context).sequences
               for c in (cfg, get_config("fp32")))
    setting = f"on {where} at {context:,} tokens of context with {weight_bits}-bit weights"
    if n == 0:
        gain = f"no sequence fits {setting}"
    elif fp32 == 0:
        gain = f"{n:,} sequence{'s' if n > 1 else ''} {setting}, where fp32 states fit none"
    else:
        gain = f"{n / fp32:.1f}× the sequences of fp32 states ({n:,} against {fp32:,}) {setting}"
    return f"{p.config}: {p.resident_bits:.2f} bits per state value, {axis.describe(p)}, {gain}."


def gap(axis: Axis, p: Point, q: Point) -> tuple[float, float | None]:
    """``p``'s value on ``axis`` minus ``q``'s, and the standard error of that difference from theirs,
    ``sqrt(se_p² + se_q²)`` (None unless both are known): exact for independent samples, an upper bound for
    scores of the same items, which move together."""
    se = [(axis.stderr or {}).get(x.config) for x in (p, q)]
    known = all(s is not None and math.isfinite(s) for s in se)
    return axis.value(p) - axis.value(q), math.hypot(*se) if known else None


def axis_table(points: Sequence[Point], axis: Axis) -> pd.DataFrame:
    """One row per point with a value on ``axis``: config, resident_bits, value, stderr (NaN where unknown) and
    frontier (on ``axis``'s frontier), fewest bits first: what the Compare page plots for an axis."""
    on = {p.config for p in frontier(points, axis)}
    rows = [{"config": p.config, "resident_bits": p.resident_bits, "value": axis.value(p),
             "stderr": (axis.stderr or {}).get(p.config), "frontier": p.config in on} for p in axis.measured(points)]
    table = pd.DataFrame(rows, columns=["config", "resident_bits", "value", "stderr", "frontier"])
    table["stderr"] = pd.to_numeric(table["stderr"], errors="coerce")
    return table.sort_values(["resident_bits", "config"], kind="stable").reset_index(drop=True)


def evidence(axis: Axis, p: Point, points: Sequence[Point], budget: float) -> dict[str, Any]:
    """What the configuration ``p`` was picked on, as its exported file records it (``provenance.evidence``,
    :mod:`pace_core.export`): the axis (its key, label, direction and what made its values), ``p``'s value and
    standard error there, the fp32 reference's where it has one, the budget in bits per state value, and the
    frontier on the axis."""
    ref = next((q for q in points if q.config == "fp32" and axis.value(q) is not None), None)
    se = (axis.stderr or {}).get(p.config)
    return {"axis": axis.key, "label": axis.label, "higher_is_better": axis.higher_is_better, "config": p.config,
            "value": axis.value(p), "stderr": se if se is not None and math.isfinite(se) else None,
            "reference": None if ref is None else {"config": ref.config, "value": axis.value(ref)},
            "budget_bits": float(budget), "resident_bits": p.resident_bits,
            "frontier": [q.config for q in frontier(points, axis)], **dict(axis.evidence or {})}
