"""The dump's hot path behind one small interface, with two implementations that the `Dumper`
chooses once, at construction, and records in the dump file (`backend`):

- `native` (native_backend.py): the C++ extension built from `csrc/`: autograd hooks, the step's
  records and the CPU statistics kernel, on its own thread;
- `torch` (torch_backend.py): the reference, in Python with batched torch ops: what an accelerator
  runs, and every machine without a compiler.

"auto" takes `native` where it builds, else `torch`. Both record the same tables
(docs/dump-format.md); the dump tests run on both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from pi0align.dump.file_format import BACKENDS
from pi0align.errors import UserError

# (role, arg_index, gradient), called with torch functions disabled
Sink = Callable[[str, int, torch.Tensor], None]


class StepRecords(Protocol):
    """One step's tensor records, their statistics, samples and stored copies."""

    # (open_call, open_backward): StepLog's two methods as functions taking its calls table (the
    # tuple of its column lists) first, which the step's StepLog uses instead of its own; or None.
    calls_table: tuple | None

    def record(self, call_id: int, name: str, role: str, arg_index: int, tensors: list[torch.Tensor]) -> int:
        """Record tensors as arguments `arg_index`, `arg_index + 1`, … of a call; returns the last
        one's row. A tensor already recorded in the step, unchanged, borrows its statistics."""

    def set_call(self, row: int, call_id: int) -> None:
        """Give a record another call; -1 drops it."""

    def grad_sink(self, name: str, forward_id: int, open_backward: Callable[[int], int]):
        """Where the gradients of forward call `forward_id` go (for `watch`): its backward row is
        opened by `open_backward(forward_id)` when the first arrives, and none is recorded once the
        step is closed."""

    def before_change(self, tensors: list[torch.Tensor]) -> None:
        """These tensors are about to change in place: take whatever statistics of them are queued."""

    def drain(self) -> None:
        """Take every statistic queued so far (gradients are about to change in place)."""

    def close(self) -> None:
        """The step has ended: gradients arriving later are not recorded."""

    def columns(self) -> dict[str, np.ndarray | list | tuple]:
        """captured_step.CAPTURED_RECORD_COLUMNS, plus `slot` (of the statistics, -1: none) and
        `sample_row`, dropped rows included: the numbers as arrays, the str columns as sequences
        or `CodedColumn`s (the writer process makes them arrays)."""

    def statistics(self) -> tuple[np.ndarray, np.ndarray]:
        """Per slot, (float64 [n, 4] min, max, mean, norm; int64 [n, 3] NaN count, Inf count,
        checksum), after `drain`."""


class Backend(Protocol):
    name: str
    status: str  # stored in the dump file: what runs, and why not the other where it matters
    # The sampler's CPU gather (`takes`, `gather`, `wait`; `sample_cache`, `remember`, `set_host`:
    # the layouts by which the step's records gather samples without the sampler), or None: samples
    # taken with torch ops.
    host_gather: object | None
    # Tensor mode's copies into the writer's ring on another thread, or None: made at once.
    # queue(tensor, address) -> the queued call to wait for, 0 when not taken (copied at once
    # instead); finished() -> queued calls run so far; wait(): until all have run.
    copier: object | None
    # The capture mode's __torch_function__ for the calls it has a plan for, or None: the mode's
    # Python one handles every call. api_handler(mode, capture, plans, filtered) -> the handler;
    # plans: func -> its API's name (recorded), None (run only) or False (Python's): the rest go
    # to mode._planned(func, types, args, kwargs), which adds their plans; filtered: names are
    # asked of the capture's filter.
    api_handler: object | None
    # Capture._enter_module and _leave_module without a Python frame per module call, or None: the
    # capture's own run. (enter_module(capture, filtered, module_level, path, module, args, kwargs),
    # leave_module(capture, path, output)); module_level: the level records module calls.
    module_handlers: tuple | None

    def tensors_of(self, *values) -> list[torch.Tensor]:
        """Every tensor in `values`, depth-first through tuples, lists and mappings."""

    def input_edges(self, inputs: list[torch.Tensor]):
        """The gradient edges of the inputs that require grad (None: none does); taken before an
        in-place call."""

    def watch(self, outputs: list[torch.Tensor], edges, sink) -> None:
        """Report, during backward, the gradients flowing into `outputs` and, through the call's own
        autograd nodes, out to the inputs of `edges`; nothing is added to the graph."""

    def watch_tensor_grads(self, tensors: list[torch.Tensor], role: str, sink) -> None:
        """Report the full gradient of each tensor that requires grad (module inputs)."""

    def describe_arguments(self, args: tuple, kwargs: dict) -> str:
        """A call's arguments as JSON (arguments.describe_arguments)."""

    def call_site(self, stacks, module: str) -> int:
        """The stack id of the call site that called into torch (stacks.call_site)."""

    def records(self, in_place_seen: bool, tensor_sink, sampler) -> StepRecords:
        """A step's records. in_place_seen: the capture sees every in-place call and calls
        `before_change` first, so statistics may wait for it; else what waits is a copy.
        tensor_sink(tensor, now=False) -> stored path (copied now, not queued, where `now`), or
        None; sampler: Sampler or None."""


def choose_backend(name: str) -> Backend:
    """The backend called `name` (one of BACKENDS); UserError when it cannot run here."""
    from pi0align.dump.backends.native_backend import NativeBackend
    from pi0align.dump.backends.torch_backend import TorchBackend

    if name not in ("auto", *BACKENDS):
        raise UserError(f"dump backend must be one of auto, {', '.join(BACKENDS)}, not {name!r}")
    if name == "torch":
        return TorchBackend("chosen")
    native = NativeBackend.load()
    if isinstance(native, NativeBackend):
        return native
    if name == "native":
        raise UserError(f"the native dump backend cannot be built here: {native}")
    return TorchBackend(f"native backend not built: {native}")
