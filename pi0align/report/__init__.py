"""Reports of a Comparison: console summary (rich), CSV and JSON files, a self-contained HTML page.

Renders `pi0align.compare.result.Comparison` and knows nothing of how its metrics were computed.
No torch here: reports are made on a laptop that has only the dumps.
"""

from pi0align.report.console import print_summary, progress_bar
from pi0align.report.html import default_html_path, plotly_js, write_html
from pi0align.report.tables import write_csv, write_json

__all__ = ["default_html_path", "plotly_js", "print_summary", "progress_bar", "write_csv", "write_html", "write_json"]
