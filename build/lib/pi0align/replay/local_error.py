"""Replay one recorded call in float64 and measure the recorded side's local error.

Forward: the call's inputs (floating ones as float64) and recorded arguments go through the same
torch function; the local error of each output is its relative L2 distance to that result.
Backward: the forward call is replayed with autograd from its inputs, and the side's own
gradients flowing into its outputs are pushed back through it; the local error of each gradient
flowing out to an input is measured the same way. The optimizer's update of a parameter
(`Optimizer.step`) is recomputed from its recorded parameter, gradient, states and
hyper-parameters (optimizer.py).

Asked (`kernel=True`), the same call also runs through this CPU's own kernel in the recorded
dtypes, from the same inputs: that kernel's local error is the rounding a sound kernel puts on
those very inputs (a long sum, terms that cancel), what `audit` holds a run alone to.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pi0align.dump.capturing.arguments import tensors_of
from pi0align.dump.file_format import OPTIMIZER_API
from pi0align.replay.apis import NotReplayable, resolve
from pi0align.replay.arguments import rebuild
from pi0align.replay.optimizer import replay_update


@dataclass(frozen=True)
class RecordedCall:
    """What one side recorded of one call, its tensors as numpy arrays by arg_index."""

    api: str
    args: str  # the call's `args` JSON
    inputs: dict[int, np.ndarray]  # the forward call's inputs
    results: dict[int, np.ndarray]  # forward: outputs; backward: gradients flowing out to inputs
    grad_outputs: dict[int, np.ndarray] | None = None  # backward: gradients flowing into outputs
    dtypes: dict[int, str] = field(default_factory=dict)  # the inputs' recorded dtypes (bfloat16 read as float32)


@dataclass(frozen=True)
class Replayed:
    """Local error per result (arg_index -> relative L2 error against the float64 replay), or
    why the call was not replayed."""

    errors: dict[int, float] = field(default_factory=dict)
    reason: str = ""
    kernel_errors: dict[int, float] = field(default_factory=dict)  # this CPU's kernel's, where asked

    def __bool__(self) -> bool:
        return not self.reason

    @property
    def error(self) -> float:
        """The largest local error of the call's results."""
        return max(self.errors.values(), default=math.nan)

    @property
    def kernel_error(self) -> float:
        """The largest local error of this CPU's own kernel on the same inputs (NaN: not run)."""
        return max(self.kernel_errors.values(), default=math.nan)


_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def replay(call: RecordedCall, kernel: bool = False) -> Replayed:
    """Replay `call` on the CPU in float64 (and, `kernel`, through this CPU's kernel in the
    recorded dtypes); never raises for a call that cannot be replayed."""
    try:
        func = None if call.api == OPTIMIZER_API else resolve(call.api)
        if not call.args:
            raise NotReplayable("arguments not recorded")
        described = json.loads(call.args)
        if not isinstance(described, dict):
            raise NotReplayable("arguments not recorded")
        count = 1 + max(call.inputs, default=-1)
        if set(call.inputs) != set(range(count)):
            raise NotReplayable("inputs not dumped in full")
        with torch.no_grad():
            inputs = [_as_float64(call.inputs[i]) for i in range(count)]
        references = _results(func, described, inputs, call)
        errors = {}
        for index, recorded in call.results.items():
            if index >= len(references) or references[index] is None:
                raise NotReplayable(f"the replay has no result {index}")
            reference = references[index]
            if tuple(reference.shape) != tuple(recorded.shape):
                raise NotReplayable(f"replayed result {index} has shape {list(reference.shape)}, "
                                    f"recorded {list(recorded.shape)}")
            errors[index] = local_error(torch.from_numpy(np.asarray(recorded)), reference.detach())
        return Replayed(errors, kernel_errors=_kernel_errors(func, described, call, references) if kernel else {})
    except NotReplayable as why:
        return Replayed(reason=str(why))
    except Exception as error:  # noqa: BLE001 - whatever torch raises, the compare goes on
        text = str(error).strip().splitlines()
        return Replayed(reason=f"replay failed: {type(error).__name__}: {text[0][:120] if text else ''}")


def _results(func, described: dict, inputs: list[torch.Tensor], call: RecordedCall) -> list[torch.Tensor | None]:
    """The call's results recomputed from `inputs` (in whatever dtypes they are)."""
    if func is None:
        updated = replay_update(described, inputs)
        return [updated.get(i) for i in range(1 + max(updated))]
    if call.grad_outputs is None:
        return _forward(func, described, inputs)
    return _backward(func, described, inputs, call)


