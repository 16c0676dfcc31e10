"""RowStore: a comparison's rows, written a part at a time and read back a part at a time.

A compare of many steps judges a window of steps at a time (engine.py); the rows each window
leaves are kept here: in memory where there is one window (a compare of a few steps never touches
the disk), else each part in a temporary HDF5 file as it comes (unnamed, in the folder TMPDIR
names, gone when the store is), so memory holds one window's rows whatever the number of steps.
Text columns are written as codes into their distinct values: rows repeat their names, APIs and
shapes at every step.
"""

from __future__ import annotations

import tempfile
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from pi0align.compare.table import Table, unique_values
from pi0align.errors import UserError

if TYPE_CHECKING:
    import h5py


class RowStore:
    """Parts of one table (the same columns), each under an order key; read in key order."""

    def __init__(self, on_disk: bool) -> None:
        self.on_disk = on_disk
        self._parts: list[tuple[tuple, Table | str]] = []  # (order key, the part or its group's name)
        self._h5: h5py.File | None = None
        self.columns: list[str] = []
        self.nullable_ints: set[str] = set()

    def append(self, rows: Table, key: tuple) -> None:
        """Add `rows` as the part read at `key`'s place among the others."""
        if not self._parts:
            self.columns, self.nullable_ints = rows.columns, set(rows.nullable_ints)
        self._parts.append((key, self._written(rows) if self.on_disk else rows))

    def parts(self, columns: list[str] | None = None) -> Iterator[Table]:
        """Each part in key order, with these columns (all when None)."""
        wanted = self.columns if columns is None else columns
        for _, part in sorted(self._parts, key=lambda entry: entry[0]):
            if isinstance(part, Table):
                yield part.select(wanted)
                continue
            group = self._h5[part]
            yield Table({column: _read(group, column) for column in wanted}, length=int(group.attrs["length"]),
                        nullable_ints=self.nullable_ints & set(wanted))

    def table(self, columns: list[str] | None = None) -> Table:
        """Every part, in key order, as one table."""
        parts = list(self.parts(columns))
        if not parts:
            return Table({column: np.zeros(0) for column in columns or self.columns}, length=0,
                         nullable_ints=self.nullable_ints)
        return Table.concat(parts)

    def _written(self, part: Table) -> str:
        """The part written to disk: its group's name."""
        import h5py  # here: a compare that keeps its rows in memory (most) never needs h5py

        try:
            if self._h5 is None:
                file = tempfile.TemporaryFile(prefix="pi0align-rows-")
                self._h5 = h5py.File(file, "w")
                weakref.finalize(self, _close, self._h5, file)  # at the latest when the store goes
            name = str(len(self._h5))
            group = self._h5.create_group(name)
            group.attrs["length"] = len(part)
            for column in self.columns:
                values = part[column]
                if values.dtype == object:
                    distinct, codes = unique_values(values)
                    group.create_dataset(f"{column}.text", data=np.array(distinct, dtype=h5py.string_dtype()))
                    values = codes.astype(np.int32)
                group.create_dataset(column, data=values)
            self._h5.flush()
        except OSError as error:
            raise UserError(f"cannot write the comparison's rows to {tempfile.gettempdir()} ({error}): make room "
                            "there, or set TMPDIR to a folder with room") from None
        return name


def _read(group: h5py.Group, column: str) -> np.ndarray:
    values = group[column][()]
    if f"{column}.text" not in group:
        return values
    distinct = group[f"{column}.text"].asstr()[()].astype(object)
    return distinct[values] if len(distinct) else np.full(len(values), "", object)


def _close(h5: h5py.File, file) -> None:
    h5.close()
    file.close()
