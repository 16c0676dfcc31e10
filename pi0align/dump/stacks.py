"""Call-site stacks, recorded once per call site: the first call from a site (the innermost
frame outside torch and the dumper, within one module path) formats the whole stack; later calls
only look that site up."""

from __future__ import annotations

import json
import os
import sys

import torch

# Frames inside torch and inside the dumper are the machinery, not the call site.
_HIDDEN = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)


class Stacks:
    """Interns call-site stacks; `new` holds the ones not yet written to the file."""

    def __init__(self) -> None:
        self._ids: dict[tuple, tuple[int, object]] = {}  # (module, id(code), line) -> (stack_id, code)
        self.new: list[tuple[int, str]] = []  # (stack_id, JSON list of "file:line function")

    def current(self, module: str) -> int:
        """The stack id of the call site that called into torch, interning it on first sight."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_HIDDEN):
            frame = frame.f_back
        if frame is None:
            return -1
        code = frame.f_code
        key = (module, id(code), frame.f_lineno)  # hashing a code object costs more than the rest
        known = self._ids.get(key)
        if known is not None:
            return known[0]
        stack_id = len(self._ids)
        self._ids[key] = (stack_id, code)  # the code object is kept: its id is not reused meanwhile
        frames = []
        while frame is not None:
            code = frame.f_code
            if not code.co_filename.startswith(_HIDDEN):
                frames.append(f"{code.co_filename}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        self.new.append((stack_id, json.dumps(frames[::-1])))
        return stack_id

    def take_new(self) -> list[tuple[int, str]]:
        new, self.new = self.new, []
        return new
