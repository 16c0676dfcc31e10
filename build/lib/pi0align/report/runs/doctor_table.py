"""The console report of `pi0align doctor`: a table, and the hints of what is not ok below it."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from pi0align.runs.supported import INFO, MISMATCH, OK, WARNING, Doctor

_STYLES = {MISMATCH: "bold red", WARNING: "yellow", OK: "green"}


def doctor_report(result: Doctor) -> Group:
    """One line per library and switch (what this machine has, what is supported, status), then
    one line per hint of those not ok, which wraps between words at any width."""
    table = Table(title="this machine against the supported versions (docs/supported-versions.md)",
                  title_justify="left")
    for column in ("check", "found", "wanted", "status"):
        table.add_column(column, overflow="fold")
    for finding in result.findings:
        table.add_row(finding.check, finding.found, finding.wanted, finding.status,
                      style=_STYLES.get(finding.status, ""))
    hints = [Text(f"{finding.check}: ", style=_STYLES.get(finding.status, "bold")) + Text(finding.hint)
             for finding in result.findings if finding.hint and finding.status in (MISMATCH, WARNING, INFO)]
    return Group(table, *hints)
