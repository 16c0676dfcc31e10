"""Sampled element positions that depend only on a record's name, role, argument index and shape,
so that two runs on two devices sample the same elements."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from pi0align.dump.kernel import KERNEL


def sample_positions(name: str, role: str, arg_index: int, shape: tuple[int, ...], size: int) -> np.ndarray:
    """Sorted flat (row-major) positions: every element when there are at most `size`."""
    numel = int(np.prod(shape, dtype=np.int64))
    if numel <= size:
        return np.arange(numel, dtype=np.int64)
    key = f"{name}|{role}|{arg_index}|{list(shape)}".encode()
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.sort(np.random.default_rng(seed).choice(numel, size=size, replace=False)).astype(np.int64)


_INT32_MAX = 2**31 - 1


class Sampler:
    """Gathers the sampled elements of captured tensors (CPU ones with the fused kernel, straight
    into a host table, others on their device, both without copying views); positions and memory
    offsets are cached per record name and layout."""

    def __init__(self, size: int, queued: bool = False) -> None:
        self.size = size
        self.queued = queued  # gathered on the fused kernel's thread: values ready after KERNEL.wait()
        # -> (positions -1-padded to `size`, count, memory offsets, their address, offsets on the device or None)
        self._cache: dict[tuple, tuple] = {}
        self._host = np.full((0, size), np.nan)  # per row, float64 NaN-padded: the kernel writes here
        self._on_device: dict[int, torch.Tensor] = {}  # row -> float64 values on the tensor's device
        self._positions: list[np.ndarray] = []  # per row, -1-padded
        self._counts: list[int] = []

    def add(self, tensor: torch.Tensor, name: str, role: str, arg_index: int) -> int:
        """Queue the sample of one record; returns its row."""
        key = (name, role, arg_index, tuple(tensor.shape), tensor.stride(), tensor.device)
        cached = self._cache.get(key)
        if cached is None:
            positions = sample_positions(name, role, arg_index, tuple(tensor.shape), self.size)
            offsets = _memory_offsets(positions, tensor)
            # int32 where every position fits: the file's positions are half the bytes (docs/dump-format.md)
            padded = np.full(self.size, -1, dtype=np.int32 if tensor.numel() <= _INT32_MAX else np.int64)
            padded[: len(positions)] = positions
            on_device = None if KERNEL.supports(tensor) else torch.from_numpy(offsets).to(tensor.device)
            cached = self._cache[key] = (padded, len(positions), offsets, offsets.ctypes.data, on_device)
        padded, count, offsets, offsets_at, on_device = cached
        row = len(self._positions)
        if on_device is None:
            if row + 1 >= len(self._host):  # one row to spare: the NaN row of records without a sample
                self._grow(row + 2)
            KERNEL.gather(tensor, offsets_at, count, self._host_at + self._host.strides[0] * row, self.queued)
        else:
            memory = tensor.detach().as_strided((_extent(tensor),), (1,))  # the elements' span, views not copied
            self._on_device[row] = memory.index_select(0, on_device).to(torch.float64)
        self._positions.append(padded)
        self._counts.append(count)
        return row

    def _grow(self, needed: int) -> None:
        """At least twice the host table's rows, once the queued gathers into it have run."""
        KERNEL.wait()
        host = np.full((max(256, needed, 2 * len(self._host)), self.size), np.nan)
        host[: len(self._host)] = self._host
        self._host, self._host_at = host, host.ctypes.data

    def collect(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For queued rows `rows` (-1: none), (values [n, size] NaN-padded, positions [n, size]
        -1-padded, counts [n]); one copy to the host per device, and the queue is emptied."""
        KERNEL.wait()
        queued = len(self._positions)
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
        take = np.where(rows >= 0, rows, queued)  # row `queued`: NaN, never written
        values = self._host[take]
        positions = np.stack([*self._positions, np.full(self.size, -1, dtype=np.int32)])[take]  # int64 if any row is
        counts = np.array([*self._counts, 0], dtype=np.int32)[take]
        self._host[: queued + 1] = np.nan
        self._on_device, self._positions, self._counts = {}, [], []
        return values, positions, counts


def _memory_offsets(positions: np.ndarray, tensor: torch.Tensor) -> np.ndarray:
    """Offsets from the tensor's first element to the elements at row-major `positions`."""
    if not len(positions):
        return positions
    index = np.unravel_index(positions, tuple(tensor.shape)) if tensor.dim() else ()
    return sum((i * s for i, s in zip(index, tensor.stride())), np.zeros_like(positions))


def _extent(tensor: torch.Tensor) -> int:
    """Elements from the tensor's first element to its last, in memory."""
    return 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
