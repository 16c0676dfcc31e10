"""A dumped step as the training process captured it, and the tables the dump file takes of it
(`file_format.StepTables`), made in the writer process: sorting the records and making the
columns' arrays took PI0 small's training thread 1.3 ms a step. Imports neither torch nor the rest
of pi0align beyond the dump's file modules (the writer process reads it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from pi0align.dump.backends.sample_rows import SampleRows
from pi0align.dump.file_format import StepTables

# Columns kept as a step runs; the rest of the format's (file_format.py) are derived in `tables()`.
CAPTURED_CALL_COLUMNS = ("seq", "name", "module", "api", "direction", "stack_id", "args")
CAPTURED_RECORD_COLUMNS = ("call_id", "role", "arg_index", "dtype", "shape", "numel", "tensor", "skipped")
_ROLE_ORDER = {"input": 0, "output": 1, "grad_output": 2, "grad_input": 3, "parameter": 4, "parameter_grad": 5}


@dataclass
class CodedColumn:
    """A str column as the index of each row's value in a list of its distinct values: a step's
    records share a few roles, dtypes and shapes, each a str to pickle when listed per row."""

    codes: np.ndarray  # int32, one per row
    values: list[str]

    def array(self) -> np.ndarray:
        return np.fromiter(self.values, dtype=object, count=len(self.values))[self.codes]


@dataclass
class CapturedStep:
    step: int
    calls: dict[str, list]  # CAPTURED_CALL_COLUMNS, one list each
    # CAPTURED_RECORD_COLUMNS, `slot` (of the statistics, -1: none) and `sample_row`, as the
    # backend took them (StepRecords.columns): dropped records (call -1) included
    records: dict[str, np.ndarray | list | tuple | CodedColumn]
    floats: np.ndarray  # per slot: min, max, mean, norm
    ints: np.ndarray  # per slot: NaN count, Inf count, checksum
    samples: SampleRows | None  # sample mode: per record as taken

    def tables(self) -> tuple[StepTables, SampleRows | None]:
        """The step's tables, records in the file's order (by call, role, argument), and its
        samples in that order, for `PositionTable.ordered`."""
        calls = {column: object_column(values) for column, values in self.calls.items()}
        calls["call_id"] = np.arange(len(self.calls["seq"]), dtype=np.int32)
        columns = {column: object_column(values) for column, values in self.records.items()}
        taken = np.flatnonzero(columns["call_id"] >= 0)
        roles = np.array([_ROLE_ORDER[role] for role in columns["role"][taken]], dtype=np.int64)
        taken = taken[np.lexsort((columns["arg_index"][taken], roles, columns["call_id"][taken]))]
        records = {column: columns[column][taken] for column in CAPTURED_RECORD_COLUMNS}
        slots = columns["slot"][taken]
        has = slots >= 0
        for j, column in enumerate(("min", "max", "mean", "norm")):
            records[column] = np.where(has, self.floats[slots, j] if len(self.floats) else np.nan, np.nan)
        for j, column in enumerate(("nan_count", "inf_count", "checksum")):
            records[column] = np.where(has, self.ints[slots, j] if len(self.ints) else 0, 0)
        samples = None
        records["sample_count"] = np.zeros(len(taken), dtype=np.int32)
        if self.samples is not None:
            samples = dataclasses.replace(self.samples, rows=self.samples.rows[taken],
                                          counts=self.samples.counts[taken])
            records["sample_count"] = samples.counts
        return StepTables(self.step, calls, records, None), samples


def object_column(column) -> np.ndarray:
    """A column as an array (an array stays as it is): str columns as object arrays (what the
    writer stores; a numpy unicode array would cost a conversion each way; `fromiter`, which does
    not look into each str for a sequence as `np.array` does, takes a quarter less)."""
    if isinstance(column, np.ndarray):
        return column
    if isinstance(column, CodedColumn):
        return column.array()
    if len(column) and isinstance(column[0], str):
        return np.fromiter(column, dtype=object, count=len(column))
    return np.array(column)
