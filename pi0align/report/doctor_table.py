"""The console table of `pi0align doctor`."""

from __future__ import annotations

from rich.table import Table

from pi0align.runs.supported import MISMATCH, OK, Doctor

_STYLES = {MISMATCH: "bold red", OK: "green"}


def doctor_table(result: Doctor) -> Table:
    """One line per library and switch: what this machine has, what is supported, status, hint."""
    table = Table(title="this machine against the supported versions (docs/supported-versions.md)",
                  title_justify="left")
    for column in ("check", "found", "wanted", "status", "hint"):
        table.add_column(column, overflow="fold")
    for finding in result.findings:
        table.add_row(finding.check, finding.found, finding.wanted, finding.status,
                      finding.hint if finding.status != OK else "", style=_STYLES.get(finding.status, ""))
    return table
