"""The writer process: it appends each dumped step to the dump file and, in tensor mode, writes the
full tensors into a side file per step, so that neither HDF5 (which holds the GIL), compression
nor the disk competes with the training thread (and at a lower CPU priority: NICENESS).

The training process copies tensors and the steps' numeric columns into a shared ring buffer and
sends their place here. Run as `python -m pi0align.dump.writing.writer_process FD SIZE COMPRESS DUMP`,
importing neither torch nor the rest of pi0align.

Commands arrive on stdin as pickled lists; answers leave on stdout, pickled:
  ("open", path)                          start a step's tensor file, written as `path` + ".partial"
  ("write", name, dtype, stored dtype, shape, (offset, nbytes), end)
                                          one tensor at `offset` of the ring; `end` is the ring
                                          position after it, answered ("freed", end) at the end of
                                          its batch; a tensor larger than the ring comes whole
                                          (an array), end None
  ("close",)                              finish the step's tensor file and rename it to `path`
  ("append", pickled, [(offset, nbytes)], end)
                                          `dump_file.append(DUMP, tables, **arguments)`, the
                                          arguments pickled (protocol 5): the bytes, or their
                                          (offset, nbytes) in the ring, with their out-of-band
                                          buffers in the ring at these places; `end` as for
                                          "write"; `tables` made of the argument `captured`
                                          (captured_step.CapturedStep, or None), its samples in
                                          the records' order
  ("monitor", step, row bytes)            `monitor_file.append(DUMP, step, row)`: DUMP is then a
                                          monitor file, the row float32 (modules × quantities)
  ("sync",)                               answered ("synced",) once everything before it is done
An error answers ("error", message); a failed tensor file skips the rest of its step. At the end
of stdin (the training process ended, even killed), queued work is finished; an unclosed step's
tensor file is deleted.
"""

from __future__ import annotations

import mmap
import os
import pickle
import queue
import signal
import sys
import threading
from pathlib import Path

import h5py
import numpy as np

from pi0align.dump.backends.sample_rows import PositionTable
from pi0align.dump.monitoring import monitor_file
from pi0align.dump.writing import dump_file
from pi0align.dump.writing.dump_file import WRITE_ERRORS, ensure_room
from pi0align.dump.writing.tensor_store import write_tensor_dataset

PARTIAL = ".partial"
_FAILURES = (*WRITE_ERRORS, ValueError)  # ValueError: h5py on an object a failed write closed ("invalid object ID")


class _Store:
    """The writer process's state: the ring, and the step's tensor file being written."""

    def __init__(self, ring: mmap.mmap, compress: bool, dump: Path, answers) -> None:
        self.ring, self.compress, self.dump, self.answers = ring, compress, dump, answers
        self.file: h5py.File | None = None
        self.path = ""
        self.failed = False  # the step's tensor file failed: skip the rest of the step
        self.positions = PositionTable()  # sample mode's, as handed over step after step

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
                ensure_room(self.file.id.get_vfd_handle(), data.nbytes + (1 << 16))
                write_tensor_dataset(self.file, name, data.reshape(shape), dtype, self.compress)
            elif kind == "close" and not self.failed:
                file, self.file = self.file, None
                file.close()
                os.replace(self.path + PARTIAL, self.path)
            elif kind == "append":
                self.append(*command[1:3])
            elif kind == "monitor":
                monitor_file.append(self.dump, command[1], np.frombuffer(command[2], np.float32))
            elif kind == "sync":
                self.answer(("synced",))
        except _FAILURES as error:
            if kind != "append":
                self.failed = True
                self.discard()
            self.answer(("error", str(error).splitlines()[0] if str(error) else type(error).__name__))

    def append(self, pickled: bytes | tuple[int, int], places: list[tuple[int, int]]) -> None:
        """Its arrays view the ring: they are gone when this returns, before their place is freed."""
        ring = memoryview(self.ring)
        if isinstance(pickled, tuple):
            offset, nbytes = pickled
            pickled = ring[offset:offset + nbytes]
        arguments = pickle.loads(pickled, buffers=[ring[offset:offset + nbytes] for offset, nbytes in places])
        captured = arguments.pop("captured")
        tables, samples = captured.tables() if captured is not None else (None, None)
        if samples is not None:
            tables.samples = self.positions.ordered(samples)
        dump_file.append(self.dump, tables, **arguments)

    def discard(self) -> None:
        """Close and delete an unfinished step's tensor file (its first error is the one reported)."""
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


# The writer's CPU priority below training's: where training keeps every core busy (a CPU run), the
# writer takes what it leaves and catches up whenever training waits for it (a full ring, flush()).
# On PI0 small's CPU tensor steps (2 cores) the step time went 1.69-1.90x -> 1.40-1.42x.
NICENESS = 19


def main(fd: int, size: int, compress: bool, dump: Path) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past a file size limit: an error to report, not a kill
    os.nice(NICENESS)  # before its threads start: they inherit it
    store = _Store(mmap.mmap(fd, size), compress, dump, sys.stdout.buffer)
    batches: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_commands, args=(sys.stdin.buffer, batches), daemon=True).start()
    while (batch := batches.get()) is not None:
        freed = None  # answered once a batch: each answer wakes a thread of the training process
        for command in batch:
            store.handle(command)
            if command[0] in ("write", "append") and command[-1] is not None:
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
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", Path(sys.argv[4]))
