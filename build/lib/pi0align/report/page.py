"""What every self-contained HTML page of pi0align shares: the Jinja environment of the templates,
plotly.js to inline, the template folder's static files, and JSON safe inside a <script> element."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import jinja2
from markupsafe import Markup

from pi0align.errors import UserError
from pi0align.report.formatting import call_label, coverage_text, format_number, innermost_frame

# plotly.js inside the plotly package (what plotly.offline.get_plotlyjs returns)
PLOTLY_JS = ("package_data", "plotly.min.js")

environment = jinja2.Environment(
    loader=jinja2.PackageLoader("pi0align.report", "templates"),
    autoescape=True, trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined,
)
environment.filters.update(num=format_number, innermost=innermost_frame, coverage=coverage_text, call_label=call_label)


@functools.lru_cache(maxsize=1)
def plotly_js() -> str:
    """plotly.js, to inline; only the JS bundle is used, figures are built as dicts.

    Read from the plotly package as plotly.offline.get_plotlyjs() reads it, but without importing
    plotly, which takes longer than reading the file. Commands call this before their work, so that
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


def static(name: str) -> str:
    """A template-folder file taken verbatim (no Jinja parsing: JavaScript braces stay braces)."""
    return environment.loader.get_source(environment, name)[0]


def script_json(data: object) -> Markup:
    """JSON for a <script type="application/json"> element; "<" escaped so it cannot close the element."""
    return Markup(json.dumps(data, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c"))
