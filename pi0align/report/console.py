"""The console summary of `pi0align compare` (rich), and the progress bar of a long compare."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from pi0align.compare.result import CallRef, Comparison
from pi0align.compare.table import isin
from pi0align.report.formatting import coverage_text, format_number, format_value, innermost_frame
from pi0align.report.summary import verdict_counts

ProgressCallback = Callable[..., None]

# How many records found on one side only, and manifest differences, the console lists.
LISTED_PER_SECTION = 10


def print_summary(comparison: Comparison, console: Console, *, top: int = 10) -> None:
    """Verdict, coverage, first divergence, top culprits, one-sided records, manifest differences, notes."""
    console.print(_verdict_panel(comparison))
    for title, call in (("first divergence", comparison.first_divergence),
                        ("first divergence in backward", comparison.first_divergence_backward)):
        if call is not None:
            console.print(_first_divergence(title, call))
    if comparison.culprits and top > 0:
        console.print(_culprit_table(comparison, top))
    one_sided = _one_sided_table(comparison)
    if one_sided is not None:
        console.print(one_sided)
    if comparison.manifest_diff:
        console.print(_manifest_table(comparison))
    for note in comparison.notes:
        console.print(Text("note: ", style="bold yellow") + Text(note))


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
    return Panel(Group(*lines), title="pi0align compare", border_style="green" if aligned else "red", expand=False)


def _first_divergence(title: str, call: CallRef) -> Panel:
    body = Text.assemble(
        ("step ", "dim"), str(call.step), ("  direction ", "dim"), call.direction,
        ("  rank ", "dim"), str(call.rank), "\n",
        ("module ", "dim"), (call.module or "(top level)", "bold"), "\n",
        ("api ", "dim"), (call.api, "bold"), ("  name ", "dim"), call.name,
    )
    for frame in reversed(call.stack):  # innermost first: the line the user should open
        body.append("\n  at " + frame, style="cyan")
    return Panel(body, title=title, border_style="red", expand=False)


def _culprit_table(comparison: Comparison, top: int) -> Table:
    table = Table(title=f"top culprits ({min(top, len(comparison.culprits))} of {len(comparison.culprits)})",
                  title_justify="left")
    # Numbers never wrap; on a narrow terminal the call (module, API, call site) does.
    for column in ("#", "step", "rank", "direction", "judged by", "introduced", "in err", "out err"):
        table.add_column(column, justify="left" if column in ("direction", "judged by") else "right", no_wrap=True)
    table.add_column("call (module · API, call site)", overflow="fold")
    for place, culprit in enumerate(comparison.culprits[:top], start=1):
        call = Text.assemble((culprit.module or "(top level)", "bold"), " · ", culprit.api)
        if culprit.evidence == "replay":
            call.append(f"\nlocal error A {format_number(culprit.local_error_a)} · B {format_number(culprit.local_error_b)}"
                        f" ({culprit.wrong_side} wrong, {format_number(culprit.local_ratio)}×)", style="magenta")
        if culprit.stack:
            call.append("\nat " + innermost_frame(culprit.stack), style="cyan")
        table.add_row(
            str(place), str(culprit.step), str(culprit.rank), culprit.direction, culprit.evidence,
            format_number(culprit.introduced_error), format_number(culprit.input_error),
            format_number(culprit.output_error), call,
        )
    return table


def _one_sided_table(comparison: Comparison) -> Table | None:
    rows = comparison.table()
    one_sided = np.flatnonzero(isin(rows["pairing"], ["only_a", "only_b"]))
    if not len(one_sided):
        return None
    table = Table(title=f"records on one side only ({len(one_sided)})", title_justify="left")
    for column in ("side", "step", "rank", "name", "role", "arg"):
        table.add_column(column, overflow="fold")
    for i in one_sided[:LISTED_PER_SECTION]:
        side = "A" if rows["pairing"][i] == "only_a" else "B"
        table.add_row(side, str(rows["step"][i]), str(rows["rank"][i]), escape(str(rows["name"][i])),
                      str(rows["role"][i]), str(rows["arg_index"][i]))
    if len(one_sided) > LISTED_PER_SECTION:
        table.caption = f"… and {len(one_sided) - LISTED_PER_SECTION} more (see --csv or the HTML report)"
    return table


def _manifest_table(comparison: Comparison) -> Table:
    table = Table(title=f"manifest differences ({len(comparison.manifest_diff)})", title_justify="left")
    for column in ("key", "A", "B"):
        table.add_column(column, overflow="fold", max_width=60)
    for key, value_a, value_b in comparison.manifest_diff[:LISTED_PER_SECTION]:
        table.add_row(escape(key), escape(format_value(value_a)), escape(format_value(value_b)))
    if len(comparison.manifest_diff) > LISTED_PER_SECTION:
        more = len(comparison.manifest_diff) - LISTED_PER_SECTION
        table.caption = f"… and {more} more (see --json or the HTML report)"
    return table


@contextmanager
def progress_bar(console: Console, description: str = "comparing") -> Iterator[ProgressCallback]:
    """A progress bar for a long compare; yields the `progress(done, total, what=None)` callback.

    Drawn only on a terminal, and removed when done, so logs and pipes stay clean.
    """
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(description, total=None)

        def update(done: int, total: int | None = None, what: str | None = None) -> None:
            progress.update(task, completed=done, total=total, description=what or description)

        yield update
