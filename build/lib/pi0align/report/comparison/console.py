"""The console summary of `pi0align compare` (rich), and the progress bar of a long compare."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from pi0align.compare.result import Comparison
from pi0align.compare.table import isin
from pi0align.report.comparison.summary import verdict_counts
from pi0align.report.culprits import call_panel, print_culprits
from pi0align.report.formatting import ShortNames, coverage_text
from pi0align.report.runs.envdiff_table import env_diff_table, env_diff_verdict
from pi0align.runs.envdiff import env_diff_of

ProgressCallback = Callable[..., None]

# How many records found on one side only, and manifest differences, the console lists.
LISTED_PER_SECTION = 10


def print_summary(comparison: Comparison, console: Console, *, top: int = 10) -> None:
    """Verdict, coverage, first divergence, top culprits, one-sided records, manifest differences,
    notes; every name shortened to its distinctive tail where the console's width needs it."""
    names = ShortNames(module for rows in comparison.row_parts(["module"]) for module in rows["module"].tolist())
    console.print(_verdict_panel(comparison))
    for title, call in (("first divergence", comparison.first_divergence),
                        ("first divergence in backward", comparison.first_divergence_backward)):
        if call is not None:
            console.print(call_panel(title, call, names, console.width))
    print_culprits(console, comparison.culprits, comparison.culprit_groups, top, names,
                   "blame: local error ratio (replay), else introduced error")
    one_sided = _one_sided_table(comparison, names, console.width)
    if one_sided is not None:
        console.print(one_sided)
    if comparison.manifest_diff:
        set_up = env_diff_of(comparison.manifest_diff)
        if set_up.notable:
            console.print(env_diff_table(set_up, title="set-up (env-diff)"))
        console.print(Text("set-up: ", style="bold") + Text(env_diff_verdict(set_up)))
    for note in comparison.notes:
        console.print(Text("note: ", style="bold yellow") + Text(names.in_text(note)))


def _verdict_panel(comparison: Comparison) -> Panel:
    aligned = comparison.verdict == "aligned"
    counts = verdict_counts(comparison)
    headline = "ALIGNED WITHIN NOISE" if comparison.within_noise else comparison.verdict.upper()
    lines = [
        Text(headline, style="bold green" if aligned else "bold red"),
        Text(f"judged by: {comparison.noise_model} · {comparison.rows_over_dtype_limits} rows beyond the fixed "
             "dtype limits"),
        Text(f"A (benchmark):  {comparison.source_a}\nB (under test): {comparison.source_b}"),
        Text(coverage_text(comparison.coverage)),
        Text(f"rows: {counts['pass']} pass · {counts['warn']} warn · {counts['fail']} fail · {counts['n/a']} n/a"),
    ]
    if comparison.explained:
        lines.append(Text("warn by rule: " + " · ".join(f"{rule} {count}" for rule, count in
                                                       sorted(comparison.explained.items(), key=lambda r: -r[1]))))
    if len(comparison.rank_verdicts) > 1:
        lines.append(Text("ranks: " + " · ".join(f"{rank} {verdict}" for rank, verdict in
                                                 comparison.rank_verdicts.items())))
    return Panel(Group(*lines), title=Text("pi0align compare"), border_style="green" if aligned else "red",
                 expand=False)


def _one_sided_table(comparison: Comparison, names: ShortNames, width: int) -> Table | None:
    table = Table(title_justify="left")
    for column in ("side", "step", "rank", "name", "role", "arg"):
        table.add_column(column, overflow="fold")
    name_width = max(width - 44, 24)  # the other columns, their borders and padding
    count = listed = 0
    for rows in comparison.row_parts(["pairing", "step", "rank", "name", "role", "arg_index"]):
        one_sided = np.flatnonzero(isin(rows["pairing"], ["only_a", "only_b"]))
        count += len(one_sided)
        for i in one_sided[:LISTED_PER_SECTION - listed].tolist():
            side = "A" if rows["pairing"][i] == "only_a" else "B"
            table.add_row(side, str(rows["step"][i]), str(rows["rank"][i]),
                          escape(names.name(str(rows["name"][i]), name_width)),
                          str(rows["role"][i]), str(rows["arg_index"][i]))
            listed += 1
    if not count:
        return None
    table.title = f"records on one side only ({count})"
    if count > listed:
        table.caption = f"… and {count - listed} more (see --csv or the HTML report)"
    return table


@contextmanager
def progress_bar(console: Console, description: str = "comparing") -> Iterator[ProgressCallback]:
    """A progress bar for a long compare; yields the `progress(done, total, what=None)` callback.

    Drawn only on a terminal, and removed when done, so logs and pipes stay clean.
    """
    if not console.is_terminal:
        yield lambda done, total=None, what=None: None
        return
    # imported here: with no terminal there is no bar to draw, and its import would be 3 % of a compare of statistics
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(description, total=None)

        def update(done: int, total: int | None = None, what: str | None = None) -> None:
            progress.update(task, completed=done, total=total, description=what or description)

        yield update
