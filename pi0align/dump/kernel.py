"""A fused single-pass statistics kernel for CPU tensors, compiled on first use.

The torch-op path reads a tensor about six times (min, max, sum, sum of squares, the checksum's
row and column sums) and allocates for the conversions; this kernel reads it once, accumulating
in float64, and counts NaN and Inf in a second pass only when the sums say there are any. It is
plain C++ behind a C entry point, built with the system compiler on first use (native.py) and
called through ctypes (which releases the GIL, so the statistics thread runs beside training).
No OpenMP threads: one tensor, one core. Without a compiler the dumper keeps the torch-op path;
`KERNEL.status` says which path runs. It also gathers sample mode's elements, for the same reasons.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from pi0align.native import Library

_SOURCE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

float as_float(uint32_t bits) { float f; std::memcpy(&f, &bits, 4); return f; }
double as_double(uint64_t bits) { double d; std::memcpy(&d, &bits, 8); return d; }

// One element kind per dtype: Raw is how it is read, value() its number, bits() the integer the
// checksum weighs (docs/dump-format.md: unsigned for 1 byte, sign-extended for 2, 4 and 8 bytes),
// Check the width the checksum wraps at.
struct Bool { using Raw = uint8_t; using Check = uint32_t;
  static double value(Raw r) { return r != 0; } static Check bits(Raw r) { return r; } };
struct U8 { using Raw = uint8_t; using Check = uint32_t;
  static double value(Raw r) { return r; } static Check bits(Raw r) { return r; } };
struct I8 { using Raw = uint8_t; using Check = uint32_t;
  static double value(Raw r) { return (int8_t)r; } static Check bits(Raw r) { return r; } };
struct I16 { using Raw = int16_t; using Check = uint32_t;
  static double value(Raw r) { return r; } static Check bits(Raw r) { return (uint32_t)(int32_t)r; } };
struct BF16 { using Raw = int16_t; using Check = uint32_t;
  static double value(Raw r) { return as_float((uint32_t)(uint16_t)r << 16); }
  static Check bits(Raw r) { return (uint32_t)(int32_t)r; } };
struct F16 { using Raw = int16_t; using Check = uint32_t;
  static double value(Raw r) {  // exact: the exponent is rebased by a multiplication, Inf/NaN kept
    uint32_t h = (uint16_t)r, magnitude = (h & 0x7fffu) << 13;
    float v = as_float(magnitude) * 0x1p112f;
    if ((h & 0x7c00u) == 0x7c00u) v = as_float(magnitude | 0x7f800000u);
    return (h & 0x8000u) ? -v : v;
  }
  static Check bits(Raw r) { return (uint32_t)(int32_t)r; } };
struct I32 { using Raw = int32_t; using Check = uint32_t;
  static double value(Raw r) { return r; } static Check bits(Raw r) { return (uint32_t)r; } };
struct F32 { using Raw = uint32_t; using Check = uint32_t;
  static double value(Raw r) { return as_float(r); } static Check bits(Raw r) { return r; } };
struct I64 { using Raw = int64_t; using Check = uint64_t;
  static double value(Raw r) { return (double)r; } static Check bits(Raw r) { return (uint64_t)r; } };
struct F64 { using Raw = uint64_t; using Check = uint64_t;
  static double value(Raw r) { return as_double(r); } static Check bits(Raw r) { return r; } };

template <class K>
struct Acc {
  double lo = INFINITY, hi = -INFINITY, sum = 0, sq = 0;
  int64_t nan = 0, inf = 0;
  typename K::Check check = 0;
};

// One row of elements x[j * stride], j < n, at row-major positions first + j * step (0-based):
// min, max, sums and checksum, vectorised; Dense (stride 1) is the common case.
template <class K, bool Dense>
void row(const typename K::Raw* x, int64_t n, int64_t stride, int64_t first, int64_t step, Acc<K>& a) {
  using Check = typename K::Check;
  double lo = a.lo, hi = a.hi, sum = a.sum, sq = a.sq;
  Check check = 0, weight = (Check)(first + 1), increment = (Check)step;
#pragma omp simd reduction(min : lo) reduction(max : hi) reduction(+ : sum, sq, check)
  for (int64_t j = 0; j < n; ++j) {
    typename K::Raw r = x[Dense ? j : j * stride];
    double v = K::value(r);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
    sum += v;
    sq += v * v;
    check += K::bits(r) * (weight + (Check)j * increment);  // wraps, as the format says
  }
  a.lo = lo, a.hi = hi, a.sum = sum, a.sq = sq, a.check += check;
}

// The same row when it holds a NaN or Inf: counts them and leaves them out (the checksum is done).
template <class K>
void masked_row(const typename K::Raw* x, int64_t n, int64_t stride, Acc<K>& a) {
  for (int64_t j = 0; j < n; ++j) {
    double v = K::value(x[j * stride]);
    if (std::isnan(v)) { ++a.nan; continue; }
    if (std::isinf(v)) { ++a.inf; continue; }
    a.lo = v < a.lo ? v : a.lo;
    a.hi = v > a.hi ? v : a.hi;
    a.sum += v;
    a.sq += v * v;
  }
}

// Visits every element of a strided tensor one row at a time: dims in the caller's order (the
// last one the row, the others in an odometer), with memory strides `stride` and row-major
// strides `step` (the checksum's positions), whatever the memory order.
template <class K, class Row>
void walk(const typename K::Raw* x, int ndim, const int64_t* size, const int64_t* stride, const int64_t* step,
          Row visit) {
  int64_t index[16] = {0}  /* _MAX_DIMS */, offset = 0, first = 0;
  const int last = ndim - 1;
  while (true) {
    visit(x + offset, size[last], stride[last], first);
    int d = last - 1;
    for (; d >= 0; --d) {
      offset += stride[d], first += step[d];
      if (++index[d] < size[d]) break;
      offset -= stride[d] * size[d], first -= step[d] * size[d], index[d] = 0;
    }
    if (d < 0) return;
  }
}

// out_f: min, max, sum, sum of squares over the finite elements; out_i: NaN count, Inf count, checksum.
template <class K>
void reduce(const void* data, int ndim, const int64_t* size, const int64_t* stride, const int64_t* step,
            double* out_f, int64_t* out_i) {
  using Raw = typename K::Raw;
  const Raw* x = static_cast<const Raw*>(data);
  const int64_t row_step = step[ndim - 1];
  Acc<K> a;
  walk<K>(x, ndim, size, stride, step, [&](const Raw* r, int64_t n, int64_t s, int64_t first) {
    if (s == 1) row<K, true>(r, n, 1, first, row_step, a); else row<K, false>(r, n, s, first, row_step, a);
  });
  if (!std::isfinite(a.sum) || !std::isfinite(a.sq)) {  // a NaN or Inf somewhere: mask them out
    Acc<K> m;
    walk<K>(x, ndim, size, stride, step, [&](const Raw* r, int64_t n, int64_t s, int64_t) { masked_row<K>(r, n, s, m); });
    m.check = a.check;
    a = m;
  }
  out_f[0] = a.lo, out_f[1] = a.hi, out_f[2] = a.sum, out_f[3] = a.sq;
  // a 32-bit checksum is stored sign-extended
  out_i[0] = a.nan, out_i[1] = a.inf;
  out_i[2] = sizeof(a.check) == 4 ? (int64_t)(int32_t)a.check : (int64_t)a.check;
}

// The elements at `offsets` (from the first element, in elements) as float64: sample mode.
template <class K>
void gather(const void* data, const int64_t* offsets, int64_t n, double* out) {
  const typename K::Raw* x = static_cast<const typename K::Raw*>(data);
  for (int64_t j = 0; j < n; ++j) out[j] = K::value(x[offsets[j]]);
}

using Reduce = void (*)(const void*, int, const int64_t*, const int64_t*, const int64_t*, double*, int64_t*);
const Reduce KINDS[] = {reduce<Bool>, reduce<U8>, reduce<I8>, reduce<I16>, reduce<BF16>, reduce<F16>,
                        reduce<I32>, reduce<F32>, reduce<I64>, reduce<F64>};

using Gather = void (*)(const void*, const int64_t*, int64_t, double*);
const Gather GATHERS[] = {gather<Bool>, gather<U8>, gather<I8>, gather<I16>, gather<BF16>, gather<F16>,
                          gather<I32>, gather<F32>, gather<I64>, gather<F64>};

}  // namespace

extern "C" void pi0align_stats(const void* data, int kind, int ndim, const int64_t* size, const int64_t* stride,
                               const int64_t* step, double* out_f, int64_t* out_i) {
  KINDS[kind](data, ndim, size, stride, step, out_f, out_i);
}

extern "C" void pi0align_gather(const void* data, int kind, const int64_t* offsets, int64_t n, double* out) {
  GATHERS[kind](data, offsets, n, out);
}
"""

