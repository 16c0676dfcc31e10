"""`--html`: one self-contained page (every script and style inline) that works with no network."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import jinja2
from markupsafe import Markup

from pi0align import __version__
from pi0align.compare.result import Comparison
from pi0align.errors import UserError
from pi0align.report.charts import error_by_step_figure, training_curve_figure
from pi0align.report.formatting import (
    call_label,
    coverage_text,
    format_number,
    innermost_frame,
)
from pi0align.report.module_tree import module_tree
from pi0align.report.output import output_path
from pi0align.report.rowdata import row_columns, rows_json
from pi0align.report.summary import summary

# Not table columns: `module` is already in `name`, `stack` is the name cell's tooltip.
HIDDEN_COLUMNS = ("module", "stack")
# plotly.js inside the plotly package (what plotly.offline.get_plotlyjs returns)
PLOTLY_JS = ("package_data", "plotly.min.js")
# Columns filtered by a drop-down of their distinct values (the rest by the text box).
SELECT_FILTERS = ["rank", "step", "direction", "role", "pairing", "evidence", "verdict"]

_environment = jinja2.Environment(
    loader=jinja2.PackageLoader("pi0align.report", "templates"),
    autoescape=True, trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined,
)
_environment.filters.update(num=format_number, innermost=innermost_frame, coverage=coverage_text,
                            call_label=call_label)


def default_html_path(source_a: str | Path, source_b: str | Path, folder: str | Path = "reports") -> Path:
    """`reports/<a>-vs-<b>.html`, each run named by its folder when its file has the generic name."""
    return Path(folder) / f"{run_label(source_a)}-vs-{run_label(source_b)}.html"


def run_label(source: str | Path) -> str:
    """`dumps/gpu/dump.h5` -> `gpu`, `dumps/gpu` -> `gpu`, `a.h5` -> `a`."""
    path = Path(source)
    if path.suffix in (".h5", ".hdf5"):
        return path.parent.name if path.stem.startswith("dump") and path.parent.name else path.stem
    return path.name or "run"


@functools.lru_cache(maxsize=1)
def plotly_js() -> str:
    """plotly.js, to inline; only the JS bundle is used, figures are built as dicts.

    Read from the plotly package as plotly.offline.get_plotlyjs() reads it, but without importing
    plotly, which takes longer than reading the file. The CLI calls this before comparing, so that
    a missing plotly is said before a long compare.
    """
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the HTML report needs plotly: pip install plotly, or pass --no-html")
    try:
        return Path(spec.submodule_search_locations[0], *PLOTLY_JS).read_text(encoding="utf-8")
    except OSError:  # another layout of the package: ask plotly
        from plotly.offline import get_plotlyjs

        return get_plotlyjs()


def write_html(comparison: Comparison, path: str | Path, *, top: int = 10) -> Path:
    """Render the report to `path`; plotly's JavaScript goes inline so the page needs no network."""
    rows = comparison.table()
    figures = {
        "errors": error_by_step_figure(comparison, top),
        "loss": training_curve_figure(comparison, "loss", "loss"),
        "grad_norm": training_curve_figure(comparison, "grad_norm", "gradient norm"),
    }
    page = _environment.get_template("report.html.j2").render(
        version=__version__,
        summary=summary(comparison),
        top=top,
        tree=module_tree(comparison),
        plotly_js=Markup(plotly_js()),
        style=Markup(_static("report.css")),
        script=Markup(_static("report.js")),
        figures_json=_script_json({name: figure for name, figure in figures.items() if figure is not None}),
        rows_json=Markup(rows_json(rows)),
        table_json=_script_json({
            "columns": [column for column in row_columns(rows) if column not in HIDDEN_COLUMNS],
            "selects": [column for column in SELECT_FILTERS if column in rows],
        }),
    )
    with output_path(path) as path:
        path.write_text(page, encoding="utf-8")
    return path


def _static(name: str) -> str:
    """A template-folder file taken verbatim (no Jinja parsing: JavaScript braces stay braces)."""
    return _environment.loader.get_source(_environment, name)[0]


def _script_json(data: object) -> Markup:
    """JSON for a <script type="application/json"> element; "<" escaped so it cannot close the element."""
    return Markup(json.dumps(data, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c"))
