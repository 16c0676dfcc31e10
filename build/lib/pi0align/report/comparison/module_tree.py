"""The model's modules as a tree, each with the worst error introduced by a call in it or below it:
where the HTML report's eye should go first."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pi0align.compare.result import Comparison
from pi0align.compare.table import Groups

CALL_DIRECTIONS = ("forward", "backward")
# shades of the worst introduced error: ≤ 1 introduces nothing; AMPLIFICATION (judge.py) and beyond
SHADES = ((1.0, "none"), (10.0, "low"), (1000.0, "high"))


@dataclass
class ModuleNode:
    name: str  # the last part of its path ("" for the model itself)
    path: str
    worst: float = math.nan  # the worst introduced error of a call in this module or below it
    culprits: int = 0  # culprits in this module or below it
    children: list[ModuleNode] = field(default_factory=list)

    @property
    def shade(self) -> str:
        """"culprit", "high", "low", "none", or "unknown" (no call judged)."""
        if self.culprits:
            return "culprit"
        if math.isnan(self.worst):
            return "unknown"
        return next((label for limit, label in SHADES if self.worst <= limit), "high")


def module_tree(comparison: Comparison) -> ModuleNode:
    """The root (the model) with every module that made a judged call, children in the order met."""
    root = ModuleNode("", "")
    nodes = {"": root}
    for rows in comparison.row_parts(["direction", "module", "introduced_error"]):
        calls = np.isin(rows["direction"].astype(str), CALL_DIRECTIONS)
        introduced = rows["introduced_error"].astype(np.float64)
        modules = rows["module"][calls].astype(object)
        if not len(modules):
            continue
        per_module = Groups(modules)  # in the order first met
        for module, value in zip(modules[per_module.first].tolist(), per_module.max(introduced[calls]).tolist()):
            for node in _ancestors(_node(module, nodes).path, nodes):
                node.worst = float(np.fmax(node.worst, value))  # NaN: not judged
    for culprit in comparison.culprits:
        if culprit.kind == "call":
            for node in _ancestors(_node(culprit.module, nodes).path, nodes):
                node.culprits += 1
    return root


def _node(path: str, nodes: dict[str, ModuleNode]) -> ModuleNode:
    if path not in nodes:
        parent = _node(path.rpartition(".")[0], nodes)
        nodes[path] = ModuleNode(path.rpartition(".")[2], path)
        parent.children.append(nodes[path])
    return nodes[path]


def _ancestors(path: str, nodes: dict[str, ModuleNode]) -> list[ModuleNode]:
    """The module at `path` and every module above it, the model last."""
    parts = path.split(".") if path else []
    return [nodes[".".join(parts[:n])] for n in range(len(parts), -1, -1)]
