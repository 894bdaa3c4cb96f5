"""Figure, table and export builders of the dashboard (pace_core.figures) on fresh random inputs."""


import numpy as np
import pandas as pd
import pytest
import torch

from pace_core import figures
from pace_core.accounting import resident_bits, sequences_that_fit, state_bytes, state_bytes_per_sequence
from pace_core.config import get_config
from pace_core.shapes import BUILTIN_SHAPES


@pytest.fixture
def rng():
    return np.random.default_rng()


def test_state_heatmaps_panels_hold_state_quantised_and_error(rng):
    ref = rng.standard_normal((16, 12))
    q_key = ref + rng.standard_normal((16, 12)) * 0.01
    q_val = ref + rng.standard_normal((16, 12)) * 0.1
    fig = figures.state_heatmaps(torch.from_numpy(ref), {"key": q_key, "value": q_val}, outlier_columns=[3, 7])
    heat = [t for t in fig.data if t.type == "heatmap"]
    assert len(heat) == 6
    np.testing.assert_array_equal(np.asarray(heat[0].z), ref)
    np.testing.assert_array_equal(np.asarray(heat[1].z), q_key)
    np.testing.assert_allclose(np.asarray(heat[2].z), q_key - ref)
    np.testing.assert_allclose(np.asarray(heat[5].z), q_val - ref)
    # robust ranges: the 99th percentile of |value| over the state panels, of |error| over the error panels
    vmax = np.percentile(np.abs(np.concatenate([ref, q_key, q_val]).ravel()), 99)
    assert vmax < max(np.abs(ref).max(), np.abs(q_val).max())
    assert [h.coloraxis for h in heat] == ["coloraxis", "coloraxis", "coloraxis2"] * 2
    assert fig.layout.coloraxis.cmax == pytest.approx(vmax) and fig.layout.coloraxis.cmin == pytest.approx(-vmax)
    emax = np.percentile(np.abs(np.concatenate([q_key - ref, q_val - ref]).ravel()), 99)
    assert fig.layout.coloraxis2.cmax == pytest.approx(emax)
    assert fig.layout.coloraxis.colorbar.orientation == "h" and "error" in fig.layout.coloraxis2.colorbar.title.text
    titles = [a.text for a in fig.layout.annotations]
    rel_key = np.linalg.norm(q_key - ref) / np.linalg.norm(ref)
    assert f"error: key (rel. {rel_key:.2%})" in titles
    markers = [t for t in fig.data if t.type == "scatter"]
    assert len(markers) == 6 and list(markers[0].x) == [3, 7]


def test_state_heatmaps_draw_each_groupings_boundaries_and_mark_the_sidebars(rng):
    """Key-axis groups of 4 over 16 key rows: 3 horizontal lines between rows 3|4, 7|8, 11|12 across the 12
    columns; value-axis groups of 4 over 12 columns: 2 vertical lines; on the quantised and error panels of
    their own row only, the sidebar's row titled so; colour bars lie below the bottom row's axis title."""
    ref = rng.standard_normal((16, 12))
    views = {"key g4": ref + 0.01, "value g4": ref - 0.01}
    fig = figures.state_heatmaps(ref, views, groups={"key g4": ("key", 4), "value g4": ("value", 4)},
                                 sidebar="key g4")
    lines = [t for t in fig.data if t.type == "scatter" and t.mode == "lines"]
    assert len(lines) == 4 and [t.legendgroup for t in lines] == ["key g4", "key g4", "value g4", "value g4"]
    assert [t.showlegend for t in lines] == [True, False, True, False]
    key, value = lines[0], lines[2]
    assert list(key.y) == [3.5, 3.5, None, 7.5, 7.5, None, 11.5, 11.5, None]
    assert list(key.x) == [-0.5, 11.5, None] * 3
    assert list(value.x) == [3.5, 3.5, None, 7.5, 7.5, None] and list(value.y) == [-0.5, 15.5, None] * 2
    assert {(t.xaxis, t.yaxis) for t in lines} == {("x2", "y2"), ("x3", "y3"), ("x5", "y5"), ("x6", "y6")}
    assert "(sidebar)" in key.name and "(sidebar)" not in value.name
    titles = [a.text for a in fig.layout.annotations]
    assert "quantised: key g4 (sidebar)" in titles and "quantised: value g4" in titles
    plot_px = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
    for bar in (fig.layout.coloraxis.colorbar, fig.layout.coloraxis2.colorbar):  # 95 px under the bottom row
        assert bar.y * plot_px == pytest.approx(-95) and -bar.y * plot_px + 60 < fig.layout.margin.b
    one = figures.state_heatmaps(ref, {"key g16": ref}, groups={"key g16": ("key", 16)})  # one group per column
    assert not [t for t in one.data if t.type == "scatter"]
    with pytest.raises(ValueError, match="not a grouping"):
        figures.state_heatmaps(ref, views, sidebar="diagonal")


