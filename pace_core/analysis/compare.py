"""Every configuration as a point of resident bits against quality, the Pareto frontier, and the best
configuration under a memory budget (issue 38: ``python -m pace_core compare`` and the Compare page).

A point is one configuration measured on one model: its exact resident bits per state value on the model's
shape (:func:`pace_core.accounting.resident_bits` of the configuration as calibrated on the model) and its
quality against the fp32 reference on held-out text (:func:`pace_core.analysis.quality.perplexity`: KL, top-1
agreement, bits per byte, perplexity). The frontier and the best point under a budget on a quality axis (KL by
default, perplexity, or a task score stored by ``python -m pace_core tasks``: issue 47) are
:mod:`pace_core.frontier`'s; this module stores the points, states a recommendation, and tabulates an axis and what
a pick was made on (:func:`axis_table`, :func:`evidence`). A budget is bits per state value, given directly
(compared with each point's resident bits, the plotted axis), or a memory size, a context length and a number of
sequences: then the recommendation is :func:`pace_core.accounting.best_in_memory`, the best point among those whose
configuration :func:`~pace_core.accounting.capacity` says holds that many sequences (what is kept once per layer
taken from the memory first). :func:`budget_bits` shows such a memory as the bits per state value the sequences'
states may share after the weights and the attention KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from pace_core.accounting import capacity, resident_bits
from pace_core.config import PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.export import config_from_dict, config_to_dict
from pace_core.frontier import KL, Axis, Point, frontier
from pace_core.shapes import ModelShape


def point(cfg: PaceConfig, shape: ModelShape, row: Mapping[str, Any]) -> dict[str, Any]:
    """The stored point of ``cfg`` (as run on the model of ``shape``, calibrated where its method needs it) and its
    perplexity ``row`` (:func:`pace_core.analysis.quality.perplexity`): config, method, resident_bits, kl,
    agreement, bpb, ppl, tokens, and ``configuration``, the configuration's record (:func:`config_to_dict`,
    its calibration included: what the Compare page exports and counts the capacity of)."""
    return {"config": cfg.name, "method": cfg.method, "resident_bits": resident_bits(cfg, shape).resident_bits,
            **{k: float(row[k]) for k in ("kl", "agreement", "bpb", "ppl")}, "tokens": int(row["tokens"]),
            "configuration": config_to_dict(cfg)}


def budget_bits(shape: ModelShape, memory_bytes: int, sequences: int, *, context: int = 0,
                weight_bits: int | None = None) -> float:
    """Bits per state value that ``sequences`` sequences' recurrent states may take in ``memory_bytes``: what is
    left after the weights (``weight_bits`` per parameter, default the shape's own) and, at ``context`` tokens
    each, the sequences' bf16 attention KV cache (the terms of :func:`pace_core.accounting.capacity`), divided by
    their state values (0 when nothing is left): the per-sequence room. A configuration that keeps nothing once per
    layer holds ``sequences`` sequences exactly when its resident bits fit it; one that does (head maps, STEPQuant's
    impact weights, static scales' ranges) may hold them with resident bits above it, since one sequence's resident
    bits carry those bytes whole: which configurations fit is :func:`pace_core.accounting.best_in_memory`'s."""
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


def stored_configs(data: Mapping[str, Any]) -> dict[str, PaceConfig]:
    """Every point's configuration of a stored comparison (as calibrated on the model), by name: what
    :func:`pace_core.accounting.best_in_memory` counts the capacity of."""
    return {p["config"]: config_from_dict(p["configuration"]) for p in data["points"]}


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


def evidence(axis: Axis, p: Point, points: Sequence[Point], budget: float,
             memory: Mapping[str, int] | None = None) -> dict[str, Any]:
    """What the configuration ``p`` was picked on, as its exported file records it (``provenance.evidence``,
    :mod:`pace_core.export`): the axis (its key, label, direction and what made its values), ``p``'s value and
    standard error there, the fp32 reference's where it has one, the budget in bits per state value (for a memory,
    its per-sequence room, :func:`budget_bits`), the memory (``memory``: bytes, sequences, context, weight bits)
    where the pick was :func:`pace_core.accounting.best_in_memory`'s, and the frontier on the axis."""
    ref = next((q for q in points if q.config == "fp32" and axis.value(q) is not None), None)
    se = (axis.stderr or {}).get(p.config)
    return {"axis": axis.key, "label": axis.label, "higher_is_better": axis.higher_is_better, "config": p.config,
            "value": axis.value(p), "stderr": se if se is not None and math.isfinite(se) else None,
            "reference": None if ref is None else {"config": ref.config, "value": axis.value(ref)},
            "budget_bits": float(budget), "resident_bits": p.resident_bits,
            "frontier": [q.config for q in frontier(points, axis)],
            **({} if memory is None else {"memory": dict(memory)}), **dict(axis.evidence or {})}
