"""Plotly figures of the HTML report, as plain figure dicts (data + layout) ready for Plotly.newPlot.

Built as dicts rather than plotly.graph_objects: nothing to validate for 20k points, and the JSON
is exactly what the browser receives.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from pi0align.compare.records import OUTPUT_ROLES, PARAMETER_ROLES
from pi0align.compare.result import Comparison
from pi0align.report.summary import json_safe

# A log axis cannot show 0: exact agreement is drawn at this floor, below any float64 rounding.
ZERO_FLOOR = 1e-16
# Above this many points per step, lines only: one SVG path stays fast, 20k markers do not.
MARKER_LIMIT = 2000
CHART_DIGITS = 4
# Steps drawn at first (the others are a click on the legend away): a hundred overlaid steps are noise.
VISIBLE_STEPS = 3


def headline_error(rows: pd.DataFrame) -> pd.Series:
    """One error per row to plot: relative L2 error where tensors or samples exist, else the norm's.

    The norm's relative error, not the mean's: a near-zero mean makes any relative error huge.
    """
    return rows["rel_l2_err"].astype("float64").fillna(rows["norm_rel_err"].astype("float64"))


def execution_order(rows: pd.DataFrame) -> pd.Series:
    """Position of each row in its step: the benchmark's sequence number, B's where A lacks it."""
    return rows["seq_a"].astype("Float64").fillna(rows["seq_b"].astype("Float64")).astype("float64")


def error_by_step_figure(comparison: Comparison, top: int) -> dict[str, Any] | None:
    """Error out of every call along execution order, one trace per step, the `top` culprits marked.

    One point per call: the largest error among its outputs (or its parameter and gradient), over
    all ranks. Its inputs are earlier calls' outputs, so plotting them too would only zigzag the line.
    """
    rows = comparison.rows
    rows = rows[rows["role"].isin(OUTPUT_ROLES + PARAMETER_ROLES)]
    frame = pd.DataFrame({
        "step": rows["step"].to_numpy(),
        "name": rows["name"].astype(str).to_numpy(),
        "direction": rows["direction"].astype(str).to_numpy(),
        "order": execution_order(rows).to_numpy(),
        "error": headline_error(rows).to_numpy(),
    }).dropna(subset=["error", "order"])
    if frame.empty:
        return None
    frame = frame.loc[frame.groupby(["step", "order"])["error"].idxmax()].sort_values(["step", "order"])
    # Rounded: the page carries one point per call, and a chart needs no 17-digit floats.
    frame["shown"] = [float(f"{value:.{CHART_DIGITS}g}") for value in np.maximum(frame["error"].to_numpy(), ZERO_FLOOR)]
    visible = set(sorted(frame["step"].unique())[:VISIBLE_STEPS])
    visible.update(culprit.step for culprit in comparison.culprits[:1])
    traces = []
    for step, part in frame.groupby("step", sort=True):
        traces.append({
            "type": "scatter", "name": f"step {step}", "visible": True if step in visible else "legendonly",
            "x": part["order"].astype(int).tolist(), "y": part["shown"].tolist(), "text": part["name"].tolist(),
            "mode": "lines" if len(part) > MARKER_LIMIT else "lines+markers", "marker": {"size": 4},
            "hovertemplate": "%{text}<br>seq %{x} · error %{y:.3g}<extra>step " + str(step) + "</extra>",
        })
    culprit_points = _culprit_points(comparison, frame, top)
    if culprit_points is not None:
        traces.append(culprit_points)
    return {
        "data": json_safe(traces),
        "layout": {
            "title": {"text": "error out of each call along execution order "
                              "(relative L2, or relative norm error for statistics)"},
            "xaxis": {"title": {"text": "call sequence number in the step (forward, then backward, then parameters)"}},
            "yaxis": {"type": "log", "title": {"text": f"relative error (0 drawn at {ZERO_FLOOR:g})"}},
            "hovermode": "closest", "height": 420, "margin": {"t": 50, "r": 20},
        },
    }


def _culprit_points(comparison: Comparison, frame: pd.DataFrame, top: int) -> dict[str, Any] | None:
    """Red markers on the largest error out of each of the `top` culprits, with their place in the list."""
    points = []
    for place, culprit in enumerate(comparison.culprits[:top], start=1):
        # backward records reuse the forward call's name: the direction tells them apart
        records = frame[(frame["step"] == culprit.step) & (frame["name"] == culprit.name)
                        & (frame["direction"] == culprit.direction)]
        if not records.empty:
            worst = records.loc[records["error"].idxmax()]
            label = f"#{place} {culprit.name} (introduced {culprit.introduced_error:.3g})"
            points.append((int(worst["order"]), worst["shown"], label))
    if not points:
        return None
    x, y, text = zip(*points)
    return {
        "type": "scatter", "name": "culprits", "mode": "markers", "x": list(x), "y": list(y), "text": list(text),
        "marker": {"color": "red", "size": 11, "symbol": "x"}, "hovertemplate": "%{text}<extra></extra>",
    }


def training_curve_figure(comparison: Comparison, column: str, title: str) -> dict[str, Any] | None:
    """One training metric (loss, grad_norm, lr) of both runs against the step; B dashed, so that
    two runs that agree still show both lines."""
    runs = (("A " + comparison.source_a, comparison.metrics_a, "solid"),
            ("B " + comparison.source_b, comparison.metrics_b, "dash"))
    traces = [
        {"type": "scatter", "mode": "lines+markers", "name": label, "marker": {"size": 4}, "line": {"dash": dash},
         "x": metrics["step"].tolist(), "y": metrics[column].tolist()}
        for label, metrics, dash in runs if column in metrics and metrics[column].notna().any()
    ]
    if not traces:
        return None
    last_step = max(max(trace["x"]) for trace in traces)
    return {
        "data": json_safe(traces),
        "layout": {"title": {"text": title}, "height": 340, "legend": {"orientation": "h", "y": -0.25},
                   "xaxis": {"title": {"text": "step"}, "dtick": max(1, round(last_step / 10))},  # whole steps
                   "margin": {"t": 50, "r": 20}},
    }
