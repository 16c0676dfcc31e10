"""A noise reference: every floating result moved by up to N ulps of its dtype, at random.

`Dumper(perturb_ulps=N)` pushes this mode beneath its own for as long as it is started, in every
step, dumped or not: the run is the same run again, as another device's rounding would make it
(other reduction orders, fused kernels), and `pi0align compare A B --noise REF` learns from it how
far this model carries rounding, record by record. It is a reference, not a training run to keep.

What is moved: each fresh floating tensor a torch call returns (results that alias an input, such
as views and in-place calls, are left as they are: they involve no rounding), and, through a small
autograd function, the gradient that flows back into it. Zeros, whole numbers a float holds
exactly (every device computes a count, a position, a cumulative sum of a mask exactly: moved, PI0's
attention masks, made by comparing cumulative sums, would change), infinities and NaNs stay; a
move that would leave the finite range is not made. The draws come from a generator of their own,
seeded, so the run's own random numbers (data order, noise) are untouched.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from pi0align.dump.capturing.arguments import tensors_of

_quiet = torch._C.DisableTorchFunction  # the mode's own tensor work is not moved again
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}  # an integer of the float's width, to move its bits
# below this, every whole number a float holds is exact, and so is a device's sum of them: 2^precision
_EXACT_WHOLE = {torch.float64: 2.0**53, torch.float32: 2.0**24, torch.bfloat16: 2.0**8, torch.float16: 2.0**11}


class UlpMover:
    """Moves a tensor's elements by a random whole number of ulps in [-ulps, ulps]."""

    def __init__(self, ulps: int, seed: int) -> None:
        if ulps < 1:
            raise ValueError(f"perturb_ulps must be at least 1, not {ulps}")
        self.ulps, self.seed = int(ulps), int(seed)
        self._generators: dict[torch.device, torch.Generator] = {}

    def move(self, tensor: torch.Tensor) -> torch.Tensor:
        bits_dtype = _BITS.get(tensor.dtype)
        if bits_dtype is None or tensor.numel() == 0:
            return tensor
        with _quiet(), torch.no_grad():
            values = tensor.detach().contiguous()
            steps = torch.randint(-self.ulps, self.ulps + 1, values.shape, generator=self._generator(values.device),
                                  device=values.device, dtype=bits_dtype)
            moved = (values.view(bits_dtype) + steps).view(values.dtype)
            whole = (values == torch.round(values)) & (values.abs() < _EXACT_WHOLE[values.dtype])
            keep = whole | ~torch.isfinite(values) | ~torch.isfinite(moved)
            keep |= torch.signbit(moved) != torch.signbit(values)  # past zero: not a move by ulps
            return torch.where(keep, values, moved)

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
            generator.manual_seed(self.seed)
        return generator


class _Moved(torch.autograd.Function):
    """Forward: the result moved; backward: the gradient flowing back into it moved too."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, mover: UlpMover) -> torch.Tensor:
        ctx.mover = mover
        return mover.move(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.mover.move(grad), None


class UlpPerturbation(TorchFunctionMode):
    """Moves the floating results of every torch call made while it is entered."""

    def __init__(self, ulps: int, seed: int = 0) -> None:
        super().__init__()
        self.mover = UlpMover(ulps, seed)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor):
            return self._move(result, args, kwargs)
        if isinstance(result, (tuple, list)) and any(isinstance(r, torch.Tensor) for r in result):
            moved = [self._move(r, args, kwargs) if isinstance(r, torch.Tensor) else r for r in result]
            return type(result)(moved) if type(result) in (tuple, list) else _same_kind(result, moved)
        return result

    def _move(self, result: torch.Tensor, args, kwargs) -> torch.Tensor:
        if not result.is_floating_point() or result.layout != torch.strided or result.is_meta:
            return result
        with _quiet():
            storage = result.untyped_storage().data_ptr()
            if any(t.layout == torch.strided and not t.is_meta and t.untyped_storage().data_ptr() == storage
                   for t in tensors_of(args, kwargs)):
                return result  # a view of an input, or an input written in place: no rounding of its own
        if result.requires_grad:
            with _quiet():
                return _Moved.apply(result, self.mover)
        return self.mover.move(result)


def _same_kind(result, items: list):
    """A named tuple (torch.return_types.max, ...) rebuilt with moved items."""
    try:
        return type(result)(items)
    except TypeError:
        return result
