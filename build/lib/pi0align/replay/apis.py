"""API names of a dump → torch callables, resolved only against torch's own overridable functions.

A dump names calls `Torch.<fn>`, `Functional.<fn>`, `Tensor.<method>` (docs/dump-format.md). Each
name is looked up as one attribute of its namespace and accepted only if the result is one of the
functions torch dispatches through `__torch_function__` (`torch.overrides`): tensor maths, never
`torch.load`, `torch.save` or anything that reaches files, processes or Python's import system.
"""

from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F  # noqa: N812

from pi0align.dump.file_format import RANDOM_FUNCTIONS

_NAMESPACES = {"Torch": torch, "Functional": F, "Tensor": torch.Tensor}
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Moving a tensor to an accelerator is moving it to the CPU here.
_TO_CPU = {"Tensor.cuda": "Tensor.cpu", "Tensor.npu": "Tensor.cpu", "Tensor.xpu": "Tensor.cpu"}


class NotReplayable(Exception):
    """Why a call cannot be replayed, in a few words (the compare's `replay` column)."""


def resolve(api: str):
    """The torch callable of an API name; NotReplayable when there is none to trust."""
    api = _TO_CPU.get(api, api)
    prefix, _, attribute = api.partition(".")
    if prefix == "Module":
        raise NotReplayable("module call (judged by the calls inside it)")
    if prefix == "NPU":
        raise NotReplayable("torch_npu op: no CPU kernel")
    if prefix == "Parameter":
        raise NotReplayable("parameter")
    namespace = _NAMESPACES.get(prefix)
    if namespace is None or not _IDENTIFIER.match(attribute):
        raise NotReplayable(f"unknown API {api!r}")
    if attribute in RANDOM_FUNCTIONS:  # a float64 replay cannot draw the same numbers
        raise NotReplayable("random op")
    func = getattr(namespace, attribute, None)
    if func is None or func not in _overridable():
        raise NotReplayable(f"{api} is not a torch function that can be replayed")
    return func


@functools.cache
def _overridable() -> frozenset:
    functions = set()
    for namespace_functions in torch.overrides.get_overridable_functions().values():
        functions.update(namespace_functions)
    # Tensor operators torch dispatches as methods (a + b -> Tensor.add, t[i] -> Tensor.__getitem__)
    functions.update(getattr(torch.Tensor, name) for name in dir(torch.Tensor)
                     if name.startswith("__") and callable(getattr(torch.Tensor, name, None))
                     and getattr(torch.Tensor, name) in torch.overrides.get_testing_overrides())
    return frozenset(f for f in functions if _hashable(f))


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
