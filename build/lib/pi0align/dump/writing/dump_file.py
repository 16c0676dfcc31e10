"""The dump file written (its format: file_format.py): created once, then appended to at each
dumped step's end, each time opened, written, flushed and closed again, so that between writes the
file on disk is complete and closed; an append is all or nothing (journal.py). Imports neither torch
nor the rest of pi0align but the format and the journal: the writer process (writer_process.py)
runs it."""

from __future__ import annotations

import errno
import json
import os
import resource
from pathlib import Path

import h5py
import numpy as np
from h5py import h5d, h5s, h5t

from pi0align.dump.file_format import (
    CALL_TYPES,
    FORMAT,
    METRIC_TYPES,
    RECORD_TYPES,
    STR,
    VERSION,
    StepTables,
    step_group,
)
from pi0align.dump.writing import journal


def create(path: Path, attrs: dict, manifest: dict) -> None:
    """A new dump file (replacing any earlier one, whole: it is written aside, then renamed):
    root attributes, manifest, empty tables."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with h5py.File(partial, "w") as f:
        f.attrs.update({"format": FORMAT, "version": VERSION, **attrs})
        f.create_dataset("manifest", data=json.dumps(manifest, default=repr), dtype=STR)
        for column, dtype in METRIC_TYPES.items():
            f.create_dataset(f"metrics/{column}", shape=(0,), maxshape=(None,), dtype=dtype, chunks=(1024,))
        f.create_dataset("stacks/stack_id", shape=(0,), maxshape=(None,), dtype=np.int32, chunks=(256,))
        f.create_dataset("stacks/frames", shape=(0,), maxshape=(None,), dtype=STR, chunks=(256,))
    journal.journal_path(path).unlink(missing_ok=True)  # an earlier file's: it must not undo this one
    os.replace(partial, path)


def append(path: Path, tables: StepTables | None, stacks: list[tuple[int, str]], metrics: list[tuple],
           tensors_file: str | None) -> None:
    """Open the file, append new stacks and metric rows and, when given, one complete step, flush
    and close it again; all of it or, when the process is killed first, none of it."""
    with journal.appending(path) as file, h5py.File(file, "a") as f:
        ensure_room(file.fileno(), 2 * _bytes_needed(tables, stacks, metrics))  # the journal's copy too
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
    """A generous bound on what one `append` adds to the file (HDF5's own overhead included)."""
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
    dataset[start:] = np.asarray(values, dtype=object if dataset.dtype == STR else dataset.dtype)


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
    if dtype is STR:
        data = _fixed_length(values)
        if data is None:
            data, file_type = np.asarray(values, dtype=object), h5t.py_create(STR, logical=True)
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


def ensure_room(handle: int, nbytes: int) -> None:
    """Raise OSError unless the disk and the process's file size limit leave `nbytes` for the file
    open as `handle`: HDF5 (2.0) crashes the process when it flushes a file whose writes failed, so
    a full disk must fail here, before HDF5 writes."""
    disk = os.fstatvfs(handle)
    if disk.f_bavail * disk.f_frsize < nbytes:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and os.fstat(handle).st_size + nbytes > limit:
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
