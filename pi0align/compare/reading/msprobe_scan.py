"""One step's msprobe dump.json as columns (`ScannedStep`): the calls' keys in order; per call its
groups of tensors by role (forward: `input` = input_args then input_kwargs, `output`; any other
direction: `grad_output` = its input, `grad_input` = its output; then one group per parameter,
of its first tensor); per tensor msprobe's statistics, dtype, shape, requires_grad and file.

Two ways to the same columns: `csrc/msprobe_scan.cpp` scans the bytes (no Python object per value;
built on first use, `scanner()` chooses once per process), and `walk` goes through the JSON as
parsed, the reference. The scanner reads what msprobe writes and gives up on anything else
(escapes in a name, text statistics, duplicate keys, a field of another type, invalid JSON): such a
file is read by `walk`, which reads it or fails on it as the reader always has.
"""

from __future__ import annotations

import ctypes
import functools
import math
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pi0align.compare.table import Coded

ROLES = ("input", "output", "grad_output", "grad_input", "parameter", "parameter_grad")  # csrc's order
PARAMETER_ROLES = frozenset({ROLES.index("parameter"), ROLES.index("parameter_grad")})
TASK_MODES = {"statistics": "stats", "tensor": "tensor"}  # msprobe's tasks read, and our mode of each
TASKS = tuple(TASK_MODES)  # csrc's order: task 1, task 2
_STATISTICS_FIELDS = ("Min", "Max", "Mean", "Norm")
_STATISTICS = operator.itemgetter(*_STATISTICS_FIELDS)
_SHAPE, _DTYPE = operator.itemgetter("shape"), operator.itemgetter("dtype")  # every tensor entry has both
_SOURCE = Path(__file__).parent / "csrc" / "msprobe_scan.cpp"


@dataclass(frozen=True)
class ScannedStep:
    """The columns of one dump.json; a group's tensors are consecutive, groups in order."""

    task: str  # "statistics" | "tensor"
    keys: list[str]  # each call's msprobe key, in the file's order
    group_call: np.ndarray  # int64: the call (a position in keys) of each group
    group_role: np.ndarray  # int64: a position in ROLES
    group_count: np.ndarray  # int64: its tensors (0 for none)
    group_parameter: list[str]  # the parameter's name in a parameter group, "" in the others
    statistics: np.ndarray  # (tensors, 4) float64: Min, Max, Mean, Norm, NaN where msprobe has none
    dtype: Coded  # "float32"
    shape: Coded  # "[2, 3]"
    numel: np.ndarray  # int64
    requires_grad: np.ndarray  # int64: 1, 0, -1 where not said
    data_name: np.ndarray  # object: the tensor's file (tensor mode), "" where none


def parse_key(key: str) -> tuple[str, str, str, str]:
    """msprobe key -> (api, module path for Module calls else "", direction, forward key); a
    module's `parameters_grad` key has direction `parameter`."""
    if key.startswith("Module.") and key.count(".") >= 4:
        parts = key.split(".")
        direction = {"parameters_grad": "parameter"}.get(parts[-2], parts[-2])
        forward_key = ".".join(parts[:-2] + ["forward", parts[-1]])
        return f"Module.{parts[-3]}", ".".join(parts[1:-3]), direction, forward_key
    head, _, direction = key.rpartition(".")  # `<api>.<k>.<direction>`
    if direction in ("forward", "backward") and "." in head:
        return head.rpartition(".")[0], "", direction, key if direction == "forward" else head + ".forward"
    return key, "", "forward", key


# --- the reference: the parsed JSON walked ----------------------------------------------------