def _kernel_errors(func, described: dict, call: RecordedCall, references: list) -> dict[int, float]:
    """This CPU's kernel's local error per result, from the recorded inputs in their recorded
    dtypes; empty where it cannot run there (a dtype the CPU has no kernel for)."""
    try:
        with torch.no_grad():
            inputs = [torch.from_numpy(np.array(call.inputs[i])) for i in range(len(call.inputs))]
            inputs = [x.to(_DTYPES.get(call.dtypes.get(i, ""), x.dtype)) if x.is_floating_point() else x
                      for i, x in enumerate(inputs)]
        results = _results(func, described, inputs, call)
        return {index: local_error(results[index].detach(), references[index].detach())
                for index in call.results if index < len(results) and results[index] is not None}
    except Exception:  # noqa: BLE001 - no kernel here: the call is held to its standard alone
        return {}


def local_error(recorded: torch.Tensor, reference: torch.Tensor) -> float:
    """‖recorded − reference‖ / ‖reference‖ in float64 over positions where both are finite
    (0/0 = 0, x/0 = ∞); ∞ when their NaN / ±Inf patterns differ."""
    recorded, reference = recorded.double(), reference.double()
    difference = float(torch.linalg.vector_norm(recorded - reference))
    scale = float(torch.linalg.vector_norm(reference))
    if not (math.isfinite(difference) and math.isfinite(scale)):  # rare: only then look at every element
        finite_r, finite_f = torch.isfinite(recorded), torch.isfinite(reference)
        same_pattern = torch.equal(finite_r, finite_f) and torch.equal(
            torch.nan_to_num(recorded[~finite_r], nan=0.0), torch.nan_to_num(reference[~finite_f], nan=0.0)) \
            and torch.equal(recorded[~finite_r].isnan(), reference[~finite_f].isnan())
        if not same_pattern:
            return math.inf
        recorded, reference = recorded[finite_r], reference[finite_f]
        difference = float(torch.linalg.vector_norm(recorded - reference))
        scale = float(torch.linalg.vector_norm(reference))
    if scale == 0.0:
        return 0.0 if difference == 0.0 else math.inf
    return difference / scale


def _as_float64(array: np.ndarray) -> torch.Tensor:
    """A tensor of its own (the replay may write into it), floating values in float64."""
    tensor = torch.from_numpy(np.asarray(array))
    return tensor.double() if tensor.is_floating_point() and tensor.dtype != torch.float64 else tensor.clone()


def _call(func, described: dict, inputs: list[torch.Tensor]):
    args = rebuild(described.get("args", []), inputs)
    kwargs = rebuild(described.get("kwargs", {}), inputs)
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise NotReplayable("arguments not recorded")
    if func in _INDEXING and len(args) > 1:
        args[1] = _index(args[1])
    result = func(*args, **kwargs)
    return tensors_of(result) or inputs[:1]  # an in-place call without a result changed its first input


_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)


def _index(index):
    """The dump writes tuples as lists: an index list holding a slice, None, Ellipsis or a tensor
    was a tuple (`t[:, 0]`); a list of plain integers stays an advanced index (`t[[0, 2]]`)."""
    if isinstance(index, list) and any(not isinstance(i, int) or isinstance(i, bool) for i in index):
        return tuple(index)
    return index


def _forward(func, described: dict, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return _call(func, described, inputs)


def _backward(func, described: dict, inputs: list[torch.Tensor], call: RecordedCall) -> list[torch.Tensor | None]:
    leaves = {i: inputs[i].requires_grad_(True) for i in call.results if inputs[i].is_floating_point()}
    if len(leaves) != len(call.results):
        raise NotReplayable("gradient of an input that is not floating")
    used = [x.clone() if i in leaves else x for i, x in enumerate(inputs)]  # an in-place call must not write a leaf
    with torch.enable_grad():
        outputs = _call(func, described, used)
    pairs = [(outputs[j], torch.from_numpy(np.asarray(g, np.float64)))
             for j, g in (call.grad_outputs or {}).items() if j < len(outputs) and outputs[j].requires_grad]
    if not pairs:
        raise NotReplayable("no gradient reaches the replayed outputs")
    order = sorted(leaves)
    grads = torch.autograd.grad([o for o, _ in pairs], [leaves[i] for i in order],
                                [g.reshape(o.shape).to(o.dtype) for o, g in pairs], allow_unused=True)
    references: list[torch.Tensor | None] = [None] * len(inputs)
    for i, grad in zip(order, grads):
        references[i] = torch.zeros_like(leaves[i]) if grad is None else grad
    return references
