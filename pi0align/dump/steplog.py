"""What one dumped step captured: the `calls` table, columnar, and the backend's records of the
tensors (statistics, samples, stored copies) they point to."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import numpy as np

from pi0align.dump.file_format import StepTables
from pi0align.dump.sample_rows import SampleRows

# Columns kept as a step runs; the rest of the format's (file_format.py) are derived at its end.
CAPTURED_CALL_COLUMNS = ("seq", "name", "module", "api", "direction", "stack_id", "args")
CAPTURED_RECORD_COLUMNS = ("call_id", "role", "arg_index", "dtype", "shape", "numel", "tensor", "skipped")
_ROLE_ORDER = {"input": 0, "output": 1, "grad_output": 2, "grad_input": 3, "parameter": 4, "parameter_grad": 5}


class Filter:
    """include / exclude fnmatch patterns over record names (`module/API#k`)."""

    def __init__(self, include: list[str] | None, exclude: list[str] | None) -> None:
        self.include = list(include or [])
        self.exclude = list(exclude or [])

    @property
    def selects_all(self) -> bool:
        """No patterns: every name is selected (the usual case)."""
        return not self.include and not self.exclude

    def __call__(self, name: str) -> bool:
        if self.selects_all:
            return True
        if self.include and not any(fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatchcase(name, p) for p in self.exclude)


@dataclass
class StepLog:
    """Accumulates one step: its calls here, its tensors in `records` (the backend's StepRecords)."""

    step: int
    records: object  # backend.StepRecords
    sampler: object | None  # sampling.Sampler in sample mode
    # CAPTURED_CALL_COLUMNS, one list each: a tuple per call would be one more object for the
    # garbage collector to track, and promote, per call
    calls: dict[str, list] = field(default_factory=lambda: {column: [] for column in CAPTURED_CALL_COLUMNS})

    def __post_init__(self) -> None:
        self._columns = tuple(self.calls.values())  # in CAPTURED_CALL_COLUMNS' order
        if self.records.calls_table is not None:  # the backend's, for this table: no Python frame per call
            open_call, open_backward = self.records.calls_table
            self.open_call = functools.partial(open_call, self._columns)
            self.open_backward = functools.partial(open_backward, self._columns)

    def close(self) -> None:
        """The step has ended: gradients arriving later (a graph kept past it) are not recorded."""
        self.records.close()

    @property
    def call_count(self) -> int:
        return len(self.calls["seq"])

    def open_call(self, name: str, module: str, api: str, direction: str, stack_id: int, args: str) -> int:
        seqs, names, modules, apis, directions, stack_ids, arguments = self._columns
        call_id = len(seqs)
        seqs.append(call_id)
        names.append(name)
        modules.append(module)
        apis.append(api)
        directions.append(direction)
        stack_ids.append(stack_id)
        arguments.append(args)
        return call_id

    def set_arguments(self, call_id: int, args: str) -> None:
        """Replace a call's recorded arguments (known only once it has run: the optimizer's states)."""
        self.calls["args"][call_id] = args

    def open_backward(self, forward_id: int) -> int:
        """Open the backward row of a forward call (when its first gradient arrives)."""
        _, names, modules, apis, _, stack_ids, arguments = self._columns
        return self.open_call(names[forward_id], modules[forward_id], apis[forward_id], "backward",
                              stack_ids[forward_id], arguments[forward_id])

    def add_tensors(self, call_id: int, name: str, role: str, tensors: list) -> None:
        self.records.record(call_id, name, role, 0, tensors)

    def add_tensor(self, call_id: int, name: str, role: str, arg_index: int, tensor) -> int:
        """Record one tensor; returns its row."""
        return self.records.record(call_id, name, role, arg_index, [tensor])

    def drop(self, row: int) -> None:
        """Forget a record (a parameter gradient superseded by a later accumulation)."""
        self.records.set_call(row, -1)

    def grad_sink(self, forward_id: int, name: str):
        """Where the gradients of one forward call go; its backward row opens when the first arrives."""
        return self.records.grad_sink(name, forward_id, self.open_backward)

    def finish(self) -> tuple[StepTables, SampleRows | None]:
        """Read the statistics back (one copy per device) and build the tables; in sample mode,
        also the samples, for the writer process to put in the records' order."""
        calls = {column: object_column(values) for column, values in self.calls.items()}
        calls["call_id"] = np.arange(self.call_count, dtype=np.int32)
        columns = self.records.columns()
        kept = columns["call_id"] >= 0
        columns = {c: v[kept] for c, v in columns.items()}
        roles = np.array([_ROLE_ORDER[r] for r in columns["role"]], dtype=np.int64)
        order = np.lexsort((columns["arg_index"], roles, columns["call_id"]))
        records = {c: columns[c][order] for c in CAPTURED_RECORD_COLUMNS}
        floats, ints = self.records.statistics()
        slots = columns["slot"][order]
        has = slots >= 0
        for j, column in enumerate(("min", "max", "mean", "norm")):
            records[column] = np.where(has, floats[slots, j] if len(floats) else np.nan, np.nan)
        for j, column in enumerate(("nan_count", "inf_count", "checksum")):
            records[column] = np.where(has, ints[slots, j] if len(ints) else 0, 0)
        samples = None
        records["sample_count"] = np.zeros(len(order), dtype=np.int32)
        if self.sampler is not None:
            samples = self.sampler.collect(columns["sample_row"][order])
            records["sample_count"] = samples.counts
        return StepTables(self.step, calls, records, None), samples


@functools.cache
def dtype_name(dtype) -> str:
    """A torch dtype as the records name it: `float32`, `bfloat16`, …"""
    return str(dtype).removeprefix("torch.")


def object_column(column) -> np.ndarray:
    """A column as an array: str columns as object arrays (what the writer stores; a numpy
    unicode array would cost a conversion each way; `fromiter`, which does not look into each str
    for a sequence as `np.array` does, takes a quarter less)."""
    if len(column) and isinstance(column[0], str):
        return np.fromiter(column, dtype=object, count=len(column))
    return np.array(column)
