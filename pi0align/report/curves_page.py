"""`pi0align curves --html`: loss, gradient norm and learning rate of runs overlaid, and each run's
relative loss error to the first with the tolerance band; one self-contained page."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from markupsafe import Markup

from pi0align import __version__
from pi0align.report.output import output_path
from pi0align.report.page import environment, plotly_js, script_json, static
from pi0align.report.summary import json_safe
from pi0align.runs.curves import CurveComparison, relative_error

PANELS = [("loss", "loss"), ("grad_norm", "gradient norm (before clipping)"), ("lr", "learning rate")]
# One colour per run in every panel (plotly.js would give each trace the next colour of its
# colorway, so a run would change colour from panel to panel): that colorway, the tolerance's red left out.
RUN_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def run_colour(index: int) -> str:
    return RUN_COLOURS[index % len(RUN_COLOURS)]


def write_curves_html(frame: pd.DataFrame, comparison: CurveComparison, path: str | Path) -> Path:
    """The runs of `frame` (curves.load_runs) overlaid, with `comparison` (curves.compare_curves)."""
    page = environment.get_template("curves.html.j2").render(
        version=__version__, comparison=comparison, plotly_js=Markup(plotly_js()), style=Markup(static("report.css")),
        figure_json=script_json(curves_figure(frame, comparison)))
    with output_path(path) as path:
        path.write_text(page, encoding="utf-8")
    return path


def curves_figure(frame: pd.DataFrame, comparison: CurveComparison) -> dict:
    """A plotly figure dict: one panel per metric, a trace per run; the last panel each run's
    relative loss error to the reference, and the tolerance as a dashed line."""
    runs = list(dict.fromkeys(frame["run"]))
    panels = len(PANELS) + 1
    data, layout = [], {"height": 260 * panels, "showlegend": True, "margin": {"t": 40},
                        "grid": {"rows": panels, "columns": 1, "pattern": "independent"}}
    colour = {run: run_colour(i) for i, run in enumerate(runs)}

    def trace(run: str, x: list, y: list, panel: int) -> dict:
        """A run's line in a panel: its colour, and in the legend once (a click hides it everywhere)."""
        return {"type": "scatter", "mode": "lines", "name": run, "legendgroup": run, "showlegend": panel == 1,
                "line": {"color": colour[run]}, "x": x, "y": json_safe(y), "xaxis": f"x{panel}", "yaxis": f"y{panel}"}

    for index, (column, title) in enumerate(PANELS, start=1):
        for run in runs:
            own = frame[frame["run"] == run]
            data.append(trace(run, own["step"].tolist(), own[column].tolist(), index))
        layout[f"yaxis{index}"] = {"title": {"text": title}}
    losses = {run: frame[frame["run"] == run].set_index("step")["loss"] for run in runs}
    for run in runs[1:]:
        error = relative_error(losses[runs[0]], losses[run], comparison.smooth)
        data.append(trace(run, error.index.tolist(), error.tolist(), panels))
    if runs:
        steps = frame["step"]
        data.append({"type": "scatter", "mode": "lines", "name": f"tolerance {comparison.tolerance:g}",
                     "line": {"dash": "dash", "color": "#c62828"}, "x": [int(steps.min()), int(steps.max())],
                     "y": [comparison.tolerance] * 2, "xaxis": f"x{panels}", "yaxis": f"y{panels}"})
    layout[f"yaxis{panels}"] = {"title": {"text": f"relative loss error to {runs[0] if runs else '-'}"}}
    layout[f"xaxis{panels}"] = {"title": {"text": "step"}}
    return {"data": data, "layout": layout}
