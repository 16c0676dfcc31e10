"""The console table of `pi0align curves`."""

from __future__ import annotations

import pandas as pd
from rich.table import Table

from pi0align.report.formatting import format_number
from pi0align.runs.curves import CurveComparison


def curves_table(frame: pd.DataFrame, comparison: CurveComparison) -> Table:
    """One line per run: its steps and final loss; against the reference, the mean and largest
    relative loss error, the first step outside the band, and the verdict."""
    band = "bit for bit" if comparison.exact else f"±{comparison.tolerance:g}"
    table = Table(title=f"loss against {comparison.reference} ({band}"
                        + (f", mean of {comparison.smooth} steps" if comparison.smooth > 1 else "") + ")",
                  title_justify="left")
    for column in ("run", "steps", "final loss", "mean rel. err", "max rel. err", "first outside", "verdict"):
        table.add_column(column, overflow="fold", justify="left" if column in ("run", "verdict") else "right")
    differences = {d.run: d for d in comparison.differences}
    for run, own in frame.groupby("run", sort=False):
        final = f"{float(own['loss'].iloc[-1]):.6g}" if len(own) else "—"
        difference = differences.get(run)
        if difference is None:
            table.add_row(run, str(len(own)), final, "", "", "", "reference")
            continue
        verdict = "identical" if difference.identical else "within" if difference.within else "outside"
        table.add_row(run, str(len(own)), final, format_number(difference.mean_relative_error),
                      format_number(difference.max_relative_error),
                      _steps(difference.first_outside, difference.window), verdict,
                      style="" if difference.within else "bold red")
    table.caption = "\n".join(_windows_said(comparison)) or None
    table.caption_justify = "left"
    return table


def _steps(step: int | None, window: int) -> str:
    """A step, or the window of steps a log's mean covers, ending at it."""
    return "—" if step is None else str(step) if window == 1 else f"{step - window + 1}–{step}"


def _windows_said(comparison: CurveComparison) -> list[str]:
    """What a comparison with a log of means, or of rounded losses, compared."""
    said = []
    for difference in comparison.differences:
        if difference.window > 1:
            said.append(f"{difference.run}: compared over a log's windows of {difference.window} steps (the mean "
                        f"it prints; a per-step run averaged over each), steps numbered from 0")
        if difference.resolution:
            said.append(f"{difference.run}: the logs print the loss to ±{difference.resolution:.1g}: a difference "
                        "within it is not judged")
    return said
