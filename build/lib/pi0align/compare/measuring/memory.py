"""Memory the C heap holds after it was freed, handed back to the system while tensors stream.

A comparison of full tensors decodes, converts and replays one call's tensors after the other.
glibc's allocator keeps the blocks they freed for reuse, and, with tensors of ever other sizes,
the process's resident memory grows with the number of calls, not with the largest one. Where
the C library has `malloc_trim` (glibc), `HeapTrimmer` calls it whenever the process has grown
by SLACK since the last time; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os

SLACK = 256 << 20  # resident bytes the heap may grow by before it is trimmed


@functools.cache
def _malloc_trim():
    # The symbols this process was linked with, the C library's among them: no search for the
    # library (ctypes.util imports subprocess, a compare's start-up would pay for it)
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc; Windows loads no library named None
        return None


def resident_bytes() -> int:
    """This process's resident memory (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HeapTrimmer:
    """Call after each piece of streamed work: trims the heap once resident memory has grown by
    `slack` bytes since the last trim."""

    def __init__(self, slack: int = SLACK) -> None:
        self.slack, self.trim = slack, _malloc_trim()
        self.mark = resident_bytes()

    def __call__(self) -> None:
        if self.trim is None:
            return
        now = resident_bytes()
        if now - self.mark > self.slack:
            self.trim(0)
            self.mark = resident_bytes()
