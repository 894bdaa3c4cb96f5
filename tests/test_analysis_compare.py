import math

import numpy as np
import pytest

from pace_core.accounting import capacity, resident_bits, state_bytes, state_bytes_per_sequence
from pace_core.analysis.compare import (
    axis_table,
    budget_bits,
    comparison,
    evidence,
    gap,
    point,
    recommendation,
    stored_config,
)
from pace_core.config import NAMED_CONFIGS, get_config
from pace_core.errors import PaceError
from pace_core.frontier import KL, PERPLEXITY, Axis, Point, best_under, dominates, frontier
from pace_core.shapes import BUILTIN_SHAPES


def _points(rng: np.random.Generator, n: int) -> list[Point]:
    """Random points with repeated bits and KL values, so that ties occur."""
    bits = rng.choice([4.25, 4.5, 5.03, 6.84, 8.5, 16.0, 32.0], n)
    kl = rng.choice([0.0, 1e-5, 3e-4, 2e-3, 1e-2, 5e-2], n)
    return [Point(f"c{i}", float(b), float(k), float(rng.random()), float(1 + rng.random())) for i, (b, k) in
            enumerate(zip(bits, kl))]


def _sweep_frontier(points: list[Point]) -> set[str]:
    """An independent frontier: by bits ascending, a point is on it when its KL is below every KL of fewer bits
    and it is the lowest KL among the points of its own bits (equal points both stay)."""
    on = set()
    for p in points:
        fewer = [q.kl for q in points if q.resident_bits < p.resident_bits]
        same = [q.kl for q in points if q.resident_bits == p.resident_bits]
        if (not fewer or p.kl < min(fewer)) and p.kl == min(same):
            on.add(p.config)
    return on


def test_frontier_is_the_undominated_points():
    rng = np.random.default_rng(int(np.random.default_rng().integers(2**31)))
    for _ in range(200):
        points = _points(rng, int(rng.integers(1, 12)))
        got = frontier(points)
        assert {p.config for p in got} == _sweep_frontier(points)
        assert [p.resident_bits for p in got] == sorted(p.resident_bits for p in got)
        # along the frontier the KL falls as the bits grow
        assert all(b.kl < a.kl for a, b in zip(got, got[1:]) if b.resident_bits > a.resident_bits)


def test_best_under_is_the_lowest_kl_that_fits_and_lies_on_the_frontier():
    rng = np.random.default_rng(int(np.random.default_rng().integers(2**31)))
    for _ in range(200):
        points = _points(rng, int(rng.integers(1, 12)))
        on = {p.config for p in frontier(points)}
        for budget in (3.0, 4.25, 4.3, 5.5, 7.0, 8.5, 20.0, 40.0):
            best = best_under(points, budget)
            fits = [p for p in points if p.resident_bits <= budget]
            if not fits:
                assert best is None
                continue
            lowest = min(p.kl for p in fits)
            assert best.kl == lowest and best.resident_bits == min(p.resident_bits for p in fits if p.kl == lowest)
            assert best.config in on
            assert not any(dominates(p, best) for p in points)


