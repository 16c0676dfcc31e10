"""The torch dump backend: the reference, and what accelerators run. Autograd hooks in Python
(backward.py), the step's records in Python lists, statistics with batched torch ops (stats.py),
samples with torch indexing."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from pi0align.dump.backends.stats import BatchedStatistics, finish_statistics, skip_reason
from pi0align.dump.backends.steplog import dtype_name
from pi0align.dump.capturing import backward
from pi0align.dump.capturing.arguments import describe_arguments, tensors_of
from pi0align.dump.capturing.stacks import call_site
from pi0align.dump.writing.captured_step import CAPTURED_RECORD_COLUMNS


class TorchBackend:
    name = "torch"
    host_gather = None
    copier = None  # tensor mode's copies are made at once
    api_handler = None  # the capture mode's own __torch_function__ handles every call
    module_handlers = None  # the capture's own _enter_module and _leave_module

    def __init__(self, status: str) -> None:
        self.status = status  # why this backend: "chosen", or why the native one is not built

    tensors_of = staticmethod(tensors_of)
    input_edges = staticmethod(backward.input_edges)
    watch = staticmethod(backward.watch)
    watch_tensor_grads = staticmethod(backward.watch_tensor_grads)
    describe_arguments = staticmethod(describe_arguments)
    call_site = staticmethod(call_site)

    def records(self, in_place_seen: bool, tensor_sink, sampler) -> TorchRecords:
        return TorchRecords(in_place_seen, tensor_sink, sampler)


@dataclass
class _Seen:
    """Statistics already queued for these elements (the same tensor, or a view of it)."""

    tensor: weakref.ref  # while it lives, its memory cannot hold other data
    slot: int
    shape: tuple
    tensor_path: str


class TorchRecords:
    """A step's records as Python rows: CAPTURED_RECORD_COLUMNS, then the statistics slot and sample row."""

    calls_table = None  # StepLog opens its calls itself

    def __init__(self, in_place_seen: bool, tensor_sink, sampler) -> None:
        self._stats = BatchedStatistics(in_place_seen)
        self._tensor_sink = tensor_sink
        self._sampler = sampler
        self._rows: list[list] = []
        self._numel: list[int] = []  # per slot
        self._seen: dict[tuple, _Seen] = {}  # _elements_key -> what to reuse
        self.closed = False

    def record(self, call_id: int, name: str, role: str, arg_index: int, tensors: list[torch.Tensor]) -> int:
        for index, tensor in enumerate(tensors, arg_index):
            self._record_one(call_id, name, role, index, tensor)
        return len(self._rows) - 1

    def _record_one(self, call_id: int, name: str, role: str, arg_index: int, tensor: torch.Tensor) -> None:
        skipped = skip_reason(tensor)
        shape = tuple(tensor.shape)
        slot, sample_row, path = -1, -1, ""
        if not skipped:
            key = _elements_key(tensor)
            known = self._seen.get(key)
            if known is not None and known.tensor() is not None:
                slot = known.slot
                same_view = known.shape == shape or self._tensor_sink is None
                path = known.tensor_path if same_view else self._tensor_sink(tensor)
            else:
                slot = len(self._numel)
                self._numel.append(tensor.numel())
                self._stats.add(tensor, slot)
                path = self._tensor_sink(tensor) if self._tensor_sink is not None else ""
                self._seen[key] = _Seen(weakref.ref(tensor), slot, shape, path)
            if self._sampler is not None:
                sample_row = self._sampler.add(tensor, name, role, arg_index)
        self._rows.append([call_id, role, arg_index, dtype_name(tensor.dtype), _shape_json(shape), tensor.numel(),
                           path, skipped, slot, sample_row])

    def set_call(self, row: int, call_id: int) -> None:
        self._rows[row][0] = call_id

    def grad_sink(self, name: str, forward_id: int, open_backward):
        return backward.sink(self, name, forward_id, open_backward)

    def before_change(self, tensors: list[torch.Tensor]) -> None:
        self._stats.before_change(tensors)

    def drain(self) -> None:
        self._stats.flush()

    def close(self) -> None:
        self.closed = True

    def columns(self) -> dict[str, np.ndarray | tuple]:
        names = (*CAPTURED_RECORD_COLUMNS, "slot", "sample_row")
        columns = dict(zip(names, zip(*self._rows))) if self._rows else dict.fromkeys(names, ())
        for column in ("call_id", "arg_index", "numel", "slot", "sample_row"):
            columns[column] = np.array(columns[column], dtype=np.int64)
        return columns  # str columns as they are: the writer process makes them arrays

    def statistics(self) -> tuple[np.ndarray, np.ndarray]:
        n = len(self._numel)
        floats, ints = np.full((n, 4), np.nan), np.zeros((n, 3), dtype=np.int64)
        self._stats.collect(floats, ints)
        finish_statistics(floats, ints, np.array(self._numel, dtype=np.float64))
        return floats, ints


def _elements_key(tensor: torch.Tensor) -> tuple:
    """Equal keys, while the first tensor lives, mean the same elements in the same row-major
    order: hence equal statistics and checksum. Views of contiguous memory share a key."""
    if tensor.is_contiguous():
        return tensor.data_ptr(), tensor.dtype, tensor.numel(), tensor._version
    return tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor._version


@functools.lru_cache(maxsize=65536)  # a model has a few hundred distinct shapes: formatted once each
def _shape_json(shape: tuple) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"  # json.dumps(list(shape)), faster