# dtype -> index into KINDS above
_KINDS = {torch.bool: 0, torch.uint8: 1, torch.int8: 2, torch.int16: 3, torch.bfloat16: 4, torch.float16: 5,
          torch.int32: 6, torch.float32: 7, torch.int64: 8, torch.float64: 9}
_MAX_DIMS = 16  # the kernel's odometer
_SIZES = ctypes.POINTER(ctypes.c_int64)
_FUNCTIONS = {
    "pi0align_stats": [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, _SIZES, _SIZES, _SIZES,
                       ctypes.POINTER(ctypes.c_double), _SIZES],
    "pi0align_gather": [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p],
}


class Kernel:
    """The compiled kernel, loaded by the first `supports` (or `load`) call."""

    def __init__(self) -> None:
        self._library = Library("stats", _SOURCE, _FUNCTIONS)
        self.status = ""  # "" until loaded, then "fused" or "torch ops: <why>"

    def load(self) -> str:
        """Build or find the kernel once per process; returns `status`."""
        loaded = self._library.load()
        self.status = "fused" if loaded else f"torch ops: {self._library.error}"
        if loaded:
            self._function, self._gather = (self._library.functions[n] for n in _FUNCTIONS)
        return self.status

    def supports(self, tensor: torch.Tensor) -> bool:
        """Whether `stats` and `gather` take this tensor (a strided CPU tensor of a known dtype)."""
        return tensor.device.type == "cpu" and tensor.dtype in _KINDS and (self.status or self.load()) == "fused"

    def stats(self, tensor: torch.Tensor) -> tuple:
        """(min, max, sum, sum of squares, NaN count, Inf count, checksum) as Python numbers."""
        data = tensor.detach()
        if data.dim() > _MAX_DIMS:
            data = data.contiguous()
        size, stride, step = _layout(data)
        n = len(size)
        floats, ints = (ctypes.c_double * 4)(), (ctypes.c_int64 * 3)()
        self._function(data.data_ptr(), _KINDS[data.dtype], n, (ctypes.c_int64 * n)(*size),
                       (ctypes.c_int64 * n)(*stride), (ctypes.c_int64 * n)(*step), floats, ints)
        return (*floats, *ints)

    def gather(self, tensor: torch.Tensor, offsets: np.ndarray) -> np.ndarray:
        """float64 values of the elements at memory `offsets` (int64, from the first element)."""
        out = np.empty(len(offsets))
        self._gather(tensor.data_ptr(), _KINDS[tensor.dtype], offsets.ctypes.data, len(offsets), out.ctypes.data)
        return out