def test_budget_bits_is_what_capacity_lets_the_states_take():
    """A configuration whose resident bits fit the budget holds the sequences (accounting.capacity); one that
    stores nothing once per layer holds them exactly when it fits."""
    rng = np.random.default_rng(int(np.random.default_rng().integers(2**31)))
    configs = list(NAMED_CONFIGS.values())
    for name, shape in BUILTIN_SHAPES.items():
        for _ in range(10):
            memory = int(rng.uniform(1.0, 3.0) * shape.weight_bytes)
            context = int(rng.choice([0, 1024, 8192, 65536]))
            weights = int(rng.choice([4, 8, 16]))
            fp32 = capacity(get_config("fp32"), shape, memory, weight_bits=weights, context=context).sequences
            sequences = int(rng.integers(1, max(2, 12 * fp32 + 2)))
            budget = budget_bits(shape, memory, sequences, context=context, weight_bits=weights)
            # the budget's own arithmetic: what is left, per state value
            left = memory - -(-shape.weight_params * weights // 8) - sequences * shape.kv_bytes_per_token * context
            assert budget == pytest.approx(max(left, 0) * 8 / (sequences * shape.state_values), rel=1e-12)
            for cfg in configs:
                bits = resident_bits(cfg, shape).resident_bits
                n = capacity(cfg, shape, memory, weight_bits=weights, context=context).sequences
                fixed = state_bytes(cfg, shape, 1) - state_bytes_per_sequence(cfg, shape)
                if bits <= budget:
                    assert n >= sequences, (name, cfg.name)
                elif fixed == 0:
                    assert n < sequences, (name, cfg.name)
    with pytest.raises(PaceError, match="sequences=0 is not allowed"):
        budget_bits(BUILTIN_SHAPES["qwen3.5-4b"], 10**11, 0)


def test_points_comparison_and_stored_configurations():
    shape = BUILTIN_SHAPES["qwen3.5-4b"]
    rows = {"fp32": (0.0, 1.0), "rtn-int4": (3e-3, 0.95), "pace-4": (1e-3, 0.97), "rtn-int8": (2e-3, 0.99)}
    points = [point(get_config(name), shape, {"kl": kl, "agreement": ag, "bpb": 1.5, "ppl": 12.0, "tokens": 99})
              for name, (kl, ag) in rows.items()]
    assert [p["resident_bits"] for p in points] == [resident_bits(get_config(n), shape).resident_bits for n in rows]
    data, table = comparison(points)
    # rtn-int8 (8.5 bits, KL 2e-3) is beaten by pace-4 (5.03 bits, KL 1e-3)
    assert data["frontier"] == ["rtn-int4", "pace-4", "fp32"]
    assert list(table.config) == ["rtn-int4", "pace-4", "rtn-int8", "fp32"]
    assert list(table.frontier) == [True, True, False, True] and "configuration" not in table.columns
    assert stored_config(data, "pace-4") == get_config("pace-4")
    with pytest.raises(PaceError, match="allowed: fp32, rtn-int4, pace-4, rtn-int8"):
        stored_config(data, "pace-4-8")


def test_recommendation_states_cost_and_gain():
    shape = BUILTIN_SHAPES["qwen3.5-27b"]
    cfg = get_config("pace-4")
    p = Point("pace-4", resident_bits(cfg, shape).resident_bits, 2.94e-4, 0.991, 1.7)
    memory = 141 * 10**9
    n, fp32 = (capacity(c, shape, memory, weight_bits=16, context=8192).sequences for c in (cfg, get_config("fp32")))
    assert n > fp32 > 0
    text = recommendation(p, cfg, shape, memory, "an H200", context=8192, weight_bits=16)
    assert text == (f"pace-4: {p.resident_bits:.2f} bits per state value, KL 2.9e-04 to fp32 (top-1 agreement 99.1%), "
                    f"{n / fp32:.1f}× the sequences of fp32 states ({n:,} against {fp32:,}) on an H200 at 8,192 "
                    "tokens of context with 16-bit weights.")
    # fp32 states fit none, this one some; and none at all
    tight = shape.weight_params * 2 + capacity(cfg, shape, 0, weight_bits=16, context=8192).kv_bytes_per_sequence \
        + state_bytes(cfg, shape, 1)
    assert capacity(get_config("fp32"), shape, tight, weight_bits=16, context=8192).sequences == 0
    assert "1 sequence on 1 GB at 8,192 tokens of context with 16-bit weights, where fp32 states fit none" in \
        recommendation(p, cfg, shape, tight, "1 GB", context=8192, weight_bits=16)
    assert "no sequence fits on 1 GB" in recommendation(p, cfg, shape, 10**9, "1 GB", context=8192, weight_bits=16)


def _scored(rng: np.random.Generator, points: list[Point]) -> dict[str, float]:
    """Random task scores (ties included) for a random subset of the points (the others were not measured)."""
    return {p.config: float(rng.choice([0.1, 0.35, 0.5, 0.62, 0.9])) for p in points if rng.random() < 0.7}


def test_a_task_axis_judges_on_its_scores_higher_better_over_the_points_it_measured():
    """Frontier and best on a task score (higher better) equal the KL ones computed on a point whose KL is the
    negated score (the independent reference: the KL-axis code of before, on relabelled points), over the points
    that have a score; points without one are on neither."""
    rng = np.random.default_rng(int(np.random.default_rng().integers(2**31)))
    for _ in range(200):
        points = _points(rng, int(rng.integers(1, 12)))
        values = _scored(rng, points)
        axis = Axis("task:x", "x · acc", higher_is_better=True, scores=values)
        as_kl = [Point(p.config, p.resident_bits, -values[p.config], p.agreement, p.bpb) for p in points
                 if p.config in values]
        assert {p.config for p in frontier(points, axis)} == _sweep_frontier(as_kl)
        for budget in (3.0, 4.3, 7.0, 40.0):
            best, reference = best_under(points, budget, axis), best_under(as_kl, budget)
            assert (best is None) == (reference is None)
            if best is not None:
                assert best.config == reference.config and values[best.config] == max(
                    values[p.config] for p in as_kl if p.resident_bits <= budget)
        lower = Axis("task:y", "y", scores=values)  # lower better: the KL rule on the scores themselves
        assert {p.config for p in frontier(points, lower)} == _sweep_frontier(
            [Point(p.config, p.resident_bits, values[p.config], 0, 1) for p in points if p.config in values])


def test_axes_of_the_comparisons_own_figures_and_their_words():
    points = [Point("fp32", 32.0, 0.0, 1.0, 1.5, 20.0), Point("a", 4.25, 2e-2, 0.9, 1.6, 23.0),
              Point("b", 5.0, 1e-3, 0.97, 1.55, 20.5), Point("c", 8.5, 1e-4, 0.99, 1.5, 20.02)]
    assert frontier(points) == frontier(points, KL) and best_under(points, 6.0) == best_under(points, 6.0, KL)
    assert [p.config for p in frontier(points, PERPLEXITY)] == ["a", "b", "c", "fp32"]
    old = Point.of({"config": "x", "resident_bits": 4, "kl": 0.1, "agreement": 0.5, "bpb": 1})  # no ppl stored
    assert PERPLEXITY.value(old) is None and PERPLEXITY.measured([old]) == [] and KL.value(old) == 0.1
    scores = {"fp32": 0.62, "a": 0.31, "c": 0.6}
    axis = Axis("task:s", "gsm8k · exact_match", higher_is_better=True, scores=scores,
                stderr={"fp32": 0.013, "a": 0.012, "c": float("nan")}, evidence={"task": "gsm8k"})
    assert axis.shown(points[1]) == "0.310 ± 0.012" and axis.shown(points[3]) == "0.600"
    shape = BUILTIN_SHAPES["qwen3.5-4b"]
    sentence = recommendation(points[3], get_config("rtn-int8"), shape, int(141e9), "an H200", context=8192,
                              weight_bits=16, axis=axis)
    assert sentence.startswith("c: 8.50 bits per state value, gsm8k · exact_match 0.600 (KL 1.0e-04 to fp32), ")
    assert recommendation(points[3], get_config("rtn-int8"), shape, int(141e9), "an H200", context=8192,
                          weight_bits=16) == sentence.replace(
        "gsm8k · exact_match 0.600 (KL 1.0e-04 to fp32)", "KL 1.0e-04 to fp32 (top-1 agreement 99.0%)")
    table = axis_table(points, axis)
    assert list(table["config"]) == ["a", "c", "fp32"] and list(table["frontier"]) == [True, True, True]
    assert table["stderr"].isna().tolist() == [False, True, False]
    picked = evidence(axis, points[1], points, 4.5)
    assert picked == {"axis": "task:s", "label": "gsm8k · exact_match", "higher_is_better": True, "config": "a",
                      "value": 0.31, "stderr": 0.012, "reference": {"config": "fp32", "value": 0.62},
                      "budget_bits": 4.5, "resident_bits": 4.25, "frontier": ["a", "c", "fp32"], "task": "gsm8k"}
    assert evidence(KL, points[2], points, 6.0)["reference"] == {"config": "fp32", "value": 0.0}
    difference, se = gap(axis, points[1], points[0])
    assert difference == pytest.approx(0.31 - 0.62) and se == pytest.approx(math.sqrt(0.012**2 + 0.013**2))
    assert gap(axis, points[3], points[0])[1] is None  # c's standard error is unknown
