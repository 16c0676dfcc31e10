"""Compiled inner loops of tensor comparison (`csrc/comparison_loops.cpp`): one pass over both
tensors gathers every sum the metrics need, reading each element once in its stored dtype; and
HDF5's shuffle filter undone word by word. Built on first use with the system compiler
(pi0align/native.py) and loaded with ctypes (compare imports no torch); without a compiler,
metrics.py and h5chunks.py keep their numpy paths, which give the same sums.

Sums, per row, in the order of FIELDS: dot products and squared norms (a.b, a.a, b.b, d.d with
d = b - a), the sum of relative errors |d|/|a|, counts within 1e-3 and 5e-3 relative error, the
count of compared elements, the count of NaN/Inf mismatches, then the maxima of |d| and |d|/|a|.
Positions where either side is NaN or Inf are not compared: they are a mismatch unless both sides
hold NaN, or the same infinity (docs/compare.md).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from pi0align.native import Library

FIELDS = ("ab", "aa", "bb", "dd", "rel", "w1", "w5", "n", "mismatch", "max_abs", "max_rel")
SUMMED = 9  # FIELDS[:SUMMED] add up across chunks; the last two are maxima

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
                            ctypes.c_int64, ctypes.c_void_p],
    "pi0align_unshuffle": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p],
}


class Kernels:
    """The compiled loops, built or found by the first `load()`."""

    def __init__(self) -> None:
        self._library = Library("comparison_loops", [_SOURCE], _FUNCTIONS, _FLAGS)
        self.status = ""  # "" until loaded, then "compiled" or "numpy: <why>"

    def load(self) -> bool:
        """Whether the compiled loops run in this process (built or found once)."""
        if not self.status:
            if self._library.load():
                self._error_sums, self._unshuffle = (self._library.functions[n] for n in _FUNCTIONS)
                self.status = "compiled"
            else:
                self.status = f"numpy: {self._library.error}"
        return self.status == "compiled"

    def error_sums(self, a: np.ndarray, b: np.ndarray, bfloat16: bool, sums: np.ndarray) -> None:
        """Adds the sums of rows of a and b (2-D, same shape; bfloat16: both hold raw bfloat16 bits)
        into sums (rows x len(FIELDS), float64, C-contiguous)."""
        if a.ndim != 2 or a.shape != b.shape or sums.shape != (a.shape[0], len(FIELDS)):
            raise ValueError(f"error_sums: shapes {a.shape}, {b.shape} and sums {sums.shape} do not match")
        (a, kind_a), (b, kind_b) = (_as_kind(x, bfloat16) for x in (a, b))
        self._error_sums(a.ctypes.data, kind_a, b.ctypes.data, kind_b, a.shape[0], a.shape[1], sums.ctypes.data)

    def unshuffle(self, planes: np.ndarray, out: np.ndarray) -> None:
        """out (C-contiguous, 2, 4 or 8 bytes an element) = the elements whose shuffled bytes are `planes`."""
        self._unshuffle(planes.ctypes.data, out.size, out.itemsize, out.ctypes.data)


def _as_kind(x: np.ndarray, bfloat16: bool) -> tuple[np.ndarray, int]:
    if bfloat16:
        return np.ascontiguousarray(x, np.uint16), _BFLOAT16
    kind = _KINDS.get(x.dtype)
    return (np.ascontiguousarray(x), kind) if kind is not None else (np.ascontiguousarray(x, np.float64), 0)


KERNELS = Kernels()
