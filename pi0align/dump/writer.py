"""The dump file (docs/dump-format.md): opened, written and closed at each step's end, so that
between steps the file on disk is complete and closed, and a killed run leaves it readable.

Full tensors (tensor mode) are written during the step by a background thread into a side file
per step, linked into the step's group at the end (HDF5 external link): the main file is never
open while they are written.
"""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path

import h5py
import hdf5plugin  # registers the Zstandard filter with HDF5, for writing and reading
import numpy as np
import torch
import zstandard

from pi0align.dump.steplog import StepTables

FORMAT = "pi0align-dump"
VERSION = 1

_STR = h5py.string_dtype("utf-8")
CALL_TYPES = {
    "call_id": np.int32, "seq": np.int64, "name": _STR, "module": _STR, "api": _STR,
    "direction": _STR, "stack_id": np.int32, "args": _STR,
}
RECORD_TYPES = {
    "call_id": np.int32, "role": _STR, "arg_index": np.int32, "dtype": _STR, "shape": _STR,
    "numel": np.int64, "min": np.float64, "max": np.float64, "mean": np.float64, "norm": np.float64,
    "nan_count": np.int64, "inf_count": np.int64, "checksum": np.int64, "sample_count": np.int32,
    "tensor": _STR, "skipped": _STR,
}
METRIC_TYPES = {"step": np.int64, "loss": np.float64, "grad_norm": np.float64, "lr": np.float64}


def step_group(step: int) -> str:
    return f"steps/{step:06d}"


class DumpFile:
    """One rank's dump file. Every method opens the file, writes, flushes and closes it."""

    def __init__(self, path: Path, attrs: dict, manifest: dict) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(path, "w") as f:
            f.attrs.update({"format": FORMAT, "version": VERSION, **attrs})
            f.create_dataset("manifest", data=json.dumps(manifest, default=repr), dtype=_STR)
            for column, dtype in METRIC_TYPES.items():
                f.create_dataset(f"metrics/{column}", shape=(0,), maxshape=(None,), dtype=dtype, chunks=(1024,))
            f.create_dataset("stacks/stack_id", shape=(0,), maxshape=(None,), dtype=np.int32, chunks=(256,))
            f.create_dataset("stacks/frames", shape=(0,), maxshape=(None,), dtype=_STR, chunks=(256,))

    def write(self, tables: StepTables | None, stacks: list[tuple[int, str]], metrics: list[tuple],
              tensors_file: str | None) -> None:
        """Append new stacks and metric rows and, when given, one complete step."""
        with h5py.File(self.path, "a") as f:
            if stacks:
                _append(f["stacks/stack_id"], [s for s, _ in stacks])
                _append(f["stacks/frames"], [frames for _, frames in stacks])
            if metrics:
                for j, column in enumerate(METRIC_TYPES):
                    _append(f[f"metrics/{column}"], [row[j] for row in metrics])
            if tables is not None:
                _write_step(f, tables, tensors_file)
            for step, loss, grad_norm, lr in metrics:
                group = f.get(step_group(step))
                if group is not None:
                    group.attrs.update({"loss": loss, "grad_norm": grad_norm, "lr": lr})
            f.flush()


def _append(dataset: h5py.Dataset, values: list) -> None:
    start = dataset.shape[0]
    dataset.resize((start + len(values),))
    dataset[start:] = np.asarray(values, dtype=object if dataset.dtype == _STR else dataset.dtype)


def _write_step(f: h5py.File, tables: StepTables, tensors_file: str | None) -> None:
    name = step_group(tables.step)
    if name in f:
        del f[name]  # the step was written once already (stop() then start() within one step)
    group = f.create_group(name)
    group.attrs.update({"step": tables.step, "loss": np.nan, "grad_norm": np.nan, "lr": np.nan, "complete": False})
    for table, types, columns in (("calls", CALL_TYPES, tables.calls), ("records", RECORD_TYPES, tables.records)):
        for column, dtype in types.items():
            values = columns[column]
            data = np.asarray(values, dtype=object) if dtype is _STR else np.asarray(values, dtype=dtype)
            group.create_dataset(f"{table}/{column}", data=data, dtype=dtype)
    if tables.samples is not None:
        values, positions = tables.samples
        group.create_dataset("samples/values", data=values)
        group.create_dataset("samples/positions", data=positions)
    if tensors_file is not None:
        group["tensors"] = h5py.ExternalLink(tensors_file, "/")
    group.attrs["complete"] = True


WRITE_ERRORS = (OSError, RuntimeError)  # h5py reports some failed writes (a full disk) as RuntimeError