def _layout(tensor: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """(sizes, memory strides, row-major strides) of the dims the kernel walks, the row last.

    Views (transposes, permutes, expands) are read in place, in memory order, rather than
    copied: the statistics do not depend on the order, and the row-major strides give each
    element its checksum position. Rows are made as long as the memory allows.
    """
    if tensor.is_contiguous():
        return [tensor.numel()], [1], [1]
    row_major = [1] * tensor.dim()
    for d in range(tensor.dim() - 2, -1, -1):
        row_major[d] = row_major[d + 1] * tensor.shape[d + 1]
    # Outermost first: repeated (stride 0) dims, then the largest memory strides.
    dims = sorted((d for d in range(tensor.dim()) if tensor.shape[d] > 1),
                  key=lambda d: (tensor.stride(d) != 0, -tensor.stride(d)))
    size, stride, step = [], [], []
    for d in dims:
        if size and stride[-1] == tensor.stride(d) * tensor.shape[d] and step[-1] == row_major[d] * tensor.shape[d]:
            size[-1], stride[-1], step[-1] = size[-1] * tensor.shape[d], tensor.stride(d), row_major[d]
        else:
            size.append(tensor.shape[d]), stride.append(tensor.stride(d)), step.append(row_major[d])
    return size, stride, step


KERNEL = Kernel()
