"""What one dumped step captured: the `calls` table, columnar, and the backend's records of the
tensors (statistics, samples, stored copies) they point to."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from pi0align.dump.writing.captured_step import CAPTURED_CALL_COLUMNS, CapturedStep


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

    def finish(self) -> CapturedStep:
        """What the step captured, its statistics read back (one copy per device) and, in sample
        mode, its samples: for the writer process to make the step's tables of."""
        columns = self.records.columns()
        floats, ints = self.records.statistics()
        samples = self.sampler.collect(columns["sample_row"]) if self.sampler is not None else None
        return CapturedStep(self.step, self.calls, columns, floats, ints, samples)


@functools.cache
def dtype_name(dtype) -> str:
    """A torch dtype as the records name it: `float32`, `bfloat16`, …"""
    return str(dtype).removeprefix("torch.")

