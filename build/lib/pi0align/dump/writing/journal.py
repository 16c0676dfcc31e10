"""The dump file's appends made all-or-nothing with a rollback journal (SQLite's scheme), and the
lock that keeps readers off a file in the middle of one.

HDF5 updates a file in place: a process killed while HDF5 writes an append's metadata leaves a file
no program can open, with every step before it. So an append goes through `JournaledFile`: before
a byte the file held when the append began is overwritten, its old value is saved in
`<dump>.journal`; the journal is deleted once the append is closed. A writer killed mid-append
leaves the journal behind, and whoever opens the file next puts the saved bytes back and cuts the
file to its old length: the file as the last complete append left it. Process death is covered
(the page cache keeps both files); power loss is not (no fsync: one per append costs more than a
step's dump budget).

An append holds an exclusive `flock` on the dump file; a reader holds a shared one while it reads
the records, so it never sees half an append, and opens the file with HDF5's own locking off, so
that a long compare never blocks the run that is writing.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import struct
import time
from pathlib import Path

_HEADER = struct.Struct("<Q")  # the file's length when the append began
_ENTRY = struct.Struct("<QQ")  # offset, length; the old bytes follow


class InterruptedAppend(Exception):
    """A killed writer's append that this process cannot undo (it may not write the file)."""


def journal_path(path: Path) -> Path:
    return path.with_name(path.name + ".journal")


class JournaledFile(io.RawIOBase):
    """The dump file opened for one append, for h5py's `fileobj` driver: writes and truncations
    below the length it had when opened save the bytes they replace in the journal first."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._fd = os.open(path, os.O_RDWR)
        self._length = os.fstat(self._fd).st_size
        self._journal = open(journal_path(path), "wb", buffering=0)  # noqa: SIM115 - closed by close()
        self._journal.write(_HEADER.pack(self._length))
        self._position = 0

    def fileno(self) -> int:
        return self._fd

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: os.fstat(self._fd).st_size}[whence]
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer) -> int:
        count = os.preadv(self._fd, [buffer], self._position)
        self._position += count
        return count

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        self._save(self._position, len(data))
        count = os.pwrite(self._fd, data, self._position)
        self._position += count
        return count

    def truncate(self, size: int | None = None) -> int:
        size = self._position if size is None else size
        self._save(size, self._length - size)
        os.ftruncate(self._fd, size)
        return size

    def _save(self, offset: int, count: int) -> None:
        count = min(count, self._length - offset)
        if count > 0:
            self._journal.write(_ENTRY.pack(offset, count) + os.pread(self._fd, count, offset))

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
            self._journal.close()
        super().close()


class DamagedJournal(ValueError):
    """A journal that no append of ours wrote: rolling it back would write what it says, not undo."""


def roll_back(path: Path) -> None:
    """Undo an append its writer did not finish (nothing when there is no journal): the saved bytes
    back, latest first, so the oldest value of a byte saved twice wins; the file cut to its old
    length. Repeatable: a roll-back killed halfway is done again from the start. A journal that
    says more than an append saves (a longer file, bytes past its old end) is DamagedJournal, and
    the file is left untouched."""
    journal = journal_path(path)
    if not journal.exists():
        return
    saved = journal.read_bytes()
    if len(saved) >= _HEADER.size:  # else killed before the header: nothing was overwritten yet
        (length,) = _HEADER.unpack_from(saved)
        entries, at = [], _HEADER.size
        while at + _ENTRY.size <= len(saved):
            offset, count = _ENTRY.unpack_from(saved, at)
            at += _ENTRY.size
            if at + count > len(saved):
                break  # killed while saving these bytes: they were not overwritten yet
            if offset + count > length:
                raise DamagedJournal(f"it saved bytes {offset}-{offset + count}, past the file's old end {length}")
            entries.append((offset, saved[at:at + count]))
            at += count
        # an append adds to the file, or cuts it after saving what it cuts: nothing else lengthens it
        if length > max([path.stat().st_size, *(offset + len(old) for offset, old in entries)]):
            raise DamagedJournal(f"it would lengthen the file to {length} bytes, past what it saved")
        fd = os.open(path, os.O_RDWR)
        try:
            for offset, old in reversed(entries):
                os.pwrite(fd, old, offset)
            os.ftruncate(fd, length)
        finally:
            os.close(fd)
    journal.unlink()


@contextlib.contextmanager
def appending(path: Path):
    """The dump file, locked against readers, as a file object whose writes are journaled; an
    append killed before this returns is undone by the next `appending` or `reading`."""
    with _locked(path, fcntl.LOCK_EX, wait_s=None):
        roll_back(path)
        with JournaledFile(path) as file:
            yield file
        journal_path(path).unlink()


@contextlib.contextmanager
def reading(path: Path, wait_s: float = 60.0):
    """Hold the dump file still while its records are read: wait out an append in progress (up to
    `wait_s`, then BlockingIOError) and roll back one its writer was killed in (InterruptedAppend
    when this process may not write the file)."""
    with _locked(path, fcntl.LOCK_SH, wait_s) as fd:
        if journal_path(path).exists():
            _lock(fd, fcntl.LOCK_EX, wait_s)  # the shared lock converted: no reader is reading it now
            try:
                roll_back(path)
            except OSError as error:
                raise InterruptedAppend(error.strerror or str(error)) from error
            _lock(fd, fcntl.LOCK_SH, wait_s)
        yield


@contextlib.contextmanager
def _locked(path: Path, kind: int, wait_s: float | None):
    fd = os.open(path, os.O_RDONLY)
    try:
        _lock(fd, kind, wait_s)
        yield fd
    finally:
        os.close(fd)  # releases the lock


def _lock(fd: int, kind: int, wait_s: float | None) -> None:
    if wait_s is None:
        fcntl.flock(fd, kind)
        return
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