class TensorWriter:
    """Writes full tensors of one step at a time to `<dump>.tensors/<step>.h5` on a thread."""

    def __init__(self, dump_path: Path, compress: bool = True, queue_size: int = 64) -> None:
        self.folder = dump_path.with_name(dump_path.name + ".tensors")
        self._compress = compress
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self._file: h5py.File | None = None
        self._count = 0
        self._thread = threading.Thread(target=self._run, name="pi0align-dump-writer", daemon=True)
        self._thread.start()

    def begin_step(self, step: int) -> str:
        """Open the step's side file (on the thread); returns its path relative to the dump file."""
        self._count = 0
        relative = f"{self.folder.name}/{step:06d}.h5"
        self._put(("open", self.folder / f"{step:06d}.h5"))
        return relative

    def put(self, tensor: torch.Tensor) -> str:
        """Queue a copy of the tensor; returns its dataset path relative to the step group."""
        path = f"tensors/{self._count}"
        copy = tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
        self._put(("write", str(self._count), copy))
        self._count += 1
        return path

    def end_step(self) -> None:
        """Wait until the step's tensors are on disk and its file is closed; raise what failed."""
        self._put(("close",))
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        self._put(None)
        self._thread.join()

    def _put(self, item) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self._queue.put(item)

    def _run(self) -> None:
        failed = False  # the step's file failed: skip the rest of the step
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if item[0] == "open":
                    failed = False
                if not failed:
                    self._handle(item)
            except BaseException as error:  # noqa: BLE001 - handed to the training thread
                failed, self._error = True, error
                self._close_quietly()
            finally:
                self._queue.task_done()

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "open":
            item[1].parent.mkdir(parents=True, exist_ok=True)
            self._file = h5py.File(item[1], "w")
        elif kind == "write":
            write_tensor_dataset(self._file, item[1], *tensor_to_numpy(item[2]), compress=self._compress)
        elif kind == "close" and self._file is not None:
            file, self._file = self._file, None
            file.close()

    def _close_quietly(self) -> None:
        """After a failed write (disk full), closing may fail the same way: the first error is the one to report."""
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except (OSError, RuntimeError):
                pass


def tensor_to_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """(array, torch dtype name): dtypes numpy lacks (bfloat16, float8, ...) as their raw unsigned bits."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    try:
        return tensor.numpy(), dtype
    except TypeError:
        bits = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32),
                8: (torch.int64, np.uint64)}[tensor.element_size()]
        return tensor.view(bits[0]).numpy().view(bits[1]), dtype




ZSTD_LEVEL = 1
CHUNK_BYTES = 1 << 20
MIN_COMPRESSED_BYTES = 1 << 12  # below this, compressing costs more time than it saves bytes


def write_tensor_dataset(group: h5py.Group, name: str, data: np.ndarray, dtype: str, compress: bool = True) -> None:
    """One full tensor as a dataset (docs/dump-format.md, *tensors*): byte-shuffled and
    Zstandard-compressed in chunks of about CHUNK_BYTES. The chunks are compressed here and
    written raw: zstandard releases the GIL while HDF5's own filter pipeline would hold it."""
    if not compress or data.ndim == 0 or data.nbytes < MIN_COMPRESSED_BYTES:
        dataset = group.create_dataset(name, data=data)
    else:
        data = np.ascontiguousarray(data)
        chunks = chunk_shape(data.shape, data.itemsize)
        dataset = group.create_dataset(name, shape=data.shape, dtype=data.dtype, chunks=chunks, shuffle=True,
                                       compression=hdf5plugin.ZSTD_ID, compression_opts=(ZSTD_LEVEL,))
        compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        for offset, block in _chunk_blocks(data, chunks):
            dataset.id.write_direct_chunk(offset, compressor.compress(_shuffle(block)))
    dataset.attrs["dtype"] = dtype


def chunk_shape(shape: tuple, itemsize: int) -> tuple:
    """Chunks of whole trailing dimensions (so each is one contiguous block of the tensor),
    about CHUNK_BYTES each: 1 along the leading axes, a run of rows along axis `a`."""
    trailing = itemsize
    for a in range(len(shape) - 1, -1, -1):
        if a == 0 or trailing * shape[a] > CHUNK_BYTES:
            rows = max(1, min(shape[a], CHUNK_BYTES // trailing))
            return (1,) * a + (rows,) + tuple(shape[a + 1:])
        trailing *= shape[a]
    raise AssertionError("unreachable")


def _chunk_blocks(data: np.ndarray, chunks: tuple):
    """(chunk offset, contiguous block padded to the full chunk) for every chunk of `data`."""
    a = len(chunks) - 1  # the axis chunks run along: the last one not taken whole
    while a > 0 and chunks[a] == data.shape[a]:
        a -= 1
    rows, tail = chunks[a], (0,) * (len(chunks) - a - 1)
    for lead in np.ndindex(*data.shape[:a]):
        for start in range(0, data.shape[a], rows):
            block = data[lead + (slice(start, start + rows),)]
            if block.shape[0] < rows:  # HDF5 stores edge chunks whole
                block = np.concatenate([block, np.zeros((rows - block.shape[0], *block.shape[1:]), data.dtype)])
            yield lead + (start,) + tail, block


def _shuffle(block: np.ndarray) -> np.ndarray:
    """HDF5's shuffle filter: byte i of every element into plane i (floats compress better so)."""
    size = block.itemsize
    elements = block.reshape(-1).view(np.uint8).reshape(-1, size)
    planes = np.empty((size, elements.shape[0]), np.uint8)
    for i in range(size):
        planes[i] = elements[:, i]
    return planes