def walk(dump: dict) -> ScannedStep:
    """The columns of a parsed dump.json whose task is known; KeyError, TypeError, ValueError or
    AttributeError where it is not as msprobe writes it."""
    keys, calls, roles, parameters, entries = [], [], [], [], []

    def add(call: int, role: str, tensors: list[dict], parameter: str = "") -> None:
        calls.append(call)
        roles.append(ROLES.index(role))
        parameters.append(parameter)
        entries.append(tensors)

    for call, (key, entry) in enumerate(dump["data"].items()):
        keys.append(key)
        direction = parse_key(key)[2]
        if direction == "parameter":
            for name, value in entry.items():
                add(call, "parameter_grad", _tensors(value)[:1], name)
            continue
        if direction == "forward":
            add(call, "input", _tensors(entry.get("input_args")) + _tensors(entry.get("input_kwargs")))
            add(call, "output", _tensors(entry.get("output")))
        else:
            add(call, "grad_output", _tensors(entry.get("input")))
            add(call, "grad_input", _tensors(entry.get("output")))
        for name, value in (entry.get("parameters") or {}).items():
            add(call, "parameter", _tensors(value)[:1], name)
    tensors = [t for group in entries for t in group]
    distinct, codes = _factorize([tuple(shape or ()) for shape in map(_SHAPE, tensors)])
    dims = [[int(s) for s in shape] for shape in distinct]
    if any(n < 0 or n != s for shape, given in zip(dims, distinct) for n, s in zip(shape, given)):
        raise ValueError("a shape that is no tensor's")
    dtypes, dtype_codes = _factorize(list(map(_DTYPE, tensors)))
    data_names = [entry.get("data_name") for entry in tensors]
    return _step(dump["task"], keys, calls, roles, [len(group) for group in entries], parameters,
                 _statistics(tensors), [str(d) for d in dtypes], dtype_codes, dims, codes,
                 np.array([{True: 1, False: 0}.get(e.get("requires_grad"), -1) for e in tensors], np.int64),
                 np.array([d if isinstance(d, str) else _file_name(d) for d in data_names], object))


def _file_name(value: Any) -> str:
    if value:
        raise TypeError(f"a data_name that is {type(value).__name__}: {value!r}")
    return ""


def _tensors(value: Any) -> list[dict]:
    """Tensor entries of an argument, flattened depth-first (non-tensors skipped)."""
    if not value:
        return []
    if isinstance(value, dict):
        if "dtype" in value and "shape" in value:
            return [value] if str(value.get("type", "torch.Tensor")).endswith("Tensor") else []
        if str(value.get("type")).endswith("Tensor"):
            raise KeyError(f"a tensor entry without {'dtype' if 'shape' in value else 'shape'}")
        value = list(value.values())
    if not isinstance(value, (list, tuple)):
        return []
    found = []
    for item in value:
        if type(item) is dict and "shape" in item and "dtype" in item:  # the common case, inline
            if str(item.get("type", "torch.Tensor")).endswith("Tensor"):
                found.append(item)
        else:
            found.extend(_tensors(item))
    return found


def _number(value: Any) -> float:
    """A statistic: a number (a bool tensor's are bools), msprobe's text for one ("inf", "NaN"), or
    None where it has none."""
    if value is None:
        return float("nan")
    if not isinstance(value, (int, float, str)):
        raise TypeError(f"a statistic that is {type(value).__name__}: {value!r}")
    return float(value)  # ValueError for text that is not a number


def _statistics(entries: list[dict]) -> np.ndarray:
    """(n, 4) float64: msprobe's Min, Max, Mean, Norm of each tensor, NaN where one is not a number."""
    try:
        return np.array(list(map(_STATISTICS, entries)), np.float64).reshape(len(entries), 4)
    except (KeyError, TypeError, ValueError, OverflowError):  # None, text or a huge integer: one by one
        return np.array([[_number(e[field]) for field in _STATISTICS_FIELDS] for e in entries],
                        np.float64).reshape(len(entries), 4)


def _factorize(keys: list) -> tuple[list, np.ndarray]:
    """The distinct keys in order of first appearance, and the position of each key among them."""
    distinct = list(dict.fromkeys(keys))
    index = {key: code for code, key in enumerate(distinct)}
    return distinct, np.fromiter(map(index.__getitem__, keys), np.int64, len(keys))


# --- both ways: the columns from their parts ---------------------------------------------------

