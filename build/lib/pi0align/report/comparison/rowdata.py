"""Comparison rows as compact columnar JSON, for the table the HTML report draws in the browser.

20k rows as 20k <tr> make a slow, huge page; columns as arrays, with each text column stored once
per distinct value (module paths, APIs, stacks repeat across steps), stay small and load fast.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import numpy as np

from pi0align.compare.result import ROW_COLUMNS
from pi0align.compare.table import Table

# Digits kept for the browser: the table shows three; the CSV keeps every digit.
SIGNIFICANT_DIGITS = 5


def rows_json(rows: Table) -> str:
    """`rows_json_pieces` of a table, joined."""
    return "".join(rows_json_pieces(row_columns(rows.columns), len(rows), rows.__getitem__))


def rows_json_pieces(names: list[str], count: int, column: Callable[[str], np.ndarray]) -> Iterator[str]:
    """`{"count": n, "columns": [{"name", "kind": "number", "data"} | {"name", "kind": "text", "values", "codes"}]}`,
    in pieces, a column each (`column(name)`: its values), so that rows on disk are read a column at a time.

    Missing numbers are null; infinities are written 1e999, which is valid JSON that JSON.parse
    reads as Infinity (strict JSON has no Infinity, and inf is a real answer: e.g. B zero, A not).
    Safe to embed in a <script> element: "<" is escaped.
    """
    yield f'{{"count":{count},"columns":['
    for k, name in enumerate(names):
        yield ("," if k else "") + _column_json(name, column(name)).replace("<", "\\u003c")
    yield "]}"


def row_columns(columns: list[str]) -> list[str]:
    """`ROW_COLUMNS`, then any other of these columns (one a user added)."""
    return ROW_COLUMNS + [column for column in columns if column not in ROW_COLUMNS]


def _column_json(name: str, column: np.ndarray) -> str:
    if column.dtype.kind not in "iuf":
        codes, values = _factorize(column.tolist())
        return json.dumps({"name": name, "kind": "text", "values": values, "codes": codes}, separators=(",", ":"))
    return f'{{"name":{json.dumps(name)},"kind":"number","data":[{_numbers(column.astype(np.float64))}]}}'


def _factorize(values: list) -> tuple[list[int], list[str]]:
    """Codes into the distinct texts of the values, numbered in order of first appearance."""
    try:
        distinct = list(dict.fromkeys(values))  # few distinct values: each is made text once
    except TypeError:  # unhashable values (sequences): text first
        values = [_text(value) for value in values]
        distinct = list(dict.fromkeys(values))
    texts = [_text(value) for value in distinct]
    text_codes = {text: code for code, text in enumerate(dict.fromkeys(texts))}
    code_of = {value: text_codes[text] for value, text in zip(distinct, texts)}
    return list(map(code_of.__getitem__, values)), list(text_codes)


def _numbers(values: np.ndarray) -> str:
    """The numbers, comma-separated: null for NaN, 1e999 for infinity, integers without a point,
    the rest to SIGNIFICANT_DIGITS."""
    with np.errstate(invalid="ignore"):
        whole = np.isfinite(values) & (values == np.trunc(values)) & (np.abs(values) < 1e15)
    text = np.empty(len(values), object)
    text[np.isnan(values)] = "null"
    text[values == np.inf], text[values == -np.inf] = "1e999", "-1e999"
    text[whole] = list(map(str, values[whole].astype(np.int64).tolist()))
    rest = ~whole & np.isfinite(values)
    text[rest] = list(map(f"{{:.{SIGNIFICANT_DIGITS}g}}".format, values[rest].tolist()))
    return ",".join(text.tolist())


def _text(value: object) -> str:
    """Shapes may come as sequences of ints (shown as JSON), stacks as sequences of frames (one a line)."""
    if isinstance(value, (list, tuple)):
        return "\n".join(value) if value and all(isinstance(v, str) for v in value) else json.dumps(list(value))
    return str(value)
