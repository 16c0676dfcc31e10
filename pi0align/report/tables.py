"""`--csv` (every row) and `--json` (the verdict and its evidence) outputs of `pi0align compare`."""

from __future__ import annotations

import json
from pathlib import Path

from pi0align.compare.result import Comparison
from pi0align.report.output import output_path
from pi0align.report.rowdata import row_columns
from pi0align.report.summary import summary


def write_csv(comparison: Comparison, path: str | Path) -> Path:
    """Every row, columns as in `ROW_COLUMNS` then any the engine added; empty cells where not computable."""
    with output_path(path) as path:
        comparison.rows.to_csv(path, columns=row_columns(comparison.rows), index=False)
    return path


def write_json(comparison: Comparison, path: str | Path) -> Path:
    """The summary documented in docs/compare-json.md, strict JSON (no NaN)."""
    with output_path(path) as path:
        path.write_text(json.dumps(summary(comparison), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path