def test_state_heatmaps_rejects_mismatched_shapes(rng):
    with pytest.raises(ValueError, match="quantised\\['k'\\]"):
        figures.state_heatmaps(rng.standard_normal((4, 4)), {"k": rng.standard_normal((4, 5))})


def test_rms_profiles_colours_outliers_and_titles_ratios(rng):
    col = np.abs(rng.standard_normal(10)) + 0.5
    row = np.abs(rng.standard_normal(8)) + 0.5
    fig = figures.rms_profiles(col, row, 5.25, 1.5, [2, 9], 4.0)
    bars = [t for t in fig.data if t.type == "bar"]
    np.testing.assert_array_equal(np.asarray(bars[0].y), col)
    colours = list(bars[0].marker.color)
    assert [j for j, c in enumerate(colours) if c == "#d62728"] == [2, 9]
    assert set(bars[1].marker.color) == {"#4a78c2"}
    titles = [a.text for a in fig.layout.annotations]
    assert "column RMS (max/median 5.25)" in titles and "row RMS (max/median 1.50)" in titles
    medians = [s.y0 for s in fig.layout.shapes]
    assert medians[0] == pytest.approx(np.median(col)) and medians[1] == pytest.approx(4 * np.median(col))
    assert medians[2] == pytest.approx(np.median(row))


def test_head_ranking_marks_the_chosen_heads(rng):
    E = rng.random((3, 6)) + 1e-3
    a = rng.random((3, 6))
    e = rng.random((3, 6))
    high = ((0, 5), (2,), ())
    fig = figures.head_ranking_figure(E, a, e, high, ["L0", "L4", "L8"])
    np.testing.assert_allclose(np.asarray(fig.data[0].z), np.log10(E))
    np.testing.assert_array_equal(np.asarray(fig.data[1].z), a)
    chosen = fig.data[3]
    assert list(chosen.x) == [0, 5, 2] and list(chosen.y) == ["L0", "L0", "L4"]


def test_sweep_figure_one_marker_per_config_grouped_by_bits_and_axis(rng):
    table = pd.DataFrame({"config": [f"c{i}" for i in range(8)], "bits": [3, 3, 4, 4, 3, 4, 8, 8],
                          "group_axis": ["key", "value"] * 4, "resident_bits": rng.random(8) * 8,
                          "output_rel_error": rng.random(8), "mean_rel_error": rng.random(8)})
    fig = figures.sweep_figure(table, "mean_rel_error")
    assert [t.name for t in fig.data] == ["3-bit, key groups", "3-bit, value groups", "4-bit, key groups",
                                          "4-bit, value groups", "8-bit, key groups", "8-bit, value groups"]
    part = table[(table.bits == 4) & (table.group_axis == "value")]
    np.testing.assert_allclose(np.asarray(fig.data[3].x), part["resident_bits"].to_numpy())
    np.testing.assert_allclose(np.asarray(fig.data[3].y), part["mean_rel_error"].to_numpy())
    assert list(fig.data[3].text) == list(part["config"]) and fig.data[3].marker.symbol == "square"
    assert "state, mean over decode" in fig.layout.yaxis.title.text
    with pytest.raises(ValueError, match="resident_bits"):
        figures.sweep_figure(table.drop(columns="resident_bits"))


