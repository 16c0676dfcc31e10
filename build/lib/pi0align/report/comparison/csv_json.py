"""`--csv` (every row) and `--json` (the verdict and its evidence) outputs of `pi0align compare`."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from pi0align.compare.result import Comparison
from pi0align.report.comparison.rowdata import row_columns
from pi0align.report.comparison.summary import summary
from pi0align.report.output import output_path, write_json_data


def write_csv(comparison: Comparison, path: str | Path) -> Path:
    """Every row, columns as in `ROW_COLUMNS` then any the engine added; empty cells where not computable."""
    columns = row_columns(comparison.row_column_names())
    with output_path(path) as path, path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(columns)
        for rows in comparison.row_parts(columns):
            writer.writerows(zip(*(_csv_cells(rows[column], column in rows.nullable_ints) for column in columns)))
    return path


def _csv_cells(values: np.ndarray, integers: bool) -> list[str]:
    """A column as CSV text, as pandas writes it: numbers as numpy prints them (shortest
    round-trip), integers stored as floats (missing as NaN) as integers, "" where missing."""
    if values.dtype.kind == "f":
        missing = np.isnan(values)
        text = np.where(missing, 0, values).astype(np.int64).astype(str) if integers else values.astype(str)
        return np.where(missing, "", text).tolist()
    if values.dtype.kind in "iub":
        return values.astype(str).tolist()
    return ["" if value is None else str(value) for value in values.tolist()]


def write_json(comparison: Comparison, path: str | Path) -> Path:
    """The summary documented in docs/compare-json.md, strict JSON (no NaN)."""
    return write_json_data(summary(comparison), path)
