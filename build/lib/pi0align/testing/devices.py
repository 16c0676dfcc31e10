"""Another device's numerics, emulated on the CPU: TorchFunctionModes to push *before* a Dumper
(so that the dumper records what they return), and a fault in one call of one module.

They imitate what differs between devices: results rounded differently (`UlpNoise`), matmul
inputs rounded to TF32 (`Tf32Matmuls`, what `allow_tf32` and Ascend's HF32 do), one kernel a few
percent off (`Fault`) or every call of one function (`EveryCall`), an Adam kernel that computes
with another epsilon or learning rate than its settings say (`adam_kernel`). `UlpNoise` moves
values as pi0align's own noise reference does (dump/capturing/perturb.py's UlpMover) but forward results
only: the reference moves gradients too.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref

import torch
import torch.nn.functional as F  # noqa: N812
import torch.optim.adam as adam_functions  # torch.optim's namespace leaves its submodules out
from torch.overrides import TorchFunctionMode

from pi0align.dump.capturing.perturb import UlpMover

_quiet = torch._C.DisableTorchFunction
# torch.Tensor's C methods, which msprobe (it wraps torch.Tensor's Python attributes) does not
# record either: an emulated fault's own arithmetic is no call of the run
_times, _view_as = torch._C.TensorBase.mul, torch._C.TensorBase.view_as
MATMUL_FAMILY = frozenset({F.linear, torch.matmul, torch.Tensor.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
                           torch.einsum, F.conv1d, F.conv2d, F.conv3d, torch.Tensor.__matmul__,
                           F.scaled_dot_product_attention})


class UlpNoise(TorchFunctionMode):
    """Every fresh floating forward result moved by a random whole number of ulps in [-ulps, ulps]
    (gradients pass through unmoved, unlike the noise reference's)."""

    def __init__(self, ulps: int = 1, seed: int = 0) -> None:
        super().__init__()
        self.mover = UlpMover(ulps, seed)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        fresh = isinstance(result, torch.Tensor) and not _aliases_an_input(result, args, kwargs)
        if fresh and result.is_floating_point():
            with _quiet():
                moved = self.mover.move(result.detach())
                return result + (moved - result).detach() if result.requires_grad else moved
        return result


def _aliases_an_input(result: torch.Tensor, args, kwargs) -> bool:
    pointer = result.untyped_storage().data_ptr()
    tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
    return any(t.untyped_storage().data_ptr() == pointer for t in tensors)


def round_to_tf32(tensor: torch.Tensor) -> torch.Tensor:
    """float32 rounded to TF32's 10-bit mantissa (round to nearest, ties away), as a float32 tensor."""
    with _quiet():
        bits = tensor.contiguous().view(torch.int32)
        rounded = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
        return torch.where(torch.isfinite(tensor), rounded, tensor)


class Tf32Matmuls(TorchFunctionMode):
    """The matmul family computed from float32 inputs rounded to TF32, gradients passing through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in MATMUL_FAMILY:
            args = tuple(_tf32(a) for a in args)
            kwargs = {k: _tf32(v) for k, v in (kwargs or {}).items()}
        return func(*args, **(kwargs or {}))


def _tf32(value):
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        with _quiet():
            rounded = round_to_tf32(value.detach())
            return value + (rounded - value).detach() if value.requires_grad else rounded
    return value


class Fault(TorchFunctionMode):
    """The `index`-th call of `func` inside each forward of `module` returns its result × `factor`
    (`backward`: returns it exactly, and its gradient × `factor`): one faulty kernel, in the
    module's first `forwards` forwards only when given (a fault at step 0 alone), from its
    `first`-th forward on (1: from the start; 2: from step 1 on). Made, it wraps the module's
    forward (to know when it runs) until `detach()`."""

    def __init__(self, module: torch.nn.Module, func, index: int = 0, factor: float = 1.03,
                 backward: bool = False, forwards: int | None = None, first: int = 1) -> None:
        super().__init__()
        self.func, self.index, self.factor, self.backward, self.forwards = func, index, factor, backward, forwards
        self.first = first
        self.module, self._depth, self._seen, self._forwards_seen = module, 0, 0, 0
        original = module.forward

        def forward(*args, **kwargs):
            if self._depth == 0:
                self._seen = 0
                self._forwards_seen += 1
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        self._original = module.__dict__.get("forward")
        module.forward = forward

    def detach(self) -> None:
        """Give the module its forward back."""
        if self._original is None:
            del self.module.forward
        else:
            self.module.forward = self._original

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if self._depth and func is self.func and self._forwards_seen >= self.first and (
                self.forwards is None or self._forwards_seen <= self.forwards):
            self._seen += 1
            if self._seen == self.index + 1 and isinstance(result, torch.Tensor):
                if self.backward:
                    return _GradientTimes.apply(result, self.factor)
                with _quiet():
                    return _times(result, self.factor)
        return result


class EveryCall(TorchFunctionMode):
    """Every call of `func` returns its result × `factor`: a kernel off wherever it runs."""

    def __init__(self, func, factor: float) -> None:
        super().__init__()
        self.func, self.factor = func, factor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is self.func and isinstance(result, torch.Tensor):
            with _quiet():
                return _times(result, self.factor)
        return result


class DrawBefore(TorchFunctionMode):
    """Before every call of `func` (a random draw), one number drawn from the default generator:
    the draws after it come from another generator state, as where one side makes a draw the
    other does not (dropout left on, an extra random call)."""

    def __init__(self, func) -> None:
        super().__init__()
        self.func = func

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is self.func:
            torch.rand(1)
        return func(*args, **(kwargs or {}))


class _GradientTimes(torch.autograd.Function):
    """The identity forward; the gradient flowing back through it × factor."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return _view_as(tensor, tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _times(grad, ctx.factor), None


@contextlib.contextmanager
def adam_kernel(eps: float | None = None, lr_scale: float = 1.0):
    """torch.optim's Adam and AdamW (single-tensor form, the CPU's) compute with `eps` instead of
    the group's, and the learning rate × `lr_scale`, while their settings, and so the dump's
    records of them, say otherwise: a device kernel with a constant of its own."""
    original = adam_functions._single_tensor_adam

    def kernel(*args, **kwargs):
        kwargs["eps"] = kwargs["eps"] if eps is None else eps
        kwargs["lr"] = kwargs["lr"] * lr_scale
        return original(*args, **kwargs)

    adam_functions._single_tensor_adam = kernel
    try:
        yield
    finally:
        adam_functions._single_tensor_adam = original


class EmulatedDevice(TorchFunctionMode):
    """A device pushed into every Python process a command starts (`device_site/sitecustomize.py`,
    on PYTHONPATH, with its description as JSON in PI0ALIGN_EMULATED_DEVICE), for the tests of a
    tool that runs the training itself (`bisect`, `attach`). The `index`-th call of `function` in
    each forward of `module` (a path in the policy whose forward is on the stack, `policy` its class;
    calls outside one, such as a replay's, are left as they are) is, once the policy's optimizer has
    made `from_update` updates (its Adam step count, restored from a checkpoint: a fault that
    strikes from some state on),
    `factor` × itself, or, `nondeterministic`, moved by between half and all of that relative amount,
    either way, drawn from the operating system's entropy (two runs of one step differ there, and by
    no less than half the amount: a draw near zero would hide the non-determinism it stands for)."""

    def __init__(self, module: str, function: str, index: int = 0, factor: float = 1.0, from_update: int = 0,
                 nondeterministic: float = 0.0, policy: str = "PI0Policy") -> None:
        super().__init__()
        self.path, self.func, self.index, self.factor = module, _FUNCTIONS[function], index, factor
        self.policy = policy  # the class name of the policy `module` is a path in
        self.from_update, self.nondeterministic = from_update, nondeterministic
        self.module: torch.nn.Module | None = None
        self._forward, self._seen = None, 0  # the module's forward running, and the calls seen in it
        self.optimizers = weakref.WeakSet()  # every optimizer made from now on (the run's is one)
        made = torch.optim.Optimizer.__init__

        def remember(optimizer, *args, **kwargs):
            made(optimizer, *args, **kwargs)
            self.optimizers.add(optimizer)

        torch.optim.Optimizer.__init__ = remember

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        forward = self._module_forward() if func is self.func else None
        if forward is None:
            return result
        if forward is not self._forward:  # another forward of the module: count from its start
            self._forward, self._seen = forward, 0
        self._seen += 1
        if self._seen != self.index + 1 or self._updates() < self.from_update or not isinstance(result, torch.Tensor):
            return result
        factor = self.factor if not self.nondeterministic else 1.0 + self.nondeterministic * _either_way_from_half()
        with _quiet():
            return _times(result, factor)

    def _module_forward(self):
        """The frame of the module's forward this call runs in, None outside one (finding the module
        in the PI0 policy whose forward is on the stack, the first time)."""
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if self.module is None and type(owner).__name__ == self.policy:
                self.module = owner.get_submodule(self.path)
                return self._module_forward()
            if owner is not None and owner is self.module and frame.f_code.co_name == "forward":
                return frame
            frame = frame.f_back
        return None

    def _updates(self) -> int:
        """The updates the run's optimizer has made: its Adam step count."""
        return max((int(state["step"]) for optimizer in list(self.optimizers) for state in optimizer.state.values()
                    if "step" in state), default=0)


_FUNCTIONS = {"gelu": F.gelu, "softmax": F.softmax, "linear": F.linear}


def _either_way_from_half() -> float:
    """A draw from the operating system's entropy in ±[0.5, 1]: a sign bit and 15 bits of magnitude."""
    bits = int.from_bytes(os.urandom(2), "little")
    return (-1.0 if bits & 1 else 1.0) * (0.5 + 0.5 * (bits >> 1) / 32767)
