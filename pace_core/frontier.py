"""Points of resident bits against KL and their Pareto frontier: the pure comparison that the Compare analysis
(:mod:`pace_core.analysis.compare`) makes and the check of a stored comparison (:mod:`pace_core.result_checks`)
recomputes. The frontier holds the points no other point dominates: none has at most its bits and at most its KL
with one of the two strictly less; :func:`best_under` picks, among the points whose bits fit a budget, the one of
lowest KL (ties: fewer bits), which is always a frontier point."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Point:
    """One configuration's cost and quality on one model: resident bits per state value, KL to fp32 (nats per
    token), top-1 agreement with fp32 and bits per byte of the text."""

    config: str
    resident_bits: float
    kl: float
    agreement: float
    bpb: float

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Point:
        """The point of a stored point (:func:`point`) or a row with the same fields."""
        return cls(str(row["config"]), float(row["resident_bits"]), float(row["kl"]), float(row["agreement"]),
                   float(row["bpb"]))


def dominates(a: Point, b: Point) -> bool:
    """True when ``a`` has at most ``b``'s bits and at most its KL, one of the two strictly less."""
    return (a.resident_bits <= b.resident_bits and a.kl <= b.kl
            and (a.resident_bits < b.resident_bits or a.kl < b.kl))


def frontier(points: Sequence[Point]) -> list[Point]:
    """The Pareto frontier of resident bits against KL: the points no other point dominates, fewest bits first."""
    return sorted((p for p in points if not any(dominates(q, p) for q in points)),
                  key=lambda p: (p.resident_bits, p.kl, p.config))


def best_under(points: Sequence[Point], budget_bits: float) -> Point | None:
    """The point of lowest KL whose resident bits fit ``budget_bits`` per state value (ties: fewer bits, then
    the name); None when none fits."""
    fits = [p for p in points if p.resident_bits <= budget_bits]
    return min(fits, key=lambda p: (p.kl, p.resident_bits, p.config)) if fits else None
