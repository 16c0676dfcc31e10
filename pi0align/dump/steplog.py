"""What one dumped step captured: the `calls` and `records` tables, columnar, plus the on-device
statistics, samples and tensor copies that the records point to."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import numpy as np
import torch

from pi0align.dump.sampling import Sampler
from pi0align.dump.stats import ChecksumWeights, StatsBatch, StatsWorker, skip_reason

CALL_COLUMNS = ("seq", "name", "module", "api", "direction", "stack_id", "args")
_ROLE_ORDER = {"input": 0, "output": 1, "grad_output": 2, "grad_input": 3, "parameter": 4, "parameter_grad": 5}
RECORD_COLUMNS = ("call_id", "role", "arg_index", "dtype", "shape", "numel", "tensor", "skipped")


@dataclass
class StepTables:
    """A finished step, host-side, in the column names of docs/dump-format.md."""

    step: int
    calls: dict[str, np.ndarray]
    records: dict[str, np.ndarray]
    samples: tuple[np.ndarray, np.ndarray] | None  # (values, positions) in sample mode


@dataclass
class _Seen:
    """Statistics already queued for these elements (the same tensor, or a view of it)."""

    tensor: weakref.ref  # while it lives, its memory cannot hold other data
    slot: int
    shape: tuple
    tensor_path: str


def _elements_key(tensor: torch.Tensor) -> tuple:
    """Equal keys, while the first tensor lives, mean the same elements in the same row-major
    order: hence equal statistics and checksum. Views of contiguous memory share a key."""
    if tensor.is_contiguous():
        return tensor.data_ptr(), tensor.dtype, tensor.numel(), tensor._version
    return tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor._version


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=65536)  # a model has a few hundred distinct shapes: formatted once each
def _shape_json(shape: tuple) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"  # json.dumps(list(shape)), faster


class Filter:
    """include / exclude fnmatch patterns over record names (`module/API#k`)."""

    def __init__(self, include: list[str] | None, exclude: list[str] | None) -> None:
        self.include = list(include or [])
        self.exclude = list(exclude or [])

    def __call__(self, name: str) -> bool:
        if self.include and not any(fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatchcase(name, p) for p in self.exclude)


@dataclass
class StepLog:
    """Accumulates one step. `tensor_sink(tensor) -> path` stores full tensors (tensor mode)."""

    step: int
    weights: ChecksumWeights
    sampler: Sampler | None
    tensor_sink: object | None  # callable(torch.Tensor) -> str, or None
    worker: StatsWorker | None = None
    queued: bool = False  # CPU statistics on the fused kernel's thread
    calls: list[tuple] = field(default_factory=list)
    records: list[list] = field(default_factory=list)  # RECORD_COLUMNS + [slot, sample row]
    seen: dict[tuple, _Seen] = field(default_factory=dict)  # _elements_key -> what to reuse
    stats: StatsBatch = None

    def __post_init__(self) -> None:
        self.stats = StatsBatch(self.weights, self.worker, self.queued)

    def open_call(self, name: str, module: str, api: str, direction: str, stack_id: int, args: str) -> int:
        self.calls.append((len(self.calls), name, module, api, direction, stack_id, args))
        return len(self.calls) - 1

    def add_tensors(self, call_id: int, name: str, role: str, tensors: list[torch.Tensor]) -> None:
        for arg_index, tensor in enumerate(tensors):
            self.add_tensor(call_id, name, role, arg_index, tensor)

    def add_tensor(self, call_id: int, name: str, role: str, arg_index: int, tensor: torch.Tensor) -> list:
        """Record one tensor. A tensor already recorded in the step, unchanged (the output of one
        call read by the next, a parameter read by many), borrows its statistics and stored copy."""
        skipped = skip_reason(tensor)
        shape = tuple(tensor.shape)
        slot, sample_row, path = -1, -1, ""
        if not skipped:
            key = _elements_key(tensor)
            known = self.seen.get(key)
            if known is not None and known.tensor() is not None:
                slot = known.slot
                if known.shape == shape or self.tensor_sink is None:
                    path = known.tensor_path
                else:
                    path = self.tensor_sink(tensor)
            else:
                slot = self.stats.add(tensor)
                path = self.tensor_sink(tensor) if self.tensor_sink is not None else ""
                self.seen[key] = _Seen(weakref.ref(tensor), slot, shape, path)
            if self.sampler is not None:
                sample_row = self.sampler.add(tensor, name, role, arg_index)
        row = [call_id, role, arg_index, _dtype_name(tensor.dtype), _shape_json(shape), tensor.numel(), path, skipped,
               slot, sample_row]
        self.records.append(row)
        return row  # its call_id may be set later (parameters get their call row at the step's end)

    def drop(self, row: list) -> None:
        """Forget a record (a parameter gradient superseded by a later accumulation)."""
        row[0] = -1

    def finish(self) -> StepTables:
        """Read the statistics back (one copy per device) and build the tables."""
        calls = dict(zip(CALL_COLUMNS, map(_array, _columns(self.calls, len(CALL_COLUMNS)))))
        calls["call_id"] = np.arange(len(self.calls), dtype=np.int32)
        columns = _columns([row for row in self.records if row[0] >= 0], len(RECORD_COLUMNS) + 2)
        call_ids, roles, arg_indices = (np.array(c, dtype=np.int64) for c in
                                        (columns[0], [_ROLE_ORDER[r] for r in columns[1]], columns[2]))
        order = np.lexsort((arg_indices, roles, call_ids))
        records = {c: _array(columns[i])[order] for i, c in enumerate(RECORD_COLUMNS)}
        floats, ints = self.stats.collect()
        slots = np.array(columns[8], dtype=np.int64)[order]
        has = slots >= 0
        for j, column in enumerate(("min", "max", "mean", "norm")):
            records[column] = np.where(has, floats[slots, j] if len(floats) else np.nan, np.nan)
        for j, column in enumerate(("nan_count", "inf_count", "checksum")):
            records[column] = np.where(has, ints[slots, j] if len(ints) else 0, 0)
        samples = None
        records["sample_count"] = np.zeros(len(order), dtype=np.int32)
        if self.sampler is not None:
            values, positions, counts = self.sampler.collect(np.array(columns[9], dtype=np.int64)[order])
            samples, records["sample_count"] = (values, positions), counts
        return StepTables(self.step, calls, records, samples)


def _array(column: tuple) -> np.ndarray:
    """A column as an array: str columns as object arrays (what the writer stores; a numpy
    unicode array would cost a conversion each way)."""
    return np.array(column, dtype=object) if column and isinstance(column[0], str) else np.array(column)


def _columns(rows: list, width: int) -> list[tuple]:
    """The columns of equally long rows (`width` empty ones when there are no rows)."""
    return list(zip(*rows)) if rows else [()] * width
