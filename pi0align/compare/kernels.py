"""Compiled inner loops of tensor comparison: one pass over both tensors gathers every sum the
metrics need, reading each element once in its stored dtype; and HDF5's shuffle filter undone
word by word. Built on first use with the system compiler (pi0align/native.py); without one,
metrics.py and h5chunks.py keep their numpy paths, which give the same sums.

Sums, per row, in the order of FIELDS: dot products and squared norms (a.b, a.a, b.b, d.d with
d = b - a), the sum of relative errors |d|/|a|, counts within 1e-3 and 5e-3 relative error, the
count of compared elements, the count of NaN/Inf mismatches, then the maxima of |d| and |d|/|a|.
Positions where either side is NaN or Inf are not compared: they are a mismatch unless both sides
hold NaN, or the same infinity (docs/compare.md).
"""

from __future__ import annotations

import ctypes

import numpy as np

from pi0align.native import Library

FIELDS = ("ab", "aa", "bb", "dd", "rel", "w1", "w5", "n", "mismatch", "max_abs", "max_rel")
SUMMED = 9  # FIELDS[:SUMMED] add up across chunks; the last two are maxima

# Reassociation lets the compiler vectorise the sums; NaN and Inf keep their IEEE meaning
# (no -ffinite-math-only), which the masked path relies on.
_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
          "-fno-signed-zeros", "-fassociative-math"]

