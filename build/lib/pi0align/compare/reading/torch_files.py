"""Tensors saved by `torch.save` (msprobe's `.pt` files), read without torch.

Such a file is a zip archive: `<name>/data.pkl`, a pickle that rebuilds the tensor from its
storages, and `<name>/data/<key>`, each storage's raw little-endian bytes. The pickle is read by
an Unpickler that knows only the names a tensor's pickle uses, each mapped to a function of ours
that describes the tensor (never torch's, never anything the file names), so nothing in the file
can run code; then the storage's bytes are viewed with the tensor's shape, strides and offset.
Importing torch would cost a compare seconds; reading this way costs milliseconds.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pi0align.compare.reading.records import Bfloat16Array

BFLOAT16 = "bfloat16"  # no numpy dtype: raw bits as uint16, decoded to float32
# torch's storage types by name -> the dtype of their elements
STORAGE_DTYPES = {"DoubleStorage": np.float64, "FloatStorage": np.float32, "HalfStorage": np.float16,
                  "BFloat16Storage": BFLOAT16, "LongStorage": np.int64, "IntStorage": np.int32,
                  "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}


class NotATensor(ValueError):
    """The file holds something else than one tensor, or names what a tensor's pickle does not."""


class _Storage(NamedTuple):
    key: str
    dtype: object  # a numpy dtype, or BFLOAT16


class _Tensor(NamedTuple):
    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements


def _rebuild_tensor(storage, offset, shape, strides, *unused) -> _Tensor:
    """What torch._utils._rebuild_tensor_v2 is given: (storage, offset, size, stride,
    requires_grad, backward_hooks[, metadata])."""
    return _Tensor(storage, int(offset), tuple(map(int, shape)), tuple(map(int, strides)))


_KNOWN = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
          ("collections", "OrderedDict"): collections.OrderedDict,
          **{("torch", name): name for name in STORAGE_DTYPES}}


def _fits(tensor: _Tensor, elements: int) -> bool:
    """Every element the tensor's shape, strides and offset address lies in its storage (in
    Python's integers: a hostile shape cannot overflow the check)."""
    shape, strides = tensor.shape, tensor.strides
    if len(shape) != len(strides) or min((*shape, *strides, tensor.offset), default=0) < 0:
        return False
    return math.prod(shape) == 0 or tensor.offset + sum((n - 1) * s for n, s in zip(shape, strides)) < elements


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = _KNOWN.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor")
        return found

    def persistent_load(self, pid) -> _Storage:
        # ("storage", storage type, key, location, number of elements)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in STORAGE_DTYPES):
            raise pickle.UnpicklingError(f"a storage described as {pid!r:.80}")
        return _Storage(str(pid[2]), STORAGE_DTYPES[pid[1]])


def _entry(archive: zipfile.ZipFile, name: str, path: str | Path) -> bytes:
    """An entry's bytes, once its stated size is found within the file (what it would allocate)."""
    info = archive.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED or info.file_size > os.path.getsize(path):
        raise NotATensor(f"an entry of {info.file_size} bytes, compressed or larger than its file: not as "
                         "torch.save writes")
    return archive.read(info)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of a C-contiguous tensor of that shape."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def load_tensor(path: str | Path, expect: Callable[[tuple[int, ...], int], None] = lambda shape, itemsize: None
                ) -> np.ndarray:
    """The tensor in a `torch.save` file as a numpy array (floating point of two bytes as float32),
    `expect(shape, element size)` called before its storage is read (it raises where the tensor is
    not the one wanted). Raises pickle.UnpicklingError when the pickle names anything a tensor's
    does not, NotATensor when it holds no single tensor or one its storage cannot hold, or an entry
    larger than the file (torch.save stores its entries uncompressed), zipfile.BadZipFile or
    KeyError when the file is not one torch.save writes."""
    with zipfile.ZipFile(path) as archive:
        pickled = next((name for name in archive.namelist() if name.endswith("/data.pkl")), None)
        if pickled is None:
            raise NotATensor("no data.pkl: not a file torch.save writes")
        prefix = pickled[:-len("data.pkl")]
        try:
            tensor = _TensorUnpickler(io.BytesIO(_entry(archive, pickled, path))).load()
        except (TypeError, IndexError, AttributeError, OverflowError, RecursionError) as error:
            raise NotATensor(f"a pickle no tensor makes ({type(error).__name__})") from None
        if not isinstance(tensor, _Tensor) or not isinstance(tensor.storage, _Storage):
            raise NotATensor(f"holds a {type(tensor).__name__}, not a tensor")
        bfloat16 = tensor.storage.dtype == BFLOAT16
        dtype = np.dtype(np.uint16 if bfloat16 else tensor.storage.dtype).newbyteorder("<")
        expect(tensor.shape, dtype.itemsize)
        raw = _entry(archive, f"{prefix}data/{tensor.storage.key}", path)
    flat = np.frombuffer(raw, dtype)
    if not _fits(tensor, len(flat)):
        raise NotATensor(f"a tensor of shape {tensor.shape} that its storage of {len(flat)} elements cannot hold")
    native = dtype.newbyteorder("=")
    if tensor.strides == _contiguous_strides(tensor.shape):  # as torch.save writes most: read in place
        values = flat[tensor.offset:tensor.offset + math.prod(tensor.shape)].reshape(tensor.shape).astype(
            native, copy=False)
    else:
        values = np.lib.stride_tricks.as_strided(flat[tensor.offset:], tensor.shape,
                                                 tuple(s * dtype.itemsize for s in tensor.strides), writeable=False)
        values = np.array(values, dtype=native, order="C")  # 0-d stays 0-d
    if bfloat16:
        return Bfloat16Array.decode(values)
    return values.astype(np.float32) if values.dtype == np.float16 else values
