"""Points of resident bits against a quality axis and their Pareto frontier: the pure comparison that the Compare
analysis (:mod:`pace_core.analysis.compare`) makes and the check of a stored comparison
(:mod:`pace_core.result_checks`) recomputes. Quality is KL to fp32 unless another :class:`Axis` is named (issue 47):
perplexity (:data:`PERPLEXITY`), or a task score stored by ``python -m pace_core tasks``
(:func:`pace_core.analysis.task_scores.task_axes`), higher better. The frontier holds the points with a value on the
axis that no other such point dominates: none has at most its bits and is at least as good on the axis, one of the
two strictly; :func:`best_under` picks, among those points whose bits fit a budget, the best on the axis (ties: fewer
bits), which is always a frontier point."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pace_core.errors import PaceError


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
        """The point of a stored point (:func:`pace_core.analysis.compare.point`) or a row with the same fields
        (``ppl`` NaN where a comparison made before it was a point's field has none)."""
        return cls(str(row["config"]), float(row["resident_bits"]), float(row["kl"]), float(row["agreement"]),
                   float(row["bpb"]), float(row.get("ppl", math.nan)))


@dataclass(frozen=True)
class Axis:
    """A quality axis points are judged on beside their bits: a :class:`Point` field (``key``: ``kl``, ``ppl``) or,
    with ``scores``, a value per configuration name (a task score; a configuration without one is not on the
    axis), ``higher_is_better`` or lower, shown with ``fmt``; ``stderr`` the values' standard errors where known;
    ``evidence`` what the values are, as the exported file records it
    (:func:`pace_core.analysis.compare.evidence`)."""

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


def dominates(a: Point, b: Point, axis: Axis = KL) -> bool:
    """True when ``a`` has at most ``b``'s bits and is at least as good on ``axis`` (default KL), one of the two
    strictly."""
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
