"""The console of `pi0align bisect`: a line per probe as it finishes, then what was found."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.text import Text

from pi0align.bisecting import Bisection, Bound, Probe
from pi0align.report.culprits import call_panel
from pi0align.report.formatting import ShortNames, format_number

PROBE_KINDS = {"device": "one step", "perturbed": "noise reference", "dumped": "dumped step"}


def probe_verdict(probe: Probe, bound: Bound | None) -> str:
    """"bound" while the bound is measured, then "within" or "beyond" it."""
    if bound is None or probe.kind == "perturbed":
        return "bound"
    return "beyond" if bound.beyond(probe) else "within"


def probe_line(probe: Probe, bound: Bound | None) -> Text:
    """One probe: the checkpoint, what ran, its loss and gradient norm's relative differences to the
    reference's logged step, and its verdict."""
    verdict = probe_verdict(probe, bound)
    style = {"beyond": "bold red", "within": "green"}.get(verdict, "dim")
    reused = " (kept)" if probe.reused else ""
    return Text.assemble(f"step {probe.step:>6}  {PROBE_KINDS[probe.kind]:<16}", ("loss Δ ", "dim"),
                         f"{format_number(probe.loss_difference):<9}", ("grad norm Δ ", "dim"),
                         f"{format_number(probe.grad_norm_difference):<9}", (verdict, style), (reused, "dim"))


def print_bisection(result: Bisection, console: Console) -> None:
    """The bound, the conclusion, the culprit and what to run on the reference's device."""
    found = result.first_checkpoint_beyond is not None
    lines = [Text("A STEP COMPUTES DIFFERENTLY" if found else "NO STEP COMPUTES DIFFERENTLY",
                  style="bold red" if found else "bold green"),
             Text(f"A (reference):  {result.reference}\nB (under test): {result.under_test}"),
             Text("curves part at step " + (str(result.parts_at) if result.parts_at is not None else "— (never)")
                  + f" · checkpoints searched: {', '.join(map(str, result.searched))}"),
             *([Text(result.monitors, style="dim" if result.first_module is None else "")] if result.monitors else []),
             Text(f"bound: loss {format_number(result.bound.loss)}, gradient norm "
                  f"{format_number(result.bound.grad_norm)} ({result.bound.measured_by})"),
             Text(f"one-step probes: {len(result.probes)}")]
    if found:
        lines.append(Text(f"first checkpoint beyond the bound: {result.first_checkpoint_beyond}"
                          + (" (this device is not deterministic there)" if result.nondeterministic else "")))
    console.print(Panel(Group(*lines), title=Text("pi0align bisect"), border_style="red" if found else "green",
                        expand=False))
    if result.culprit is not None:
        names = ShortNames([result.culprit.module])
        console.print(call_panel(f"culprit ({result.judged_by})", result.culprit, names, console.width))
    for note in result.notes:
        console.print(Text("note: ", style="bold yellow") + Text(note))
    if result.commands:
        console.print(Text("on the reference's device, for its side of the step:", style="bold"))
        for command in result.commands:
            console.print("  " + command, highlight=False, soft_wrap=True)