def _step(task: str, keys: list[str], calls: Any, roles: Any, counts: Any, parameters: list[str],
          statistics: np.ndarray, dtypes: list[str], dtype_codes: np.ndarray, shapes: list[list[int]],
          shape_codes: np.ndarray, requires_grad: np.ndarray, data_names: np.ndarray) -> ScannedStep:
    """A ScannedStep of its columns, dtypes and shapes given as their distinct values and codes."""
    if any(math.prod(shape) >= 1 << 62 for shape in shapes):
        raise ValueError("a shape that is no tensor's")
    shape_texts = np.array(["[" + ", ".join(map(str, shape)) + "]" for shape in shapes] or [""], object)
    numels = np.array([math.prod(shape) for shape in shapes] or [0], np.int64)
    dtype_names = Coded.of(np.array([d.removeprefix("torch.") for d in dtypes] or [""], object))
    shape_names = Coded.of(shape_texts)
    return ScannedStep(task, keys, np.asarray(calls, np.int64), np.asarray(roles, np.int64),
                       np.asarray(counts, np.int64), parameters, statistics, dtype_names.take(dtype_codes),
                       shape_names.take(shape_codes), numels[shape_codes], requires_grad, data_names)


# --- the scanner ------------------------------------------------------------------------------

_FUNCTIONS = {
    "pi0align_msprobe_scan": [ctypes.c_char_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p],
    "pi0align_msprobe_columns": [ctypes.c_void_p, ctypes.c_char_p] + [ctypes.c_void_p] * 7,
}


class CompiledScanner:
    """`csrc/msprobe_scan.cpp`, through ctypes."""

    def __init__(self, functions: dict) -> None:
        self._scan, self._columns = (functions[name] for name in _FUNCTIONS)

    def scan(self, raw: bytes) -> ScannedStep | None:
        """The columns of a dump.json's bytes; None where it holds what msprobe does not write."""
        handle, sizes = ctypes.c_void_p(), np.zeros(9, np.int64)
        self._scan(raw, len(raw), ctypes.byref(handle), sizes.ctypes.data)
        scanned, calls, groups, tensors, dtypes, shapes, dims, task, key_bytes = sizes.tolist()
        if not scanned:
            return None
        keys, group_columns = ctypes.create_string_buffer(key_bytes), np.empty((groups, 5), np.int64)
        statistics, tensor_ints = np.empty((tensors, 4)), np.empty((tensors, 5), np.int64)
        dtype_spans, shape_offsets, shape_dims = (np.empty((dtypes, 2), np.int64), np.empty(shapes + 1, np.int64),
                                                  np.empty(dims, np.int64))
        self._columns(handle, raw, keys, *(a.ctypes.data for a in (group_columns, statistics, tensor_ints, dtype_spans,
                                                                    shape_offsets, shape_dims)))
        text = functools.partial(_text, raw)
        offsets = shape_offsets.tolist()
        dims_flat = shape_dims.tolist()
        call, role, count = group_columns[:, :3].T
        return _step(TASKS[task - 1], keys.raw.decode().split("\n")[:-1] if calls else [], call, role, count,
                     _texts(raw, group_columns[:, 3:], len(call)).tolist(), statistics,
                     [text(o, n) for o, n in dtype_spans.tolist()], tensor_ints[:, 1],
                     [dims_flat[start:end] for start, end in zip(offsets, offsets[1:])], tensor_ints[:, 2],
                     tensor_ints[:, 0].copy(), _texts(raw, tensor_ints[:, 3:], tensors))


def _texts(raw: bytes, spans: np.ndarray, n: int) -> np.ndarray:
    """The texts at (offset, length) `spans`, "" where the offset is -1 (most: a few parameters'
    names among many groups; no file names in a dump of statistics)."""
    texts = np.full(n, "", object)
    present = np.flatnonzero(spans[:, 0] >= 0)
    texts[present] = [_text(raw, offset, length) for offset, length in spans[present].tolist()]
    return texts


def _text(raw: bytes, offset: int, length: int) -> str:
    return raw[offset:offset + length].decode()


@functools.cache
def scanner() -> CompiledScanner | None:
    """The compiled scanner where it builds (once per process); None: `walk` reads every file."""
    from pi0align.native import Library  # here: its build tools are imported only when a dump.json is read

    library = Library("msprobe_scan", [_SOURCE], _FUNCTIONS)
    return CompiledScanner(library.functions) if library.load() else None
