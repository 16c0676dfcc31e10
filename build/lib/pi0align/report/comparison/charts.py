"""Plotly figures of the HTML report, as plain figure dicts (data + layout) ready for Plotly.newPlot.

Built as dicts rather than plotly.graph_objects: nothing to validate for 20k points, and the JSON
is exactly what the browser receives.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pi0align.compare.reading.records import OUTPUT_ROLES, PARAMETER_ROLES
from pi0align.compare.result import Comparison
from pi0align.compare.table import Table, isin
from pi0align.report.json_values import json_safe

# A log axis cannot show 0: exact agreement is drawn at this floor, below any float64 rounding.
ZERO_FLOOR = 1e-16
# Above this many points per step, lines only: one SVG path stays fast, 20k markers do not.
MARKER_LIMIT = 2000
CHART_DIGITS = 4
# Steps drawn at first (the others are a click on the legend away): a hundred overlaid steps are noise.
VISIBLE_STEPS = 3


def headline_error(rows: Table) -> np.ndarray:
    """One error per row to plot: relative L2 error where tensors or samples exist, else the norm's.

    The norm's relative error, not the mean's: a near-zero mean makes any relative error huge.
    """
    rel_l2 = rows["rel_l2_err"].astype(np.float64)
    return np.where(np.isnan(rel_l2), rows["norm_rel_err"].astype(np.float64), rel_l2)


def execution_order(rows: Table) -> np.ndarray:
    """Position of each row in its step: the benchmark's sequence number, B's where A lacks it."""
    seq_a = rows["seq_a"].astype(np.float64)
    return np.where(np.isnan(seq_a), rows["seq_b"].astype(np.float64), seq_a)


_POINT_COLUMNS = ["step", "name", "direction", "role", "seq_a", "seq_b", "rel_l2_err", "norm_rel_err"]


def _points(rows: Table) -> Table:
    """The rows' outputs (and parameters, gradients) with an error and a place: step, name,
    direction, order, error."""
    rows = rows.take(isin(rows["role"], OUTPUT_ROLES + PARAMETER_ROLES))
    points = Table({
        "step": rows["step"], "name": rows["name"], "direction": rows["direction"],
        "order": execution_order(rows), "error": headline_error(rows),
    }, length=len(rows))
    return points.take(~np.isnan(points["error"]) & ~np.isnan(points["order"]))


def error_by_step_figure(comparison: Comparison, top: int) -> dict[str, Any] | None:
    """Error out of every call along execution order, one trace per step, the `top` culprits marked.

    One point per call: the largest error among its outputs (or its parameter and gradient), over
    all ranks. Its inputs are earlier calls' outputs, so plotting them too would only zigzag the line.
    """
    points = Table.concat([_points(part) for part in comparison.row_parts(_POINT_COLUMNS)])
    if not len(points):
        return None
    # the call's largest error (its first row, among equals), in order of step and position
    largest = np.lexsort((-points["error"], points["order"], points["step"]))
    step, order = points["step"][largest], points["order"][largest]
    points = points.take(largest[np.r_[True, (step[1:] != step[:-1]) | (order[1:] != order[:-1])]])
    # Rounded: the page carries one point per call, and a chart needs no 17-digit floats.
    points["shown"] = np.array([float(f"{value:.{CHART_DIGITS}g}")
                                for value in np.maximum(points["error"], ZERO_FLOOR).tolist()])
    steps = np.unique(points["step"])
    visible = set(steps[:VISIBLE_STEPS].tolist())
    visible.update(culprit.step for culprit in comparison.culprits[:1])
    traces = []
    for step in steps.tolist():
        part = points["step"] == step
        count = int(part.sum())
        traces.append({
            "type": "scatter", "name": f"step {step}", "visible": True if step in visible else "legendonly",
            "x": points["order"][part].astype(int).tolist(), "y": points["shown"][part].tolist(),
            "text": points["name"][part].tolist(),
            "mode": "lines" if count > MARKER_LIMIT else "lines+markers", "marker": {"size": 4},
            "hovertemplate": "%{text}<br>seq %{x} · error %{y:.3g}<extra>step " + str(step) + "</extra>",
        })
    culprit_points = _culprit_points(comparison, points, top)
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


def _culprit_points(comparison: Comparison, points: Table, top: int) -> dict[str, Any] | None:
    """Red markers on the largest error out of each of the `top` culprits, with their place in the list."""
    marks = []
    for place, culprit in enumerate(comparison.culprits[:top], start=1):
        # backward records reuse the forward call's name: the direction tells them apart
        records = np.flatnonzero((points["step"] == culprit.step) & (points["name"] == culprit.name)
                                 & (points["direction"] == culprit.direction))
        if len(records):
            worst = records[np.argmax(points["error"][records])]
            label = f"#{place} {culprit.name} (introduced {culprit.introduced_error:.3g})"
            marks.append((int(points["order"][worst]), float(points["shown"][worst]), label))
    if not marks:
        return None
    x, y, text = zip(*marks)
    return {
        "type": "scatter", "name": "culprits", "mode": "markers", "x": list(x), "y": list(y), "text": list(text),
        "marker": {"color": "red", "size": 11, "symbol": "x"}, "hovertemplate": "%{text}<extra></extra>",
    }


def training_curve_figure(comparison: Comparison, column: str, title: str) -> dict[str, Any] | None:
    """One training metric (loss, grad_norm, lr) of both runs against the step; B dashed, so that
    two runs that agree still show both lines."""
    runs = (("A " + comparison.source_a, comparison.table("metrics_a"), "solid"),
            ("B " + comparison.source_b, comparison.table("metrics_b"), "dash"))
    traces = [
        {"type": "scatter", "mode": "lines+markers", "name": label, "marker": {"size": 4}, "line": {"dash": dash},
         "x": metrics["step"].tolist(), "y": metrics[column].tolist()}
        for label, metrics, dash in runs if column in metrics and _any_value(metrics[column])
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


def _any_value(values: np.ndarray) -> bool:
    """Whether a metric column holds a number anywhere (NaN and None are missing)."""
    if values.dtype.kind == "f":
        return bool((~np.isnan(values)).any())
    return any(value is not None and not (isinstance(value, float) and math.isnan(value)) for value in values.tolist())
