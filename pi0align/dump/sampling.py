"""Sampled element positions that depend only on a record's name, role, argument index and shape,
so that two runs on two devices sample the same elements."""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def sample_positions(name: str, role: str, arg_index: int, shape: tuple[int, ...], size: int) -> np.ndarray:
    """Sorted flat (row-major) positions: every element when there are at most `size`."""
    numel = int(np.prod(shape, dtype=np.int64))
    if numel <= size:
        return np.arange(numel, dtype=np.int64)
    key = f"{name}|{role}|{arg_index}|{list(shape)}".encode()
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.sort(np.random.default_rng(seed).choice(numel, size=size, replace=False)).astype(np.int64)


class Sampler:
    """Gathers the sampled elements of captured tensors on their device; positions are cached."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._cache: dict[tuple, tuple[np.ndarray, torch.Tensor]] = {}
        self._values: list[torch.Tensor] = []  # per row, float64 on the tensor's device
        self._positions: list[np.ndarray] = []

    def add(self, tensor: torch.Tensor, name: str, role: str, arg_index: int) -> int:
        """Queue the sample of one record; returns its row."""
        key = (name, role, arg_index, tuple(tensor.shape), tensor.device)
        cached = self._cache.get(key)
        if cached is None:
            host = sample_positions(name, role, arg_index, tuple(tensor.shape), self.size)
            cached = self._cache[key] = (host, torch.from_numpy(host).to(tensor.device))
        self._values.append(torch.take(tensor.detach(), cached[1]).to(torch.float64))
        self._positions.append(cached[0])
        return len(self._positions) - 1

    def collect(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For queued rows `rows` (-1: none), (values [n, size] NaN-padded, positions [n, size]
        -1-padded, counts [n]); one copy to the host per device, and the queue is emptied."""
        values = np.full((len(rows), self.size), np.nan)
        positions = np.full((len(rows), self.size), -1, dtype=np.int64)
        counts = np.zeros(len(rows), dtype=np.int32)
        by_device: dict[torch.device, list[int]] = {}
        for row, value in enumerate(self._values):
            by_device.setdefault(value.device, []).append(row)
        starts = np.cumsum([0] + [p.size for p in self._positions])
        flat_values = np.empty(starts[-1])
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
