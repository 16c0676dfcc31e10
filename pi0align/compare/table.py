"""Table: named numpy columns of equal length, and the joins and group-bys the compare needs.

The compare pipeline works on tables of tens of thousands of rows. pandas would cost a third of a
second to import and its per-call machinery more than the work itself; numpy's sort, unique and
reduceat do the same joins and group-bys. A pandas DataFrame is made only when asked for
(`to_pandas`, e.g. by `Comparison.rows`).

Text columns are object arrays of str; integer columns that can be missing are float64 with NaN,
named in `nullable_ints` (they become pandas `Int64` and are written as integers). A column is
coded once where it is grouped or joined on (`Table.coded`, a `Coded`): its rows' codes follow it
through `take`, `between` and `concat`, and the helpers below take a `Coded` where they take a
column, so a text column is hashed row by row once per table, not once per group-by.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Coded:
    """A column as its distinct values, sorted (NaN last), and each row's position among them.
    After a `take`, values no row holds may remain among `distinct`."""

    distinct: np.ndarray
    codes: np.ndarray

    @staticmethod
    def of(values: np.ndarray) -> Coded:
        return Coded(*unique_values(values))

    def __len__(self) -> int:
        return len(self.codes)

    @property
    def values(self) -> np.ndarray:
        """The column itself."""
        return self.distinct[self.codes] if len(self.distinct) else np.zeros(len(self.codes), self.distinct.dtype)

    def take(self, rows: np.ndarray | slice) -> Coded:
        return Coded(self.distinct, self.codes[rows])

    def gathered(self, rows: np.ndarray, missing: Any) -> Coded:
        """Its rows at `rows` and `missing` where a row is -1 (as `gather`)."""
        with_missing = Coded.concat([self, Coded.of(np.array([missing], self.distinct.dtype))])
        return with_missing.take(np.where(rows >= 0, rows, len(self)))

    @staticmethod
    def concat(parts: Sequence[Coded]) -> Coded:
        """The rows of every part, in order, over the distinct values of all."""
        distinct, _ = unique_values(np.concatenate([part.distinct for part in parts]))
        return Coded(distinct, np.concatenate([_positions(distinct, part.distinct)[0][part.codes] for part in parts]))


class Table:
    """Columns in order, all of the same length."""

    def __init__(self, columns: dict[str, Any] | None = None, *, length: int | None = None,
                 nullable_ints: Iterable[str] = ()):
        self._columns: dict[str, np.ndarray] = {}
        self._coded: dict[str, Coded] = {}
        self._length = length
        self.nullable_ints = set(nullable_ints)
        for name, values in (columns or {}).items():
            self[name] = values

    def __len__(self) -> int:
        return self._length or 0

    def __contains__(self, name: object) -> bool:
        return name in self._columns

    def __getitem__(self, name: str) -> np.ndarray:
        return self._columns[name]

    def __setitem__(self, name: str, values: Any) -> None:
        """An array of this table's length, a Coded one, or one value for every row."""
        self._coded.pop(name, None)
        if isinstance(values, Coded):
            self[name] = values.values
            self._coded[name] = values
            self._columns[name].flags.writeable = False
            return
        if np.ndim(values) == 0:
            if self._length is None:
                raise ValueError(f"column {name!r}: a single value needs a table of known length")
            values = np.full(self._length, values, dtype=object if isinstance(values, str) else None)
        else:
            values = np.asarray(values)
            if self._length is None:
                self._length = len(values)
            elif len(values) != self._length:
                raise ValueError(f"column {name!r} has {len(values)} rows, the table {self._length}")
        self._columns[name] = values

    @property
    def columns(self) -> list[str]:
        return list(self._columns)

    def coded(self, name: str) -> Coded:
        """Column `name` coded, once per table (the codes follow its rows into tables taken from it);
        the column is read-only from then on: its codes would not follow a change in place."""
        if name not in self._coded:
            self._coded[name] = Coded.of(self[name])
            self[name].flags.writeable = False
        return self._coded[name]

    def isin(self, name: str, *values: Any) -> np.ndarray:
        """Mask of the rows whose column `name` holds one of `values` (from its codes)."""
        return isin(self.coded(name), values)

    def take(self, rows: np.ndarray) -> Table:
        """The rows at these positions, or where this mask is true."""
        rows = np.asarray(rows)
        length = int(rows.sum()) if rows.dtype == bool else len(rows)
        return self._taken(rows, length)

    def between(self, start: int, stop: int) -> Table:
        """Rows start to stop (exclusive), their columns views of this table's."""
        return self._taken(slice(start, stop), stop - start)

    def _taken(self, rows: np.ndarray | slice, length: int) -> Table:
        taken = Table({name: self[name][rows] for name in self.columns}, length=length,
                      nullable_ints=self.nullable_ints)
        taken._coded = {name: coded.take(rows) for name, coded in self._coded.items()}
        return taken

    def taken_when_read(self, rows: np.ndarray) -> Table:
        """`take(rows)`, each column taken when first read (TakenRows): for a table read through a
        few of its columns. This table's columns must not change while it is read."""
        return TakenRows(self, np.asarray(rows))

    def select(self, names: Sequence[str]) -> Table:
        """These columns, in this order."""
        selected = Table({name: self[name] for name in names}, length=len(self),
                         nullable_ints=self.nullable_ints & set(names))
        selected._coded = {name: self._coded[name] for name in names if name in self._coded}
        return selected

    @staticmethod
    def concat(tables: Sequence[Table]) -> Table:
        """Rows of every table, in order; the columns of the first. One table is returned itself,
        not copied: a window's rows are its largest table."""
        first = tables[0]
        if len(tables) == 1:
            return first
        return Table({name: Coded.concat([t.coded(name) for t in tables])
                      if any(name in t._coded for t in tables) else np.concatenate([t[name] for t in tables])
                      for name in first.columns}, length=sum(len(t) for t in tables), nullable_ints=first.nullable_ints)

    def to_pandas(self):
        """A pandas DataFrame of the same columns (pandas is imported here, and only here)."""
        import pandas as pd

        columns = {}
        for name in self.columns:
            values = self[name]
            if name in self.nullable_ints:
                missing = np.isnan(values)
                values = pd.arrays.IntegerArray(np.where(missing, 0, values).astype(np.int64), missing)
            columns[name] = values
        return pd.DataFrame(columns, index=pd.RangeIndex(len(self)), columns=self.columns)

    @classmethod
    def from_pandas(cls, frame) -> Table:
        """The columns of a DataFrame: integers with missing values as float64 NaN, text as str
        ("" where missing)."""
        import pandas as pd  # only reached when a DataFrame exists, so pandas is already imported

        columns, nullable = {}, []
        for name, column in frame.items():
            dtype = column.dtype
            if pd.api.types.is_bool_dtype(dtype) and not column.hasnans:
                values = column.to_numpy(bool)
            elif pd.api.types.is_integer_dtype(dtype):
                if column.hasnans:
                    values = column.to_numpy(np.float64, na_value=np.nan)
                    nullable.append(name)
                else:
                    values = column.to_numpy(np.int64)
            elif pd.api.types.is_numeric_dtype(dtype) and not pd.api.types.is_bool_dtype(dtype):
                values = column.to_numpy(np.float64, na_value=np.nan)
            else:
                values = column.to_numpy(object, na_value="")
            columns[str(name)] = values
        return cls(columns, length=len(frame), nullable_ints=nullable)


