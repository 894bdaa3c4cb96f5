"""Plotly figure and table builders of the dashboard (no streamlit here: pages only place them).

Every builder takes plain arrays / tables (numpy, torch or pandas) and returns a plotly Figure,
a pandas DataFrame or an HTML string, so each can be unit-tested without a browser.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from pace_core.accounting import capacity, resident_bits
from pace_core.config import PaceConfig, get_config
from pace_core.errors import PaceError
from pace_core.shapes import ModelShape

MIB = 2**20
GB = 10**9
GPU_BUDGETS_GB: dict[str, float] = {"H100 80 GB": 80.0, "H200 141 GB": 141.0}
WEIGHT_PRECISIONS: dict[str, int] = {"bf16 (16 bits)": 16, "fp8 (8 bits)": 8, "int4 (4 bits)": 4}
"""The weight precisions the capacity views offer (bits per weight parameter)."""
CAPACITY_GPU = "H200 141 GB"
CAPACITY_CONTEXT = 8192
CAPACITY_WEIGHT_BITS = 16
"""The stated setting of a capacity summary (the Export page's, the Compare page's sentence for a budget in bits):
one H200, bf16 weights, this many tokens of context a sequence."""
_TERM_COLOURS = {"payload": "#2f6fdf", "metadata": "#f2a93b", "buffer c·dP": "#3aa675"}
_STATE_SCALE = "RdBu_r"
COLOUR_PERCENTILE = 99.0
"""Heatmap colour ranges span this percentile of the absolute values (larger entries saturate)."""


def _np(x: Any) -> np.ndarray:
    """torch / list / numpy -> float64 numpy array (on CPU)."""
    if hasattr(x, "detach"):
        x = x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


HEATMAP_ROW_PX = 380
"""Height of one row of state heatmaps (pixels); the gaps below are pixels too, so titles and colour bars keep
their distance whatever the number of rows."""
_HEATMAP_MARGIN = dict(t=120, l=50, r=20, b=170)
_LEGEND_RISE_PX = 40    # the legend's bottom above the top row: over its panel titles, under the figure's title
_ROW_GAP_PX = 110       # between rows: the upper row's tick labels and axis title, the lower row's titles and markers
_COLOURBAR_DROP_PX = 95  # colour bars' top below the bottom row: under its tick labels and axis title
GROUP_LINE = dict(color="#111111", width=1, dash="dot")
"""How the scale-group boundaries are drawn on a grouping's panels."""


def _group_boundaries(axis: str, group_size: int, shape: tuple[int, int]) -> tuple[list, list]:
    """(x, y) of the lines between scale groups of ``group_size`` along ``axis`` ("key": g consecutive key rows of
    one value column, so horizontal lines between rows; "value": g consecutive value columns of one key row,
    vertical lines) over a [K, V] panel, one segment per boundary (None between segments); none when one group
    spans the whole axis."""
    K, V = shape
    n = K if axis == "key" else V
    xs, ys = [], []
    for b in range(group_size, n, group_size):
        edge = b - 0.5
        if axis == "key":
            xs += [-0.5, V - 0.5, None]
            ys += [edge, edge, None]
        else:
            xs += [edge, edge, None]
            ys += [-0.5, K - 0.5, None]
    return xs, ys


