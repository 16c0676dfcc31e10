"""Statistics of captured tensors, computed on the tensor's own device and read back once per step.

`StatsBatch.add` queues a handful of reductions per tensor and returns a slot; `collect` stacks
every slot's results and copies them to the host in one transfer per device. Nothing here reads a
value back per tensor on an accelerator. On the CPU the fused kernel (`kernel.py`) reads each
tensor once, on the kernel's own thread when the capture sees every in-place call, and writes
host values; where it cannot run, torch ops do the work, one finiteness check picking the cheap
unmasked path for the (usual) tensors without NaN or Inf, and a `StatsWorker` thread can take
that work off the training thread.
"""

from __future__ import annotations

import math
import queue
import threading

import numpy as np
import torch

from pi0align.dump.kernel import KERNEL

_COLUMNS = 4096  # the checksum's matrix view: any width gives the same checksum; this one is fastest on CPU
_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def skip_reason(tensor: torch.Tensor) -> str:
    """Why a tensor gets no statistics ("" when it gets them)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return f"subclass:{type(tensor).__name__}"
    if tensor.layout != torch.strided:
        return "sparse"
    if tensor.is_meta:
        return "meta"
    if tensor.is_complex():
        return "complex"
    if tensor.is_quantized:
        return "subclass:quantized"
    if tensor.numel() == 0:
        return "empty"
    return ""


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are computed in: float32 for float32 and narrower floats, else float64."""
    return torch.float32 if dtype.is_floating_point and dtype.itemsize <= 4 else torch.float64


class ChecksumWeights:
    """Cached position ramps 0, 1, 2, … per device and integer dtype, grown geometrically."""

    def __init__(self) -> None:
        self._cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        ramp = self._cache.get((device, dtype))
        if ramp is None or ramp.numel() < length:
            size = max(length, _COLUMNS, 2 * (ramp.numel() if ramp is not None else 0))
            ramp = self._cache[(device, dtype)] = torch.arange(size, dtype=dtype, device=device)
        return ramp[:length]


def checksum(flat: torch.Tensor, ramps: ChecksumWeights) -> torch.Tensor:
    """Σ bits[i] × (i + 1) over a flat tensor (docs/dump-format.md); 0-d, on its device.

    Integer arithmetic wraps the same way in any order, so equal bits give an equal checksum on
    any device whatever its reduction order. Seen as a matrix of `_COLUMNS` columns, position
    i = r·C + c, so the sum is C·Σ_r r·rowsum_r + Σ_c c·colsum_c + Σ all: two cheap reductions
    instead of a product per element.
    """
    size = flat.element_size()
    bits = flat.view(_BITS_VIEW[size])
    dtype = torch.int64 if size == 8 else torch.int32
    if size < 4:
        bits = bits.to(dtype)
    rows = bits.numel() // _COLUMNS
    tail = bits[rows * _COLUMNS :]
    total = _dot(tail, ramps.get(tail.numel(), bits.device, dtype)) + tail.sum(dtype=dtype) * (rows * _COLUMNS + 1)
    if rows:
        matrix = bits[: rows * _COLUMNS].view(rows, _COLUMNS)
        row_sums = matrix.sum(1, dtype=dtype)
        by_row = _dot(row_sums, ramps.get(rows, bits.device, dtype))
        by_column = (_dot(matrix.sum(0, dtype=dtype), ramps.get(_COLUMNS, bits.device, dtype))
                     + row_sums.sum(dtype=dtype))
        total = total + by_row * _COLUMNS + by_column
    return total