class TakenRows(Table):
    """Rows of a table at some positions (`Table.taken_when_read`), each column copied from it
    when first read: the call table reads fewer than half of a window's row columns."""

    def __init__(self, source: Table, rows: np.ndarray) -> None:
        super().__init__(length=int(rows.sum()) if rows.dtype == bool else len(rows),
                         nullable_ints=source.nullable_ints)
        self._source, self._rows = source, rows
        self._set_here: set[str] = set()  # columns set on this table, not its source's

    def __setitem__(self, name: str, values: Any) -> None:
        self._set_here.add(name)
        super().__setitem__(name, values)

    def __contains__(self, name: object) -> bool:
        return name in self._columns or name in self._source

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._columns:
            if name in self._source._coded:
                self._columns[name] = self.coded(name).values
                self._columns[name].flags.writeable = False
            else:
                self._columns[name] = self._source[name][self._rows]
        return self._columns[name]

    def coded(self, name: str) -> Coded:
        if name not in self._coded and name not in self._set_here:  # the source's codes, taken
            self._coded[name] = self._source.coded(name).take(self._rows)
        return super().coded(name)

    @property
    def columns(self) -> list[str]:
        return [*self._source.columns, *(name for name in self._columns if name not in self._source)]


def mapped(values: np.ndarray | Coded, function: Callable[[Any], Any], dtype: Any = object) -> np.ndarray:
    """function(value) of each value, called once per distinct value: text columns repeat a few
    values over many rows."""
    if isinstance(values, Coded):
        return mapped(values.distinct, function, dtype)[values.codes] if len(values.distinct) else \
            np.zeros(len(values), dtype)
    items = np.atleast_1d(values).tolist()
    of = {value: function(value) for value in dict.fromkeys(items)}
    if dtype is object:
        return np.array(list(map(of.__getitem__, items)), dtype=object)
    return np.fromiter(map(of.__getitem__, items), dtype, len(items))


