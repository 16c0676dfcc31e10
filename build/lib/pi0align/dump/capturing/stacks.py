"""Call-site stacks, recorded once per call site: the first call from a site (the innermost
frame outside torch and the dumper, within one module path) formats the whole stack; later calls
only look that site up (`call_site`; the native backend has the same in C++:
csrc/call_description.cpp)."""

from __future__ import annotations

import json
import os
import sys

import torch

_DUMP_PART = os.path.dirname(os.path.dirname(__file__))  # pi0align/dump, every sub-folder of it

class Stacks:
    """Interns call-site stacks; `new` holds the ones not yet written to the file."""

    # files whose frames are the machinery (torch's, the dumper's, `pi0align attach`'s wrapper of
    # the model's forward), not the call site
    hidden = (os.path.dirname(torch.__file__) + os.sep, _DUMP_PART + os.sep,
              os.path.join(os.path.dirname(_DUMP_PART), "attach") + os.sep)

    def __init__(self) -> None:
        # (module, id(code), line) -> (stack id, code): hashing a code object costs more than the
        # rest; the code object is kept, so that its id is not reused meanwhile
        self.ids: dict[tuple, tuple[int, object]] = {}
        self.new: list[tuple[int, str]] = []  # (stack_id, JSON list of "file:line function")
        # The native backend adds `native_sites` on first use: the sites of `ids` by instruction
        # (csrc/call_description.cpp's Sites), which finds a site seen before without its line.

    def intern(self, frame, key: tuple) -> int:
        """The stack id of a call site seen for the first time: `frame`, under `key`."""
        stack_id = len(self.ids)
        self.ids[key] = (stack_id, frame.f_code)
        frames = []
        while frame is not None:
            code = frame.f_code
            if not code.co_filename.startswith(self.hidden):
                frames.append(f"{code.co_filename}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        self.new.append((stack_id, json.dumps(frames[::-1])))
        return stack_id

    def take_new(self) -> list[tuple[int, str]]:
        new, self.new = self.new, []
        return new


def call_site(stacks: Stacks, module: str) -> int:
    """The stack id of the call site that called into torch, interned in `stacks` on first sight;
    -1 when every frame is torch's or the dumper's."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(stacks.hidden):
        frame = frame.f_back
    if frame is None:
        return -1
    key = (module, id(frame.f_code), frame.f_lineno)
    known = stacks.ids.get(key)
    return known[0] if known is not None else stacks.intern(frame, key)
