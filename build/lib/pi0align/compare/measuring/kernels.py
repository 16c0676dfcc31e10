"""Compiled inner loops of tensor comparison (`csrc/comparison_loops.cpp`): one pass over both
tensors gathers every sum the metrics need, reading each element once in its stored dtype; and
HDF5's shuffle filter undone word by word. Built on first use with the system compiler
(pi0align/native.py) and loaded with ctypes (compare imports no torch): `CompiledLoops`. Without a
compiler `NumpyLoops` gives the same sums; `comparison_loops()` chooses once per process, and
metrics.py and h5chunks.py take the choice at construction.

Sums, per row, in the order of FIELDS: dot products and squared norms (a.b, a.a, b.b, d.d with
d = b - a), the sum of relative errors |d|/|a|, counts within 1e-3 and 5e-3 relative error, the
count of compared elements, the count of NaN/Inf mismatches, then the maxima of |d|, of |d|/|a|
and of the relative L2 error ‖d_r‖/‖a_r‖ of the tensor's rows (runs of `row_length` elements, its
last dimension; NaN where the elements summed are not whole rows).
Positions where either side is NaN or Inf are not compared: they are a mismatch unless both sides
hold NaN, or the same infinity (docs/compare.md).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

from pi0align.compare.reading.records import Bfloat16Array

FIELDS = ("ab", "aa", "bb", "dd", "rel", "w1", "w5", "n", "mismatch", "max_abs", "max_rel", "max_row_rel")
SUMMED = 9  # FIELDS[:SUMMED] add up across chunks; the rest are maxima

# Reassociation lets the compiler vectorise the sums; NaN and Inf keep their IEEE meaning
# (no -ffinite-math-only), which the masked path relies on.
_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
          "-fno-signed-zeros", "-fassociative-math"]
_SOURCE = Path(__file__).parent / "csrc" / "comparison_loops.cpp"


# numpy dtype -> the kernel's element kind; other dtypes are converted to float64 first
_KINDS = {np.dtype(np.float64): 0, np.dtype(np.float32): 1, np.dtype(np.float16): 3}
_BFLOAT16 = 2

_FUNCTIONS = {
    "pi0align_error_sums": [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p],
    "pi0align_unshuffle": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p],
}


class CompiledLoops:
    """`csrc/comparison_loops.cpp`, through ctypes."""

    def __init__(self, functions: dict) -> None:
        self._error_sums, self._unshuffle = (functions[name] for name in _FUNCTIONS)
        self.status = "compiled"

    def error_sums(self, a: np.ndarray, b: np.ndarray, bfloat16: bool, sums: np.ndarray, scratch: dict,
                   row_length: int = 0) -> None:
        """Adds the sums of rows of a and b (2-D, same shape; bfloat16: both hold raw bfloat16 bits)
        into sums (rows x len(FIELDS), float64, C-contiguous). `scratch`: the caller's reusable
        temporaries (one dict per thread). `row_length`: each row of a is whole tensor rows of that
        many elements (0: it is not, and max_row_rel becomes NaN)."""
        if a.ndim != 2 or a.shape != b.shape or sums.shape != (a.shape[0], len(FIELDS)):
            raise ValueError(f"error_sums: shapes {a.shape}, {b.shape} and sums {sums.shape} do not match")
        (a, kind_a), (b, kind_b) = (_as_kind(x, bfloat16) for x in (a, b))
        self._error_sums(a.ctypes.data, kind_a, b.ctypes.data, kind_b, a.shape[0], a.shape[1], row_length,
                         sums.ctypes.data)

    def unshuffle(self, planes: np.ndarray, itemsize: int, out: memoryview) -> np.ndarray:
        """The bytes of the elements (2, 4 or 8 bytes each) whose shuffled bytes are `planes`
        (byte i of every element in plane i), written into `out`."""
        elements = np.frombuffer(out, f"u{itemsize}")
        self._unshuffle(planes.ctypes.data, elements.size, itemsize, elements.ctypes.data)
        return elements.view(np.uint8)


class NumpyLoops:
    """The same sums and unshuffle with numpy: the reference, and what runs without a compiler."""

    def __init__(self, why: str = "chosen") -> None:
        self.status = f"numpy: {why}"

    def error_sums(self, a: np.ndarray, b: np.ndarray, bfloat16: bool, sums: np.ndarray, scratch: dict,
                   row_length: int = 0) -> None:
        a, b = ((Bfloat16Array.decode(x) if bfloat16 else x).astype(np.float64, copy=False) for x in (a, b))
        part = _partial_sums(a, b, scratch, row_length)
        if not np.isfinite(part["aa"] + part["bb"]).all():  # rare: a NaN or Inf somewhere, mask it out
            part = _partial_sums(a, b, scratch, row_length, mask_nonfinite=True)
        summed = [np.broadcast_to(part.get(k, 0.0), len(sums)) for k in FIELDS[:SUMMED]]
        sums[:, :SUMMED] += np.stack(summed, 1)
        # NaN-sticky, as the compiled loops: a stream not of whole rows stays unmeasured
        np.maximum(sums[:, SUMMED:], np.stack([part[k] for k in FIELDS[SUMMED:]], 1), out=sums[:, SUMMED:])

    def unshuffle(self, planes: np.ndarray, itemsize: int, out: memoryview) -> np.ndarray:
        elements = np.frombuffer(out, np.uint8).reshape(-1, itemsize)
        for i, plane in enumerate(planes.reshape(itemsize, -1)):  # one strided write per plane
            elements[:, i] = plane
        return elements.reshape(-1)


@functools.cache
def comparison_loops() -> CompiledLoops | NumpyLoops:
    """The compiled loops where they build (once per process), else numpy's."""
    from pi0align.native import Library  # here: its build tools are not imported by a compare of statistics

    library = Library("comparison_loops", [_SOURCE], _FUNCTIONS, _FLAGS)
    return CompiledLoops(library.functions) if library.load() else NumpyLoops(library.error)