def recoded(function: Callable[..., Any], *columns: np.ndarray | Coded) -> Coded:
    """function(*values) of each row's values in `columns`, coded: called once per distinct tuple of
    them (of one coded column, once per its distinct value)."""
    if len(columns) == 1 and isinstance(columns[0], Coded):
        return Coded.of(mapped(columns[0].distinct, function)).take(columns[0].codes)
    tuple_codes, count = key_codes(*columns)
    row = row_of_each(tuple_codes, count)
    values = [(column.take(row).values if isinstance(column, Coded) else np.asarray(column)[row]).tolist()
              for column in columns]
    return Coded.of(np.array([function(*each) for each in zip(*values)], object)).take(tuple_codes)


def isin(values: np.ndarray | Coded, choices: Iterable[Any]) -> np.ndarray:
    """Mask of the values equal to one of `choices` (a few), for text columns too."""
    if isinstance(values, Coded):
        return isin(values.distinct, choices)[values.codes] if len(values.distinct) else np.zeros(len(values), bool)
    mask = np.zeros(len(values), bool)
    for choice in choices:
        mask |= values == choice
    return mask


_MAX_CODES = 2**62


def key_codes(*keys: np.ndarray | Coded) -> tuple[np.ndarray, int]:
    """One code per row for its tuple of keys, equal codes for equal tuples, numbered in the
    tuples' sorted order (NaN last, NaNs equal to each other); and the number of codes."""
    codes, count = np.zeros(len(keys[0]) if keys else 0, np.int64), 1
    for key in keys:
        distinct, inverse = unique_values(key)
        if count * max(len(distinct), 1) >= _MAX_CODES:  # renumbered densely only before it could overflow
            codes, count = _compress(codes)
        codes, count = codes * len(distinct) + inverse, count * max(len(distinct), 1)
    return _compress(codes)


def row_of_each(codes: np.ndarray, count: int) -> np.ndarray:
    """For each of `count` codes, a row that holds it (key_codes' codes: every code is held)."""
    rows = np.zeros(count, np.int64)
    rows[codes] = np.arange(len(codes))
    return rows