def state_heatmaps(
    reference: Any,
    quantised: Mapping[str, Any],
    *,
    groups: Mapping[str, tuple[str, int]] | None = None,
    sidebar: str | None = None,
    outlier_columns: Sequence[int] = (),
    title: str = "",
) -> go.Figure:
    """fp32 state, quantised states and their errors of one head, one row per grouping.

    reference [K, V] fp32 state; quantised {label: S_hat [K, V]} (e.g. key-axis and value-axis groups).
    Row r shows: reference | quantised[label_r] | quantised − reference. The state panels share one
    symmetric colour range and colour bar, the error panels another (bars under their columns); each
    range is the 99th percentile of the absolute values (:data:`COLOUR_PERCENTILE`), so a few outliers
    saturate instead of washing out the rest. ``groups`` {label: (axis, group size)}: the scale-group
    boundaries of that row's grouping are drawn on its quantised and error panels (dotted, one legend entry
    per row); ``sidebar``: the label of the sidebar's grouping, whose panel titles say so. Outlier columns get
    a marker above each panel.
    """
    ref = _np(reference)
    if ref.ndim != 2:
        raise ValueError(f"reference: expected a [K, V] matrix, got shape {ref.shape}")
    labels = list(quantised)
    quants = [_np(quantised[k]) for k in labels]
    for lab, q in zip(labels, quants):
        if q.shape != ref.shape:
            raise ValueError(f"quantised[{lab!r}]: shape {q.shape} differs from reference {ref.shape}")
    groups = dict(groups or {})
    unknown = (set(groups) | ({sidebar} if sidebar is not None else set())) - set(labels)
    if unknown:
        raise ValueError(f"groups / sidebar name {sorted(unknown)}, not a grouping of quantised {labels}")
    errors = [q - ref for q in quants]
    vmax = float(np.percentile(np.abs(np.stack([ref, *quants])), COLOUR_PERCENTILE)) or 1.0
    emax = float(np.percentile(np.abs(np.stack(errors)), COLOUR_PERCENTILE)) if errors else 0.0
    emax = emax or 1.0
    titles = []
    for lab, err in zip(labels, errors):
        rel = np.linalg.norm(err) / (np.linalg.norm(ref) or 1.0)
        mark = " (sidebar)" if lab == sidebar else ""
        titles += ["fp32 state", f"quantised: {lab}{mark}", f"error: {lab} (rel. {rel:.2%})"]
    height = HEATMAP_ROW_PX * len(labels) + _HEATMAP_MARGIN["t"] + _HEATMAP_MARGIN["b"]
    plot_px = height - _HEATMAP_MARGIN["t"] - _HEATMAP_MARGIN["b"]
    fig = make_subplots(rows=len(labels), cols=3, subplot_titles=titles, horizontal_spacing=0.05,
                        vertical_spacing=min(_ROW_GAP_PX / plot_px, 0.3) if len(labels) > 1 else 0.0)
    hover = "key row %{y}<br>value col %{x}<br>%{z:.4g}<extra></extra>"
    for r, (lab, q, e) in enumerate(zip(labels, quants, errors), start=1):
        for c, (z, axis) in enumerate([(ref, "coloraxis"), (q, "coloraxis"), (e, "coloraxis2")], start=1):
            fig.add_trace(go.Heatmap(z=z, coloraxis=axis, hovertemplate=hover), row=r, col=c)
            if outlier_columns:
                fig.add_trace(go.Scatter(
                    x=list(outlier_columns), y=[-2.0] * len(outlier_columns), mode="markers",
                    marker=dict(symbol="triangle-down", size=9, color="#00a844"),
                    name="outlier column", showlegend=(r == 1 and c == 1),
                    hovertemplate="outlier column %{x}<extra></extra>"), row=r, col=c)
            if lab in groups and c > 1:
                group_axis, size = groups[lab]
                xs, ys = _group_boundaries(group_axis, size, ref.shape)
                if xs:
                    fig.add_trace(go.Scatter(
                        x=xs, y=ys, mode="lines", line=GROUP_LINE, showlegend=(c == 2), legendgroup=lab,
                        name=f"scale groups of {lab}: {size} {'key rows' if group_axis == 'key' else 'value columns'}"
                             + (" (sidebar)" if lab == sidebar else ""),
                        hoverinfo="skip"), row=r, col=c)
            fig.update_yaxes(autorange="reversed", row=r, col=c, title_text="key row i" if c == 1 else None)
            fig.update_xaxes(title_text="value column j", row=r, col=c)
    bar_y = -_COLOURBAR_DROP_PX / plot_px
    fig.update_layout(
        title=dict(text=title, x=0.0, xanchor="left", y=1.0 - 10 / height, yanchor="top"), height=height,
        margin=_HEATMAP_MARGIN,
        legend=dict(orientation="h", yanchor="bottom", y=1.0 + _LEGEND_RISE_PX / plot_px, xanchor="left", x=0.0),
        coloraxis=dict(colorscale=_STATE_SCALE, cmin=-vmax, cmax=vmax, colorbar=dict(
            title=dict(text="state value (fp32 and quantised)", side="top"), orientation="h", x=0.33, xanchor="center",
            y=bar_y, yanchor="top", len=0.6, thickness=12)),
        coloraxis2=dict(colorscale=_STATE_SCALE, cmin=-emax, cmax=emax, colorbar=dict(
            title=dict(text="error (quantised − fp32)", side="top"), orientation="h", x=0.84, xanchor="center",
            y=bar_y, yanchor="top", len=0.3, thickness=12)))
    return fig


