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

from pi0align.compare.reading.records import Dump
from pi0align.compare.table import Table
from pi0align.dump.file_format import DEVICE_NAME, DEVICE_REPR

_DEVICE_REPR = re.compile(DEVICE_REPR)
_DEVICE_TEXT = re.compile(f'"{DEVICE_NAME}"')


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


def adam_step(args: str) -> float:
    """The most an Adam-family update (its hyper-parameters have `betas`) moves one element:
    lr × max(1, (1 − β1) / √(1 − β2)) (Kingma and Ba, "Adam", section 2.1: the effective step is
    bounded by the learning rate, or by that ratio of it when 1 − β1 > √(1 − β2)); NaN for other
    optimizers or arguments that do not say."""
    settings = _loads(args).get("hyper_parameters")
    if not isinstance(settings, dict):
        return float("nan")
    lr, betas = settings.get("lr"), settings.get("betas")
    if not isinstance(lr, (int, float)) or not (isinstance(betas, list) and len(betas) == 2
                                                 and all(isinstance(b, (int, float)) for b in betas)):
        return float("nan")
    return adam_step_for(float(lr), float(betas[0]), float(betas[1]))


DEFAULT_BETAS = (0.9, 0.999)  # torch.optim.Adam/AdamW's: the wider bound, where the betas are not recorded


def adam_step_for(lr: float, beta1: float = DEFAULT_BETAS[0], beta2: float = DEFAULT_BETAS[1]) -> float:
    """lr × max(1, (1 − β1) / √(1 − β2)): adam_step() from its settings."""
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1) or lr < 0:
        return float("nan")
    return lr * max(1.0, (1.0 - beta1) / (1.0 - beta2) ** 0.5)


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
