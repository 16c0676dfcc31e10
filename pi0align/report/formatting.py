"""How numbers and call sites read in the console and the HTML page (the same in both)."""

from __future__ import annotations

import json
import math
import os
from typing import Any


def format_number(value: Any) -> str:
    """Three significant digits; an em dash where the value is missing or not computable."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def format_value(value: Any) -> str:
    """A manifest value: text as itself, anything else as JSON (`null`, `[1, 2]`, `{"a": 1}`)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def innermost_frame(stack: list[str]) -> str:
    """The call site nearest the call: stacks are stored innermost last."""
    return stack[-1] if stack else ""


def relative_frame(frame: str, folder: str | None = None) -> str:
    """A frame ("path:line function") with its path relative to `folder` (the working folder)
    when it lies inside it."""
    prefix = os.path.join(os.path.abspath(folder or os.getcwd()), "")
    return frame.removeprefix(prefix)


def call_label(name: str) -> str:
    """A record name (`module/API#k`, `parameter/Optimizer.step#0`, `key/Data#0`) as it reads:
    `blocks.0.0 · Functional.linear#0`."""
    where, _, call = name.rpartition("/")
    return f"{where or '(top level)'} · {call}"


def fit_left(text: str, width: int) -> str:
    """`text` in `width` characters, its start cut to an ellipsis: module paths differ at their end."""
    return text if len(text) <= width else "…" + text[len(text) - width + 1:]


# Coverage keys in the order they read best; any other key the engine adds follows, by name.
_COVERAGE_LABELS = {"matched": "pairs matched", "only_a": "only in A", "only_b": "only in B"}


def coverage_text(coverage: dict[str, int]) -> str:
    """`pairs matched 213 · only in A 0 · only in B 1 · realigned 2`: zero extras are left out."""
    parts = [f"{label} {coverage.get(key, 0)}" for key, label in _COVERAGE_LABELS.items()]
    parts += [f"{key.replace('_', ' ')} {count}" for key, count in sorted(coverage.items())
              if key not in _COVERAGE_LABELS and count]
    return " · ".join(parts)
