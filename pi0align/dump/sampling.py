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


class Sampler:
    """Gathers the sampled elements of captured tensors (CPU ones with the fused kernel, others on
    their device, both without copying views); positions and memory offsets are cached."""

    def __init__(self, size: int, queued: bool = False) -> None:
        self.size = size
        self.queued = queued  # gathered on the fused kernel's thread: values ready after KERNEL.wait()
        self._cache: dict[tuple, tuple] = {}  # -> (positions, memory offsets, offsets on the device or None)
        self._values: list[np.ndarray | torch.Tensor] = []  # per row: float64, on the host or the tensor's device
        self._positions: list[np.ndarray] = []

    def add(self, tensor: torch.Tensor, name: str, role: str, arg_index: int) -> int:
        """Queue the sample of one record; returns its row."""
        key = (name, role, arg_index, tuple(tensor.shape), tensor.stride(), tensor.device)
        cached = self._cache.get(key)
        if cached is None:
            positions = sample_positions(name, role, arg_index, tuple(tensor.shape), self.size)
            offsets = _memory_offsets(positions, tensor)
            on_device = None if KERNEL.supports(tensor) else torch.from_numpy(offsets).to(tensor.device)
            cached = self._cache[key] = (positions, offsets, on_device)
        positions, offsets, on_device = cached
        if on_device is None:
            values = np.empty(len(offsets))
            KERNEL.gather(tensor, offsets, values, self.queued)
            self._values.append(values)
        else:
            memory = tensor.detach().as_strided((_extent(tensor),), (1,))  # the elements' span, views not copied
            self._values.append(memory.index_select(0, on_device).to(torch.float64))
        self._positions.append(positions)
        return len(self._positions) - 1

    def collect(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For queued rows `rows` (-1: none), (values [n, size] NaN-padded, positions [n, size]
        -1-padded, counts [n]); one copy to the host per device, and the queue is emptied."""
        KERNEL.wait()
        values = np.full((len(rows), self.size), np.nan)
        positions = np.full((len(rows), self.size), -1, dtype=np.int64)
        counts = np.zeros(len(rows), dtype=np.int32)
        starts = np.cumsum([0] + [p.size for p in self._positions])
        flat_values = np.empty(starts[-1])
        by_device: dict[torch.device, list[int]] = {}
        for row, value in enumerate(self._values):
            if isinstance(value, np.ndarray):  # gathered by the kernel
                flat_values[starts[row] : starts[row + 1]] = value
            else:
                by_device.setdefault(value.device, []).append(row)
        for device_rows in by_device.values():
            host = torch.cat([self._values[r] for r in device_rows]).cpu().numpy()
            offset = 0
            for r in device_rows:
                n = self._positions[r].size
                flat_values[starts[r] : starts[r] + n] = host[offset : offset + n]
                offset += n
        for i, row in enumerate(rows):
            if row >= 0:
                n = self._positions[row].size
                values[i, :n] = flat_values[starts[row] : starts[row] + n]
                positions[i, :n] = self._positions[row]
                counts[i] = n
        self._values, self._positions = [], []
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
