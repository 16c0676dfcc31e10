"""The console of `pi0align ckpt-diff`: the modules by their largest difference, then the tensors
that differ most."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from pi0align.report.formatting import ShortNames, format_number
from pi0align.runs.checkpoints import TensorDifference, beyond, by_module

LISTED = 15


def ckpt_report(differences: list[TensorDifference], tolerance: float, width: int) -> Group:
    names = ShortNames([*(d.module for d in differences), *(d.name.split(":")[0] for d in differences)])
    modules = by_module(differences)
    table = Table(title=f"modules, the largest difference first ({len(modules)})", title_justify="left", box=None,
                  pad_edge=False, padding=(0, 1, 0, 0))
    for column in ("module", "tensors", "differ", "rel. L2", "max |Δ|"):
        table.add_column(column, justify="left" if column == "module" else "right", no_wrap=True)
    for module in modules[:LISTED]:
        table.add_row(names.module(module.module or "(top level)", width - 34), str(module.tensors),
                      str(module.differing), format_number(module.relative_l2), format_number(module.max_abs),
                      style="bold red" if module.relative_l2 > tolerance else "")
    worst = Table(title="tensors, the largest difference first", title_justify="left", box=None, pad_edge=False,
                  padding=(0, 1, 0, 0))
    for column in ("tensor", "shape", "rel. L2", "cosine", "max |Δ|"):
        worst.add_column(column, justify="left" if column in ("tensor", "shape") else "right", no_wrap=True)
    for d in differences[:LISTED]:
        shape = str(list(d.shape_a)) if d.shape_a == d.shape_b else f"{d.shape_a} / {d.shape_b}"
        parameter, _, state = d.name.partition(":")
        shape_width = len(str(list(d.shape_a or ())))
        shown = names.module(parameter, width - 28 - shape_width - len(state)) + (f" {state}" if state else "")
        worst.add_row(shown, shape, format_number(d.relative_l2),
                      format_number(d.cosine), format_number(d.max_abs))
    off = beyond(differences, tolerance)
    verdict = (Text(f"{len(off)} of {len(differences)} tensors differ beyond {tolerance:g}", style="bold red") if off
               else Text(f"all {len(differences)} tensors within {tolerance:g}"
                         + (" (identical)" if not any(d.differs for d in differences) else ""), style="bold green"))
    return Group(table, worst, verdict)