def unique_values(values: np.ndarray | Coded) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(values, return_inverse=True): the distinct values sorted, and each value's position
    (of a Coded column, its own, which may hold values no row has)."""
    if isinstance(values, Coded):
        return values.distinct, values.codes
    if values.dtype != object:
        distinct, inverse = np.unique(values, return_inverse=True)
        return distinct, inverse.reshape(-1)
    items = values.tolist()  # text: hashing every value and sorting the few distinct is much faster
    distinct = sorted(dict.fromkeys(items))
    index = {value: code for code, value in enumerate(distinct)}
    return np.array(distinct, object), np.fromiter(map(index.__getitem__, items), np.int64, len(items))


def _compress(codes: np.ndarray) -> tuple[np.ndarray, int]:
    """Codes renumbered 0, 1, ... in the same order, and how many."""
    unique, inverse = np.unique(codes, return_inverse=True)
    return inverse.reshape(-1), len(unique)


class Groups:
    """Rows grouped by equal keys; groups numbered in the order of their first row."""

    def __init__(self, *keys: np.ndarray | Coded):
        codes, count = key_codes(*keys)
        _, first = np.unique(codes, return_index=True)  # the first row of each code
        group_of_code = np.empty(count, np.int64)
        group_of_code[np.argsort(first, kind="stable")] = np.arange(count)
        self.codes = group_of_code[codes]  # group of each row
        self.first = np.sort(first)  # first row of each group
        self.order = np.argsort(self.codes, kind="stable")  # rows, group after group
        self.starts = np.searchsorted(self.codes[self.order], np.arange(count))

    def __len__(self) -> int:
        return len(self.first)

    def max(self, values: np.ndarray) -> np.ndarray:
        """Largest value of each group, NaN ignored (NaN where all are NaN)."""
        if not len(self):
            return values[:0]
        ufunc = np.fmax if values.dtype.kind == "f" else np.maximum
        return ufunc.reduceat(values[self.order], self.starts)

    def min(self, values: np.ndarray) -> np.ndarray:
        """Smallest value of each group, NaN ignored (NaN where all are NaN)."""
        if not len(self):
            return values[:0]
        ufunc = np.fmin if values.dtype.kind == "f" else np.minimum
        return ufunc.reduceat(values[self.order], self.starts)

    def median(self, values: np.ndarray) -> np.ndarray:
        """Median of each group's values, NaN ignored (NaN where all are NaN)."""
        if not len(self):
            return np.zeros(0)
        parts = np.split(values[self.order].astype(np.float64), self.starts[1:])
        with np.errstate(all="ignore"):
            return np.array([np.nan if np.isnan(p).all() else np.nanmedian(p) for p in parts])

    def count(self) -> np.ndarray:
        """Rows in each group."""
        return np.diff(np.append(self.starts, len(self.order)))

    def any(self, values: np.ndarray) -> np.ndarray:
        if not len(self):
            return np.zeros(0, bool)
        return np.logical_or.reduceat(values[self.order], self.starts)

    def max_text(self, values: np.ndarray | Coded) -> np.ndarray:
        """Greatest string of each group (in Python's order)."""
        distinct, codes = unique_values(values)
        return distinct[self.max(codes)] if len(self) else distinct[:0]


def gather(values: np.ndarray, rows: np.ndarray, missing: Any) -> np.ndarray:
    """values[rows], and `missing` where a row is -1 (as `lookup` gives)."""
    present = rows >= 0
    taken = values[np.where(present, rows, 0)] if len(values) else np.zeros(len(rows), values.dtype)
    return np.where(present, taken, missing)


def lookup(keys: Sequence[np.ndarray | Coded], table_keys: Sequence[np.ndarray | Coded]) -> np.ndarray:
    """For each row of `keys`, the position of the row of `table_keys` with the same values
    (the first, when several have them), -1 where none has."""
    return KeyIndex(table_keys).rows(keys)


