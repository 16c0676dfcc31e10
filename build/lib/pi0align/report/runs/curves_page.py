"""`pi0align curves --html`: loss, gradient norm and learning rate of runs overlaid, and each run's
relative loss error to the first with the tolerance band; one self-contained page."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from markupsafe import Markup

from pi0align.report.json_values import json_safe
from pi0align.report.output import output_path
from pi0align.report.page import environment, plotly_js, script_json, static
from pi0align.runs.curves import CurveComparison, relative_error
from pi0align.runs.monitor import ModuleComparison
from pi0align.version import __version__

PANELS = [("loss", "loss"), ("grad_norm", "gradient norm (before clipping)"), ("lr", "learning rate")]
# One colour per run in every panel (plotly.js would give each trace the next colour of its
# colorway, so a run would change colour from panel to panel): that colorway, the tolerance's red left out.
RUN_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def run_colour(index: int) -> str:
    return RUN_COLOURS[index % len(RUN_COLOURS)]


def write_curves_html(frame: pd.DataFrame, comparison: CurveComparison, path: str | Path,
                      modules: ModuleComparison | None = None, monitor: pd.DataFrame | None = None) -> Path:
    """The runs of `frame` (curves.load_runs) overlaid, with `comparison` (curves.compare_curves);
    with `modules` (monitor.compare_modules of `monitor`, monitor.load_monitor), a heat map over
    step × module of each run's difference to the reference, a click on a row overlaying that
    module's quantities in both runs."""
    trends = None
    if modules is not None and monitor is not None:
        trends = {"heatmaps": [modules_heatmap(modules, run) for run in modules.first_outside],
                  "series": module_series(monitor), "band": modules.band}
    page = environment.get_template("curves.html.j2").render(
        version=__version__, comparison=comparison, plotly_js=Markup(plotly_js()), style=Markup(static("report.css")),
        figure_json=script_json(curves_figure(frame, comparison)), modules=modules,
        trends_json=script_json(json_safe(trends)) if trends else None)
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


def modules_heatmap(modules: ModuleComparison, run: str) -> dict:
    """A plotly heat map: a row per module (in the order they run), a column per step, the
    largest of its quantities' relative differences to the reference in band units (log10: 0 is
    the band's edge)."""
    own = modules.differences[modules.differences["run"] == run]
    largest = own.groupby(["module", "step"])["difference"].max().unstack("step")
    largest = largest.reindex([m for m in modules.modules if m in largest.index])
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.log10(np.maximum(largest.to_numpy(np.float64), 1e-30) / modules.band).clip(-6, 6)
    return {"run": run, "data": [{"type": "heatmap", "x": [int(s) for s in largest.columns], "y": list(largest.index),
                                  "z": json_safe(z.tolist()), "zmin": -6, "zmax": 6, "colorscale": "RdBu",
                                  "reversescale": True, "colorbar": {"title": {"text": "log10(diff / band)"}}}],
            "layout": {"title": {"text": f"{run} against {modules.reference}: each module's largest difference"},
                       "height": 120 + 22 * len(largest.index), "margin": {"l": 420},
                       "xaxis": {"title": {"text": "step"}}, "yaxis": {"autorange": "reversed"}}}


def module_series(monitor: pd.DataFrame) -> dict:
    """{module: {quantity: {run: {"x": steps, "y": values}}}}: what a click on a row overlays."""
    series: dict = {}
    for (module, quantity, run), own in monitor.groupby(["module", "quantity", "run"], sort=False):
        series.setdefault(module, {}).setdefault(quantity, {})[run] = {
            "x": own["step"].astype(int).tolist(), "y": json_safe(own["value"].tolist())}
    return series
