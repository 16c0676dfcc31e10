"""The monitor's per-tensor norms: of tensors (the gradients; the modules' outputs, with their
largest magnitudes), and after the optimizer's step of the parameters and Adam's, its two moments'
and its update's, lr × m̂ / (√v̂ + ε) (docs/monitor-format.md).

Two implementations, chosen once by `parameter_norms()`: `TorchNorms`, torch's multi-tensor kernels
on the parameters' device (a GPU's, an NPU's; the reference), and `CompiledNorms`,
`csrc/parameter_norms.cpp` through ctypes for parameters on the CPU, where torch's multi-tensor
norm runs tensor by tensor (its dispatch costing more than the memory it reads) and Adam's update
takes it ten passes: here one call reads each tensor once.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# after the optimizer's step, in the order of the compiled sums
QUANTITIES = ("param_norm", "exp_avg_norm", "exp_avg_sq_norm", "update_norm")
_SOURCE = Path(__file__).parent.parent / "csrc" / "parameter_norms.cpp"
_P = ctypes.c_void_p
_FUNCTIONS = {"pi0align_squared_sums": [ctypes.c_int64, _P, _P, ctypes.c_int, _P],
              "pi0align_squares_and_largest": [ctypes.c_int64, _P, _P, ctypes.c_int, _P],
              "pi0align_adam_sums": [ctypes.c_int64, _P, _P, _P, _P, _P, _P, ctypes.c_int, _P]}


@dataclass(frozen=True)
class Norms:
    """One quantity's norms: `at`, the parameters (indices) that have it; `values`, their norms
    (1-D, on the parameters' device; None when `at` is empty)."""

    at: list[int]
    values: torch.Tensor | None


NONE = Norms([], None)


@dataclass(frozen=True)
class _Adam:
    """The parameters (indices) with Adam's states, their moments, and per parameter its scalars."""

    at: list[int]
    first: list[torch.Tensor]
    second: list[torch.Tensor]
    second_scales: list[float]  # 1 / √(1 − β₂ᵗ)
    eps: list[float]
    update_scales: list[float]  # lr / (1 − β₁ᵗ)


def _adam_states(optimizer: torch.optim.Optimizer | None, parameters: list, learning_rates: list[float] | None
                 ) -> _Adam | None:
    if optimizer is None:
        return None
    groups = {id(p): (group, k) for k, group in enumerate(optimizer.param_groups) for p in group["params"]}
    at, first, second, second_scales, eps, update_scales = [], [], [], [], [], []
    for index, parameter in enumerate(parameters):
        state = optimizer.state.get(parameter, {})
        if not ("exp_avg" in state and "exp_avg_sq" in state and "step" in state):
            continue  # another optimizer, or no step yet
        (group, k), step = groups[id(parameter)], float(state["step"])
        lr = learning_rates[k] if learning_rates is not None and k < len(learning_rates) else float(group["lr"])
        beta1, beta2 = group["betas"]
        at.append(index)
        first.append(state["exp_avg"])
        second.append(state["exp_avg_sq"])
        second_scales.append((1 - beta2 ** step) ** -0.5)
        eps.append(float(group["eps"]))
        update_scales.append(lr / (1 - beta1 ** step))
    return _Adam(at, first, second, second_scales, eps, update_scales) if at else None


class TorchNorms:
    """Torch's multi-tensor kernels, on the parameters' device."""

    status = "torch"

    def norms(self, tensors: list[torch.Tensor | None]) -> Norms:
        """The L2 norm of each tensor that is not None."""
        at = [i for i, t in enumerate(tensors) if t is not None]
        return Norms(at, torch.stack(torch._foreach_norm([tensors[i] for i in at]))) if at else NONE

    def norms_and_largest(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each tensor's L2 norm and largest magnitude (NaN where it holds a NaN)."""
        # from the extremes: torch's ∞-norm of a strided tensor is ten times slower
        extremes = torch.stack([torch.stack((t.amax(), t.amin())) for t in tensors]).abs().amax(1)
        return torch.stack(torch._foreach_norm(tensors)), extremes

    def after_step(self, optimizer: torch.optim.Optimizer | None, parameters: list,
                   learning_rates: list[float] | None = None) -> dict[str, Norms]:
        """QUANTITIES: the parameters', and Adam's of those with its states (`learning_rates`: each
        param group's in the step, where a scheduler has since changed them)."""
        adam = _adam_states(optimizer, parameters, learning_rates)
        result = {"param_norm": self.norms(parameters)}
        if adam is None:
            return result | dict.fromkeys(QUANTITIES[1:], NONE)
        denominators = torch._foreach_sqrt(adam.second)
        torch._foreach_mul_(denominators, adam.second_scales)
        torch._foreach_add_(denominators, adam.eps)
        directions = torch.stack(torch._foreach_norm(torch._foreach_div(adam.first, denominators)))
        scales = torch.tensor(adam.update_scales, dtype=directions.dtype, device=directions.device)
        return result | {"exp_avg_norm": Norms(adam.at, torch.stack(torch._foreach_norm(adam.first))),
                         "exp_avg_sq_norm": Norms(adam.at, torch.stack(torch._foreach_norm(adam.second))),
                         "update_norm": Norms(adam.at, directions * scales)}


class CompiledNorms:
    """`csrc/parameter_norms.cpp`, for tensors on the CPU (float32 as they are, others converted),
    on `threads` threads."""

    status = "compiled"

    def __init__(self, functions: dict, threads: int) -> None:
        self._squared_sums, self._squares_and_largest, self._adam_sums = (functions[name] for name in _FUNCTIONS)
        self.threads = threads

    def norms(self, tensors: list[torch.Tensor | None]) -> Norms:
        """The L2 norm of each tensor that is not None."""
        at = [i for i, t in enumerate(tensors) if t is not None]
        if not at:
            return NONE
        present = _float32([tensors[i] for i in at])
        pointers, sizes, sums = _pointers(present), _sizes(present), np.empty(len(at), np.float64)
        self._squared_sums(len(at), pointers.ctypes.data, sizes.ctypes.data, self.threads, sums.ctypes.data)
        return Norms(at, torch.from_numpy(np.sqrt(sums)))

    def norms_and_largest(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each tensor's L2 norm and largest magnitude (NaN where it holds a NaN)."""
        present = _float32(tensors)
        pointers, sizes, sums = _pointers(present), _sizes(present), np.empty((len(present), 2), np.float64)
        self._squares_and_largest(len(present), pointers.ctypes.data, sizes.ctypes.data, self.threads,
                                  sums.ctypes.data)
        return torch.from_numpy(np.sqrt(sums[:, 0])), torch.from_numpy(sums[:, 1])

    def after_step(self, optimizer: torch.optim.Optimizer | None, parameters: list,
                   learning_rates: list[float] | None = None) -> dict[str, Norms]:
        """TorchNorms.after_step, in one pass over the parameters and both moments (a parameter
        without Adam's states: its own norm)."""
        if not parameters:
            return dict.fromkeys(QUANTITIES, NONE)
        adam = _adam_states(optimizer, parameters, learning_rates)
        at = adam.at if adam is not None else []
        moved = _float32(parameters)
        # every array the call reads held in a name until it returns; null: no Adam's states
        first, second = (_float32(tensors) for tensors in ((adam.first, adam.second) if adam else ([], [])))
        first_pointers, second_pointers = np.zeros(len(moved), np.uintp), np.zeros(len(moved), np.uintp)
        first_pointers[at], second_pointers[at] = _pointers(first), _pointers(second)
        second_scales, eps = np.zeros(len(moved)), np.zeros(len(moved))
        if adam is not None:
            second_scales[at], eps[at] = adam.second_scales, adam.eps
        pointers, sizes = _pointers(moved), _sizes(moved)
        sums = np.empty((len(moved), len(QUANTITIES)), np.float64)
        self._adam_sums(len(moved), pointers.ctypes.data, first_pointers.ctypes.data, second_pointers.ctypes.data,
                        sizes.ctypes.data, second_scales.ctypes.data, eps.ctypes.data, self.threads, sums.ctypes.data)
        norms = np.sqrt(sums)
        result = {"param_norm": Norms(list(range(len(moved))), torch.from_numpy(norms[:, 0].copy()))}
        if adam is None:
            return result | dict.fromkeys(QUANTITIES[1:], NONE)
        norms = norms[at]
        norms[:, 3] *= adam.update_scales
        return result | {quantity: Norms(at, torch.from_numpy(np.ascontiguousarray(norms[:, column])))
                         for column, quantity in enumerate(QUANTITIES) if column}


def _float32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous() for t in tensors]


def _pointers(tensors: list[torch.Tensor]) -> np.ndarray:
    return np.array([t.data_ptr() for t in tensors], np.uintp)


def _sizes(tensors: list[torch.Tensor]) -> np.ndarray:
    return np.array([t.numel() for t in tensors], np.int64)


def parameter_norms(device: torch.device) -> TorchNorms | CompiledNorms:
    """The implementation for parameters on `device`: the compiled one on the CPU where it builds,
    on this process's share of the cores it may use (torchrun's LOCAL_WORLD_SIZE processes share
    them), at most 8."""
    if device.type != "cpu":
        return TorchNorms()
    from pi0align.native import FLAGS, Library

    flags = [*FLAGS, "-pthread", "-fno-math-errno"]  # sqrt vectorised
    library = Library("parameter_norms", [_SOURCE], _FUNCTIONS, flags)
    if not library.load():
        return TorchNorms()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return CompiledNorms(library.functions, min(8, max(1, share)))
