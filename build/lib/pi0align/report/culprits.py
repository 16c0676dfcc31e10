"""Culprits on the console, as `compare` and `audit` both print them: a call's panel (the first
divergence, the first NaN), the table of the top culprits, their groups and the groups' hints."""

from __future__ import annotations

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from pi0align.compare.result import CallRef, Culprit, CulpritGroup
from pi0align.report.formatting import (
    ShortNames,
    fit_left,
    format_number,
    innermost_frame,
    relative_frame,
    short_frame,
)

# a call's direction in the culprit table's kind column (any other direction is printed whole)
_SHORT_DIRECTIONS = {"forward": "fwd", "backward": "bwd", "update": "upd"}
# culprit table columns of fixed width: #, step, kind, judged by, blame (and a space between each)
_CULPRIT_FIXED = 3 + 5 + 13 + 10 + 9


def print_culprits(console: Console, culprits: list[Culprit], groups: list[CulpritGroup], top: int,
                   names: ShortNames, caption: str) -> None:
    """The top culprits, what the first broke, their groups and the groups' hints."""
    if culprits and top > 0:
        console.print(culprit_table(culprits, top, console.width, names, caption))
        console.print(Text("top culprit: ", style="bold") + Text(broken_bound_text(culprits[0])))
    if groups:
        console.print(groups_table(groups))
        for group in groups:
            if group.hint:
                console.print(Text(f"hint ({group.api}): ", style="bold magenta") + Text(names.in_text(group.hint)))


def broken_bound_text(culprit: Culprit) -> str:
    """Which bound a culprit broke, and by how much."""
    if not culprit.bound > 0:
        return culprit.bound_by
    if culprit.evidence == "replay":
        what, measured = "local error", culprit.local_error_b if culprit.wrong_side == "B" else culprit.local_error_a
    else:
        what, measured = "error", culprit.introduced_error * culprit.bound
    return (f"{what} {format_number(measured)}, {format_number(measured / culprit.bound)}× its bound "
            f"{format_number(culprit.bound)}: {culprit.bound_by}")


def call_panel(title: str, call: CallRef, names: ShortNames, width: int) -> Panel:
    """A call as the user needs to find it: kind, step, direction, rank, module, API, name and its
    stack, innermost frame first, every name and path shortened to the panel's width."""
    inside = width - 4  # the panel's borders and padding
    body = Text.assemble(
        ("kind ", "dim"), (call.kind, "bold"), ("  step ", "dim"), str(call.step), ("  direction ", "dim"),
        call.direction, ("  rank ", "dim"), str(call.rank), "\n",
        ("module ", "dim"), (names.module(call.module, inside - len("module ")) or "(top level)", "bold"), "\n",
        ("api ", "dim"), (call.api, "bold"), "\n", ("name ", "dim"), names.name(call.name, inside - len("name ")),
    )
    for frame in reversed(call.stack):  # innermost first: the line the user should open
        body.append("\n  at " + short_frame(relative_frame(frame), inside - len("  at ")), style="cyan")
    return Panel(body, title=Text(title), border_style="red", expand=False)


def culprit_table(culprits: list[Culprit], top: int, width: int, names: ShortNames, caption: str) -> Table:
    """One line a culprit (its call, then its module where both do not fit on one), and its call
    site on the next, at any width from 80 columns: long module paths lose whole parts from their
    start ("…model.layers.1.mlp.gate_proj"), keeping the tail that tells calls apart."""
    table = Table(title=f"top culprits ({min(top, len(culprits))} of {len(culprits)})", title_justify="left",
                  box=None, pad_edge=False, padding=(0, 1, 0, 0), caption=caption, caption_justify="left")
    for column in ("#", "step", "kind", "judged by", "blame"):
        table.add_column(column, justify="right" if column in ("#", "step", "blame") else "left", no_wrap=True)
    call_width = max(20, width - _CULPRIT_FIXED)
    table.add_column("call · call site", no_wrap=True, overflow="crop", max_width=call_width)
    for place, culprit in enumerate(culprits[:top], start=1):
        kind = culprit.kind if culprit.kind != "call" else \
            f"call {_SHORT_DIRECTIONS.get(culprit.direction, culprit.direction)}"
        blame = culprit.local_ratio if culprit.evidence == "replay" else culprit.introduced_error
        side = f" {culprit.wrong_side}" if culprit.wrong_side else ""
        call = Text(names.label(culprit.name, call_width), style="bold")
        if culprit.stack:
            call.append("\n" + short_frame(relative_frame(innermost_frame(culprit.stack)), call_width), style="cyan")
        table.add_row(str(place), str(culprit.step), kind, culprit.evidence + side, format_number(blame), call)
    return table


def groups_table(groups: list[CulpritGroup]) -> Table:
    """One line a group of culprits: kind, API, how many, of how many calls, median blame."""
    table = Table(title=f"culprit groups ({len(groups)})", title_justify="left", box=None, pad_edge=False,
                  padding=(0, 1, 0, 0))
    for column in ("kind", "API", "culprits", "of calls", "introducing", "median blame"):
        table.add_column(column, justify="left" if column in ("kind", "API") else "right", no_wrap=True)
    for group in groups:
        table.add_row(group.kind, fit_left(group.api, 36), str(group.count), str(group.calls),
                      f"{group.share_introducing:.0%}", format_number(group.median_ratio))
    return table
