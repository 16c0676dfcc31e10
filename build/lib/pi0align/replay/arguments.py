"""A call's recorded arguments (docs/dump-format.md, `calls/args`) rebuilt for a replay.

`{"tensor": k}` becomes the k-th input tensor; JSON scalars and lists stay; `{"repr": ...}`
values are rebuilt only where their text names a value without running anything: torch dtypes
and memory formats, devices (the CPU, where the replay runs), slices, Ellipsis and non-finite
floats. Anything else makes the call not replayable.
"""

from __future__ import annotations

import math
import re

import torch

from pi0align.dump.file_format import DEVICE_NAME, DEVICE_REPR
from pi0align.replay.apis import NotReplayable

_SLICE = re.compile(r"^slice\((-?\d+|None), (-?\d+|None), (-?\d+|None)\)$")
_DEVICE = re.compile(f"^{DEVICE_REPR}$")
_DEVICE_TEXT = re.compile(f"^{DEVICE_NAME}$")
_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def rebuild(value, inputs: list[torch.Tensor]):
    """The recorded argument `value` with its tensors taken from `inputs` (by their index)."""
    if isinstance(value, dict):
        if set(value) == {"tensor"}:
            index = value["tensor"]
            if not isinstance(index, int) or not 0 <= index < len(inputs):
                raise NotReplayable(f"argument tensor {index!r} was not dumped")
            return inputs[index]
        if set(value) == {"repr"}:
            return _from_repr(str(value["repr"]))
        return {key: rebuild(item, inputs) for key, item in value.items()}
    if isinstance(value, list):
        return [rebuild(item, inputs) for item in value]
    if isinstance(value, str) and _DEVICE_TEXT.match(value):
        return "cpu"
    return value


def _from_repr(text: str):
    if text in _FLOATS:
        return _FLOATS[text]
    if text == "Ellipsis":
        return Ellipsis
    if _DEVICE.match(text):
        return torch.device("cpu")
    found = _SLICE.match(text)
    if found:
        return slice(*(None if part == "None" else int(part) for part in found.groups()))
    if text.startswith("torch.") and _is_identifier(text[6:]):
        value = getattr(torch, text[6:], None)
        if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
            return value
    raise NotReplayable(f"argument {text[:60]} cannot be rebuilt")


def _is_identifier(text: str) -> bool:
    return text.isidentifier()
