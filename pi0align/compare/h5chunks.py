"""Read the chunks of a compressed HDF5 dataset in parallel, bypassing h5py's global lock.

h5py serialises every read behind one lock, so gzip decompression -- the bottleneck of tensor
mode -- would use one core. When a dataset's filters are ones we can undo ourselves (gzip,
shuffle, or none), we read each chunk's bytes straight from the file (os.pread), inflate them
with zlib and unshuffle them with numpy, all of which release the GIL, in worker threads.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import h5py
import numpy as np

_SUPPORTED_FILTERS = {"gzip", "shuffle"}


def chunk_layout(ds: Any) -> tuple | None:
    """(chunk shape, filters) when `ds` is an h5py dataset we can read chunk by chunk, else None."""
    if not isinstance(ds, h5py.Dataset) or ds.chunks is None or ds.dtype.kind not in "fiub":
        return None
    filters = ds._filters
    if not set(filters) <= _SUPPORTED_FILTERS:
        return None
    return ds.chunks, tuple(sorted(filters))


def chunk_index(ds: h5py.Dataset) -> dict[tuple, tuple[int, int, int]] | None:
    """chunk offset -> (byte offset, size, filter mask); None when a chunk was never written."""
    index = {}
    ds.id.chunk_iter(lambda info: index.__setitem__(info.chunk_offset, (info.byte_offset, info.size,
                                                                         info.filter_mask)))
    expected = int(np.prod([-(-n // c) for n, c in zip(ds.shape, ds.chunks)]))
    return index if len(index) == expected else None


class ChunkReader:
    """Decoded chunks of one dataset, safe to call from several threads."""

    def __init__(self, ds: h5py.Dataset):
        self.shape, self.chunks, self.dtype = ds.shape, ds.chunks, ds.dtype
        self.gzip, self.shuffle = "gzip" in ds._filters, "shuffle" in ds._filters
        self.fd = os.open(ds.file.filename, os.O_RDONLY)

    def read(self, offset: tuple, where: tuple[int, int, int]) -> np.ndarray:
        byte_offset, size, mask = where
        raw = os.pread(self.fd, size, byte_offset)
        # filter_mask bit i set: filter i of the pipeline (shuffle first, then gzip) was skipped
        if self.gzip and not mask & 0b10:
            raw = zlib.decompress(raw)
        data = np.frombuffer(raw, np.uint8)
        if self.shuffle and not mask & 0b01 and self.dtype.itemsize > 1:
            data = _unshuffle(data, self.dtype.itemsize)
        chunk = data.view(self.dtype).reshape(self.chunks)
        # edge chunks are stored whole: keep the part inside the dataset
        return chunk[tuple(slice(0, min(c, n - o)) for c, n, o in zip(self.chunks, self.shape, offset))]

    def close(self) -> None:
        os.close(self.fd)


def _unshuffle(planes: np.ndarray, itemsize: int) -> np.ndarray:
    """Undo HDF5's shuffle filter: byte i of every element was stored in plane i. (One strided
    write per plane is several times faster than a transposed copy.)"""
    out = np.empty((planes.size // itemsize, itemsize), np.uint8)
    for i, plane in enumerate(planes.reshape(itemsize, -1)):
        out[:, i] = plane
    return out.reshape(-1)


def chunk_pairs(a: Any, b: Any) -> tuple[ChunkReader, ChunkReader, list[tuple]] | None:
    """Readers and (offset, where in a, where in b) per chunk, for two datasets of the same shape
    and chunk layout; None when they cannot be read this way. Close the readers after use."""
    layout = chunk_layout(a)
    if layout is None or layout != chunk_layout(b) or a.shape != b.shape:
        return None
    index_a, index_b = chunk_index(a), chunk_index(b)
    if index_a is None or index_b is None:
        return None
    jobs = [(offset, where, index_b[offset]) for offset, where in sorted(index_a.items())]
    return ChunkReader(a), ChunkReader(b), jobs
