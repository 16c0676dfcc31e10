"""Full tensors of tensor mode on disk: the dataset encoding (docs/dump-format.md, *tensors*), and
the writer process that applies it.

The training process copies each tensor into a shared ring buffer and sends its place here; this
process compresses and writes it, so that neither the compression nor HDF5 (which holds the GIL)
competes with the training thread, and the step does not wait on the disk. It runs as a script
(`python tensor_store.py FD SIZE`), importing neither torch nor pi0align.

Commands arrive on stdin as pickled lists; answers leave on stdout, pickled:
  ("open", path)                          start a step's file, written as `path` + ".partial"
  ("write", name, dtype, stored dtype, shape, (offset, nbytes), end)
                                          one tensor at `offset` of the ring; `end` is the ring
                                          position after it, answered ("freed", end) at the end of
                                          its batch; a tensor larger than the ring comes whole
                                          (an array), end None
  ("close",)                              finish the step's file and rename it to `path`
  ("sync",)                               answered ("synced",) once everything before it is done
An error answers ("error", message) and skips the rest of the step. At the end of stdin (the
training process ended, even killed), queued work is finished; an unclosed step's file is deleted.
"""

from __future__ import annotations

import errno
import mmap
import os
import pickle
import queue
import resource
import sys
import threading

import h5py
import hdf5plugin  # registers the Zstandard filter with HDF5, for writing and reading
import numpy as np
import zstandard

ZSTD_LEVEL = 1
CHUNK_BYTES = 1 << 20
MIN_COMPRESSED_BYTES = 1 << 12  # below this, compressing costs more time than it saves bytes
PARTIAL = ".partial"


def write_tensor_dataset(group: h5py.Group, name: str, data: np.ndarray, dtype: str, compress: bool = True) -> None:
    """One full tensor as a dataset: byte-shuffled and Zstandard-compressed in chunks of about
    CHUNK_BYTES, compressed here and written raw (faster than HDF5's own filter pipeline)."""
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


def ensure_room(file: h5py.File, nbytes: int) -> None:
    """Raise OSError unless the disk and the process's file size limit leave `nbytes` for this
    file: HDF5 (2.0) crashes the process when it flushes a file whose writes failed, so a full
    disk must fail here, before HDF5 writes."""
    handle = file.id.get_vfd_handle()
    disk = os.fstatvfs(handle)
    if disk.f_bavail * disk.f_frsize < nbytes:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and os.fstat(handle).st_size + nbytes > limit:
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))


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


class _Store:
    """The writer process's state: the ring, and the step file being written."""

    def __init__(self, ring: mmap.mmap, compress: bool, answers) -> None:
        self.ring, self.compress, self.answers = ring, compress, answers
        self.file: h5py.File | None = None
        self.path = ""
        self.failed = False  # the step's file failed: skip the rest of the step

    def handle(self, command: tuple) -> None:
        kind = command[0]
        try:
            if kind == "open":
                self.discard()  # a step that never ended
                self.failed, self.path = False, command[1]
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                self.file = h5py.File(self.path + PARTIAL, "w")
            elif kind == "write" and not self.failed:
                _, name, dtype, stored, shape, where, _ = command
                stored = np.dtype(stored)
                if isinstance(where, np.ndarray):  # too large for the ring: sent whole
                    data = where.view(stored)
                else:
                    offset, nbytes = where
                    data = np.frombuffer(self.ring, stored, nbytes // stored.itemsize, offset)
                ensure_room(self.file, data.nbytes + (1 << 16))
                write_tensor_dataset(self.file, name, data.reshape(shape), dtype, self.compress)
            elif kind == "close" and not self.failed:
                file, self.file = self.file, None
                file.close()
                os.replace(self.path + PARTIAL, self.path)
            elif kind == "sync":
                self.answer(("synced",))
        except (OSError, RuntimeError, ValueError) as error:  # h5py reports a full disk as RuntimeError
            self.failed = True
            self.discard()
            self.answer(("error", str(error).splitlines()[0] if str(error) else type(error).__name__))

    def discard(self) -> None:
        """Close and delete an unfinished step file (its first error is the one reported)."""
        file, self.file = self.file, None
        if file is not None:
            try:
                file.close()
            except (OSError, RuntimeError):
                pass
            try:
                os.remove(self.path + PARTIAL)
            except OSError:
                pass

    def answer(self, answer: tuple) -> None:
        try:
            pickle.dump(answer, self.answers)
            self.answers.flush()
        except (BrokenPipeError, ValueError):
            pass  # the training process is gone: nobody to tell, the work goes on


def main(fd: int, size: int, compress: bool) -> None:
    store = _Store(mmap.mmap(fd, size), compress, sys.stdout.buffer)
    batches: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_commands, args=(sys.stdin.buffer, batches), daemon=True).start()
    while (batch := batches.get()) is not None:
        freed = None  # answered once a batch: each answer wakes a thread of the training process
        for command in batch:
            store.handle(command)
            if command[0] == "write" and command[-1] is not None:
                freed = command[-1]  # written or skipped: its place in the ring is free
        if freed is not None:
            store.answer(("freed", freed))
    store.discard()


def _read_commands(stream, batches: queue.SimpleQueue) -> None:
    """Reads ahead of the writing, so that the training process never blocks on a full pipe."""
    while True:
        try:
            batch = pickle.load(stream)
        except (EOFError, pickle.UnpicklingError):  # the training process ended, maybe mid-batch
            batch = None
        batches.put(batch)
        if batch is None:
            return


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1")
