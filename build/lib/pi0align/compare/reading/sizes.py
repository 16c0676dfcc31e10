"""Sizes a file states, held to what its records say and to what the file itself holds before they
size an allocation: a dataset, tensor file or chunk that states more is a damaged file, one line
naming it (UserError), before anything is read by it.

A crafted or damaged dump could otherwise make a compare allocate what it states: an HDF5 dataset
of 100,000 × 100,000 elements whose chunks were never written takes no room on disk and 40 GB once
read. So every whole read is first checked: a tensor against its record (shape, dtype, element
count); a table's column against its table's length; a dataset's storage against what its shape
needs (an unfiltered one holds every byte its shape states; a compressed one every chunk); a
chunk's stored bytes against the file's size. Datasets are duck-typed (h5py's): this module
imports neither h5py nor torch.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pi0align.compare.reading.records import TensorRecord
from pi0align.errors import UserError

# Bytes per element of the dtypes a record names, as a file stores them (bfloat16 as its raw bits).
ITEMSIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}


def record_shape(text: str, where: str) -> tuple[int, ...]:
    """A record's shape (its text, `[2, 3]`) as dimensions; one line when it is no shape."""
    try:
        dims = json.loads(text)
    except (json.JSONDecodeError, TypeError, RecursionError):
        dims = None
    if not isinstance(dims, list) or not all(type(d) is int and d >= 0 for d in dims):
        raise UserError(f"{where}: damaged (its record's shape {str(text)[:40]!r} is no shape)")
    return tuple(dims)


def check_tensor(shape: tuple[int, ...], itemsize: int, record: TensorRecord, where: str) -> None:
    """A stored tensor's shape and element size against its record's shape, dtype and element
    count: any other is a damaged file."""
    expected = record_shape(record.shape, where)
    if math.prod(expected) != record.numel:
        raise UserError(f"{where}: damaged (its record counts {record.numel} elements in a shape of "
                        f"{math.prod(expected)})")
    if tuple(int(n) for n in shape) != expected:
        raise UserError(f"{where}: damaged (it stores a tensor of shape {list(shape)}, its record says "
                        f"{list(expected)})")
    wanted = ITEMSIZES.get(record.dtype)
    if wanted is not None and itemsize != wanted:
        raise UserError(f"{where}: damaged (it stores {itemsize}-byte elements, its record says {record.dtype})")


def check_length(dataset: Any, length: int, where: str) -> None:
    """A column of a table of `length` rows: one dimension of that length, its bytes in the file."""
    if tuple(dataset.shape) != (length,):
        raise UserError(f"{where}: damaged (a column of shape {list(dataset.shape)} in a table of {length} rows)")
    check_stored(dataset, where)


def check_stored(dataset: Any, where: str) -> None:
    """An HDF5 dataset holds what its shape states: an unfiltered one every byte (a variable-length
    string's bytes lie in the file's heap, whose reads HDF5 bounds), a filtered one every chunk,
    none larger than the dataset, each within the file; else it is damaged. Its logical size is
    then what the file holds (unfiltered) or what its record says (filtered, checked before)."""
    layout = dataset.id.get_create_plist()
    filters = layout.get_nfilters() if dataset.chunks is not None else 0
    needed = dataset.size * dataset.id.get_type().get_size()
    if not filters:
        if dataset.size and dataset.id.get_storage_size() < needed:
            raise UserError(f"{where}: damaged (it stores {dataset.id.get_storage_size()} bytes of the {needed} its "
                            f"shape {list(dataset.shape)} needs)")
        return
    chunk_elements = math.prod(dataset.chunks)
    if chunk_elements > max(dataset.size, 1):
        raise UserError(f"{where}: damaged (chunks of {chunk_elements} elements in a dataset of {dataset.size})")
    expected = math.prod(-(-n // c) for n, c in zip(dataset.shape, dataset.chunks))
    if dataset.id.get_num_chunks() != expected:
        raise UserError(f"{where}: damaged (it stores {dataset.id.get_num_chunks()} of its {expected} chunks)")
    file_size = dataset.file.id.get_filesize()
    if dataset.id.get_storage_size() > file_size:
        raise UserError(f"{where}: damaged (its chunks claim more bytes than its file holds)")


def check_chunk(stored_bytes: int, file_bytes: int, where: str) -> None:
    """A chunk's stored bytes, as its index says, lie within its file."""
    if not 0 <= stored_bytes <= file_bytes:
        raise UserError(f"{where}: damaged (a chunk of {stored_bytes} bytes in a file of {file_bytes})")
