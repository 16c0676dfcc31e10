"""Full tensors of tensor mode on disk: the dataset encoding (docs/dump-format.md, *tensors*),
applied by the writer process (writer_process.py). Imports neither torch nor the rest of pi0align."""

from __future__ import annotations

import h5py
import hdf5plugin  # registers the Zstandard filter with HDF5, for writing and reading
import numpy as np
import zstandard

ZSTD_LEVEL = 1
CHUNK_BYTES = 1 << 20
MIN_COMPRESSED_BYTES = 1 << 12  # below this, compressing costs more time than it saves bytes
# A chunk that compression shrinks by less than this share is stored as it is, both filters
# skipped (its filter mask): decoding it (Zstandard at about 1.5 GB/s a core, then the unshuffle)
# would cost a reader more time than the bytes saved take to read from a local disk.
MIN_SAVING = 0.25
SKIP_FILTERS = 0b11  # HDF5's filter mask: bit i set, filter i of the pipeline (shuffle, Zstandard) skipped


def write_tensor_dataset(group: h5py.Group, name: str, data: np.ndarray, dtype: str, compress: bool = True) -> None:
    """One full tensor as a dataset: byte-shuffled and Zstandard-compressed in chunks of about
    CHUNK_BYTES, compressed here and written raw (faster than HDF5's own filter pipeline); a chunk
    that compression shrinks by less than MIN_SAVING is stored unfiltered."""
    if not compress or data.ndim == 0 or data.nbytes < MIN_COMPRESSED_BYTES:
        dataset = group.create_dataset(name, data=data)
    else:
        data = np.ascontiguousarray(data)
        chunks = chunk_shape(data.shape, data.itemsize)
        dataset = group.create_dataset(name, shape=data.shape, dtype=data.dtype, chunks=chunks, shuffle=True,
                                       compression=hdf5plugin.ZSTD_ID, compression_opts=(ZSTD_LEVEL,))
        compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        for offset, block in _chunk_blocks(data, chunks):
            compressed = compressor.compress(_shuffle(block))
            if len(compressed) > (1 - MIN_SAVING) * block.nbytes:
                dataset.id.write_direct_chunk(offset, np.ascontiguousarray(block), filter_mask=SKIP_FILTERS)
            else:
                dataset.id.write_direct_chunk(offset, compressed)
    dataset.attrs["dtype"] = dtype


def chunk_shape(shape: tuple, itemsize: int) -> tuple:
    """Chunks of whole trailing dimensions (so each is one contiguous block of the tensor),
    about CHUNK_BYTES each: 1 along the leading axes, a run of rows along axis `a`."""
    trailing = itemsize
    for a in range(len(shape) - 1, -1, -1):
        if a == 0 or trailing * shape[a] > CHUNK_BYTES:
            rows = max(1, min(shape[a], CHUNK_BYTES // trailing))
            return (1,) * a + (rows,) + tuple(shape[a + 1:])
        trailing *= shape[a]
    raise AssertionError("unreachable")


def _chunk_blocks(data: np.ndarray, chunks: tuple):
    """(chunk offset, contiguous block padded to the full chunk) for every chunk of `data`."""
    a = len(chunks) - 1  # the axis chunks run along: the last one not taken whole
    while a > 0 and chunks[a] == data.shape[a]:
        a -= 1
    rows, tail = chunks[a], (0,) * (len(chunks) - a - 1)
    for lead in np.ndindex(*data.shape[:a]):
        for start in range(0, data.shape[a], rows):
            block = data[lead + (slice(start, start + rows),)]
            if block.shape[0] < rows:  # HDF5 stores edge chunks whole
                block = np.concatenate([block, np.zeros((rows - block.shape[0], *block.shape[1:]), data.dtype)])
            yield lead + (start,) + tail, block


def _shuffle(block: np.ndarray) -> np.ndarray:
    """HDF5's shuffle filter: byte i of every element into plane i (floats compress better so)."""
    size = block.itemsize
    elements = block.reshape(-1).view(np.uint8).reshape(-1, size)
    planes = np.empty((size, elements.shape[0]), np.uint8)
    for i in range(size):
        planes[i] = elements[:, i]
    return planes
