"""Reports of a Comparison: console summary (rich), CSV and JSON files, a self-contained HTML page.

Renders `pi0align.compare.result.Comparison` and knows nothing of how its metrics were computed.
No torch here: reports are made on a laptop that has only the dumps.
"""

from pi0align.report.comparison.console import print_summary, progress_bar
from pi0align.report.comparison.csv_json import write_csv, write_json

_HTML = ("default_html_path", "plotly_js", "write_html")

__all__ = ["default_html_path", "plotly_js", "print_summary", "progress_bar", "write_csv", "write_html", "write_json"]


def __getattr__(name: str):
    # Lazy: the HTML report's Jinja2 is imported only when an HTML report is written.
    if name in _HTML:
        from pi0align.report.comparison import html

        return getattr(html, name)
    raise AttributeError(f"module 'pi0align.report' has no attribute {name!r}")
