"""How numbers and call sites read in the console and the HTML page (the same in both)."""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterable
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


# A module path of three parts or more, and the call a record name adds to it (`/Functional.linear#0`,
# `/input 1`): what the console shortens in its prose (notes, hints).
_NAME_IN_TEXT = re.compile(r"(?<![\w./])([A-Za-z_]\w*(?:\.\w+){2,})(/[A-Za-z_][\w.]*(?:#\d+|(?= input \d)))?")
PROSE_NAME_WIDTH = 48  # a name in a note: its distinctive tail, and as much more as fits this


class ShortNames:
    """Names as the console shows them: a module path's distinctive tail (the fewest last parts
    that no other module path of the run ends with), then as many more parts as fit, the start
    elided to "…"; never cut inside a part. The CSV, JSON and HTML reports keep the full name."""

    def __init__(self, paths: Iterable[str] = ()):
        self._tails: Counter[tuple[str, ...]] = Counter()
        for path in set(paths):
            parts = tuple(path.split(".")) if path else ()
            self._tails.update(parts[-k:] for k in range(1, len(parts) + 1))

    def module(self, path: str, width: int) -> str:
        """A module path in `width` characters where its distinctive tail fits in them."""
        if len(path) <= width:
            return path
        parts = path.split(".")
        distinct = next((k for k in range(1, len(parts)) if self._tails[tuple(parts[-k:])] <= 1), len(parts))
        kept = max((k for k in range(1, len(parts)) if len(".".join(parts[-k:])) + 1 <= width), default=1)
        kept = max(kept, min(distinct, len(parts) - 1))
        if kept > 1 and parts[-kept].isdigit():  # an index without what it indexes (`…1.mlp`) tells nothing
            kept -= 1
        shown = "…" + ".".join(parts[-kept:])
        if len(shown) > width and kept > 2:  # its distinctive part, then as much of its end as fits
            head, tail = parts[-kept], []
            for part in reversed(parts[-kept + 1:]):
                if len(f"…{head}…{'.'.join([part, *tail])}") > width:
                    break
                tail.insert(0, part)
            if tail:
                shown = f"…{head}…{'.'.join(tail)}"
        return shown

    def name(self, name: str, width: int) -> str:
        """A record name (`<module>/<call>`), its call whole and its module shortened."""
        where, slash, call = name.rpartition("/")
        if not slash:
            return self.module(name, width)
        return self.module(where, max(width - len(call) - 1, 1)) + "/" + call

    def label(self, name: str, width: int) -> str:
        """`call_label` in `width` columns: on one line where its module keeps three parts or
        more there, else the call, then its module on a line of its own."""
        where, _, call = name.rpartition("/")
        if not where:
            return f"(top level) · {call}"
        module = self.module(where, max(width - len(call) - 3, 1))
        if module == where or module.count(".") >= 2:
            return f"{module} · {call}"
        return f"{call}\n{self.module(where, width)}"

    def in_text(self, text: str, width: int = PROSE_NAME_WIDTH) -> str:
        """Every module path and record name in a text shortened to `width`."""
        return _NAME_IN_TEXT.sub(lambda m: self.name(m.group(1) + (m.group(2) or ""), width), text)


def short_frame(frame: str, width: int) -> str:
    """A call site ("path:line function") in `width` characters: whole folders dropped from the
    start of its path, "…" in their place; its file, line and function kept."""
    if len(frame) <= width:
        return frame
    folders = frame.split("/")
    while len(folders) > 1 and len("…/" + "/".join(folders)) > width:
        folders.pop(0)
    return "…/" + "/".join(folders)
