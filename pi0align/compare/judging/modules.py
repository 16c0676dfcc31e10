"""Module invocations as a tree of calls: which module call holds which calls.

In forward, a module invocation at path P holds the later calls (same rank, step and direction)
made in P or below it, up to the first call elsewhere or P's next invocation. In backward a
module's record is written after the calls inside it, so there a module holds the calls of its
path or below it made in the same step.
"""

from __future__ import annotations

import numpy as np

from pi0align.compare.table import Coded, Table, unique_values


def is_module(calls: Table) -> np.ndarray:
    return is_module_api(calls.coded("api"))


def is_module_api(apis: np.ndarray | Coded) -> np.ndarray:
    """Which API names are modules' (`Module.<Class>`): decided once per distinct name (a text
    column as a fixed-width str array, which np.char needs, costs its longest name on every row)."""
    distinct, inverse = unique_values(apis)
    return np.array([str(api).startswith("Module.") for api in distinct.tolist()], bool)[inverse]


def within(path: str, module: str) -> bool:
    """Whether the module path `path` is `module` or below it ("" is the whole model)."""
    return module == "" or path == module or path.startswith(module + ".")


def enclosing_paths(path: str) -> list[str]:
    """A module path and the paths above it, "" (the whole model) first."""
    parts = path.split(".") if path else []
    return [".".join(parts[:n]) for n in range(len(parts) + 1)]


def enclosing_modules(calls: Table) -> np.ndarray:
    """Per call, the innermost forward module invocation holding it (its row in `calls`; -1: none);
    per backward module call, the innermost backward module call holding it. A module's backward
    row opens at its first gradient, before its children's, and its input gradient is the first
    child's (a Sequential's and its first Linear's, at level module): without it the parent, first
    in order, was named and its child counted downstream of it."""
    order = np.lexsort((calls["seq_a"], calls.coded("direction").codes, calls["step"], calls["rank"]))
    module_api = is_module(calls).tolist()
    paths, ranks, steps = calls["module"].tolist(), calls["rank"].tolist(), calls["step"].tolist()
    directions = calls["direction"].tolist()
    parent = np.full(len(calls), -1, np.int64)
    open_calls: list[int] = []
    group = None
    for i in order.tolist():
        key = (ranks[i], steps[i], directions[i])
        if key != group:
            open_calls, group = [], key
        if key[2] != "forward" and not module_api[i]:
            continue
        path = paths[i]
        while open_calls:
            top = paths[open_calls[-1]]
            if within(path, top) and not (module_api[i] and path == top):
                break
            open_calls.pop()
        parent[i] = open_calls[-1] if open_calls else -1
        if module_api[i]:
            open_calls.append(i)
    return parent


def holds_calls(calls: Table, parent: np.ndarray) -> np.ndarray:
    """Module calls that hold other calls: in forward, the parents of some call; in backward, a
    module with a call of its path or below it in the same rank, step and direction."""
    held = np.zeros(len(calls), bool)
    held[parent[parent >= 0]] = True
    module_api = is_module(calls)
    backward = ~calls.isin("direction", "forward")
    key = lambda i: (int(calls["rank"][i]), int(calls["step"][i]), str(calls["direction"][i]))
    below = set()
    for i in np.flatnonzero(backward & ~module_api).tolist():
        parts = str(calls["module"][i]).split(".") if calls["module"][i] else []
        below.update((*key(i), ".".join(parts[:n])) for n in range(len(parts) + 1))
    for i in np.flatnonzero(backward & module_api).tolist():
        held[i] = (*key(i), str(calls["module"][i])) in below
    return held


def containing(parent: np.ndarray, members: np.ndarray) -> np.ndarray:
    """The forward module calls inside which one of `members` ran (`parent`: enclosing_modules)."""
    found = np.zeros(len(parent), bool)
    for i in np.flatnonzero(members).tolist():
        module = parent[i]
        while module >= 0 and not found[module]:
            found[module] = True
            module = parent[module]
    return found


def innermost(parent: np.ndarray, selected: np.ndarray) -> np.ndarray:
    """`selected` without the module calls inside which another selected call ran (`parent`:
    enclosing_modules)."""
    return selected & ~containing(parent, selected)
