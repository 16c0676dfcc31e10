"""The tensors of a call, flattened, and its other arguments as replayable JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import orjson
import torch

_MAX_REPR = 200


def tensors_of(*values) -> list[torch.Tensor]:
    """Every tensor in `values`, depth-first through tuples, lists and mappings (the native
    backend has the same in C++: csrc/capture_extension.cpp)."""
    out: list[torch.Tensor] = []
    for value in values:
        _flatten(value, out)
    return out


def _flatten(value, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _flatten(item, out)
    elif isinstance(value, Mapping):
        for item in value.values():
            _flatten(item, out)


def named_tensors(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a call with their key paths (the batch's keys, for data records): mapping
    keys and sequence positions joined by "/"; positional arguments by their index, keywords by
    name, the path of a call's only argument without its own; a lone tensor is "input"."""
    arguments = [(str(i), a) for i, a in enumerate(args)] + [(str(k), v) for k, v in kwargs.items()]
    out: list[tuple[str, torch.Tensor]] = []
    for key, value in arguments:
        _named(value, "" if len(arguments) == 1 else key, out)
    return out


def _named(value, path: str, out: list) -> None:
    if isinstance(value, torch.Tensor):
        out.append((path or "input", value))
    elif isinstance(value, (tuple, list, Mapping)):
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        for key, item in items:
            _named(item, f"{path}/{key}" if path else str(key), out)


def describe_arguments(args: tuple, kwargs: dict) -> str:
    """`{"args": [...], "kwargs": {...}}` with tensors as `{"tensor": k}`, k in flattening order
    (the native backend has the same in C++: csrc/call_description.cpp)."""
    counter = iter(range(1 << 62))
    described = {
        "args": [_describe(a, counter) for a in args],
        "kwargs": {str(k): _describe(v, counter) for k, v in kwargs.items()},
    }
    try:
        return orjson.dumps(described).decode()  # compact, as json.dumps below, several times faster
    except orjson.JSONEncodeError:  # an int beyond 64 bits
        return json.dumps(described, separators=(",", ":"))


def _describe(value, counter):
    if isinstance(value, torch.Tensor):
        return {"tensor": next(counter)}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"repr": repr(value)}
    if isinstance(value, (tuple, list)):
        return [_describe(v, counter) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _describe(v, counter) for k, v in value.items()}
    text = repr(value)
    return {"repr": text if len(text) <= _MAX_REPR else text[:_MAX_REPR] + "…"}
