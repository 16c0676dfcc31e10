"""What one dumped step captured: the `calls` and `records` tables, columnar, plus the on-device
statistics, samples and tensor copies that the records point to."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import numpy as np
import torch

from pi0align.dump.file_format import StepTables
from pi0align.dump.sampling import Sampler
from pi0align.dump.stats import ChecksumWeights, StatsBatch, StatsWorker, skip_reason

CALL_COLUMNS = ("seq", "name", "module", "api", "direction", "stack_id", "args")
_ROLE_ORDER = {"input": 0, "output": 1, "grad_output": 2, "grad_input": 3, "parameter": 4, "parameter_grad": 5}
RECORD_COLUMNS = ("call_id", "role", "arg_index", "dtype", "shape", "numel", "tensor", "skipped")


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
        if not self.include and not self.exclude:
            return True  # the usual case, asked once per call
        if self.include and not any(fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatchcase(name, p) for p in self.exclude)


@dataclass
class StepLog:
    """Accumulates one step. `tensor_sink(tensor) -> path` stores full tensors (tensor mode).

    Records are kept by the extension's recorder (observer.py) where it is built, else here in
    Python; both keep the same columns, and `finish` builds the tables from either."""

    step: int
    weights: ChecksumWeights
    sampler: Sampler | None
    tensor_sink: object | None  # callable(torch.Tensor) -> str, or None
    worker: StatsWorker | None = None
    queued: bool = False  # CPU statistics on the fused kernel's thread
    native: object = None  # the extension (observer.py) whose recorder keeps the records, or None
    # CALL_COLUMNS, one list each: a tuple per call would be one more object for the garbage
    # collector to track, and promote, per call
    calls: dict[str, list] = field(default_factory=lambda: {column: [] for column in CALL_COLUMNS})
    records: list[list] = field(default_factory=list)  # Python path: RECORD_COLUMNS + [slot, sample row]
    seen: dict[tuple, _Seen] = field(default_factory=dict)  # Python path: _elements_key -> what to reuse
    stats: StatsBatch = None
    closed: bool = False

    def __post_init__(self) -> None:
        self.stats = StatsBatch(self.weights, self.worker, self.queued)
        self._recorder = None
        if self.native is not None:
            _describe_records(self.native)
            self._recorder = self.native.recorder(self.queued, self.stats.compute, self.tensor_sink,
                                                  self.sampler.add if self.sampler is not None else None)

    @property
    def recorder(self):
        """The extension's recorder of this step, None on the Python path."""
        return self._recorder

    def close(self) -> None:
        """The step has ended: gradients arriving later (a graph kept past it) are not recorded."""
        self.closed = True
        if self._recorder is not None:
            self.native.close(self._recorder)

    @property
    def call_count(self) -> int:
        return len(self.calls["seq"])

    def open_call(self, name: str, module: str, api: str, direction: str, stack_id: int, args: str) -> int:
        seqs, names, modules, apis, directions, stack_ids, arguments = self.calls.values()  # CALL_COLUMNS' order
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
        calls = self.calls
        return self.open_call(calls["name"][forward_id], calls["module"][forward_id], calls["api"][forward_id],
                              "backward", calls["stack_id"][forward_id], calls["args"][forward_id])

    def add_tensors(self, call_id: int, name: str, role: str, tensors: list[torch.Tensor]) -> None:
        if self._recorder is not None:
            self.native.record(self._recorder, call_id, name, role, 0, tensors)
            return
        for arg_index, tensor in enumerate(tensors):
            self.add_tensor(call_id, name, role, arg_index, tensor)

    def add_tensor(self, call_id: int, name: str, role: str, arg_index: int, tensor: torch.Tensor) -> int:
        """Record one tensor; returns its row. A tensor already recorded in the step, unchanged (the
        output of one call read by the next, a parameter read by many), borrows its statistics and
        stored copy."""
        if self._recorder is not None:
            return self.native.record(self._recorder, call_id, name, role, arg_index, [tensor])
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
        self.records.append([call_id, role, arg_index, _dtype_name(tensor.dtype), _shape_json(shape), tensor.numel(),
                             path, skipped, slot, sample_row])
        return len(self.records) - 1

    def set_call(self, row: int, call_id: int) -> None:
        """Give a record its call (parameters get their call row at the step's end); -1 drops it."""
        if self._recorder is not None:
            self.native.set_call(self._recorder, row, call_id)
        else:
            self.records[row][0] = call_id

    def drop(self, row: int) -> None:
        """Forget a record (a parameter gradient superseded by a later accumulation)."""
        self.set_call(row, -1)

    def finish(self) -> StepTables:
        """Read the statistics back (one copy per device) and build the tables."""
        calls = {column: _array(values) for column, values in self.calls.items()}
        calls["call_id"] = np.arange(self.call_count, dtype=np.int32)
        columns = self._record_columns()
        kept = columns["call_id"] >= 0
        columns = {c: v[kept] for c, v in columns.items()}
        roles = np.array([_ROLE_ORDER[r] for r in columns["role"]], dtype=np.int64)
        order = np.lexsort((columns["arg_index"], roles, columns["call_id"]))
        records = {c: columns[c][order] for c in RECORD_COLUMNS}
        self.stats.drain()
        floats, ints = self.stats.collect(self.native.statistics(self._recorder) if self._recorder else None)
        slots = columns["slot"][order]
        has = slots >= 0
        for j, column in enumerate(("min", "max", "mean", "norm")):
            records[column] = np.where(has, floats[slots, j] if len(floats) else np.nan, np.nan)
        for j, column in enumerate(("nan_count", "inf_count", "checksum")):
            records[column] = np.where(has, ints[slots, j] if len(ints) else 0, 0)
        samples = None
        records["sample_count"] = np.zeros(len(order), dtype=np.int32)
        if self.sampler is not None:
            values, positions, counts = self.sampler.collect(columns["sample_row"][order])
            samples, records["sample_count"] = (values, positions), counts
        return StepTables(self.step, calls, records, samples)

    def _record_columns(self) -> dict[str, np.ndarray]:
        """RECORD_COLUMNS plus slot and sample_row, dropped records included."""
        if self._recorder is not None:
            call_id, arg_index, numel, slot, sample_row, *texts = self.native.columns(self._recorder)
            columns = {"call_id": np.frombuffer(call_id, np.int64), "arg_index": np.frombuffer(arg_index, np.int32),
                       "numel": np.frombuffer(numel, np.int64), "slot": np.frombuffer(slot, np.int64),
                       "sample_row": np.frombuffer(sample_row, np.int64)}
            for column, values in zip(("role", "dtype", "shape", "tensor", "skipped"), texts):
                columns[column] = _array(values)
            return columns
        names = (*RECORD_COLUMNS, "slot", "sample_row")
        columns = dict(zip(names, map(_array, _columns(self.records, len(names)))))
        for column in ("call_id", "arg_index", "numel", "slot", "sample_row"):
            columns[column] = columns[column].astype(np.int64)
        return columns


@functools.cache
def _describe_records(native) -> None:
    """Tell the extension's recorder which types are plain tensors and how dtypes are named."""
    native.describe_records(torch.Tensor, torch.nn.Parameter, lambda tensor: _dtype_name(tensor.dtype))


def _array(column) -> np.ndarray:
    """A column as an array: str columns as object arrays (what the writer stores; a numpy
    unicode array would cost a conversion each way)."""
    return np.array(column, dtype=object) if len(column) and isinstance(column[0], str) else np.array(column)


def _columns(rows: list, width: int) -> list[tuple]:
    """The columns of equally long rows (`width` empty ones when there are no rows)."""
    return list(zip(*rows)) if rows else [()] * width
