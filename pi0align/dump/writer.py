"""The dump file (docs/dump-format.md): opened, written and closed at each step's end, so that
between steps the file on disk is complete and closed, and a killed run leaves it readable.

Full tensors (tensor mode) are written by a separate process into a side file per step, linked
into the step's group at the end (HDF5 external link): the main file is never open while they
are written, and the step does not wait for them.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import h5py
import numpy as np
from h5py import h5d, h5s, h5t
import torch

from pi0align.dump import tensor_store
from pi0align.dump.steplog import StepTables
from pi0align.dump.tensor_store import ensure_room

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
            ensure_room(f, _bytes_needed(tables, stacks, metrics))
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


def _bytes_needed(tables: StepTables | None, stacks: list[tuple[int, str]], metrics: list[tuple]) -> int:
    """A generous bound on what one `DumpFile.write` adds to the file (HDF5's own overhead included)."""
    raw = sum(len(frames) + 64 for _, frames in stacks) + 64 * len(metrics)
    if tables is not None:
        raw += sum(_column_bytes(v) for columns in (tables.calls, tables.records) for v in columns.values())
        raw += sum(a.nbytes for a in tables.samples or ())
    return 2 * raw + (1 << 20)


def _column_bytes(values: np.ndarray) -> int:
    """A bound on a column's bytes in the file: str columns (object arrays) by their UTF-8 length."""
    if values.dtype == object:
        return 4 * sum(map(len, values)) + 16 * len(values)
    return values.nbytes + 16 * len(values)


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
        table_group = group.create_group(table)
        for column, dtype in types.items():
            _create_column(table_group, column, columns[column], dtype)
    if tables.samples is not None:
        values, positions = tables.samples
        group.create_dataset("samples/values", data=values)
        group.create_dataset("samples/positions", data=positions)
    if tensors_file is not None:
        group["tensors"] = h5py.ExternalLink(tensors_file, "/")
    group.attrs["complete"] = True


_SHORT = 64  # str columns no longer than this, and ASCII, are stored fixed-length (docs/dump-format.md)


def _create_column(group: h5py.Group, name: str, values: np.ndarray, dtype) -> None:
    """One column, through h5py's low-level API: the dataset `create_dataset` makes, in half the time
    (two dozen columns a step). Short ASCII str columns (roles, dtypes, shapes, ...) are stored as
    fixed-length strings: HDF5 copies them, where each variable-length one is converted alone."""
    memory_type = None
    if dtype is _STR:
        data = _fixed_length(values)
        if data is None:
            data, file_type = np.asarray(values, dtype=object), h5t.py_create(_STR, logical=True)
        else:
            file_type = memory_type = h5t.py_create(data.dtype)
            file_type.set_cset(h5t.CSET_UTF8)
    else:
        data = np.ascontiguousarray(values, dtype=dtype)
        file_type = h5t.py_create(data.dtype)
    dataset = h5d.create(group.id, name.encode(), file_type, h5s.create_simple((len(data),)))
    if len(data):
        dataset.write(h5s.ALL, h5s.ALL, data, mtype=memory_type)  # str objects: converted one by one


def _fixed_length(values: np.ndarray) -> np.ndarray | None:
    """The column as a bytes array when every value is short ASCII, else None."""
    if not len(values) or max(map(len, values)) > _SHORT:
        return None
    try:
        return np.array(values, dtype="S")
    except UnicodeEncodeError:
        return None


WRITE_ERRORS = (OSError, RuntimeError)  # h5py reports some failed writes (a full disk) as RuntimeError


RING_BYTES = 1 << 30  # tensors in flight to the writer process; a full ring makes the training wait


class TensorWriter:
    """Full tensors of one step at a time, into `<dump>.tensors/<step>.h5`, written by a separate
    process (`tensor_store.py`): the training thread only copies each tensor into a shared ring
    buffer, and waits only when the ring is full. `close()` waits until everything is on disk."""

    def __init__(self, dump_path: Path, compress: bool = True, ring_bytes: int = RING_BYTES) -> None:
        self.folder = dump_path.with_name(dump_path.name + ".tensors")
        self._ring_bytes = ring_bytes
        fd = os.memfd_create("pi0align-tensors")
        os.ftruncate(fd, ring_bytes)
        # MAP_POPULATE: the pages are allocated now, not at a dumped step's first copy into them
        self._ring = mmap.mmap(fd, ring_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self._ring_tensor = torch.frombuffer(self._ring, dtype=torch.uint8)
        self._process = subprocess.Popen([sys.executable, tensor_store.__file__, str(fd), str(ring_bytes),
                                          "1" if compress else "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         pass_fds=(fd,))
        os.close(fd)  # both processes map it: the memory lives while either does
        self._head = 0  # ring bytes ever handed out (a position in an unbounded stream)
        self._freed = 0  # stream position up to which the writer is done with the ring
        self._synced = 0  # sync answers received
        self._error: str | None = None
        self._closing = self._ended = False
        self._commands: list[tuple] = []  # not yet sent
        self._count = 0
        self._answered = threading.Condition()
        self._answers = threading.Thread(target=self._read_answers, name="pi0align-tensor-answers", daemon=True)
        self._answers.start()

    def begin_step(self, step: int) -> str:
        """Start the step's side file; returns its path relative to the dump file."""
        self._count = 0
        self._commands.append(("open", str(self.folder / f"{step:06d}.h5")))
        return f"{self.folder.name}/{step:06d}.h5"

    def put(self, tensor: torch.Tensor) -> str:
        """Copy the tensor for the writer; returns its dataset path relative to the step group, or
        "" once the writer has failed (the failure is raised at the step's end, not inside the
        model's forward or backward)."""
        if self._error is not None or self._ended:
            return ""
        name = str(self._count)
        self._count += 1
        nbytes = tensor.numel() * tensor.element_size()
        dtype, np_dtype = _dtype_names(tensor.dtype)
        size = -(-nbytes // 64) * 64  # aligned, so the copy can view the ring as any dtype
        if size > self._ring_bytes:  # larger than the whole ring: through the pipe
            data = tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
            self._commands.append(("write", name, dtype, np_dtype, tuple(tensor.shape), data.view(-1).view(
                torch.uint8).numpy(), None))
            return f"tensors/{name}"
        position = self._head % self._ring_bytes
        start = self._head + (self._ring_bytes - position if position + size > self._ring_bytes else 0)
        # free once the writer is past what was there a lap ago (never past what it was given:
        # the skipped end of the ring, when the tensor wraps to the start, is never answered)
        free_from = min(start + size - self._ring_bytes, self._head)
        # checked before waiting, which sends the queued commands: they go in batches, not one by one
        if self._freed < free_from and not self._wait(lambda: self._freed >= free_from):
            return ""
        offset = start % self._ring_bytes
        self._head = start + size
        target = self._ring_tensor[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
        target.copy_(tensor.detach())
        self._commands.append(("write", name, dtype, np_dtype, tuple(tensor.shape), (offset, nbytes), self._head))
        if len(self._commands) >= 256:
            self._send()
        return f"tensors/{name}"

    def end_step(self) -> None:
        """Let the writer finish the step's file on its own time; raise an earlier failure."""
        self._commands.append(("close",))
        self._send()
        self._raise_error()

    def flush(self) -> None:
        """Wait until every tensor put so far is on disk; raise what failed."""
        synced = self._synced + 1
        self._commands.append(("sync",))
        self._wait(lambda: self._synced >= synced)
        self._raise_error()

    def close(self) -> None:
        """Wait until every tensor is on disk, end the writer, free the ring; raise what failed."""
        try:
            if self._process.poll() is None:
                self.flush()
        finally:
            self._closing = True
            self._send_batch(None)
            self._process.wait()
            self._answers.join()
            # Freed here: the last reference must not fall to the answers thread, which may be torn
            # down at interpreter exit, when freeing a torch.frombuffer tensor aborts the process.
            self._ring_tensor = None
            self._ring.close()
        self._raise_error()

    def _send(self) -> None:
        commands, self._commands = self._commands, []
        if commands:
            self._send_batch(commands)

    def _send_batch(self, batch: list | None) -> None:
        try:
            pickle.dump(batch, self._process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self._process.stdin.flush()
        except (BrokenPipeError, OSError):
            self._writer_ended()

    def _wait(self, done) -> bool:
        """Block until `done()` (an answer arrived): True, or until the writer failed or ended: False."""
        self._send()
        with self._answered:
            return self._answered.wait_for(lambda: done() or self._error is not None or self._ended) and done()

    def _read_answers(self) -> None:
        answers = self._process.stdout
        while True:
            try:
                answer = pickle.load(answers)
            except (EOFError, pickle.UnpicklingError, OSError):
                self._writer_ended()
                return
            with self._answered:
                if answer[0] == "freed":
                    self._freed = answer[1]
                elif answer[0] == "synced":
                    self._synced += 1
                elif answer[0] == "error" and self._error is None:
                    self._error = answer[1]
                self._answered.notify_all()

    def _writer_ended(self) -> None:
        """Its answers (or its input) ended: the writer process is ending too."""
        code = self._process.wait()
        with self._answered:
            if not self._closing and self._error is None:
                self._error = f"the tensor writer process ended unexpectedly (exit code {code})"
            self._ended = True
            self._answered.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise OSError(error)


@functools.cache
def _dtype_names(dtype: torch.dtype) -> tuple[str, str]:
    """(torch dtype name, NumPy dtype it is stored as): dtypes NumPy lacks (bfloat16, float8, ...)
    as their raw unsigned bits, losslessly."""
    try:
        stored = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        stored = np.dtype(f"u{torch.empty(0, dtype=dtype).element_size()}")
    return str(dtype).removeprefix("torch."), stored.str