def test_drift_figure_one_line_per_config_and_checks_columns(rng):
    steps = np.arange(20)
    table = pd.concat([pd.DataFrame({"config": name, "step": steps, "rel_error": rng.random(20),
                                     "excess_nll": rng.standard_normal(20)}) for name in ("a", "b")])
    shuffled = table.sample(frac=1.0)
    fig = figures.drift_figure(shuffled)
    order = list(shuffled["config"].unique())
    assert [t.name for t in fig.data] == [order[0], order[0], order[1], order[1]]
    np.testing.assert_array_equal(np.asarray(fig.data[0].x), steps)
    b = 2 * order.index("b")
    np.testing.assert_allclose(np.asarray(fig.data[b].y), table[table.config == "b"]["rel_error"].to_numpy())
    np.testing.assert_allclose(np.asarray(fig.data[b + 1].y), table[table.config == "b"]["excess_nll"].to_numpy())
    # the state error on a log axis labelled in %, each panel's y axis naming its quantity
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.tickformat.endswith("p")
    assert list(fig.layout.yaxis.tickvals) == figures.log_ticks(table["rel_error"])
    assert fig.layout.yaxis.title.text == "relative state error (%, log scale)"
    assert fig.layout.yaxis2.title.text == "excess NLL over fp32 (nats per token)" and fig.layout.yaxis2.type != "log"
    assert {(t.xaxis, t.yaxis) for t in fig.data[0::2]} == {("x", "y")}
    assert {(t.xaxis, t.yaxis) for t in fig.data[1::2]} == {("x2", "y2")}
    with pytest.raises(ValueError, match="excess_nll"):
        figures.drift_figure(table.drop(columns=["excess_nll"]))


def test_resident_bits_table_and_figure_match_accounting():
    shape = BUILTIN_SHAPES["qwen3.5-27b"]
    configs = {"pace-4-8": get_config("pace-4-8"), "rtn-int4": get_config("rtn-int4"),
               "dP 32": get_config("pace-4").replace(decode_period=32)}
    table = figures.resident_bits_table(configs, shape)
    for _, row in table.iterrows():
        rb = resident_bits(configs[row["config"]], shape)
        assert row["payload"] == rb.payload_bits and row["buffer c·dP"] == rb.buffer_bits
        assert row["resident"] == pytest.approx(row["payload"] + row["metadata"] + row["buffer c·dP"])
    row = table.set_index("config").loc["pace-4-8"]
    rb = resident_bits(configs["pace-4-8"], shape)
    assert row["payload"] == pytest.approx(rb.code_bits + rb.scale_bits) and row["exact"] == rb.exact_bits
    fig = figures.resident_bits_figure(table)
    assert fig.layout.barmode == "stack"
    assert [t.name for t in fig.data[:3]] == ["payload", "metadata", "buffer c·dP"]
    assert list(fig.data[3].text) == [f"{v:.2f}" for v in table["resident"]]


def test_dp_curve_is_the_accounting_at_each_dp_and_linear_beyond_one():
    shape = BUILTIN_SHAPES["qwen3.5-4b"]
    cfg = get_config("pace-4")
    periods = [1, 2, 5, 8, 11]
    fig = figures.dp_curve_figure({"pace-4": cfg}, shape, periods=periods)
    ys = np.asarray(fig.data[0].y)
    for p, y in zip(periods, ys):
        assert y == resident_bits(cfg.replace(decode_period=p), shape).resident_bits
    steps = np.diff(ys[1:]) / np.diff(periods[1:])
    np.testing.assert_allclose(steps, steps[0], rtol=1e-12)
    assert steps[0] > 0 and ys[0] < ys[1]
    assert fig.data[1].y[0] == resident_bits(cfg, shape).resident_bits      # the marker at the set dP


