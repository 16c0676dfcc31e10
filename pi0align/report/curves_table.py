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
                      "—" if difference.first_outside is None else str(difference.first_outside), verdict,
                      style="" if difference.within else "bold red")
    return table