def _dot(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if values.device.type == "cpu":
        return torch.dot(values, weights)  # one fused pass; accelerators lack integer dot
    return torch.sum(values * weights, dtype=values.dtype)


def torch_stats(tensor: torch.Tensor, weights: ChecksumWeights) -> tuple:
    """(min, max, sum, sum of squares, NaN count, Inf count, checksum) as 0-d tensors on the
    tensor's device, the counts None when known to be 0: accelerators, and the CPU without the
    fused kernel."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    acc = stats_dtype(flat.dtype)
    values = flat if flat.dtype == acc else flat.to(acc)
    lo, hi = values.amin(), values.amax()  # twice as fast as aminmax on the CPU
    total = values.sum()
    squares = torch.dot(values, values)
    nan = inf = None
    # A NaN or Inf anywhere makes the sums NaN or Inf. Reading them back is free on the CPU
    # only; elsewhere the masked statistics are always computed, without a synchronisation.
    if values.device.type != "cpu" or not math.isfinite(total.item() + squares.item()):
        lo, hi, total, squares, nan, inf = _masked(values)
    return lo, hi, total, squares, nan, inf, checksum(flat, weights)


class StatsWorker:
    """Computes the statistics of CPU tensors on a second thread while training goes on (torch
    releases the GIL inside its kernels). Whoever may change a queued tensor in place, or needs
    the results, calls `drain()` first."""

    def __init__(self, weights: ChecksumWeights) -> None:
        self._weights = weights
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._done = threading.Condition()
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="pi0align-dump-stats", daemon=True).start()

    def submit(self, results: dict, slot: int, tensor: torch.Tensor) -> None:
        with self._done:
            self._pending += 1
        self._queue.put((results, slot, tensor))

    def drain(self) -> None:
        """Wait until every queued tensor has its statistics, computing queued ones meanwhile."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:  # close() came first: leave it for the thread
                self._queue.put(None)
                break
            self._compute(item)
        with self._done:
            self._done.wait_for(lambda: self._pending == 0)
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """End the thread once the queue is done."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._compute(item)

    def _compute(self, item: tuple) -> None:
        results, slot, tensor = item
        try:
            with torch._C.DisableTorchFunction():
                results[slot] = torch_stats(tensor, self._weights)
        except BaseException as error:  # noqa: BLE001 - raised by drain() in the training thread
            self._error = error
        finally:
            with self._done:
                self._pending -= 1
                self._done.notify_all()


class StatsBatch:
    """Statistics of every tensor captured in one step, gathered on the device until `collect`.
    CPU tensors the fused kernel takes are written to host arrays, by the kernel's own thread when
    `queued`; other CPU tensors go to `worker` when one is given; the rest to torch ops. With the
    extension's recorder (steplog.py), the recorder numbers the slots and holds the kernel's
    arrays, and hands the tensors the kernel does not take to `compute`."""

    def __init__(self, weights: ChecksumWeights, worker: StatsWorker | None = None, queued: bool = False) -> None:
        self._weights = weights
        self._worker = worker
        self._queued = queued
        self._results: dict[int, tuple] = {}  # slot -> torch_stats' tensors
        self._numel: list[int] = []
        self._floats, self._ints = np.full((0, 4), np.nan), np.zeros((0, 3), dtype=np.int64)  # the kernel's

    def add(self, tensor: torch.Tensor) -> int:
        """Queue the statistics of a tensor that `skip_reason` accepts; returns its slot."""
        slot = len(self._numel)
        self._numel.append(tensor.numel())
        if KERNEL.supports(tensor):
            if slot >= len(self._floats):
                self._grow(slot + 1)
            KERNEL.stats(tensor, self._floats_at + self._floats.strides[0] * slot,
                         self._ints_at + self._ints.strides[0] * slot, self._queued)
        else:
            self.compute(tensor, slot)
        return slot

    def compute(self, tensor: torch.Tensor, slot: int) -> None:
        """The statistics of a tensor the kernel does not take, with torch ops, into `slot`."""
        if self._worker is not None and tensor.device.type == "cpu":
            self._worker.submit(self._results, slot, tensor)
        else:
            self._results[slot] = torch_stats(tensor, self._weights)

    def _grow(self, needed: int) -> None:
        """At least twice the kernel's rows, once the queued calls that write into them have run."""
        self.drain()
        rows = max(256, needed, 2 * len(self._floats))
        floats, ints = np.full((rows, 4), np.nan), np.zeros((rows, 3), dtype=np.int64)
        floats[: len(self._floats)], ints[: len(self._ints)] = self._floats, self._ints
        self._floats, self._ints = floats, ints
        self._floats_at, self._ints_at = floats.ctypes.data, ints.ctypes.data

    def drain(self) -> None:
        """Wait for the statistics queued so far (a queued tensor is about to change)."""
        if self._queued:
            KERNEL.wait()
        if self._worker is not None:
            self._worker.drain()

    def collect(self, recorded: tuple[bytes, bytes, bytes] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(float64 [n, 4] min/max/mean/norm, int64 [n, 3] nan/inf/checksum), one copy per device.
        `recorded`: the recorder's kernel rows and element counts (its `statistics`), taken after
        `drain()`."""
        self.drain()
        if recorded is None:
            n = len(self._numel)
            numel = np.array(self._numel, dtype=np.float64)
            floats, ints = np.full((n, 4), np.nan), np.zeros((n, 3), dtype=np.int64)
            rows = min(n, len(self._floats))
            floats[:rows], ints[:rows] = self._floats[:rows], self._ints[:rows]
        else:
            floats = np.frombuffer(recorded[0], np.float64).reshape(-1, 4).copy()
            ints = np.frombuffer(recorded[1], np.int64).reshape(-1, 3).copy()
            numel = np.frombuffer(recorded[2], np.int64).astype(np.float64)
        if self._results:
            on_device = sorted(self._results)
            results = [self._results[slot] for slot in on_device]
            floats[on_device] = _stack_to_host([value for r in results for value in r[:4]]).reshape(-1, 4)
            ints[on_device, 2] = _stack_to_host([r[6] for r in results])
            counted = [slot for slot in on_device if self._results[slot][4] is not None]
            if counted:
                counts = [count for slot in counted for count in self._results[slot][4:6]]
                ints[counted, :2] = _stack_to_host(counts).reshape(-1, 2)
        finite = numel - ints[:, 0] - ints[:, 1]
        with np.errstate(invalid="ignore", divide="ignore"):
            floats[:, 2] /= finite
            floats[:, 3] = np.sqrt(floats[:, 3])
        floats[finite == 0] = np.nan
        return floats, ints


def _masked(values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """min, max, sum, sum of squares over the finite elements, then the NaN and Inf counts."""
    finite = torch.isfinite(values)
    nan = torch.isnan(values).sum()
    inf = values.numel() - finite.sum() - nan
    zeroed = torch.where(finite, values, 0)
    lo = torch.where(finite, values, math.inf).amin()
    hi = torch.where(finite, values, -math.inf).amax()
    return lo, hi, zeroed.sum(), torch.dot(zeroed, zeroed), nan, inf


def _stack_to_host(values: list[torch.Tensor]) -> np.ndarray:
    """Stack same-shape tensors (any dtypes, any devices) into one host array, one copy per device."""
    by_group: dict[tuple, list[int]] = {}
    for i, value in enumerate(values):
        by_group.setdefault((value.device, value.dtype), []).append(i)
    out = None
    for (_, dtype), indices in by_group.items():
        host = torch.stack([values[i] for i in indices]).cpu()
        host = host.numpy() if dtype in (torch.int64, torch.float64) else host.double().numpy()
        if out is None:
            out = np.empty((len(values), *host.shape[1:]), dtype=host.dtype)
        out[indices] = host
    return out