def _as_kind(x: np.ndarray, bfloat16: bool) -> tuple[np.ndarray, int]:
    if bfloat16:
        return np.ascontiguousarray(x, np.uint16), _BFLOAT16
    kind = _KINDS.get(x.dtype)
    return (np.ascontiguousarray(x), kind) if kind is not None else (np.ascontiguousarray(x, np.float64), 0)


def _dot(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    # einsum, not BLAS: between other work BLAS threads fall asleep, and waking them costs more
    return np.einsum("ij,ij->i", x, y)


def _largest_row_error(a: np.ndarray, d: np.ndarray, row_length: int) -> np.ndarray:
    """Per row of a, the largest ‖d_r‖ / ‖a_r‖ over its runs of row_length elements (0/0 = 0,
    x/0 = inf); NaN where its elements are not whole runs."""
    if row_length <= 0 or a.shape[-1] % row_length:
        return np.full(len(a), np.nan)
    runs = (len(a), -1, row_length)
    dd, aa = (np.einsum("ijk,ijk->ij", x.reshape(runs), x.reshape(runs)) for x in (d, a))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(aa > 0, np.sqrt(dd / np.where(aa > 0, aa, 1.0)), np.where(dd > 0, np.inf, 0.0))
    return ratio.max(-1, initial=0.0)


def _partial_sums(a: np.ndarray, b: np.ndarray, scratch: dict, row_length: int,
                  mask_nonfinite: bool = False) -> dict[str, np.ndarray]:
    """Per-row sums and maxima of one chunk. Memory passes bound throughput, and fresh large
    arrays cost page faults, so temporaries live in `scratch` and are reused chunk after chunk."""
    part = {}
    masked = 0
    if mask_nonfinite:
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        both = np.isfinite(a) & np.isfinite(b)
        # Same NaN pattern and same infinities count as agreement; anything else is a mismatch.
        with np.errstate(invalid="ignore"):
            part["mismatch"] = ((nan_a != nan_b) | (~both & ~nan_a & ~nan_b & (a != b))).sum(-1)
        a, b = np.where(both, a, 0.0), np.where(both, b, 0.0)
        masked = (~both).sum(-1)  # masked positions count neither as elements nor as "within"
    if scratch.get("size", -1) < a.size:
        scratch.update(size=a.size, d=np.empty(a.size), rel=np.empty(a.size), flag=np.empty(a.size, bool))
    d, rel, flag = (scratch[k][:a.size].reshape(a.shape) for k in ("d", "rel", "flag"))
    with np.errstate(invalid="ignore", over="ignore"):
        np.subtract(b, a, out=d)
        part.update(n=a.shape[-1] - masked, ab=_dot(a, b), aa=_dot(a, a), bb=_dot(b, b), dd=_dot(d, d))
        part["max_row_rel"] = _largest_row_error(a, d, row_length)
        np.abs(d, out=d)
        part["max_abs"] = d.max(-1, initial=0.0)
        np.abs(a, out=rel)
        with np.errstate(divide="ignore"):
            np.divide(d, rel, out=rel)  # x/0 = inf: a difference where B is exactly zero
        np.isnan(rel, out=flag)  # 0/0 (and masked positions): no difference
        if flag.any():
            rel[flag] = 0.0
        part["max_rel"] = rel.max(-1, initial=0.0)
        part["rel"] = rel.sum(-1)
        part["w1"] = np.count_nonzero(np.less_equal(rel, 1e-3, out=flag), axis=-1) - masked
        part["w5"] = np.count_nonzero(np.less_equal(rel, 5e-3, out=flag), axis=-1) - masked
    return part
