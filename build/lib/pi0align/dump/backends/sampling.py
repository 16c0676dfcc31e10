"""Sampled element positions that depend only on a record's name, role, argument index and shape,
so that two runs on two devices sample the same elements."""

from __future__ import annotations

import numpy as np
import torch

from pi0align.dump.backends.sample_rows import SampleRows
from pi0align.dump.file_format import sample_positions

_INT32_MAX = 2**31 - 1


class Sampler:
    """Gathers the sampled elements of captured tensors (those the backend's `host_gather` takes
    straight into a host table, others with torch indexing on their device, both without copying
    views); positions and memory offsets are computed once per record name and layout, the
    positions kept as rows of one table. With the native backend, a record whose layout was seen
    before is gathered by the recorder itself (`native_cache`), without calling `add`."""

    def __init__(self, size: int, host_gather=None, queued: bool = False) -> None:
        self.size = size
        self._host_gather = host_gather if host_gather is not None else _NoHostGather()
        self.queued = queued  # gathered on the native kernel's thread: values ready after its wait()
        # -> (row of the positions table, count, memory offsets, their address, offsets on the device or None, wide)
        self._cache: dict[tuple, tuple] = {}
        # Positions, -1-padded to `size`: row 0 all -1 (records without a sample), then one row per
        # cached layout; int32 until a tensor of 2^31 elements or more needs int64 (docs/dump-format.md).
        self._position_table = np.full((256, size), -1, dtype=np.int32)
        self._layouts = 1  # rows of the positions table in use
        self._positions_handed = 0  # rows of the positions table handed over so far (`collect`)
        self._host = np.full((0, size), np.nan)  # per row, float64: the kernel writes a record's values here
        self._on_device: dict[int, torch.Tensor] = {}  # row -> float64 values on the tensor's device
        self._position_rows: list[int] = []  # per row, its row of the positions table
        self._counts: list[int] = []
        self._wide_rows = 0  # rows of the step whose positions need int64
        # the recorder's way to the layouts seen so far (it appends to the two lists above), or None
        self.native_cache = self._host_gather.sample_cache(self._position_rows, self._counts, queued)

    def add(self, tensor: torch.Tensor, name: str, role: str, arg_index: int, now: bool = False) -> int:
        """Queue the sample of one record (gathered now where `now`); returns its row."""
        key = (name, role, arg_index, tensor.shape, tensor.stride(), tensor.device)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._cache[key] = self._layout(tensor, name, role, arg_index)
        position_row, count, offsets, offsets_at, on_device, wide = cached
        row = len(self._position_rows)
        if on_device is None:
            if row + 1 >= len(self._host):  # one row to spare: the NaN row of records without a sample
                self._grow(row + 2)
            # the kernel writes the first `count` values; those past them are NaN'd at `collect`
            self._host_gather.gather(tensor, offsets_at, count, self._host_at + self._row_bytes * row,
                                     self.queued and not now)
            if not wide:  # a wide row stays here, where `_wide_rows` counts it
                self._host_gather.remember(self.native_cache, tensor, name, role, arg_index, position_row, count,
                                           offsets_at)
        else:
            memory = tensor.detach().as_strided((_extent(tensor),), (1,))  # the elements' span, views not copied
            self._on_device[row] = memory.index_select(0, on_device).to(torch.float64)
        self._position_rows.append(position_row)
        self._counts.append(count)
        self._wide_rows += wide
        return row

    def _layout(self, tensor: torch.Tensor, name: str, role: str, arg_index: int) -> tuple:
        """The cache entry of a record name and tensor layout."""
        positions = sample_positions(name, role, arg_index, tuple(tensor.shape), self.size)
        offsets = _memory_offsets(positions, tensor)
        wide = tensor.numel() > _INT32_MAX
        row, self._layouts = self._layouts, self._layouts + 1
        if row == len(self._position_table) or (wide and self._position_table.dtype != np.int64):
            table = np.full((2 * len(self._position_table), self.size), -1, dtype=np.int64 if wide else
                            self._position_table.dtype)
            table[:row] = self._position_table[:row]
            self._position_table = table
        self._position_table[row, : len(positions)] = positions
        on_device = None if self._host_gather.takes(tensor) else torch.from_numpy(offsets).to(tensor.device)
        return row, len(positions), offsets, offsets.ctypes.data, on_device, wide

    def _grow(self, needed: int) -> None:
        """At least twice the host table's rows, once the queued gathers into it have run."""
        self._host_gather.wait()
        host = np.full((max(256, needed, 2 * len(self._host)), self.size), np.nan)
        host[: len(self._host)] = self._host
        self._host, self._host_at, self._row_bytes = host, host.ctypes.data, host.strides[0]
        self._host_gather.set_host(self.native_cache, self._host_at, self._row_bytes, len(host))

    def collect(self, rows: np.ndarray) -> SampleRows:
        """The samples of queued rows `rows` (-1: none), for the writer process to order
        (sample_rows.py); one copy to the host per device, and the queue is emptied. Its values
        view the host table: hand them over before the next record is added."""
        self._host_gather.wait()
        queued = len(self._position_rows)
        if queued + 1 > len(self._host):
            self._grow(queued + 1)
        by_device: dict[torch.device, list[int]] = {}
        for row, values in self._on_device.items():
            by_device.setdefault(values.device, []).append(row)
        for device_rows in by_device.values():
            host = torch.cat([self._on_device[r] for r in device_rows]).cpu().numpy()
            offset = 0
            for r in device_rows:
                self._host[r, : self._counts[r]] = host[offset : offset + self._counts[r]]
                offset += self._counts[r]
        take = np.where(rows >= 0, rows, queued)  # row `queued`: a spare one, of count 0
        samples = SampleRows(
            values=self._host[: queued + 1], rows=take, counts=np.array([*self._counts, 0], dtype=np.int32)[take],
            position_rows=np.array([*self._position_rows, 0], dtype=np.int64),
            new_positions=self._position_table[self._positions_handed : self._layouts],
            first_new=self._positions_handed, wide=bool(self._wide_rows))
        self._positions_handed = self._layouts
        self._on_device, self._wide_rows = {}, 0
        self._position_rows.clear()  # in place: the recorder's gather appends to these lists
        self._counts.clear()
        return samples

    def hand_over_all_positions(self) -> None:
        """The next `collect` hands over the whole positions table (to a new writer process)."""
        self._positions_handed = 0


class _NoHostGather:
    """The torch backend's: every sample is taken with torch indexing."""

    @staticmethod
    def takes(tensor: torch.Tensor) -> bool:
        return False

    def wait(self) -> None:
        pass

    @staticmethod
    def sample_cache(position_rows: list, counts: list, queued: bool) -> None:
        return None

    def set_host(self, cache, address: int, row_bytes: int, rows: int) -> None:
        pass


def _memory_offsets(positions: np.ndarray, tensor: torch.Tensor) -> np.ndarray:
    """Offsets from the tensor's first element to the elements at row-major `positions`."""
    if not len(positions):
        return positions
    index = np.unravel_index(positions, tuple(tensor.shape)) if tensor.dim() else ()
    return sum((i * s for i, s in zip(index, tensor.stride())), np.zeros_like(positions))


def _extent(tensor: torch.Tensor) -> int:
    """Elements from the tensor's first element to its last, in memory."""
    return 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
