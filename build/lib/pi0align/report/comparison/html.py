"""`--html`: one self-contained page (every script and style inline) that works with no network."""

from __future__ import annotations

from pathlib import Path

from markupsafe import Markup

from pi0align.compare.result import Comparison
from pi0align.report.comparison.charts import error_by_step_figure, training_curve_figure
from pi0align.report.comparison.module_tree import module_tree
from pi0align.report.comparison.rowdata import row_columns, rows_json_pieces
from pi0align.report.comparison.summary import summary
from pi0align.report.output import output_path
from pi0align.report.page import environment, plotly_js, script_json, static
from pi0align.version import __version__

# Not table columns: `module` is already in `name`, `stack` is the name cell's tooltip.
HIDDEN_COLUMNS = ("module", "stack")
# Columns filtered by a drop-down of their distinct values (the rest by the text box).
SELECT_FILTERS = ["rank", "step", "direction", "role", "pairing", "evidence", "verdict"]
_ROWS_HERE = "\x00rows\x00"  # where the rows go in the rendered page: no text from a file holds a NUL


def default_html_path(source_a: str | Path, source_b: str | Path, folder: str | Path = "reports") -> Path:
    """`reports/<a>-vs-<b>.html`, each run named by its folder when its file has the generic name."""
    return Path(folder) / f"{run_label(source_a)}-vs-{run_label(source_b)}.html"


def run_label(source: str | Path) -> str:
    """`dumps/gpu/dump.h5` -> `gpu`, `dumps/gpu` -> `gpu`, `a.h5` -> `a`."""
    path = Path(source)
    if path.suffix in (".h5", ".hdf5"):
        return path.parent.name if path.stem.startswith("dump") and path.parent.name else path.stem
    return path.name or "run"


def write_html(comparison: Comparison, path: str | Path, *, top: int = 10) -> Path:
    """Render the report to `path`; plotly's JavaScript goes inline so the page needs no network.
    The rows go in a column at a time (a compare of many steps keeps them on disk)."""
    columns = row_columns(comparison.row_column_names())
    figures = {
        "errors": error_by_step_figure(comparison, top),
        "loss": training_curve_figure(comparison, "loss", "loss"),
        "grad_norm": training_curve_figure(comparison, "grad_norm", "gradient norm"),
    }
    page = environment.get_template("report.html.j2").render(
        version=__version__,
        summary=summary(comparison),
        top=top,
        tree=module_tree(comparison),
        plotly_js=Markup(plotly_js()),
        style=Markup(static("report.css")),
        script=Markup(static("report.js")),
        figures_json=script_json({name: figure for name, figure in figures.items() if figure is not None}),
        rows_json=Markup(_ROWS_HERE),
        table_json=script_json({
            "columns": [column for column in columns if column not in HIDDEN_COLUMNS],
            "selects": [column for column in SELECT_FILTERS if column in columns],
        }),
    )
    before, after = page.split(_ROWS_HERE)
    count = len(comparison.table(columns=columns[:1]))
    with output_path(path) as path, path.open("w", encoding="utf-8") as handle:
        handle.write(before)
        for piece in rows_json_pieces(columns, count, lambda name: comparison.table(columns=[name])[name]):
            handle.write(piece)
        handle.write(after)
    return path
