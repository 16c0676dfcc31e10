"""Statistics of captured tensors with torch ops, batched: the torch backend's (and the native
backend's for tensors its kernel does not take, such as accelerator tensors).

`BatchedStatistics.add` only queues a tensor. At `flush` (before an in-place call could change a
queued tensor, after backward, at the step's end, or once enough is queued) the queued tensors of
one device and dtype are reduced together: one concatenation, then multi-tensor (`torch._foreach_*`)
reductions over views of it and prefix sums for the integer counts and the checksum, about thirty
ops for the whole group instead of a dozen per tensor. Results stay on the device until `collect`,
one copy per device. Nothing reads a value back per tensor or per flush.
"""

from __future__ import annotations

import math

import numpy as np
import torch

_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# A flush once this much is queued: queued tensors stay alive until then.
_FLUSH_ELEMENTS = 1 << 22
_FLUSH_TENSORS = 4096
_WINDOW = 1 << 20  # elements of the integer sums' prefix sums at a time


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


def stats_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype statistics are computed in: float64, except float32 for float32 and narrower
    floats on accelerators (where float64 is slow or missing). The CPU's float32 norm sums in order,
    off by 1e-5 of the norm at a million elements; its float64 costs little."""
    narrow = dtype.is_floating_point and dtype.itemsize <= 4 and device.type != "cpu"
    return torch.float32 if narrow else torch.float64


class BatchedStatistics:
    """Statistics of the tensors of one step, by slot. `in_place_seen`: the caller sees every
    in-place call and calls `before_change` first, so a queued tensor cannot change unseen;
    otherwise a copy is queued (1 op), and a tensor too large to copy is reduced at once."""

    def __init__(self, in_place_seen: bool) -> None:
        self._in_place_seen = in_place_seen
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._pending_elements = 0
        self._pending_storages: set[int] = set()
        self._done: list[tuple[np.ndarray, torch.Tensor, torch.Tensor]] = []  # (slots, floats [k, 4], ints [k, 3])
        self._ramps: dict[torch.device, torch.Tensor] = {}  # 1, 2, 3, … as int64, per device

    def add(self, tensor: torch.Tensor, slot: int) -> None:
        """Queue the statistics of a tensor that `skip_reason` accepts, into `slot`."""
        tensor = tensor.detach()
        large = tensor.numel() >= _FLUSH_ELEMENTS
        if not self._in_place_seen and not large:
            tensor = tensor.clone()
        self._pending.append((slot, tensor))
        self._pending_elements += tensor.numel()
        self._pending_storages.add(_storage(tensor))
        if large or self._pending_elements >= _FLUSH_ELEMENTS or len(self._pending) >= _FLUSH_TENSORS:
            self.flush()

    def before_change(self, tensors: list[torch.Tensor]) -> None:
        """`tensors` are about to change in place: reduce what is queued if any of it shares their memory."""
        if self._pending and any(s is None or s in self._pending_storages for s in map(_storage, tensors)):
            self.flush()

    def flush(self) -> None:
        """Reduce everything queued, one group per device and dtype."""
        groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
        for slot, tensor in self._pending:
            groups.setdefault((tensor.device, tensor.dtype), []).append((slot, tensor))
        self._pending, self._pending_elements, self._pending_storages = [], 0, set()
        for members in groups.values():
            slots = np.array([slot for slot, _ in members], dtype=np.int64)
            self._done.append((slots, *self._reduce([tensor for _, tensor in members])))

    def collect(self, floats: np.ndarray, ints: np.ndarray) -> None:
        """Write the slots' min, max, sum, sum of squares of the finite elements into `floats` [n, 4]
        and NaN count, Inf count, checksum into `ints` [n, 3]; one copy per device."""
        self.flush()
        by_device: dict[torch.device, list] = {}
        for done in self._done:
            by_device.setdefault(done[1].device, []).append(done)
        for done in by_device.values():
            slots = np.concatenate([d[0] for d in done])
            floats[slots] = torch.cat([d[1] for d in done]).cpu().double().numpy()
            floats[slots, 3] **= 2
            ints[slots] = torch.cat([d[2] for d in done]).cpu().numpy()
        self._done = []

    def _reduce(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(min, max, sum, norm of the finite elements [k, 4], NaN count, Inf count, checksum [k, 3]),
        on the tensors' device, of tensors of one device and dtype."""
        flats = [t.reshape(-1) for t in tensors]
        lengths = [f.numel() for f in flats]
        flat = torch.cat(flats) if len(flats) > 1 else flats[0]
        if flat.dtype == torch.bool:
            flat = flat.view(torch.uint8)
        acc = stats_dtype(flat.dtype, flat.device)
        values = flat if flat.dtype == acc else flat.to(acc)
        # Each pass that writes a tensor costs several times one that only reduces: few of them.
        # NaN and ±Inf become 0 for the sums, and the lowest value for the maxima.
        full = values.nan_to_num(0.0, 0.0, 0.0)
        masked = full.split(lengths)
        highest = values.nan_to_num(-math.inf, -math.inf, -math.inf).split(lengths)
        lowest = values.neg().nan_to_num_(-math.inf, -math.inf, -math.inf).split(lengths)
        lo = torch.stack(torch._foreach_max(lowest)).neg_()
        hi = torch.stack(torch._foreach_max(highest))
        # Σx = 2 Σ max(x, 0) - Σ |x|
        total = (2 * torch.stack(torch._foreach_norm(torch._foreach_clamp_min(masked, 0), 1))
                 - torch.stack(torch._foreach_norm(masked, 1)))
        norm = torch.stack(torch._foreach_norm(masked, 2))  # squared on the host: no float32 overflow
        floats = torch.stack([lo, hi, total, norm], 1)
        # unsigned for one byte, sign-extended for two, four and eight (docs/dump-format.md)
        bits = flat.view(_BITS_VIEW[flat.element_size()])
        bounds = np.cumsum([0, *lengths])  # where each tensor starts in the concatenation, then its end
        sums = self._integer_sums(values.isnan(), full != values, bits, bounds)
        starts = torch.tensor(bounds[:-1], device=flat.device)
        checksum = sums[3] - starts * sums[2]  # positions counted from each tensor's first element
        if flat.element_size() <= 4:
            checksum = ((checksum & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000  # 32-bit, sign-extended
        ints = torch.stack([sums[0], sums[1] - sums[0], checksum], 1)
        return floats, ints

    def _integer_sums(self, nan: torch.Tensor, nonfinite: torch.Tensor, bits: torch.Tensor,
                      bounds: np.ndarray) -> torch.Tensor:
        """[4, k] int64: per tensor, its NaN count, non-finite count, Σ bits and Σ bits × (position in
        the concatenation + 1), as differences of prefix sums (int64 wraps alike in any order), one
        window of the concatenation at a time (the counts' prefix sums in int32: a window holds
        fewer than 2^31 elements). bounds: each tensor's first position in it, then its end."""
        sums = bits.new_zeros((4, len(bounds) - 1), dtype=torch.int64)
        for first in range(0, int(bounds[-1]), _WINDOW):
            last = min(first + _WINDOW, int(bounds[-1]))
            window = slice(first, last)
            wide = bits[window].to(torch.int64)
            prefixes = (nan[window].cumsum(0, dtype=torch.int32),
                        nonfinite[window].cumsum(0, dtype=torch.int32),
                        wide.cumsum(0), (wide * self._ramp(last, bits.device)[window]).cumsum(0))
            # the tensors in the window, and where each one's part of it ends
            inside = slice(int(np.searchsorted(bounds, first, "right")) - 1, int(np.searchsorted(bounds, last, "left")))
            ends = torch.tensor(np.minimum(bounds[1:][inside], last) - 1 - first, device=bits.device)
            at_ends = torch.stack([prefix.index_select(0, ends).to(torch.int64) for prefix in prefixes])
            sums[:, inside] += at_ends.diff(dim=1, prepend=at_ends.new_zeros(4, 1))
        return sums

    def _ramp(self, length: int, device: torch.device) -> torch.Tensor:
        """1, 2, …, length as int64 on `device`, from a cache grown geometrically."""
        ramp = self._ramps.get(device)
        if ramp is None or ramp.numel() < length:
            size = max(length, 1 << 16, 2 * (ramp.numel() if ramp is not None else 0))
            ramp = self._ramps[device] = torch.arange(1, size + 1, dtype=torch.int64, device=device)
        return ramp[:length]


def finish_statistics(floats: np.ndarray, ints: np.ndarray, numel: np.ndarray) -> None:
    """Sums to the format's statistics, in place: sum to mean and sum of squares to norm over the
    finite elements; NaN where no element is finite."""
    finite = numel - ints[:, 0] - ints[:, 1]
    with np.errstate(invalid="ignore", divide="ignore"):
        floats[:, 2] /= finite
        floats[:, 3] = np.sqrt(floats[:, 3])
    floats[finite == 0] = np.nan


def _storage(tensor: torch.Tensor) -> int | None:
    """The address of the tensor's memory; None when it has none to tell (a subclass, say)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