class KeyIndex:
    """The rows of a table's keys, sorted once for many lookups (`rows`, as `lookup`): per key, its
    distinct values and the distinct codes of the keys up to it; a row's code at each key is its
    position among them (NaNs equal to each other)."""

    def __init__(self, table_keys: Sequence[np.ndarray | Coded]):
        self._stages: list[tuple[np.ndarray, np.ndarray]] = []
        codes = np.zeros(len(table_keys[0]), np.int64)
        for key in table_keys:
            distinct, inverse = unique_values(key)
            combined, codes = np.unique(codes * len(distinct) + inverse, return_inverse=True)
            self._stages.append((distinct, combined))
        self._first = np.unique(codes.reshape(-1), return_index=True)[1]  # each code's first row

    def rows(self, keys: Sequence[np.ndarray | Coded]) -> np.ndarray:
        """For each row of `keys`, the first table row with the same values, -1 where none has."""
        codes, found = np.zeros(len(keys[0]), np.int64), np.ones(len(keys[0]), bool)
        for key, (distinct, combined) in zip(keys, self._stages):
            value_codes, present = _positions(distinct, key)
            codes, known = _positions(combined, codes * len(distinct) + value_codes)
            found &= present & known
        return np.where(found, self._first[np.where(found, codes, 0)] if len(self._first) else -1, -1)


def _positions(sorted_distinct: np.ndarray, values: np.ndarray | Coded) -> tuple[np.ndarray, np.ndarray]:
    """Each value's position among `sorted_distinct` (0 where absent), and whether it is there."""
    if isinstance(values, Coded):
        at, present = _positions(sorted_distinct, values.distinct)
        return at[values.codes], present[values.codes]
    values = np.asarray(values)
    if not len(sorted_distinct):
        return np.zeros(len(values), np.int64), np.zeros(len(values), bool)
    if sorted_distinct.dtype == object or values.dtype == object:
        index = {value: code for code, value in enumerate(sorted_distinct.tolist())}
        found = np.fromiter(map(index.get, values.tolist(), repeat(-1)), np.int64, len(values))
        return np.maximum(found, 0), found >= 0
    at = np.minimum(np.searchsorted(sorted_distinct, values), len(sorted_distinct) - 1)
    there = sorted_distinct[at]
    present = there == values
    if there.dtype.kind == "f" and values.dtype.kind == "f":
        present |= np.isnan(there) & np.isnan(values)
    return at, present


def outer_join(keys_a: Sequence[np.ndarray | Coded], keys_b: Sequence[np.ndarray | Coded]
               ) -> tuple[np.ndarray, np.ndarray]:
    """Rows (ia, ib) of a full outer join on equal keys, -1 on the side without a partner; in the
    keys' sorted order, rows of equal keys in their order in a, then b (as pandas merges)."""
    n = len(keys_a[0])
    codes, count = key_codes(*(concatenated(a, b) for a, b in zip(keys_a, keys_b)))
    codes_a, codes_b = codes[:n], codes[n:]
    count_a, count_b = np.bincount(codes_a, minlength=count), np.bincount(codes_b, minlength=count)
    both = (count_a > 0) & (count_b > 0)
    size = np.where(both, count_a * count_b, count_a + count_b)  # rows per key: a × b, or one side's
    key = np.repeat(np.arange(count), size)
    k = np.arange(len(key)) - np.repeat(np.cumsum(size) - size, size)  # row within its key
    width_b = np.maximum(count_b, 1)[key]
    ia = _rows_of(codes_a, count_a, key, np.where(both[key], k // width_b, k))
    ib = _rows_of(codes_b, count_b, key, np.where(both[key], k % width_b, k))
    return ia, ib


def concatenated(a: np.ndarray | Coded, b: np.ndarray | Coded) -> np.ndarray | Coded:
    """The rows of a, then b: coded where both are."""
    if isinstance(a, Coded) and isinstance(b, Coded):
        return Coded.concat([a, b])
    return np.concatenate([a.values if isinstance(a, Coded) else a, b.values if isinstance(b, Coded) else b])


def _rows_of(codes: np.ndarray, counts: np.ndarray, key: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Row k (in row order) among the rows of code `key`, -1 where that code has no row."""
    order = np.argsort(codes, kind="stable")
    starts = np.cumsum(counts) - counts
    present = counts[key] > 0
    rows = np.full(len(key), -1, np.int64)
    rows[present] = order[starts[key[present]] + k[present]]
    return rows
