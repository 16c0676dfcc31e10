"""Comparison rows as compact columnar JSON, for the table the HTML report draws in the browser.

20k rows as 20k <tr> make a slow, huge page; columns as arrays, with each text column stored once
per distinct value (module paths, APIs, stacks repeat across steps), stay small and load fast.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from pi0align.compare.result import ROW_COLUMNS

# Digits kept for the browser: the table shows three; the CSV keeps every digit.
SIGNIFICANT_DIGITS = 5


def rows_json(rows: pd.DataFrame) -> str:
    """`{"count": n, "columns": [{"name", "kind": "number", "data"} | {"name", "kind": "text", "values", "codes"}]}`.

    Missing numbers are null; infinities are written 1e999, which is valid JSON that JSON.parse
    reads as Infinity (strict JSON has no Infinity, and inf is a real answer: e.g. B zero, A not).
    Safe to embed in a <script> element: "<" is escaped.
    """
    columns = [_column_json(name, rows[name]) for name in row_columns(rows)]
    return f'{{"count":{len(rows)},"columns":[{",".join(columns)}]}}'.replace("<", "\\u003c")


def row_columns(rows: pd.DataFrame) -> list[str]:
    """`ROW_COLUMNS`, then any column the engine added (e.g. `rank` for multi-rank runs)."""
    return ROW_COLUMNS + [column for column in rows.columns if column not in ROW_COLUMNS]


def _column_json(name: str, column: pd.Series) -> str:
    if pd.api.types.is_bool_dtype(column.dtype) or not pd.api.types.is_numeric_dtype(column.dtype):
        codes, values = pd.factorize(column.map(_text, na_action="ignore").fillna(""))
        return json.dumps({"name": name, "kind": "text", "values": values.tolist(), "codes": codes.tolist()},
                          separators=(",", ":"))
    numbers = ",".join(_number(value) for value in column.astype("float64").tolist())
    return f'{{"name":{json.dumps(name)},"kind":"number","data":[{numbers}]}}'


def _number(value: float) -> str:
    if math.isnan(value):
        return "null"
    if math.isinf(value):
        return "1e999" if value > 0 else "-1e999"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.{SIGNIFICANT_DIGITS}g}"


def _text(value: object) -> str:
    """Shapes may come as sequences of ints (shown as JSON), stacks as sequences of frames (one a line)."""
    if isinstance(value, (list, tuple)):
        return "\n".join(value) if value and all(isinstance(v, str) for v in value) else json.dumps(list(value))
    return str(value)