def rms_profiles(col_rms: Any, row_rms: Any, col_ratio: float, row_ratio: float,
                 outlier_columns: Sequence[int], threshold: float) -> go.Figure:
    """Column RMS ‖S[:, j]‖/√d_k and row RMS ‖S[i, :]‖/√d_v of one head, with the median lines.

    col_rms [V], row_rms [K] and the max/median ratios as pace_core.analysis.structure computes them;
    outlier columns (RMS > threshold × median) are drawn red.
    """
    col, row = _np(col_rms), _np(row_rms)
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        f"column RMS (max/median {col_ratio:.2f})", f"row RMS (max/median {row_ratio:.2f})"))
    outliers = {int(j) for j in outlier_columns}
    for c, prof, axis_name, marked in ((1, col, "value column j", outliers), (2, row, "key row i", set())):
        med = float(np.median(prof))
        colours = ["#d62728" if j in marked else "#4a78c2" for j in range(len(prof))]
        fig.add_trace(go.Bar(x=np.arange(len(prof)), y=prof, marker_color=colours, showlegend=False,
                             hovertemplate=f"{axis_name} %{{x}}<br>RMS %{{y:.4g}}<extra></extra>"),
                      row=1, col=c)
        fig.add_hline(y=med, line_dash="dot", line_color="#555", row=1, col=c,
                      annotation_text="median", annotation_position="top left")
        if c == 1:
            fig.add_hline(y=threshold * med, line_dash="dash", line_color="#d62728", row=1, col=c,
                          annotation_text=f"{threshold:g}× median (outlier)", annotation_position="top left")
        fig.update_xaxes(title_text=axis_name, row=1, col=c)
        fig.update_yaxes(title_text="RMS", row=1, col=c)
    fig.update_layout(height=330, margin=dict(t=50, l=50, r=20, b=40))
    return fig


def head_ranking_figure(E: Any, a: Any, e: Any, high_heads: Sequence[Sequence[int]],
                        layer_labels: Sequence[str]) -> go.Figure:
    """E_h heatmap over GDN layer × value head (chosen 8-bit heads boxed) and a_h, e_h beside it.

    E, a, e [L, HV]; high_heads per layer (indices of the heads kept at high bits).
    """
    E, a, e = _np(E), _np(a), _np(e)
    L, HV = E.shape
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.04, shared_yaxes=True, subplot_titles=(
        "retained error E_h = e_h / (1 − a_h^(2·dP))", "mean decay a_h", "rounding error e_h"))
    panels = ((np.log10(np.maximum(E, 1e-30)), "Viridis", "E_h (log scale)", True), (a, "Blues", "a_h", False),
              (np.log10(np.maximum(e, 1e-30)), "Oranges", "e_h (log scale)", True))
    for c, (z, scale, name, log) in enumerate(panels, start=1):
        bar = dict(title=dict(text=name, side="top"), orientation="h", x=(c - 0.5) / 3, xanchor="center", y=-0.3,
                   yanchor="top", len=0.28, thickness=12)
        if log:  # ticks at powers of ten, written as values
            exps = list(range(int(np.floor(z.min())), int(np.ceil(z.max())) + 1))
            bar.update(tickvals=exps, ticktext=[f"1e{k}" for k in exps])
        value = "10^%{z:.2f}" if log else "%{z:.4f}"
        fig.add_trace(go.Heatmap(z=z, x=list(range(HV)), y=list(layer_labels), colorscale=scale, colorbar=bar,
                                 hovertemplate=f"%{{y}}, head %{{x}}<br>{name.split()[0]} = {value}<extra></extra>"),
                      row=1, col=c)
        fig.update_xaxes(title_text="value head", row=1, col=c)
    xs, ys = [], []
    for li, heads in enumerate(high_heads):
        for h in heads:
            xs.append(h)
            ys.append(layer_labels[li])
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name="8-bit head", showlegend=True,
                             marker=dict(symbol="square-open", size=16, color="#ff1744", line=dict(width=2)),
                             hovertemplate="8-bit: %{y}, head %{x}<extra></extra>"), row=1, col=1)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(height=max(300, 34 * L + 230), margin=dict(t=60, l=70, r=20, b=150),
                      legend=dict(orientation="h", yanchor="bottom", y=1.08, xanchor="right", x=1.0))
    return fig


DRIFT_ERROR_AXIS = "relative state error (%, log scale)"
DRIFT_NLL_AXIS = "excess NLL over fp32 (nats per token)"
PERCENT_TICKS = ".2~p"
"""d3 format of a share written in % with two significant digits (0.0012 -> 0.12%, 0.3 -> 30%)."""


def log_ticks(values: Any) -> list[float]:
    """Tick values 1, 2, 5 × 10^k from just below the smallest positive value to just above the largest (a log
    axis labels every digit of a short range otherwise, and the labels crowd)."""
    v = _np(values)
    v = v[np.isfinite(v) & (v > 0)]
    if not v.size:
        return []
    lo, hi = float(v.min()), float(v.max())
    decades = range(int(np.floor(np.log10(lo))) - 1, int(np.ceil(np.log10(hi))) + 1)
    ticks = [m * 10.0**k for k in decades for m in (1, 2, 5)]
    below = max((t for t in ticks if t <= lo), default=ticks[0])
    above = min((t for t in ticks if t >= hi), default=ticks[-1])
    return [t for t in ticks if below <= t <= above]


