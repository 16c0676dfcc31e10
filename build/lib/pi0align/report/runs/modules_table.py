"""The console of `pi0align curves --modules`: where to look first, and the module quantities
that leave the band, in the order a step computes them."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from pi0align.report.formatting import ShortNames, format_number
from pi0align.runs.curves import CurveComparison
from pi0align.runs.monitor import ModuleComparison, computed_at

LISTED = 10  # leaving quantities listed per run


def modules_report(modules: ModuleComparison, curves: CurveComparison, width: int) -> Group:
    """Per run: the first module and quantity to leave the band, beside the step its loss leaves
    its own; then the first few to leave."""
    names = ShortNames(modules.modules)
    loss = {d.run: d.first_outside for d in curves.differences}
    parts = []
    position = {module: i for i, module in enumerate(modules.modules)}
    for run, first in modules.first_outside.items():
        left = loss.get(run)
        beside = f"the loss leaves its band at step {left}" if left is not None else "the loss stays within its band"
        if first is None:
            parts.append(Text(f"{run}: every module within ±{modules.band:g} of {modules.reference} ({beside})"))
            continue
        parts.append(Text.assemble(("where to look first: ", "bold"), f"{run}: ",
                                   (names.module(first.module, width - 40), "bold red"),
                                   f" {first.quantity} leaves ±{modules.band:g} at step {first.first_outside} "
                                   f"({beside})"))
        table = Table(title=f"{run}: module quantities outside the band, as the step computes them",
                      title_justify="left", box=None, pad_edge=False, padding=(0, 1, 0, 0))
        for column in ("step", "module", "quantity", "largest"):
            table.add_column(column, justify="right" if column in ("step", "largest") else "left", no_wrap=True)
        gone = sorted((x for x in modules.leaving if x.run == run and x.first_outside is not None),
                      key=lambda x: computed_at(x, position))
        for leaving in gone[:LISTED]:
            table.add_row(str(leaving.first_outside), names.module(leaving.module, width - 36), leaving.quantity,
                          format_number(leaving.max_difference))
        parts.append(table)
    return Group(*parts)
