"""The console summary of `pi0align audit` (rich): the verdict, the first NaN/Inf, the top
culprits and their groups, results near their dtype's largest value, notes."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.text import Text

from pi0align.auditing import Audit
from pi0align.report.culprits import call_panel, print_culprits
from pi0align.report.formatting import ShortNames, format_number

LISTED_EDGES = 10  # results near their dtype's largest value the console lists


def print_audit(result: Audit, console: Console, names: ShortNames, *, top: int = 10) -> None:
    """Everything `pi0align audit` found, names shortened to the console's width."""
    console.print(_verdict_panel(result))
    for origin in result.nonfinite:
        console.print(call_panel(f"first NaN/Inf (rank {origin.rank})", origin, names, console.width))
    print_culprits(console, result.culprits, result.culprit_groups, top, names,
                   "blame: local error over its standard (docs/audit.md)")
    for edge in result.edges[:LISTED_EDGES]:
        console.print(Text("near overflow: ", style="bold yellow") + Text(
            f"step {edge.step} rank {edge.rank} {names.name(edge.name, 48)} ({edge.direction}): "
            f"|x| up to {format_number(edge.value)} of {edge.dtype}'s {format_number(edge.limit)}"))
    if len(result.edges) > LISTED_EDGES:
        console.print(f"… and {len(result.edges) - LISTED_EDGES} more results near overflow (see --json)")
    for note in result.notes:
        console.print(Text("note: ", style="bold yellow") + Text(names.in_text(note)))


def _verdict_panel(result: Audit) -> Panel:
    passed = result.verdict == "pass"
    skipped = sum(result.not_replayed.values())
    lines = [Text(result.verdict.upper(), style="bold green" if passed else "bold red"),
             Text(f"dump: {result.source} · {result.mode} mode"),
             Text(f"NaN/Inf made: {len(result.nonfinite) and 'yes, at step ' + str(result.nonfinite[0].step) or 'none'}"
                  f" · results near overflow: {len(result.edges)}")]
    if result.mode == "tensor":
        lines.append(Text(f"calls held to their standard: {result.replayed} · not replayed: {skipped}"))
        if skipped:
            common = sorted(result.not_replayed.items(), key=lambda item: -item[1])[:3]
            lines.append(Text("  " + " · ".join(f"{reason} {count}" for reason, count in common), style="dim"))
    return Panel(Group(*lines), title=Text("pi0align audit"), border_style="green" if passed else "red",
                 expand=False)
