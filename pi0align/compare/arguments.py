"""Whether two paired calls were given the same non-tensor arguments (`calls/args`).

A call whose inputs agree and whose arguments differ (a scale, an epsilon, a dropout rate) computes
something else on one side, however right its kernel: replay cannot see it, this does. Devices are
left out of the comparison: a GPU run and an NPU run name theirs; so are the optimizer settings
only one side names (another implementation's switches).
"""

from __future__ import annotations

import json
import re

import numpy as np

from pi0align.compare.records import Dump
from pi0align.compare.table import Table

_DEVICE_REPR = re.compile(r"device\(type='[a-z]+'(, index=\d+)?\)")
_DEVICE_TEXT = re.compile(r'"(cpu|cuda|npu|xpu|mps)(:\d+)?"')


def canonical(args: str) -> str:
    """The arguments' JSON with devices replaced by one placeholder, compactly re-serialised."""
    text = _DEVICE_TEXT.sub('"<device>"', _DEVICE_REPR.sub("<device>", args))
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except json.JSONDecodeError:
        return text


def hyper_parameter_differences(args_a: str, args_b: str) -> list[tuple[str, object, object]]:
    """(name, A's value, B's value) of the optimizer settings both calls name and set apart (an
    optimizer of another implementation may name more or fewer settings: those are not compared)."""
    settings_a, settings_b = (_loads(text).get("hyper_parameters") for text in (args_a, args_b))
    if not isinstance(settings_a, dict) or not isinstance(settings_b, dict):
        return []
    return [(key, settings_a[key], settings_b[key]) for key in sorted(settings_a.keys() & settings_b.keys())
            if settings_a[key] != settings_b[key]]


def _loads(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _differ(args_a: str, args_b: str) -> bool:
    if '"hyper_parameters"' in args_a and '"hyper_parameters"' in args_b:
        return bool(hyper_parameter_differences(args_a, args_b))
    return canonical(args_a) != canonical(args_b)


def arguments_differ(rows: Table, a: Dump, b: Dump, ia: np.ndarray, ib: np.ndarray) -> np.ndarray:
    """Per row: both sides' calls are known and were given different arguments (backward rows
    compare their forward calls' arguments, which they repeat)."""
    differ = np.zeros(len(rows), bool)
    if a.args_reader is None or b.args_reader is None:
        return differ
    both = np.flatnonzero((ia >= 0) & (ib >= 0))
    seen: dict[tuple[int, int, int], bool] = {}
    calls_a, calls_b = a.records["call"], b.records["call"]
    steps = rows["step"]
    for row in both.tolist():
        key = (int(steps[row]), int(calls_a[ia[row]]), int(calls_b[ib[row]]))
        if key not in seen:
            step, call_a, call_b = key
            seen[key] = _differ(a.args_reader(step, call_a), b.args_reader(step, call_b))
        differ[row] = seen[key]
    return differ
