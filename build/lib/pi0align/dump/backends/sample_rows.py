"""Sample mode's values on their way to the dump file: the training thread hands them over as the
sampler holds them (its host table's rows in the order the records were taken, and only the rows of
its positions table that are new since the last hand-over), and the writer process puts them in the
records' order (`PositionTable.ordered`), the file's `samples/values` and `samples/positions`
(docs/dump-format.md). The reordering and the positions, repeated at every step, are so done off
the training thread. Imports neither torch nor the rest of pi0align (the writer process reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SampleRows:
    """One step's samples as the sampler holds them."""

    values: np.ndarray  # [host rows, size] float64; each row valid up to its record's count
    rows: np.ndarray  # per record, in the step's order: its row of `values`, of counts 0 where it has no sample
    counts: np.ndarray  # per record: how many elements were sampled, int32
    position_rows: np.ndarray  # per row of `values`: its row of the positions table (row 0: none)
    new_positions: np.ndarray  # the positions table's rows from `first_new` on, -1-padded
    first_new: int
    wide: bool  # some record of the step has positions of 2^31 or more (stored as int64)


class PositionTable:
    """The sampler's positions table as handed over so far, one step's new rows after the other."""

    def __init__(self) -> None:
        self._table: np.ndarray | None = None
        self._rows = 0

    def ordered(self, samples: SampleRows) -> tuple[np.ndarray, np.ndarray]:
        """(values, positions) in the records' order: values NaN and positions -1 past each
        record's count; positions int64 only in a step that needs it."""
        self._extend(samples.first_new, samples.new_positions)
        values = samples.values[samples.rows]
        values[np.arange(values.shape[1]) >= samples.counts[:, None]] = np.nan  # a row's values of an earlier step
        positions = self._table[samples.position_rows[samples.rows]]
        if positions.dtype == np.int64 and not samples.wide:
            positions = positions.astype(np.int32)
        return values, positions

    def _extend(self, first: int, rows: np.ndarray) -> None:
        if first != self._rows:
            raise ValueError(f"sample positions handed over out of order: rows from {first}, {self._rows} held")
        if not len(rows):
            return
        needed = self._rows + len(rows)
        if self._table is None:
            self._table = np.empty((0, rows.shape[1]), dtype=rows.dtype)
        dtype = np.promote_types(self._table.dtype, rows.dtype)
        if needed > len(self._table) or dtype != self._table.dtype:
            table = np.empty((max(needed, 2 * len(self._table)), rows.shape[1]), dtype=dtype)
            table[: self._rows] = self._table[: self._rows]
            self._table = table
        self._table[self._rows : needed] = rows
        self._rows = needed
