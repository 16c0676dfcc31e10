"""`pi0align audit --html`: the audit as one self-contained page (no script, no network)."""

from __future__ import annotations

from pathlib import Path

from markupsafe import Markup

from pi0align.auditing import Audit
from pi0align.report.audit.audit_json import audit_summary
from pi0align.report.output import output_path
from pi0align.report.page import environment, static
from pi0align.version import __version__


def write_audit_html(result: Audit, path: str | Path, *, top: int = 10) -> Path:
    page = environment.get_template("audit.html.j2").render(
        version=__version__, summary=audit_summary(result), top=top, style=Markup(static("report.css")))
    with output_path(path) as path:
        path.write_text(page, encoding="utf-8")
    return path