def test_fit_table_uses_the_accounting():
    """Without context and weight bits the table is sequences_that_fit (states beside the shape's own weights);
    with them, the capacity planner's count: weights at those bits, then per sequence the state and the KV of
    the context, counted here from the per-sequence bytes."""
    shapes = {k: BUILTIN_SHAPES[k] for k in ("qwen3.5-4b", "qwen3.5-27b")}
    configs = {"fp32": get_config("fp32"), "pace-4": get_config("pace-4")}
    table = figures.fit_table(configs, shapes, {"H200 141 GB": 141.0, "x": 33.5})
    assert len(table) == 4
    row = table[(table.model == "qwen3.5-27b") & (table.config == "pace-4")].iloc[0]
    assert row["sequences in H200 141 GB"] == sequences_that_fit(configs["pace-4"], shapes["qwen3.5-27b"], 141 * 10**9)
    assert row["sequences in x"] == sequences_that_fit(configs["pace-4"], shapes["qwen3.5-27b"], int(33.5e9))
    one = state_bytes(configs["pace-4"], shapes["qwen3.5-27b"], 1)
    assert row["state MiB / sequence"] == pytest.approx(one / 2**20) and row["KV MiB / sequence"] == 0
    shape, cfg = shapes["qwen3.5-27b"], configs["pace-4"]
    table = figures.fit_table(configs, shapes, {"H200 141 GB": 141.0}, weight_bits=8, context=4096)
    row = table[(table.model == "qwen3.5-27b") & (table.config == "pace-4")].iloc[0]
    per_state = state_bytes_per_sequence(cfg, shape)
    fixed = state_bytes(cfg, shape, 1) - per_state     # head maps etc., stored once
    kv = shape.kv_bytes_per_token * 4096
    assert kv > 0 and row["KV MiB / sequence"] == pytest.approx(kv / 2**20)
    assert row["sequences in H200 141 GB"] == (141 * 10**9 - shape.weight_params - fixed) // (per_state + kv)


def test_generation_html_marks_the_first_divergent_token():
    out = figures.generation_html(["a", "<b>", "c\n", "d"], 1)
    assert '<mark style="background:#ff8a80" title="first divergent token">&lt;b&gt;</mark>' in out
    assert '<span style="background:#fff3c4">c↵<br></span>' in out
    assert "<mark" not in figures.generation_html(["a", "b"], None)


def test_bench_figure_groups_series_and_checks_columns(rng):
    rows = pd.DataFrame({"batch": [1, 2, 4] * 2, "us": rng.random(6), "variant": ["x"] * 3 + ["y"] * 3})
    fig = figures.bench_figure(rows, x="batch", y="us", series="variant", title="t", y_title="µs")
    assert [t.name for t in fig.data] == ["x", "y"] and fig.layout.xaxis.type == "log"
    np.testing.assert_array_equal(np.asarray(fig.data[1].y), rows["us"].to_numpy()[3:])
    with pytest.raises(ValueError, match="missing columns"):
        figures.bench_figure(rows, x="batch", y="ms", series="variant", title="t", y_title="ms")


def test_split_bench_document_and_plot_columns(rng):
    rows = [{"batch": b, "variant": v, "step_time_us": float(rng.random()), "bytes": 10 * b}
            for v in ("bf16", "pace-4") for b in (1, 8)]
    doc = {"device": "H200", "date": "2026-11-30", "decode_step": rows, "notes": ["a", "b"]}
    tables, prov = figures.split_bench_document(doc)
    assert list(tables) == ["decode_step"] and tables["decode_step"] == rows
    assert prov == {"device": "H200", "date": "2026-11-30", "notes": ["a", "b"]}
    assert figures.bench_plot_columns(pd.DataFrame(rows)) == ("batch", ["step_time_us"], "variant")
    assert figures.bench_plot_columns(pd.DataFrame(rows).drop(columns=["variant"])) is None
    nested = [dict(r, spread=[0.1, 0.2], config={"warps": 4, "per_part": "auto" if i else True}, hbm_fraction=0.5)
              for i, r in enumerate(rows)]
    table = figures.bench_scalar_table(nested)
    # nested records' fields as columns, lists left out, a field of several types as text (Arrow takes one type)
    assert list(table.columns) == ["batch", "variant", "step_time_us", "bytes", "hbm_fraction", "config.warps",
                                   "config.per_part"]
    assert list(table["config.warps"]) == [4] * 4 and list(table["config.per_part"]) == ["True"] + ["auto"] * 3
    assert figures.bench_plot_columns(table) == ("batch", ["step_time_us", "hbm_fraction"], "variant")


