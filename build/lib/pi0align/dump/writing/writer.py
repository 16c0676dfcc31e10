"""The dump file of one rank (docs/dump-format.md), written by a separate process
(writer_process.py): the training thread hands each dumped step over, its numeric columns copied
into a shared ring buffer, and goes on while that process appends it to the file, so neither HDF5
(which holds the GIL) nor the disk competes with the training. In tensor mode the same process
writes the full tensors into a side file per step, linked into the step's group (HDF5 external
link). Between two appends the file on disk is complete and closed; a killed training process
leaves the writer to finish what it was handed.
"""

from __future__ import annotations

import atexit
import collections
import functools
import mmap
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from pi0align.dump.file_format import tensors_file
from pi0align.dump.writing.captured_step import CapturedStep

TENSOR_RING_BYTES = 1 << 30  # tensors in flight to the writer process; a full ring makes the training wait
STEP_RING_BYTES = 1 << 26  # the steps' numeric columns in flight (stats and sample modes)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # where the writer process finds pi0align


class DumpWriter:
    """Hands the appends of the dump file `path` (made by `dump_file.create`) and, with
    `tensors`, the full tensors of each step (into `<dump>.tensors/<step>.h5`) to the writer
    process. The training thread waits only when the ring is full; `flush()` waits until everything
    handed over is on disk, `close()` also ends the process. A failure in the process is raised by
    the next call that hands something over."""

    def __init__(self, path: Path, tensors: bool = False, compress: bool = True, ring_bytes: int | None = None,
                 copier=None) -> None:
        """`copier`: the backend's queued copies into the ring (`queue`, `finished`, `wait`:
        backend.py), taken where the capture waits for them before an in-place call; None: each
        tensor is copied at once."""
        self.path = path
        self._ring_bytes = ring_bytes or (TENSOR_RING_BYTES if tensors else STEP_RING_BYTES)
        fd = os.memfd_create("pi0align-dump")
        os.ftruncate(fd, self._ring_bytes)
        # MAP_POPULATE: the pages are allocated now, not at a dumped step's first copy into them
        self._ring = mmap.mmap(fd, self._ring_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self._ring_tensor = torch.frombuffer(self._ring, dtype=torch.uint8)
        self._ring_address = self._ring_tensor.data_ptr()
        self._ring_array = np.frombuffer(self._ring, dtype=np.uint8)
        python_path = os.pathsep.join(filter(None, (_PACKAGE_ROOT, os.environ.get("PYTHONPATH"))))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "pi0align.dump.writing.writer_process", str(fd), str(self._ring_bytes),
             "1" if compress else "0", str(path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,),
            env={**os.environ, "PYTHONPATH": python_path})
        os.close(fd)  # both processes map it: the memory lives while either does
        self._head = 0  # ring bytes ever handed out (a position in an unbounded stream)
        self._freed = 0  # stream position up to which the writer is done with the ring
        self._synced = 0  # sync answers received
        self._error: str | None = None
        self._closing = self._ended = False
        self._commands: list[tuple] = []  # not yet sent
        self._sent = 0  # commands sent so far: the place of _commands[0] in the stream
        self._copier = copier
        self._queue_copy = copier.queue if copier is not None else lambda tensor, address: 0
        # (place in the stream, queued copy) of the unsent commands whose tensor is still being copied
        self._copying: collections.deque[tuple[int, int]] = collections.deque()
        self._tensor_step_open = False
        self._count = 0
        self._answered = threading.Condition()
        self._answers = threading.Thread(target=self._read_answers, name="pi0align-dump-answers", daemon=True)
        self._answers.start()
        atexit.register(self._close_at_exit)

    def begin_step(self, step: int) -> str:
        """Start the step's tensor file; returns its path relative to the dump file."""
        self._count = 0
        self._tensor_step_open = True
        relative = tensors_file(self.path, step)
        self._commands.append(("open", str(self.path.parent / relative)))
        return relative

    def put(self, tensor: torch.Tensor, now: bool = False) -> str:
        """Copy the tensor for the writer (now, or queued where the DumpWriter has a copier and not
        `now`); returns its dataset path relative to the step group, or "" once the writer has
        failed (the failure is raised at the step's end, not inside the model's forward or
        backward)."""
        if self._error is not None or self._ended:
            return ""
        name = str(self._count)
        self._count += 1
        nbytes = tensor.numel() * tensor.element_size()
        dtype, np_dtype = _dtype_names(tensor.dtype)
        if nbytes > self._ring_bytes - 64:  # larger than the whole ring: through the pipe
            data = tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
            self._commands.append(("write", name, dtype, np_dtype, tuple(tensor.shape), data.view(-1).view(
                torch.uint8).numpy(), None))
            self._send(copied=True)  # its copy, as large as the ring, is not kept until the step's end
            return f"tensors/{name}"
        offset = self._place(nbytes)
        if offset is None:
            return ""
        copying = 0 if now else self._queue_copy(tensor, self._ring_address + offset)
        if copying:
            self._copying.append((self._sent + len(self._commands), copying))
        else:
            target = self._ring_tensor[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
            target.copy_(tensor.detach())
        self._commands.append(("write", name, dtype, np_dtype, tuple(tensor.shape), (offset, nbytes), self._head))
        # A step's tensors go to the writer process once those in flight fill half the ring, else at
        # the step's end: writing (compressing) them meanwhile would take the core that the copies
        # and statistics run on (PI0 small's tensor steps on 2 cores: 13, 16 and 47 ms less).
        if len(self._commands) >= 256 and self._head - self._freed > self._ring_bytes // 2:
            self._send()
        return f"tensors/{name}"

    def end_step(self, captured: CapturedStep | None, stacks: list[tuple[int, str]], metrics: list[tuple],
                 tensors_file: str | None) -> None:
        """Close the step's tensor file, if one is open, and hand over the step, for the writer
        process to append `dump_file.append(...)` of its tables and these; raise an earlier failure."""
        if self._tensor_step_open:
            self._commands.append(("close",))
            self._tensor_step_open = False
        if not self._ended and (captured is not None or stacks or metrics):
            self._hand_over_append({"captured": captured, "stacks": stacks, "metrics": metrics,
                                    "tensors_file": tensors_file})
        self._send(copied=True)
        self._raise_error()

    def append_monitor(self, step: int, values: np.ndarray) -> None:
        """Hand over one step's monitor row (modules × quantities), for the writer process to
        append (`monitor_file.append`); raise an earlier failure."""
        if not self._ended:
            self._commands.append(("monitor", step, np.ascontiguousarray(values, np.float32).tobytes()))
        self._send()
        self._raise_error()

    def flush(self) -> None:
        """Wait until everything handed over so far is on disk; raise what failed."""
        synced = self._synced + 1
        self._commands.append(("sync",))
        self._wait(lambda: self._synced >= synced)
        self._raise_error()

    def close(self) -> None:
        """Wait until everything is on disk, end the writer, free the ring; raise what failed."""
        atexit.unregister(self._close_at_exit)
        try:
            if self._process.poll() is None:
                self.flush()
        finally:
            self._closing = True
            self._send_batch(None)
            self._process.wait()
            self._answers.join()
            for pipe in (self._process.stdin, self._process.stdout):  # not left for the garbage collector
                pipe.close()
            # Freed here: the last reference must not fall to the answers thread, which may be torn
            # down at interpreter exit, when freeing a torch.frombuffer tensor aborts the process.
            self._ring_tensor = self._ring_array = None
            if not self._ring.closed:
                self._ring.close()
        self._raise_error()

    def _close_at_exit(self) -> None:
        """A dumper never closed: the file must be complete before the next program reads it."""
        try:
            self.close()
        except OSError as error:
            print(f"pi0align: cannot write the dump file {self.path}: {error}", file=sys.stderr)

    def _hand_over_append(self, arguments: dict) -> None:
        """The arguments pickled and copied into the ring, with their arrays (numeric columns,
        samples) as out-of-band buffers, the pipe carrying only their places; all through the pipe
        when they would take over half the ring (the places of one append must never wait for one
        another). Through the pipe, PI0 small's 0.33 MB a step cost the step 0.5 ms: a pipe holds
        64 KB, and the writer process, at a low priority, empties it."""
        buffers: list[pickle.PickleBuffer] = []
        pickled = pickle.dumps(arguments, protocol=5, buffer_callback=buffers.append)
        raws = [memoryview(pickled), *(buffer.raw() for buffer in buffers)]
        if sum(raw.nbytes + 64 for raw in raws) > self._ring_bytes // 2:
            self._commands.append(("append", pickle.dumps(arguments, protocol=5), [], None))
            return
        places = []
        for raw in raws:
            offset = self._place(raw.nbytes)
            if offset is None:
                return
            self._ring_array[offset:offset + raw.nbytes] = np.frombuffer(raw, np.uint8)
            places.append((offset, raw.nbytes))
        self._commands.append(("append", places[0], places[1:], self._head))

    def _place(self, nbytes: int) -> int | None:
        """The ring offset where `nbytes` go (aligned, so a copy can view the ring as any dtype),
        once the writer is done with what was there a lap ago; None once it has failed or ended."""
        size = -(-nbytes // 64) * 64
        position = self._head % self._ring_bytes
        start = self._head + (self._ring_bytes - position if position + size > self._ring_bytes else 0)
        # free once the writer is past what was there a lap ago (never past what it was given:
        # the skipped end of the ring, when the data wraps to the start, is never answered)
        free_from = min(start + size - self._ring_bytes, self._head)
        # checked before waiting, which sends the queued commands: they go in batches, not one by one
        if self._freed < free_from and not self._wait(lambda: self._freed >= free_from):
            return None
        self._head = start + size
        return start % self._ring_bytes

    def _send(self, copied: bool = False) -> None:
        """Send the commands whose tensors are in the ring: those before the first whose queued
        copy has not run yet, or, `copied`, all of them once every queued copy has run."""
        ready = len(self._commands)
        if self._copying and copied:
            self._copier.wait()
            self._copying.clear()
        elif self._copying:
            finished = self._copier.finished()
            while self._copying and self._copying[0][1] <= finished:
                self._copying.popleft()
            if self._copying:
                ready = self._copying[0][0] - self._sent
        if not ready:
            return
        commands = self._commands[:ready]
        del self._commands[:ready]
        self._sent += ready
        self._send_batch(commands)

    def _send_batch(self, batch: list | None) -> None:
        try:
            pickle.dump(batch, self._process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self._process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):  # ValueError: closed by close()
            self._writer_ended()

    def _wait(self, done) -> bool:
        """Block until `done()` (an answer arrived): True, or until the writer failed or ended: False."""
        self._send(copied=True)
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
                self._error = f"the dump writer process ended unexpectedly (exit code {code})"
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
