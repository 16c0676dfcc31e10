"""The optimizer's update as records: one `Optimizer.step` call per parameter (docs/dump-format.md).

Inputs: the parameter (arg 0), its gradient as the optimizer reads it (arg 1: after clipping) and
its state tensors (arg 2 on, in the order of their names); outputs: the updated parameter (arg 0)
and states (the same indexes). The call's arguments are the parameter group's hyper-parameters, so
that compare names the one that differs (an `eps`, a weight decay).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import torch

from pi0align.dump.file_format import OPTIMIZER_API as API

DIRECTION = "optimizer"
# Implementation switches, not hyper-parameters: runs that differ in them compute the same update
# up to rounding, which the records' limits judge.
_IMPLEMENTATION = frozenset({"params", "foreach", "fused", "capturable", "differentiable", "initial_lr"})


def hyper_parameters(group: dict, state: list[str], optimizer: type) -> str:
    """The group's numeric and boolean settings as JSON, with the names of the state tensors and
    the optimizer's class (replay recomputes the updates of the classes it knows)."""
    settings = {}
    for key, value in sorted(group.items()):
        if key in _IMPLEMENTATION:
            continue
        value = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        if isinstance(value, bool) or value is None or isinstance(value, int):
            settings[key] = value
        elif isinstance(value, float):
            settings[key] = value if math.isfinite(value) else repr(value)
        elif isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) for v in value):
            settings[key] = list(value)
    return json.dumps({"hyper_parameters": settings, "state": state,
                       "optimizer": f"{optimizer.__module__}.{optimizer.__qualname__}"}, separators=(",", ":"))


class _Described:
    """hyper_parameters of each (group, state names) of one optimizer step, computed once: every
    parameter of a group shares them (and a tensor learning rate is read back once, not once a
    parameter)."""

    def __init__(self, optimizer) -> None:
        self._optimizer, self._done = optimizer, {}

    def __call__(self, group: dict, state: list[tuple[str, torch.Tensor]]) -> str:
        names = [k for k, _ in state]
        key = (id(group), *names)
        if key not in self._done:
            self._done[key] = hyper_parameters(group, names, type(self._optimizer))
        return self._done[key]


def _state_tensors(state: dict) -> list[tuple[str, torch.Tensor]]:
    return sorted((k, v) for k, v in state.items() if isinstance(v, torch.Tensor))


class OptimizerRecorder:
    """Step hooks on one optimizer. `log()` is the step's StepLog (None outside dumped steps);
    `name_of(param)` is (record name prefix, module path); `selected(name)` the record filter."""

    def __init__(self, optimizer: torch.optim.Optimizer, log: Callable, name_of: Callable, selected: Callable):
        self.optimizer, self._log, self._name_of, self._selected = optimizer, log, name_of, selected
        self._open: list[tuple[int, str, torch.Tensor, dict]] = []  # (call id, record name, parameter, group)
        self._handles = [optimizer.register_step_pre_hook(self._before),
                         optimizer.register_step_post_hook(self._after)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _before(self, optimizer, args, kwargs) -> None:
        log = self._log()
        self._open = []
        if log is None:
            return
        described = _Described(optimizer)
        with torch._C.DisableTorchFunction():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    prefix, module = self._name_of(param)
                    name = f"{prefix}/{API}#0"
                    if not self._selected(name):
                        continue
                    state = _state_tensors(optimizer.state.get(param, {}))
                    call = log.open_call(name, module, API, DIRECTION, -1, described(group, state))
                    log.add_tensor(call, name, "input", 0, param)
                    log.add_tensor(call, name, "input", 1, param.grad)
                    for index, (_, tensor) in enumerate(state, start=2):
                        log.add_tensor(call, name, "input", index, tensor)
                    self._open.append((call, name, param, group))
            log.records.drain()  # the update writes into these tensors next

    def _after(self, optimizer, args, kwargs) -> None:
        log, opened, self._open = self._log(), self._open, []
        if log is None:
            return
        described = _Described(optimizer)
        with torch._C.DisableTorchFunction():
            for call, name, param, group in opened:
                state = _state_tensors(optimizer.state.get(param, {}))
                # a fused kernel (torch's fused AdamW, NpuFusedAdamW) writes the parameter and its
                # states without counting a change: counted here, so that their statistics are
                # taken anew, not those of the inputs (the same memory, the same version) reused
                for tensor in (param, *(tensor for _, tensor in state)):
                    torch.autograd.graph.increment_version(tensor)
                # the states exist from the first update on: named now
                log.set_arguments(call, described(group, state))
                log.add_tensor(call, name, "output", 0, param)
                for index, (_, tensor) in enumerate(state, start=2):
                    log.add_tensor(call, name, "output", index, tensor)
