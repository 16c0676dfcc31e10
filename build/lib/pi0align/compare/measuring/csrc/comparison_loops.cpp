// Compiled inner loops of tensor comparison (pi0align/compare/kernels.py loads them with ctypes):
// - pi0align_error_sums: one pass over both tensors gathers every sum the metrics need, reading
//   each element once in its stored dtype: a.b, a.a, b.b, d.d (d = b - a), the sum of relative
//   errors |d|/|a|, counts within 1e-3 and 5e-3, compared elements, NaN/Inf mismatches, then the
//   maxima of |d|, |d|/|a| and of the rows' relative L2 errors ‖d_r‖/‖a_r‖ (rows: runs of
//   row_length elements, a tensor's last dimension). NaN/Inf positions are not compared
//   (docs/compare.md).
// - pi0align_unshuffle: HDF5's shuffle filter undone word by word.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t BLOCK = 1024;  // elements staged per side at a time: stays in L1
enum Kind { F64 = 0, F32 = 1, BF16 = 2, F16 = 3 };
enum Field { AB, AA, BB, DD, REL, W1, W5, N, MISMATCH, MAX_ABS, MAX_REL, MAX_ROW_REL, FIELDS };

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

// Adds one block into s, and its a.a and d.d into squares; false (adding nothing) when a sum is not
// finite: NaN or Inf in the block.
bool block_sums(const double* x, const double* y, int64_t count, double* s, double* squares) {
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
  squares[0] = aa, squares[1] = dd;
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

// Rows this long or longer are staged a row's part at a time, whose block sums are the row's:
// no pass of their own (a pass over short rows cost the loops 10-15 %).
constexpr int64_t FUSED_ROW = 128;

// The largest relative L2 error of a row, over the rows of `length` elements a stream of staged
// blocks holds; NaN-sticky in s[MAX_ROW_REL]: a stream that is not whole rows is not measured.
struct RowErrors {
  int64_t length, filled = 0;
  double dd = 0, aa = 0;

  explicit RowErrors(int64_t row_length, double* s) : length(row_length) {
    if (length <= 0) s[MAX_ROW_REL] = NAN;
  }

  // How many of `left` elements to stage next: within one row where rows are FUSED_ROW or longer,
  // else whole rows where one fits in a block.
  int64_t block(int64_t left) const {
    int64_t n = left < BLOCK ? left : BLOCK;
    if (length >= FUSED_ROW) return n < length - filled ? n : length - filled;
    return length > 1 && n >= length ? n - n % length : n;
  }

  // finite: every element of the block is finite, and squares holds its a.a and d.d (else the
  // non-finite positions are left out)
  void add(const double* x, const double* y, int64_t count, bool finite, const double* squares, double* s) {
    if (length <= 1) return;  // rows of one element: MAX_REL (end)
    if (finite && length >= FUSED_ROW) {  // the block lies within one row
      aa += squares[0], dd += squares[1], filled += count;
      if (filled == length) finish(s);
      return;
    }
    for (int64_t i = 0; i < count;) {
      int64_t n = count - i < length - filled ? count - i : length - filled;
      double row_dd = 0, row_aa = 0;
      if (finite) {
        for (int64_t k = i; k < i + n; ++k) { double d = y[k] - x[k]; row_dd += d * d; row_aa += x[k] * x[k]; }
      } else {
        for (int64_t k = i; k < i + n; ++k)
          if (std::isfinite(x[k]) && std::isfinite(y[k])) { double d = y[k] - x[k]; row_dd += d * d; row_aa += x[k] * x[k]; }
      }
      dd += row_dd, aa += row_aa, filled += n, i += n;
      if (filled == length) finish(s);
    }
  }

  void finish(double* s) {  // a row complete
    double r = aa > 0 ? std::sqrt(dd / aa) : (dd > 0 ? INFINITY : 0.0);
    if (!std::isnan(s[MAX_ROW_REL])) s[MAX_ROW_REL] = std::fmax(s[MAX_ROW_REL], r);
    filled = 0, dd = 0, aa = 0;
  }

  void end(double* s) const {
    if (filled != 0) s[MAX_ROW_REL] = NAN;  // a row left partial: the stream was not whole rows
    if (length == 1 && !std::isnan(s[MAX_ROW_REL])) s[MAX_ROW_REL] = std::fmax(s[MAX_ROW_REL], s[MAX_REL]);
  }
};

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

// rows x cols elements per side (row-major, contiguous); sums: rows x FIELDS, added to. Each row of
// cols elements is whole tensor rows of row_length elements (0: not so; MAX_ROW_REL becomes NaN).
extern "C" void pi0align_error_sums(const void* a, int kind_a, const void* b, int kind_b, int64_t rows,
                                    int64_t cols, int64_t row_length, double* sums) {
  double x[BLOCK], y[BLOCK];
  for (int64_t row = 0; row < rows; ++row) {
    const char* row_a = static_cast<const char*>(a) + row * cols * item_size(kind_a);
    const char* row_b = static_cast<const char*>(b) + row * cols * item_size(kind_b);
    double* s = sums + row * FIELDS;
    RowErrors row_errors(row_length, s);
    for (int64_t start = 0, count; start < cols; start += count) {
      count = row_errors.block(cols - start);
      stage(row_a, kind_a, start, count, x);
      stage(row_b, kind_b, start, count, y);
      double squares[2];
      bool finite = block_sums(x, y, count, s, squares);
      if (!finite) block_sums_masked(x, y, count, s);
      row_errors.add(x, y, count, finite, squares, s);
    }
    row_errors.end(s);
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