_SOURCE = r"""
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t BLOCK = 1024;  // elements staged per side at a time: stays in L1
enum Kind { F64 = 0, F32 = 1, BF16 = 2, F16 = 3 };
enum Field { AB, AA, BB, DD, REL, W1, W5, N, MISMATCH, MAX_ABS, MAX_REL, FIELDS };

float bits_to_float(uint32_t bits) { float f; std::memcpy(&f, &bits, 4); return f; }

float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // Inf, NaN
  if (exponent) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  float magnitude = std::ldexp(float(mantissa), -24);  // zero or subnormal
  return sign ? -magnitude : magnitude;
}

void stage(const void* source, int kind, int64_t start, int64_t count, double* out) {
  switch (kind) {
    case F64: { const double* p = static_cast<const double*>(source) + start;
                for (int64_t i = 0; i < count; ++i) out[i] = p[i]; break; }
    case F32: { const float* p = static_cast<const float*>(source) + start;
                for (int64_t i = 0; i < count; ++i) out[i] = p[i]; break; }
    case BF16: { const uint16_t* p = static_cast<const uint16_t*>(source) + start;
                 for (int64_t i = 0; i < count; ++i) out[i] = bits_to_float(uint32_t(p[i]) << 16); break; }
    case F16: { const uint16_t* p = static_cast<const uint16_t*>(source) + start;
                for (int64_t i = 0; i < count; ++i) out[i] = half_to_float(p[i]); break; }
  }
}

int64_t as_bits(double value) { int64_t bits; std::memcpy(&bits, &value, 8); return bits; }
double from_bits(int64_t bits) { double value; std::memcpy(&value, &bits, 8); return value; }

// Adds one block into s; false (adding nothing) when a sum is not finite: NaN or Inf in the block.
bool block_sums(const double* x, const double* y, int64_t count, double* s) {
  double ab = 0, aa = 0, bb = 0, dd = 0, rel = 0, w1 = 0, w5 = 0;
  // Maxima of non-negative doubles through their bits: same order, and integer maxima vectorise.
  int64_t max_abs = 0, max_rel = 0;
  for (int64_t i = 0; i < count; ++i) {
    double a = x[i], b = y[i], d = b - a;
    ab += a * b; aa += a * a; bb += b * b; dd += d * d;
    double diff = std::fabs(d), scale = std::fabs(a);
    double r = diff / scale;  // 0/0 is NaN: no difference; x/0 is inf
    r = r == r ? r : 0.0;
    rel += r;
    w1 += diff <= 1e-3 * scale ? 1.0 : 0.0;
    w5 += diff <= 5e-3 * scale ? 1.0 : 0.0;
    int64_t diff_bits = as_bits(diff), rel_bits = as_bits(r);
    max_abs = diff_bits > max_abs ? diff_bits : max_abs;
    max_rel = rel_bits > max_rel ? rel_bits : max_rel;
  }
  if (!(std::fabs(aa + bb + dd + rel) <= DBL_MAX)) return false;
  s[AB] += ab; s[AA] += aa; s[BB] += bb; s[DD] += dd; s[REL] += rel; s[W1] += w1; s[W5] += w5;
  s[N] += double(count);
  s[MAX_ABS] = std::fmax(s[MAX_ABS], from_bits(max_abs));
  s[MAX_REL] = std::fmax(s[MAX_REL], from_bits(max_rel));
  return true;
}

void block_sums_masked(const double* x, const double* y, int64_t count, double* s) {
  for (int64_t i = 0; i < count; ++i) {
    double a = x[i], b = y[i];
    if (!std::isfinite(a) || !std::isfinite(b)) {
      bool nan_a = std::isnan(a), nan_b = std::isnan(b);
      if (nan_a != nan_b || (!nan_a && !nan_b && a != b)) s[MISMATCH] += 1;
      continue;
    }
    double d = b - a, diff = std::fabs(d), scale = std::fabs(a);
    double r = scale > 0 ? diff / scale : (diff > 0 ? INFINITY : 0.0);
    s[AB] += a * b; s[AA] += a * a; s[BB] += b * b; s[DD] += d * d; s[REL] += r;
    s[W1] += diff <= 1e-3 * scale ? 1.0 : 0.0;
    s[W5] += diff <= 5e-3 * scale ? 1.0 : 0.0;
    s[N] += 1;
    s[MAX_ABS] = std::fmax(s[MAX_ABS], diff);
    s[MAX_REL] = std::fmax(s[MAX_REL], r);
  }
}

int64_t item_size(int kind) { return kind == F64 ? 8 : kind == F32 ? 4 : 2; }

template <typename Word>
void unshuffle_words(const uint8_t* planes, int64_t n, Word* out) {
  constexpr int width = sizeof(Word);
  for (int64_t start = 0; start < n; start += BLOCK) {
    int64_t count = n - start < BLOCK ? n - start : BLOCK;
    Word* block = out + start;
    for (int64_t i = 0; i < count; ++i) block[i] = planes[start + i];
    for (int p = 1; p < width; ++p) {
      const uint8_t* plane = planes + p * n + start;
      for (int64_t i = 0; i < count; ++i) block[i] |= Word(plane[i]) << (8 * p);
    }
  }
}

}  // namespace

// rows x cols elements per side (row-major, contiguous); sums: rows x FIELDS, added to.
extern "C" void pi0align_error_sums(const void* a, int kind_a, const void* b, int kind_b, int64_t rows,
                                    int64_t cols, double* sums) {
  double x[BLOCK], y[BLOCK];
  for (int64_t row = 0; row < rows; ++row) {
    const char* row_a = static_cast<const char*>(a) + row * cols * item_size(kind_a);
    const char* row_b = static_cast<const char*>(b) + row * cols * item_size(kind_b);
    double* s = sums + row * FIELDS;
    for (int64_t start = 0; start < cols; start += BLOCK) {
      int64_t count = cols - start < BLOCK ? cols - start : BLOCK;
      stage(row_a, kind_a, start, count, x);
      stage(row_b, kind_b, start, count, y);
      if (!block_sums(x, y, count, s)) block_sums_masked(x, y, count, s);
    }
  }
}

// HDF5's shuffle filter stored byte p of element i at planes[p * n + i]; out: n elements of 2, 4
// or 8 bytes.
extern "C" void pi0align_unshuffle(const uint8_t* planes, int64_t n, int width, uint8_t* out) {
  switch (width) {
    case 2: unshuffle_words(planes, n, reinterpret_cast<uint16_t*>(out)); break;
    case 4: unshuffle_words(planes, n, reinterpret_cast<uint32_t*>(out)); break;
    case 8: unshuffle_words(planes, n, reinterpret_cast<uint64_t*>(out)); break;
  }
}
"""

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
        self._library = Library("compare", _SOURCE, _FUNCTIONS, _FLAGS)
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
