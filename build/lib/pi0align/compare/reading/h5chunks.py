"""Read the chunks of a compressed HDF5 dataset in parallel, bypassing h5py's global lock.

h5py serialises every read behind one lock, so decompression -- the bottleneck of tensor mode --
would use one core. When a dataset's filters are ones we can undo ourselves (Zstandard, as
pi0align writes tensors, or gzip; shuffle; or none), we read each chunk's bytes straight from the
file (os.pread), decompress them and unshuffle them (kernels.py), all of which release the GIL, in
worker threads. Importing this module registers the Zstandard filter (hdf5plugin) for h5py's own
reads as well.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import h5py
import hdf5plugin  # lets h5py read Zstandard-compressed datasets too
import numpy as np
import zstandard

from pi0align.compare.reading.sizes import check_chunk
from pi0align.errors import UserError

_ZSTD = str(hdf5plugin.ZSTD_ID)  # how h5py names a filter it has no name for
_SUPPORTED_FILTERS = {"gzip", "shuffle", _ZSTD}


def chunk_layout(ds: Any) -> tuple | None:
    """(chunk shape, filters) when `ds` is an h5py dataset we can read chunk by chunk, else None."""
    if not isinstance(ds, h5py.Dataset) or ds.chunks is None or ds.dtype.kind not in "fiub":
        return None
    filters = ds._filters
    if not set(filters) <= _SUPPORTED_FILTERS:
        return None
    return ds.chunks, tuple(sorted(filters))


def chunk_index(ds: h5py.Dataset) -> dict[tuple, tuple[int, int, int]] | None:
    """chunk offset -> (byte offset, size, filter mask); None when a chunk was never written. A
    chunk stated to lie beyond its file is a damaged file (UserError)."""
    index = {}
    ds.id.chunk_iter(lambda info: index.__setitem__(info.chunk_offset, (info.byte_offset, info.size,
                                                                         info.filter_mask)))
    file_bytes = ds.file.id.get_filesize()
    for byte_offset, size, _ in index.values():
        check_chunk(byte_offset + size, file_bytes, f"{ds.file.filename}: {ds.name}")
    expected = int(np.prod([-(-n // c) for n, c in zip(ds.shape, ds.chunks)]))
    return index if len(index) == expected else None


class ChunkReader:
    """Decoded chunks of one dataset, safe to call from several threads, each with its own
    `ChunkBuffers`: fresh megabyte buffers per chunk would cost more in page faults than the
    decompression itself."""

    def __init__(self, ds: h5py.Dataset, loops):
        self.shape, self.chunks, self.dtype = ds.shape, ds.chunks, ds.dtype
        self.loops = loops  # kernels.py's, for the unshuffle
        self.gzip, self.zstd, self.shuffle = "gzip" in ds._filters, _ZSTD in ds._filters, "shuffle" in ds._filters
        self.chunk_bytes = int(np.prod(self.chunks)) * self.dtype.itemsize
        self.filename, self.name = ds.file.filename, ds.name
        self.fd = os.open(ds.file.filename, os.O_RDONLY)

    def read(self, offset: tuple, where: tuple[int, int, int], buffers: ChunkBuffers) -> np.ndarray:
        """The chunk at `offset`, valid until `buffers` serve the next read of this side."""
        byte_offset, size, mask = where
        raw = buffers.get("raw", size)
        os.preadv(self.fd, [raw], byte_offset)
        # filter_mask bit i set: filter i of the pipeline (shuffle first, then compression) was skipped
        if self.gzip and not mask & 0b10:  # no more than a chunk holds, whatever the bytes say
            raw = memoryview(zlib.decompressobj().decompress(raw, self.chunk_bytes))
        elif self.zstd and not mask & 0b10:
            raw = _zstd_into(raw, buffers.get("plain", self.chunk_bytes))
        if len(raw) != self.chunk_bytes:
            raise UserError(f"{self.filename}: damaged (a chunk of {self.name} decodes to {len(raw)} bytes, not "
                            f"{self.chunk_bytes})")
        data = np.frombuffer(raw, np.uint8)
        if self.shuffle and not mask & 0b01 and self.dtype.itemsize > 1:
            data = self.loops.unshuffle(data, self.dtype.itemsize, buffers.get("unshuffled", data.size))
        chunk = data.view(self.dtype).reshape(self.chunks)
        # edge chunks are stored whole: keep the part inside the dataset
        return chunk[tuple(slice(0, min(c, n - o)) for c, n, o in zip(self.chunks, self.shape, offset))]

    def close(self) -> None:
        os.close(self.fd)


class ChunkBuffers:
    """Reusable byte buffers of one reader thread, by purpose, grown as needed."""

    def __init__(self) -> None:
        self._buffers: dict[str, bytearray] = {}

    def get(self, purpose: str, size: int) -> memoryview:
        buffer = self._buffers.get(purpose)
        if buffer is None or len(buffer) < size:
            buffer = self._buffers[purpose] = bytearray(size)
        return memoryview(buffer)[:size]


def _zstd_into(compressed: memoryview, out: memoryview) -> memoryview:
    with zstandard.ZstdDecompressor().stream_reader(compressed) as reader:
        filled = 0
        while filled < len(out) and (count := reader.readinto(out[filled:])):
            filled += count
    return out[:filled]


def chunk_pairs(a: Any, b: Any, loops) -> tuple[ChunkReader, ChunkReader, list[tuple]] | None:
    """Readers and (offset, where in a, where in b) per chunk, for two datasets of the same shape
    and chunk layout; None when they cannot be read this way. Close the readers after use.
    `loops`: kernels.py's loops, which unshuffle."""
    layout = chunk_layout(a)
    if layout is None or layout != chunk_layout(b) or a.shape != b.shape:
        return None
    index_a, index_b = chunk_index(a), chunk_index(b)
    if index_a is None or index_b is None:
        return None
    jobs = [(offset, where, index_b[offset]) for offset, where in sorted(index_a.items())]
    return ChunkReader(a, loops), ChunkReader(b, loops), jobs