def drift_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Relative state error (left, log axis labelled in %) and excess NLL (right) over decode steps, one line
    per configuration in each panel, each panel's y axis naming its quantity (``title``: above both panels,
    e.g. naming the configurations).

    table: long form with columns config, step, rel_error, excess_nll.
    """
    missing = {"config", "step", "rel_error", "excess_nll"} - set(table.columns)
    if missing:
        raise ValueError(f"drift table: missing columns {sorted(missing)}")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, subplot_titles=(
        "relative state error ‖S̃ − S‖_F / ‖S‖_F", "excess NLL: quantised run's NLL − fp32's"))
    palette = _palette(table["config"].unique())
    for name, part in table.groupby("config", sort=False):
        part = part.sort_values("step")
        fig.add_trace(go.Scatter(x=part["step"], y=part["rel_error"], name=str(name), mode="lines",
                                 line=dict(color=palette[name]), legendgroup=str(name),
                                 hovertemplate=f"{name}<br>step %{{x}}: state error %{{y:.3~p}}<extra></extra>"),
                      row=1, col=1)
        fig.add_trace(go.Scatter(x=part["step"], y=part["excess_nll"], name=str(name), mode="lines",
                                 line=dict(color=palette[name]), legendgroup=str(name), showlegend=False,
                                 hovertemplate=f"{name}<br>step %{{x}}: excess NLL %{{y:+.4f}} nats<extra></extra>"),
                      row=1, col=2)
    fig.update_yaxes(type="log", tickformat=PERCENT_TICKS, tickvals=log_ticks(table["rel_error"]),
                     title_text=DRIFT_ERROR_AXIS, row=1, col=1)
    fig.update_yaxes(title_text=DRIFT_NLL_AXIS, row=1, col=2)
    fig.update_xaxes(title_text="decode step")
    fig.update_layout(height=440 if title else 420, margin=dict(t=80 if title else 50, l=70, r=20, b=40),
                      title=dict(text=title) if title else None)
    return fig


SWEEP_ERRORS = {"output_rel_error": "output", "mean_rel_error": "state, mean over decode",
                "final_rel_error": "state, after the last decode step", "prefill_rel_error": "state, after prefill"}
"""The relative errors of a stored sweep (``python -m pace_core sweep``) and their labels."""


def sweep_figure(table: pd.DataFrame, error: str = "output_rel_error") -> go.Figure:
    """Measured relative error against resident bits per state value, one marker per swept
    configuration: one colour per bit width, a circle for key-axis and a square for value-axis groups,
    the configuration's name on hover.

    table: one row per configuration with columns config, bits, group_axis, resident_bits and ``error``
    (one of :data:`SWEEP_ERRORS`).
    """
    missing = {"config", "bits", "group_axis", "resident_bits", error} - set(table.columns)
    if missing:
        raise ValueError(f"sweep table: missing columns {sorted(missing)}")
    fig = go.Figure()
    palette = _palette(sorted(table["bits"].unique()))
    for (bits, axis), part in table.groupby(["bits", "group_axis"], sort=True):
        fig.add_trace(go.Scatter(
            x=part["resident_bits"], y=part[error], mode="markers", name=f"{bits}-bit, {axis} groups",
            text=part["config"], hovertemplate="%{text}<br>%{x:.3f} bits, error %{y:.3%}<extra></extra>",
            marker=dict(color=palette[bits], size=9, symbol="circle" if axis == "key" else "square")))
    fig.update_xaxes(title_text="resident bits per state value")
    fig.update_yaxes(type="log", title_text=f"relative error ({SWEEP_ERRORS.get(error, error)})")
    fig.update_layout(height=420, margin=dict(t=30, l=60, r=20, b=40))
    return fig


def _palette(names: Iterable[Any]) -> dict[Any, str]:
    colours = ["#2f6fdf", "#d62728", "#3aa675", "#f2a93b", "#8e44ad", "#17becf", "#7f7f7f",
               "#bcbd22", "#e377c2", "#8c564b"]
    return {n: colours[i % len(colours)] for i, n in enumerate(names)}


def resident_bits_table(configs: Mapping[str, PaceConfig], shape: ModelShape) -> pd.DataFrame:
    """Resident bits per state value of each configuration on `shape` (spec §5).

    Columns: config, payload, metadata, buffer c·dP, resident (= sum), exact (bits actually stored), c, dP.
    """
    rows = []
    for label, cfg in configs.items():
        rb = resident_bits(cfg, shape)
        rows.append({"config": label, "payload": rb.payload_bits, "metadata": rb.metadata_bits,
                     "buffer c·dP": rb.buffer_bits, "resident": rb.resident_bits,
                     "exact": rb.exact_bits, "c": rb.c, "dP": cfg.decode_period})
    return pd.DataFrame(rows)


def at_width(cfg: PaceConfig, bits: int) -> PaceConfig:
    """``cfg`` with its codes at ``bits`` bits, its high-bit heads (if any) at least as wide (PACE-4/8 at 3 bits
    is PACE-3/8); the rest as it is."""
    return cfg.replace(bits=bits, high_bits=max(cfg.high_bits, bits))


def width_table(cfg: PaceConfig, shape: ModelShape, widths: Iterable[int] = range(2, 9), *,
                budget_bytes: int | None = None, weight_bits: int | None = None, context: int = 0) -> pd.DataFrame:
    """What each code width costs with the other settings of ``cfg`` on ``shape`` (:func:`at_width`), from
    :mod:`pace_core.accounting`: the resident bits per state value (every width stored densely), the state bytes
    each sequence adds, their saving against fp32 states and, with ``budget_bytes``, the sequences that fit beside
    the weights (``weight_bits``) and ``context`` tokens of attention KV each (:func:`pace_core.accounting.capacity`).
    One row per width the method takes (a width it refuses, e.g. STEPQuant's other than 4 and 6, is left out);
    ``current``: the width of ``cfg``. Empty for the references (no codes)."""
    columns = ["bits", "resident bits", "state KiB / sequence", "× fewer than fp32", "current"]
    if budget_bytes is not None:
        columns.append("sequences")
    if not cfg.quantized:
        return pd.DataFrame(columns=columns)
    fp32 = capacity(get_config("fp32"), shape, 0).state_bytes_per_sequence
    rows = []
    for b in widths:
        try:
            other = at_width(cfg, b)
            other.validate_for(shape)
        except PaceError:
            continue
        per = capacity(other, shape, budget_bytes or 0, weight_bits=weight_bits, context=context)
        row = {"bits": b, "resident bits": resident_bits(other, shape).resident_bits,
               "state KiB / sequence": per.state_bytes_per_sequence / 1024,
               "× fewer than fp32": fp32 / per.state_bytes_per_sequence, "current": b == cfg.bits}
        if budget_bytes is not None:
            row["sequences"] = per.sequences
        rows.append(row)
    return pd.DataFrame(rows, columns=columns)


def width_figure(table: pd.DataFrame, label: str) -> go.Figure:
    """Resident bits per state value of each code width (:func:`width_table`), the saving against fp32 states on
    each bar, the current width darker."""
    fig = go.Figure(go.Bar(
        x=[f"{b}-bit" for b in table["bits"]], y=table["resident bits"],
        marker_color=["#2f6fdf" if current else "#9dbcf0" for current in table["current"]],
        text=[f"{r:.2f} bits · {x:.1f}× fewer" for r, x in zip(table["resident bits"], table["× fewer than fp32"])],
        textposition="outside", hovertemplate=f"{label} at %{{x}}<br>%{{y:.3f}} bits/value<extra></extra>"))
    fig.update_layout(height=360, yaxis_title="resident bits per state value", xaxis_title="code width",
                      margin=dict(t=30, l=60, r=20, b=50),
                      yaxis_range=[0, float(table["resident bits"].max()) * 1.2 if len(table) else 1])
    return fig


def resident_bits_figure(table: pd.DataFrame) -> go.Figure:
    """Stacked bars payload / metadata / c·dP per configuration with the total on top."""
    fig = go.Figure()
    for term, colour in _TERM_COLOURS.items():
        fig.add_trace(go.Bar(x=table["config"], y=table[term], name=term, marker_color=colour,
                             hovertemplate=f"%{{x}}<br>{term}: %{{y:.4g}} bits/value<extra></extra>"))
    fig.add_trace(go.Scatter(x=table["config"], y=table["resident"], mode="text",
                             text=[f"{v:.2f}" for v in table["resident"]], textposition="top center",
                             showlegend=False, hoverinfo="skip"))
    fig.update_layout(barmode="stack", height=420, yaxis_title="resident bits per state value (log scale)",
                      margin=dict(t=30, l=60, r=20, b=80), legend=dict(orientation="h", y=1.08))
    # log scale: the 16- and 32-bit references stay on the chart without squashing the 4-8-bit bars
    fig.update_yaxes(type="log", tickvals=[1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32],
                     range=[0, np.log10(max(float(table["resident"].max()), 8.0) * 1.3)])
    return fig


def dp_curve_figure(configs: Mapping[str, PaceConfig], shape: ModelShape,
                    periods: Sequence[int] = tuple(range(1, 65))) -> go.Figure:
    """Resident bits per value against the decode period dP for each configuration (spec §5)."""
    fig = go.Figure()
    for label, cfg in configs.items():
        ys = [resident_bits(cfg.replace(decode_period=p), shape).resident_bits for p in periods]
        fig.add_trace(go.Scatter(x=list(periods), y=ys, mode="lines", name=label,
                                 hovertemplate=f"{label}<br>dP %{{x}}: %{{y:.3f}} bits/value<extra></extra>"))
        fig.add_trace(go.Scatter(x=[cfg.decode_period], y=[resident_bits(cfg, shape).resident_bits],
                                 mode="markers", marker=dict(size=10), showlegend=False,
                                 hovertemplate=f"{label} (set dP)<br>%{{y:.3f}} bits/value<extra></extra>"))
    fig.update_layout(height=380, xaxis_title="decode period dP (tokens)",
                      yaxis_title="resident bits per state value", margin=dict(t=30, l=60, r=20, b=50))
    return fig


def fit_table(configs: Mapping[str, PaceConfig], shapes: Mapping[str, ModelShape],
              budgets_gb: Mapping[str, float], *, weight_bits: int | None = None, context: int = 0) -> pd.DataFrame:
    """Sequences that fit in each budget, per model shape and configuration: :func:`pace_core.accounting.capacity`
    with weights of ``weight_bits`` (default each shape's own) and, per sequence, its state and the attention
    KV cache of ``context`` tokens (0: states only), as the capacity planner counts.

    Also the state and KV MiB per sequence. Budgets in GB (10^9 bytes).
    """
    rows = []
    for model, shape in shapes.items():
        for label, cfg in configs.items():
            per = capacity(cfg, shape, 0, weight_bits=weight_bits, context=context)  # one sequence's bytes
            row = {"model": model, "config": label, "state MiB / sequence": per.state_bytes_per_sequence / MIB,
                   "KV MiB / sequence": per.kv_bytes_per_sequence / MIB}
            row.update({f"sequences in {budget}": capacity(cfg, shape, int(gb * GB), weight_bits=weight_bits,
                                                           context=context).sequences
                        for budget, gb in budgets_gb.items()})
            rows.append(row)
    return pd.DataFrame(rows)


def capacity_figure(capacities: Mapping[str, Any], budget_bytes: int) -> go.Figure:
    """Memory used (GB) against concurrent sequences N: weights + stored-once bytes + N · (state + KV) for
    each configuration's :class:`pace_core.accounting.Capacity` (the weights are the same for all), the
    budget as a line, each maximum marked; N runs a little past the largest maximum."""
    fig = go.Figure()
    weights = next(iter(capacities.values())).weight_bytes
    top = max(max(c.sequences for c in capacities.values()) * 1.15, 1)
    xs = np.unique(np.linspace(0, top, 200).astype(np.int64))
    for label, cap in capacities.items():
        per_seq = cap.state_bytes_per_sequence + cap.kv_bytes_per_sequence
        ys = (weights + cap.fixed_bytes + xs * per_seq) / GB
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=label,
                                 hovertemplate=f"{label}<br>N = %{{x}}: %{{y:.1f}} GB<extra></extra>"))
        n = cap.sequences
        fig.add_trace(go.Scatter(x=[n], y=[(weights + cap.fixed_bytes + n * per_seq) / GB], mode="markers+text",
                                 text=[f"{n:,}"], textposition="top left", marker=dict(size=9), showlegend=False,
                                 hovertemplate=f"{label}: at most {n:,} sequences<extra></extra>"))
    fig.add_hline(y=budget_bytes / GB, line_dash="dash", annotation_text="GPU memory", annotation_position="top left")
    fig.add_hline(y=weights / GB, line_dash="dot", annotation_text="weights", annotation_position="bottom right")
    fig.update_layout(height=400, xaxis_title="concurrent sequences N", yaxis_title="memory used (GB, 10⁹ bytes)",
                      margin=dict(t=30, l=60, r=20, b=50), legend=dict(orientation="h", y=1.1))
    return fig


def compare_figure(table: pd.DataFrame, best: str | None = None, budget_bits: float | None = None, *, y: str = "kl",
                   y_title: str = "KL to fp32 (nats per token, log scale)", log_y: bool = True,
                   error: str | None = None) -> go.Figure:
    """Resident bits per state value (log axis) against a quality column ``y`` (default KL to fp32, log axis), one
    labelled point per configuration (``table``: config, resident_bits, ``y``, frontier;
    :func:`pace_core.analysis.compare.comparison` or :func:`~pace_core.analysis.compare.axis_table`), the Pareto
    frontier as a line through its points, ``best`` ringed, ``budget_bits`` as a dashed vertical line and, with
    ``error``, the column of each value's standard error as error bars. On a log axis a point of value 0 or less
    (the fp32 reference's KL) cannot sit and is left out."""
    shown = table[table[y] > 0] if log_y else table[table[y].notna()]
    shown = shown.sort_values(["resident_bits", y])
    on = shown[shown["frontier"]]
    bars = None
    if error is not None and shown[error].notna().any():
        bars = dict(type="data", array=list(shown[error].fillna(0.0)), visible=True, color="#8a8f98")
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=on["resident_bits"], y=on[y], mode="lines", name="frontier",
                             line=dict(color="#3aa675", width=2), hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=shown["resident_bits"], y=shown[y], mode="markers+text", name="configurations",
                             text=list(shown["config"]), textfont=dict(size=11), error_y=bars,
                             # neighbours' labels above and below in turn: points of close bits crowd
                             textposition=["top right" if i % 2 == 0 else "bottom right" for i in range(len(shown))],
                             marker=dict(size=9, color=np.where(shown["frontier"], "#3aa675", "#2f6fdf")),
                             customdata=shown["config"],
                             hovertemplate="%{customdata}<br>%{x:.3f} bits, "
                                           + ("KL %{y:.2e}" if y == "kl" else "%{y:.4g}") + "<extra></extra>"))
    if best is not None and best in set(shown["config"]):
        row = shown[shown["config"] == best].iloc[0]
        fig.add_trace(go.Scatter(x=[row["resident_bits"]], y=[row[y]], mode="markers", name=f"best: {best}",
                                 marker=dict(size=20, color="rgba(0,0,0,0)", line=dict(color="#d62728", width=3)),
                                 hoverinfo="skip"))
    bits = list(shown["resident_bits"])
    if budget_bits is not None and budget_bits > 0:
        fig.add_vline(x=budget_bits, line_dash="dash", line_color="#d62728")
        bits.append(budget_bits)
    # the range set, not autoranged: on a log axis plotly would take a shape's or label's position for a log10
    fig.update_xaxes(type="log", title="resident bits per state value (log scale; dashed: the budget)",
                     tickvals=[2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64],
                     range=[np.log10(min(bits) / 1.1), np.log10(max(bits) * 1.25)] if bits else None)
    if log_y:
        fig.update_yaxes(type="log", title=y_title, tickvals=log_ticks(shown[y]), tickformat=".0e")
    else:
        fig.update_yaxes(title=y_title)
    fig.update_layout(height=480, margin=dict(t=30, l=70, r=20, b=50), legend=dict(orientation="h", y=1.08))
    return fig


def generation_html(pieces: Sequence[str], divergence: int | None) -> str:
    """Token texts as HTML with the first divergent token and everything after it highlighted."""
    out = []
    for i, piece in enumerate(pieces):
        text = html.escape(piece).replace("\n", "↵<br>")
        if divergence is not None and i == divergence:
            out.append(f'<mark style="background:#ff8a80" title="first divergent token">{text}</mark>')
        elif divergence is not None and i > divergence:
            out.append(f'<span style="background:#fff3c4">{text}</span>')
        else:
            out.append(text)
    return ('<div style="font-family:monospace;font-size:0.9em;line-height:1.5;'
            'white-space:pre-wrap;border:1px solid #ddd;border-radius:6px;padding:8px">'
            + "".join(out) + "</div>")


def bench_figure(rows: pd.DataFrame, *, x: str, y: str, series: str, title: str,
                 y_title: str, log_x: bool = True) -> go.Figure:
    """Line plot of a benchmark table: `y` against `x`, one line per `series` value."""
    missing = {x, y, series} - set(rows.columns)
    if missing:
        raise ValueError(f"benchmark table: missing columns {sorted(missing)}")
    fig = go.Figure()
    for name, part in rows.groupby(series, sort=False):
        part = part.sort_values(x)
        fig.add_trace(go.Scatter(x=part[x], y=part[y], mode="lines+markers", name=str(name)))
    fig.update_layout(title=title, height=440, xaxis_title=x, yaxis_title=y_title,
                      margin=dict(t=50, l=60, r=20, b=50),
                      legend=dict(orientation="h", yanchor="top", y=-0.25, xanchor="left", x=0.0))
    if log_x:
        ticks = sorted(rows[x].unique())
        fig.update_xaxes(type="log", tickvals=ticks, ticktext=[str(t) for t in ticks])
    return fig


def split_bench_document(doc: Mapping[str, Any]) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """A benchmark JSON -> ({name: rows} for every list of records, everything else = provenance)."""
    tables, rest = {}, {}
    for key, value in doc.items():
        if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            tables[key] = value
        else:
            rest[key] = value
    return tables, rest


_SERIES_COLUMNS = ("variant", "method", "config", "impl", "kernel", "name")
_METRIC_HINTS = ("seconds", "time", "_us", "_ms", "tpot", "latency", "fraction", "speedup", "bandwidth", "gbps")


def bench_scalar_table(rows: list[dict]) -> pd.DataFrame:
    """The benchmark records as a table of their scalar fields, those of nested records as ``outer.inner`` columns
    (nested lists left out)."""
    frame = pd.json_normalize(rows)
    nested = [c for c in frame.columns if frame[c].map(lambda v: isinstance(v, (list, dict))).any()]
    frame = frame.drop(columns=nested)
    for c in frame.columns:  # a field of several types (a setting "auto" or a flag) as text: Arrow takes one type
        if frame[c].dtype == "object" and frame[c].dropna().map(type).nunique() > 1:
            frame[c] = frame[c].map(lambda v: v if pd.isna(v) else str(v))
    return frame


BENCH_METRICS: dict[str, tuple[str, str, float]] = {
    "seconds_per_token": ("time per token", "µs", 1e6),
    "tpot_mean_s": ("time per output token", "ms", 1e3),
    "tpot_median_s": ("time per output token, median", "ms", 1e3),
    "hbm_fraction": ("share of the copy bandwidth", "%", 100.0),
    "speedup_vs_bf16_per_token": ("speed-up over bf16 per-token", "×", 1.0),
    "bytes_per_token": ("bytes moved per token", "MB", 1e-6),
    "bytes_per_second": ("bandwidth", "GB/s", 1e-9),
}
"""Benchmark JSON keys -> (what it is, unit, factor from the stored SI value)."""
BENCH_BASELINE = "bf16 per-token"


def bench_metric_title(key: str) -> str:
    """``time per token (µs)`` for a known key, else the key itself."""
    return f"{BENCH_METRICS[key][0]} ({BENCH_METRICS[key][1]})" if key in BENCH_METRICS else key


def bench_readable(rows: pd.DataFrame) -> pd.DataFrame:
    """A benchmark table with the known metrics in their units and titled (:data:`BENCH_METRICS`)."""
    out = rows.copy()
    for key, (_, _, factor) in BENCH_METRICS.items():
        if key in out.columns:
            out[key] = out[key] * factor
    return out.rename(columns={k: bench_metric_title(k) for k in BENCH_METRICS if k in out.columns})


def _bench_time_key(rows: pd.DataFrame) -> str | None:
    """The time column of a benchmark table (decode step: seconds per token; end to end: per output token),
    None when it has none or no variant and batch columns."""
    if not {"variant", "batch"} <= set(rows.columns):
        return None
    return next((k for k in ("seconds_per_token", "tpot_median_s", "tpot_mean_s") if k in rows.columns), None)


def bench_headline(rows: pd.DataFrame) -> pd.DataFrame | None:
    """One row per variant, one column per batch: time per token, the speed-up over bf16 per-token at the
    same batch and (for the decode step) the share of the copy bandwidth. None without variant, batch and
    a time column."""
    time_key = _bench_time_key(rows)
    if time_key is None:
        return None
    _, unit, factor = BENCH_METRICS[time_key]
    base = rows[rows["variant"] == BENCH_BASELINE].set_index("batch")[time_key]
    table = {}
    for variant, part in rows.groupby("variant", sort=False):
        cells = {}
        for _, r in part.sort_values("batch").iterrows():
            text = f"{r[time_key] * factor:,.1f} {unit}"
            if r["batch"] in base.index and variant != BENCH_BASELINE:
                text += f" · {base[r['batch']] / r[time_key]:.2f}×"
            if "hbm_fraction" in r and pd.notna(r["hbm_fraction"]):
                text += f" · {r['hbm_fraction']:.0%} HBM"
            cells[f"B = {int(r['batch'])}"] = text
        table[variant] = cells
    return pd.DataFrame.from_dict(table, orient="index").rename_axis("variant").reset_index()


def bench_speedups(rows: pd.DataFrame) -> pd.DataFrame | None:
    """The speed-up over bf16 per-token (:data:`BENCH_BASELINE`) of every other variant at each batch that both
    measured: the baseline's time per token over the variant's (> 1: faster). One row per variant, one column
    per batch (``B = n``, in increasing order; empty where a batch was not measured); None without variant,
    batch and time columns or without a baseline row."""
    time_key = _bench_time_key(rows)
    if time_key is None:
        return None
    base = rows[rows["variant"] == BENCH_BASELINE].set_index("batch")[time_key]
    if base.empty:
        return None
    others = rows[(rows["variant"] != BENCH_BASELINE) & rows["batch"].isin(base.index)]
    table = {variant: {int(b): float(base[b] / t) for b, t in zip(part["batch"], part[time_key])}
             for variant, part in others.groupby("variant", sort=False)}
    frame = pd.DataFrame.from_dict(table, orient="index")
    frame = frame[sorted(frame.columns)].rename(columns=lambda b: f"B = {b}")
    return frame.rename_axis("variant").reset_index()


def bench_plot_columns(rows: pd.DataFrame) -> tuple[str, list[str], str] | None:
    """(x, [y...], series) to plot a benchmark table: x = batch, ys = the numeric columns named like
    timings, bandwidth fractions or speed-ups (in table order), series = the first label column; None
    when the table has no such columns."""
    if "batch" not in rows.columns:
        return None
    series = next((c for c in _SERIES_COLUMNS if c in rows.columns and not
                   pd.api.types.is_numeric_dtype(rows[c])), None)
    ys = [c for c in rows.columns if c != "batch" and pd.api.types.is_numeric_dtype(rows[c])
          and any(h in c.lower() for h in _METRIC_HINTS)]
    if series is None or not ys:
        return None
    return "batch", ys, series
