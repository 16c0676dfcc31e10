"""The console table of `pi0align check`."""

from __future__ import annotations

from rich.table import Table

from pi0align.runs.baselines import FAIL, PASS, Check

_STYLES = {FAIL: "bold red", PASS: "green"}


def check_table(result: Check) -> Table:
    """One line per criterion: the run's value, the baseline's, pass / fail / not judged, why."""
    table = Table(title=f"against baseline {result.baseline}", title_justify="left")
    for column in ("criterion", "run", "baseline", "status", "detail"):
        table.add_column(column, overflow="fold")
    for criterion in result.criteria:
        table.add_row(criterion.name, criterion.run, criterion.baseline, criterion.status, criterion.detail,
                      style=_STYLES.get(criterion.status, ""))
    return table
