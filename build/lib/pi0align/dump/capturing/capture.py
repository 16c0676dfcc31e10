"""Hooks that feed a StepLog: torch API calls (a TorchFunctionMode), module forwards, autograd
nodes for backward, parameters and their gradients. `remove` undoes everything `install` did."""

from __future__ import annotations

import functools
import sys

import torch
from torch.overrides import TorchFunctionMode

from pi0align.dump.backends.backend import Backend
from pi0align.dump.backends.steplog import Filter, StepLog
from pi0align.dump.capturing.arguments import named_tensors
from pi0align.dump.capturing.naming import ApiNames, is_inplace, next_name
from pi0align.dump.capturing.optimizer import OptimizerRecorder
from pi0align.dump.capturing.stacks import Stacks

_BACKWARD = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
_quiet = torch._C.DisableTorchFunction  # the dumper's own tensor work is never captured


class Capture:
    """Everything installed on a model during dumped steps; records into the current StepLog
    through `backend`'s hooks."""

    def __init__(self, level: str, selected: Filter, backend: Backend) -> None:
        self.level = level
        self.selected = selected
        self.api_names = ApiNames()
        self.name_counts: dict[tuple[str, str, str], int] = {}  # the step's, for next_name
        self.stacks = Stacks()
        self.log: StepLog | None = None
        self._mode: _ApiMode | None = None
        self._mode_paused = False  # left by Tensor.backward, entered again at the next forward
        self._backward: tuple | None = None  # (Tensor.backward before, the wrapper in its place)
        self._backward_wrapper = None  # made once per Tensor.backward it wraps, as plans refer to it
        # The native API handler's plans (_ApiMode._plan), kept from one install to the next: made
        # again at each, a step started and stopped around (msprobe's way) would run each function's
        # first call through Python.
        self.plans: dict = {}
        self._hooked: list[dict] = []  # the gradient-hook dicts of the parameters it has a hook in
        self._hook_key = object()  # its hooks' key in those dicts (torch's keys are ints)
        self._wrapped: list[tuple[torch.nn.Module, object]] = []  # (module, its own forward before, or None)
        self._npu_patches: list[tuple[object, str, object]] = []  # (torch_npu, attribute, original)
        self._running = False  # a captured call is running: calls it makes are not captured
        self._module_paths: list[str] = []  # modules executing, innermost last
        self._open_modules: list[tuple | None] = []  # (call_id, name, sink) per executing module
        # After backward, the rest of the step (clipping, optimizer) is not the model's: calls are
        # captured again from the model's next forward (gradient accumulation) or the next step.
        self.after_backward = False
        # Of the model last installed on, made once rather than at each dumped step: fewer objects
        # for the garbage collector to promote (a full collection costs more than a step here).
        # Modules and parameters added to the model later are not seen.
        self._model: torch.nn.Module | None = None
        self._modules: list[tuple[str, torch.nn.Module]] = []
        self._parameters: list[tuple[str, str, torch.nn.Parameter]] = []  # (name, module, param)
        self._parameter_names: dict[int, tuple[str, str]] = {}  # id(param) -> (name, module)
        self._optimizer: OptimizerRecorder | None = None
        self._forwards: dict[torch.nn.Module, object] = {}  # module -> its forward wrapper
        self._grad_hooks: list[tuple[torch.nn.Parameter, object]] = []  # (selected parameter, its gradient hook)
        self._param_calls: dict[int, int] | None = None  # id(param) -> its call, once the step read them
        self._grad_rows: dict[int, int] = {}  # id(param) -> its latest gradient record's row
        # DDP writes the reduced gradient back into .grad in place: asked once a step, not per gradient
        self._grads_reduced_in_place = False
        self._input_edges, self._watch = backend.input_edges, backend.watch
        self._watch_tensor_grads = backend.watch_tensor_grads
        self._tensors_of = backend.tensors_of
        self._describe_arguments, self._call_site = backend.describe_arguments, backend.call_site
        self._api_handler = backend.api_handler
        if backend.module_handlers is None:
            self._enter, self._leave = self._enter_module, self._leave_module
        else:
            enter, leave = backend.module_handlers
            self._enter = functools.partial(enter, self, not selected.selects_all, level != "api")
            self._leave = functools.partial(leave, self)

    @property
    def installed(self) -> bool:
        return bool(self._hooked or self._wrapped) or self._mode is not None

    def install(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None = None) -> None:
        if model is not self._model:
            self._model, self._forwards = model, {}
            self._modules = list(model.named_modules()) if model is not None else []
            self._parameters = [(name, name.rpartition(".")[0], param)
                                for name, param in (model.named_parameters() if model is not None else ())]
            self._parameter_names = {id(param): (name, module) for name, module, param in self._parameters}
            self._grad_hooks = []
            for name, _, param in self._parameters:
                record_name = f"{name}/Parameter#0"
                if self.selected(record_name):
                    self._grad_hooks.append((param, self._grad_hook(record_name)))
        if optimizer is not None:
            self._optimizer = OptimizerRecorder(optimizer, lambda: self.log, self._optimized_name, self.selected)
        for path, module in self._modules:
            self._wrap_forward(path, module)
        for param, hook in self._grad_hooks:
            if param.requires_grad:
                self._hooked.append(_add_gradient_hook(param, self._hook_key, hook))
        if self.level != "module":
            self._patch_npu()
            self._mode = _ApiMode(self, self._api_handler)
            self._mode.__enter__()
            self._patch_backward()

    def _patch_npu(self) -> None:
        """torch_npu's fused ops (`torch_npu.npu_*`) bypass `__torch_function__`: wrap them."""
        npu = sys.modules.get("torch_npu")
        for name in dir(npu) if npu is not None else ():
            func = getattr(npu, name)
            if name.startswith("npu_") and callable(func) and not isinstance(func, type):
                setattr(npu, name, self._npu_wrapper(func, f"NPU.{name}"))
                self._npu_patches.append((npu, name, func))

    def _npu_wrapper(self, func, api: str):
        @functools.wraps(func)
        def call(*args, **kwargs):
            if self.log is None or self.after_backward or self._running:
                return func(*args, **kwargs)
            with _quiet():
                return self.api_call(func, api, args, kwargs)

        return call

    def _patch_backward(self) -> None:
        """`Tensor.backward` leaves the mode while it runs and until the model's next forward: the
        calls in between (clipping, the optimizer) are not recorded, and so need not pass through
        the mode, whose cost they would pay each."""
        original = torch.Tensor.backward
        if self._backward_wrapper is None or self._backward_wrapper.__wrapped__ is not original:
            self._backward_wrapper = self._backward_wrapping(original)
        torch.Tensor.backward = self._backward_wrapper
        self._backward = (original, self._backward_wrapper)

    def _backward_wrapping(self, original):
        @functools.wraps(original)
        def backward(tensor, *args, **kwargs):
            if self.log is None or torch.overrides._get_current_function_mode() is not self._mode:
                return original(tensor, *args, **kwargs)  # through the mode, if under another one
            self._mode.__exit__(None, None, None)
            self._mode_paused = True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self.backward_done()

        return backward

    def is_backward(self, func) -> bool:
        return func in _BACKWARD or (self._backward is not None and func is self._backward[1])

    def backward_done(self) -> None:
        """Nothing is recorded from here until the model's next forward (gradient accumulation) or
        the next step."""
        self.after_backward = True
        self.log.records.drain()  # clipping and the optimizer change gradients in place next

    def _resume(self) -> None:
        """Record again: a forward begins."""
        self.after_backward = False
        if self._mode_paused:
            self._mode.__enter__()
            self._mode_paused = False

    def remove(self) -> None:
        if self._mode is not None:
            if not self._mode_paused:
                self._mode.__exit__(None, None, None)
            self._mode, self._mode_paused = None, False
        if self._backward is not None:
            torch.Tensor.backward = self._backward[0]
            self._backward = None
        for hooks in self._hooked:
            hooks.pop(self._hook_key, None)
        for module, previous in self._wrapped:
            if previous is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = previous
        for npu, name, func in self._npu_patches:
            setattr(npu, name, func)
        if self._optimizer is not None:
            self._optimizer.remove()
            self._optimizer = None
        self._npu_patches.clear()
        self._hooked.clear()
        self._wrapped.clear()
        self._module_paths.clear()
        self._open_modules.clear()

    def _wrap_forward(self, path: str, module: torch.nn.Module) -> None:
        """Wrap the module's `forward` on the instance: unlike forward hooks, this also sees
        `module.forward(...)` called directly, as LeRobot's PI0 does. The wrapper of the class's
        forward is kept for the next dumped step; one of an instance's own forward is not. The
        wrapper goes into the instance's `__dict__` directly: `forward` is no parameter, buffer or
        submodule, which is all nn.Module's `__setattr__` and `__delattr__` (Python) would look for,
        at ~0.5 ms a start and stop of PI0 small's modules."""
        previous = module.__dict__.get("forward")
        forward = self._forwards.get(module) if previous is None else None
        if forward is None or getattr(forward.__wrapped__, "__func__", None) is not type(module).forward:
            forward = self._forward_wrapper(path, module, module.forward)
            if previous is None:
                self._forwards[module] = forward
        module.__dict__["forward"] = forward
        self._wrapped.append((module, previous))

    def _forward_wrapper(self, path: str, module: torch.nn.Module, original):
        enter, leave = self._enter, self._leave

        @functools.wraps(original)
        def forward(*args, **kwargs):
            enter(path, module, args, kwargs)
            output = None
            try:
                output = original(*args, **kwargs)
            finally:
                leave(path, output)
            return output

        return forward

    def begin_step(self, log: StepLog) -> None:
        self.log = log
        self._resume()
        self.name_counts.clear()
        self._param_calls = None
        self._grad_rows = {}
        self._grads_reduced_in_place = _several_ranks()
        self._module_paths.clear()
        self._open_modules.clear()

    def end_step(self) -> StepLog | None:
        """Close the step; None when nothing ran in it."""
        log, self.log = self.log, None
        if log is None:
            return None
        log.close()  # gradients of a graph kept past the step are not its
        return log if log.call_count else None

    def _optimized_name(self, param: torch.Tensor) -> tuple[str, str]:
        """(name, module path) of a parameter the optimizer updates; one of no module's by its place."""
        known = self._parameter_names.get(id(param))
        if known is not None:
            return known
        optimizer = self._optimizer.optimizer
        place = next(f"optimizer.{g}.{i}" for g, group in enumerate(optimizer.param_groups)
                     for i, p in enumerate(group["params"]) if p is param)
        return place, ""

    # ---- forward -------------------------------------------------------------------------------

    def _read_parameters(self) -> None:
        """The parameters' values as the step's forward first reads them, once per step: each a
        `Parameter` call of its own, ahead of the step's other calls (its gradient joins it)."""
        self._param_calls = {}
        with _quiet():
            for name, module, param in self._parameters:
                record_name = f"{name}/Parameter#0"
                if self.selected(record_name):
                    call_id = self.log.open_call(record_name, module, "Parameter", "parameter", -1, "{}")
                    self.log.add_tensor(call_id, record_name, "parameter", 0, param)
                    self._param_calls[id(param)] = call_id

    def _record_data(self, args: tuple, kwargs: dict) -> None:
        """The model's inputs (the batch, each micro-batch) as `Data` calls, one per key, after the
        step's parameters."""
        if self._param_calls is None:
            self._read_parameters()
        with _quiet():
            for key, tensor in named_tensors(args, kwargs):
                name = next_name(self.name_counts, key, "Data", "data")
                if self.selected(name):
                    call_id = self.log.open_call(name, "", "Data", "data", -1, "{}")
                    self.log.add_tensor(call_id, name, "output", 0, tensor)

    def _open(self, module: str, api: str, args: tuple, kwargs: dict) -> tuple[int, str] | None:
        """Name the call and open its row; None when the filter leaves it out."""
        if self._param_calls is None:
            self._read_parameters()
        name = next_name(self.name_counts, module, api, "forward")
        if not self.selected(name):
            return None
        call_id = self.log.open_call(name, module, api, "forward", self._call_site(self.stacks, module),
                                     self._describe_arguments(args, kwargs))
        return call_id, name

    def api_call(self, func, api: str, args: tuple, kwargs: dict):
        """Run one torch call, recording its inputs and outputs and watching its backward."""
        module = self._module_paths[-1] if self._module_paths else ""
        inputs = self._tensors_of(args, kwargs)
        if is_inplace(api, kwargs):
            # The call overwrites an input: its statistics and gradient edge must come first.
            opened = self._open(module, api, args, kwargs)
            if opened is None:
                return self._run(func, args, kwargs)
            self.log.add_tensors(opened[0], opened[1], "input", inputs)
            edges = self._input_edges(inputs) if torch.is_grad_enabled() else None
            self.log.records.before_change(inputs)  # statistics still queued may be of a tensor about to change
            result = self._run(func, args, kwargs)
            outputs = self._tensors_of(result) or inputs[:1]
        else:
            result = self._run(func, args, kwargs)
            outputs = self._tensors_of(result)
            if not outputs:
                return result  # a query (size, item, ...) or an action (backward): nothing to record
            opened = self._open(module, api, args, kwargs)
            if opened is None:
                return result
            self.log.add_tensors(opened[0], opened[1], "input", inputs)
            edges = self._input_edges(inputs) if torch.is_grad_enabled() else None
        call_id, name = opened
        self.log.add_tensors(call_id, name, "output", outputs)
        if edges or any(o.requires_grad for o in outputs):
            self._watch(outputs, edges, self.log.grad_sink(call_id, name))
        return result

    def _run(self, func, args: tuple, kwargs: dict):
        self._running = True
        try:
            return func(*args, **kwargs)
        finally:
            self._running = False

    def _enter_module(self, path: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """A module's forward begins (the backend's `module_handlers` do the same without Python)."""
        self._module_paths.append(path)
        self._resume()
        opened = None
        if self.log is not None and not path:
            self._record_data(args, kwargs)
        if self.log is not None and self.level != "api":
            with _quiet():
                opened = self._open(path, f"Module.{type(module).__name__}", args, kwargs)
                if opened is not None:
                    call_id, name = opened
                    inputs = self._tensors_of(args, kwargs)
                    self.log.add_tensors(call_id, name, "input", inputs)
                    opened = (call_id, name, self.log.grad_sink(call_id, name))
                    self._watch_tensor_grads(inputs, "grad_input", opened[2])
        self._open_modules.append(opened)

    def _leave_module(self, path: str, output) -> None:
        if not self._module_paths or self._module_paths[-1] != path:
            return  # installed while this module was already running
        self._module_paths.pop()
        opened = self._open_modules.pop()
        if opened is not None and self.log is not None and output is not None:
            call_id, name, sink = opened
            with _quiet():
                outputs = self._tensors_of(output)
                self.log.add_tensors(call_id, name, "output", outputs)
                self._watch(outputs, None, sink)

    # ---- backward ------------------------------------------------------------------------------

    def _grad_hook(self, record_name: str):
        """The hook that records a parameter's gradient once torch has accumulated it into .grad."""

        def hook(param: torch.nn.Parameter) -> None:
            if self.log is None or param.grad is None:
                return
            with _quiet():
                earlier = self._grad_rows.get(id(param))
                if earlier is not None:
                    self.log.drop(earlier)  # gradient accumulation: the last sum is the gradient
                if self._param_calls is None:  # started between the forward and the backward
                    self._read_parameters()
                # under DDP the reduced gradient is written back into .grad, in place, as backward
                # ends: the record is this rank's own, taken now (the optimizer's records hold the reduced)
                gradient = param.grad.detach().clone() if self._grads_reduced_in_place else param.grad
                self._grad_rows[id(param)] = self.log.add_tensor(self._param_calls[id(param)], record_name,
                                                                 "parameter_grad", 0, gradient)

        return hook


class _ApiMode(TorchFunctionMode):
    """Sees every torch function, Tensor method and operator call; torch pops the mode while a
    call runs, so calls made inside a captured call are not captured again.

    With the backend's `api_handler`, that handler is the mode's `__torch_function__` (the
    instance's, in C++): it runs and records a call as `Capture.api_call` does where it has the
    function's plan (`_plan`), and hands every other call to `_planned`, which makes the plan and
    handles the call here."""

    def __init__(self, capture: Capture, api_handler=None) -> None:
        super().__init__()
        self.capture = capture
        if api_handler is not None:
            self.__torch_function__ = api_handler(self, capture, capture.plans, not capture.selected.selects_all)

    def _planned(self, func, types, args=(), kwargs=None):
        """The native handler's way for a call of a function it has no plan for, planned False, or
        given `out=` or `inplace=`."""
        try:
            self.capture.plans.setdefault(func, self._plan(func))
        except TypeError:  # an unhashable function: handled here each time
            pass
        return _ApiMode.__torch_function__(self, func, types, args, kwargs)

    def _plan(self, func) -> str | bool | None:
        """The API's name where the native handler records the call, None where it only runs it
        (not recorded), False where it hands it to Python (backward, a call that writes its
        arguments)."""
        api = self.capture.api_names(func)
        if api is None:
            return None
        return False if self.capture.is_backward(func) or is_inplace(api, {}) else api

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        capture = self.capture
        api = capture.api_names(func)
        if api is None or capture.log is None or capture.after_backward:
            return func(*args, **kwargs)
        if capture.is_backward(func):
            result = func(*args, **kwargs)
            capture.backward_done()
            return result
        return capture.api_call(func, api, args, kwargs)


def _add_gradient_hook(param: torch.nn.Parameter, key: object, hook) -> dict:
    """`param.register_post_accumulate_grad_hook(hook)`, after its first time without the handle
    and the checks (PI0 small's 125 took a step start 0.6 ms): the hook put into the dict of hooks
    that torch keeps on the parameter and calls (as torch's FSDP reads it). Returns that dict."""
    hooks = param._post_accumulate_grad_hooks
    if hooks is None:  # torch makes the dict, and tells autograd to call it
        param.register_post_accumulate_grad_hook(hook).remove()
        hooks = param._post_accumulate_grad_hooks
    hooks[key] = hook
    return hooks


def _several_ranks() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1