def test_bench_speedups_are_the_baseline_time_over_each_variants_at_the_same_batch(rng):
    """Seeded random times; a batch the baseline did not measure is left out, one a variant did not measure is
    empty; no baseline rows: None."""
    times = {(v, b): float(t) for (v, b), t in zip([(v, b) for v in ("bf16 per-token", "A", "B") for b in (1, 8, 32)],
                                                     rng.uniform(1e-5, 1e-3, 9))}
    rows = [{"variant": v, "batch": b, "seconds_per_token": t} for (v, b), t in times.items() if (v, b) != ("B", 8)]
    rows.append({"variant": "A", "batch": 64, "seconds_per_token": 1e-4})   # no baseline at 64
    table = figures.bench_speedups(pd.DataFrame(rows)).set_index("variant")
    assert list(table.columns) == ["B = 1", "B = 8", "B = 32"] and list(table.index) == ["A", "B"]
    for v in ("A", "B"):
        for b in (1, 8, 32):
            expected = times[("bf16 per-token", b)] / times[(v, b)]
            assert np.isnan(table.loc[v, f"B = {b}"]) if (v, b) == ("B", 8) else table.loc[v, f"B = {b}"] == expected
    e2e = pd.DataFrame(
        [{"variant": v, "batch": 16, "tpot_median_s": t} for v, t in (("bf16 per-token", 0.2), ("A", 0.1))]
    )
    assert figures.bench_speedups(e2e).set_index("variant").loc["A", "B = 16"] == 2.0
    assert figures.bench_speedups(pd.DataFrame(rows[3:])) is None  # no baseline


def test_log_ticks_are_1_2_5_per_decade_spanning_the_values():
    assert figures.log_ticks([0.023, 0.31]) == pytest.approx([0.02, 0.05, 0.1, 0.2, 0.5])
    assert figures.log_ticks([0.1, 0.1]) == pytest.approx([0.1])
    assert figures.log_ticks([0.0, -1.0, float("nan"), 3e-4, 1.5e-3]) == pytest.approx([2e-4, 5e-4, 1e-3, 2e-3])
    assert figures.log_ticks([0.0]) == []


def test_compare_figure_draws_the_points_the_frontier_the_best_and_the_budget(rng):
    kl = np.sort(rng.random(4))[::-1] * 1e-2
    table = pd.DataFrame({"config": ["a", "b", "c", "d", "fp32"], "resident_bits": [4.25, 5.0, 6.5, 8.5, 32.0],
                          "kl": [*kl, 0.0], "frontier": [True, False, True, True, True]})
    fig = figures.compare_figure(table, best="c", budget_bits=7.0)
    frontier, points, ring = fig.data
    assert list(points.text) == ["a", "b", "c", "d"]  # KL 0 is off the log axis
    np.testing.assert_allclose(np.asarray(points.y), kl)
    assert list(frontier.x) == [4.25, 6.5, 8.5] and frontier.name == "frontier"
    assert ring.name == "best: c" and list(ring.x) == [6.5] and list(ring.y) == [kl[2]]
    assert fig.layout.xaxis.type == fig.layout.yaxis.type == "log"
    assert [s.x0 for s in fig.layout.shapes] == [7.0]
    assert len(figures.compare_figure(table, best="fp32").data) == 2  # the reference: no ring off the axis


def test_compare_figure_on_another_axis_is_linear_with_error_bars():
    table = pd.DataFrame({"config": ["fp32", "a", "b"], "resident_bits": [32.0, 4.25, 8.5], "value": [0.6, 0.0, 0.55],
                          "stderr": [0.02, None, 0.03], "frontier": [True, True, True]})
    fig = figures.compare_figure(table, best="a", budget_bits=5.0, y="value", y_title="gsm8k (higher is better)",
                                 log_y=False, error="stderr")
    frontier, points, ring = fig.data
    assert list(points.text) == ["a", "b", "fp32"]  # a value 0 stays on a linear axis
    assert list(points.error_y.array) == [0.0, 0.03, 0.02] and list(ring.y) == [0.0]
    assert fig.layout.yaxis.type != "log" and fig.layout.yaxis.title.text == "gsm8k (higher is better)"
