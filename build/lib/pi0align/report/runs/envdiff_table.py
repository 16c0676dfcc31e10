"""The console table of two runs' set-up (`pi0align env-diff`, and the compare summary's)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from pi0align.report.formatting import format_value
from pi0align.runs.envdiff import MATTERS, NO_EFFECT, ONE_SIDE, SAME, EnvDiff

_STYLES = {MATTERS: "bold red", SAME: "green"}


def env_diff_table(diff: EnvDiff, *, title: str = "set-up", show_same: bool = False) -> Table:
    """One line per item that differs with an effect (every item with `show_same`): A's value, B's,
    the status."""
    table = Table(title=title, title_justify="left")
    for column, width in (("item", 26), ("A", 18), ("B", 18), ("status", 20)):
        table.add_column(column, max_width=width, overflow="ellipsis", no_wrap=column in ("A", "B"))
    for line in diff.lines if show_same else diff.notable:
        table.add_row(escape(line.item), escape(format_value(line.a)), escape(format_value(line.b)), line.status,
                      style=_STYLES.get(line.status, ""))
    return table


def env_diff_verdict(diff: EnvDiff) -> str:
    """One line: alike, or how many items differ and which of them matter; the items that differ
    with no effect (paths, times) counted."""
    quiet = [line.item for line in diff.differing if line.status == NO_EFFECT]
    one_side = [line.item for line in diff.differing if line.status == ONE_SIDE]
    aside = "".join(f" ({len(items)} {what}: {', '.join(items)})" for items, what in (
        (quiet, "differ with no effect"), (one_side, "recorded on one side only")) if items)
    if not diff.notable:
        return "set up alike" + aside
    matters = [line.item for line in diff.matters]
    return (f"{len(diff.notable)} item(s) differ; "
            + (f"{len(matters)} matter: {', '.join(matters)}" if matters else "none that changes the numbers") + aside)
