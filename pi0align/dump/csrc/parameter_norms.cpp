// The monitor's per-tensor sums on the CPU (parameter_norms.py, CompiledNorms): many float32
// tensors (the gradients; the parameters and Adam's moments; the modules' outputs, with their
// largest magnitudes) summed in one call each. Torch's multi-tensor norm runs tensor by tensor on
// a CPU, its dispatch costing more than the memory it reads; Adam's update direction
// m / (sqrt(v) * scale + eps) costs its multi-tensor path ten passes and three temporaries. Here
// each tensor is read once, in float32 as Adam computes. Sums run in LANES float32 lanes over
// blocks of BLOCK elements, the lanes then added in order in float64: a fixed order, so a tensor's
// sum is the same number whichever loop takes it (a parameter's norm with Adam's states or
// without), however the compiler vectorises it and on any count of threads. The monitor runs
// between the training's kernels, its cores idle: `threads` threads share the blocks, each a run
// of consecutive blocks, read in order and ahead of the hardware prefetcher (`ahead_of`): the data
// were last touched by Adam's sweep, which has left little of them in the caches.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int64_t BLOCK = 2048;
constexpr int LANES = 16;
constexpr int64_t AHEAD = 256;  // elements (1 KB): the hardware prefetcher stops at each 4 KB page

// element i of a block adds to lane (i - block start) % LANES
struct Lanes {
  float lane[LANES] = {};
  double total() const {
    double sum = 0;
    for (int j = 0; j < LANES; ++j) sum += lane[j];
    return sum;
  }
};

// a prefetch of each of `arrays` (of `size` elements) AHEAD elements past element i
template <typename... Arrays>
auto ahead_of(int64_t size, const Arrays*... arrays) {
  return [=](int64_t i) {
    const int64_t at = std::min(i + AHEAD, size - 1);
    (__builtin_prefetch(arrays + at), ...);
  };
}

// for every element i of the block [begin, end), add(lanes, j, i) with j its lane, and prefetch(i)
// once every LANES elements (outside the loop the compiler vectorises); the block's Width sums into
// out
template <int Width, typename Add, typename Prefetch>
void in_lanes(int64_t begin, int64_t end, double* out, Add add, Prefetch prefetch) {
  Lanes lanes[Width];
  int64_t i = begin;
  for (; i + LANES <= end; i += LANES) {
    prefetch(i);
    for (int j = 0; j < LANES; ++j) add(lanes, j, i + j);
  }
  for (int j = 0; i < end; ++i, ++j) add(lanes, j, i);
  for (int w = 0; w < Width; ++w) out[w] = lanes[w].total();
}

struct Add {
  double operator()(double total, double x, int) const { return total + x; }
};

// sums[t * Width + w] = what `block(t, begin, end, out)` gives for each block of tensor t, combined
// (added, by default) in the blocks' order: the same number on any count of `threads`, each of
// which takes a run of consecutive blocks (one stream through memory: blocks taken in turn broke
// it at every block)
template <int Width, typename Block, typename Combine = Add>
void by_blocks(int64_t count, const int64_t* sizes, int threads, double* sums, Block block, Combine combine = {}) {
  std::vector<int64_t> first(count + 1, 0);  // tensor t's blocks: first[t] .. first[t + 1] - 1
  for (int64_t t = 0; t < count; ++t) first[t + 1] = first[t] + (sizes[t] + BLOCK - 1) / BLOCK;
  std::vector<double> partial((size_t)first[count] * Width);
  auto work = [&](int k) {
    int64_t t = 0;
    for (int64_t b = first[count] * k / threads; b < first[count] * (k + 1) / threads; ++b) {
      while (first[t + 1] <= b) ++t;
      const int64_t begin = (b - first[t]) * BLOCK;
      block(t, begin, std::min(sizes[t], begin + BLOCK), &partial[(size_t)b * Width]);
    }
  };
  std::vector<std::thread> helpers;
  for (int k = 1; k < threads; ++k) helpers.emplace_back(work, k);
  work(0);
  for (auto& helper : helpers) helper.join();
  for (int64_t t = 0; t < count; ++t)
    for (int w = 0; w < Width; ++w) {
      double total = 0;
      for (int64_t b = first[t]; b < first[t + 1]; ++b) total = combine(total, partial[(size_t)b * Width + w], w);
      sums[t * Width + w] = total;
    }
}

}  // namespace

// sums[t] = the sum of squares of tensor t's sizes[t] elements
extern "C" void pi0align_squared_sums(int64_t count, const float* const* tensors, const int64_t* sizes,
                                      int threads, double* sums) {
  by_blocks<1>(count, sizes, threads, sums, [&](int64_t t, int64_t begin, int64_t end, double* out) {
    const float* x = tensors[t];
    in_lanes<1>(begin, end, out, [x](Lanes* s, int j, int64_t i) { s[0].lane[j] += x[i] * x[i]; },
                ahead_of(sizes[t], x));
  });
}

// sums[2t] = the sum of squares of tensor t, sums[2t + 1] its largest magnitude (NaN where it
// holds a NaN)
extern "C" void pi0align_squares_and_largest(int64_t count, const float* const* tensors, const int64_t* sizes,
                                             int threads, double* sums) {
  by_blocks<2>(
      count, sizes, threads, sums,
      [&](int64_t t, int64_t begin, int64_t end, double* out) {
        const float* x = tensors[t];
        in_lanes<1>(begin, end, out, [x](Lanes* s, int j, int64_t i) { s[0].lane[j] += x[i] * x[i]; },
                    ahead_of(sizes[t], x));
        // the magnitudes' bits compared as integers (vectorised; a NaN's are the largest)
        uint32_t largest = 0;
        for (int64_t i = begin; i < end; ++i) {
          uint32_t bits;
          std::memcpy(&bits, &x[i], sizeof bits);
          largest = std::max(largest, bits & 0x7fffffffu);
        }
        float magnitude;
        std::memcpy(&magnitude, &largest, sizeof magnitude);
        out[1] = magnitude;
      },
      [](double total, double x, int w) { return w == 0 ? total + x : (x > total || x != x) ? x : total; });
}

// sums[4t..4t+3] = the sums of squares of parameter t, Adam's first moment m, its second v, and
// m / (sqrt(v) * scales[t] + eps[t]); of a parameter without Adam's states (first[t] null) its
// own, the others 0
extern "C" void pi0align_adam_sums(int64_t count, const float* const* parameters, const float* const* first,
                                   const float* const* second, const int64_t* sizes, const double* scales,
                                   const double* eps, int threads, double* sums) {
  by_blocks<4>(count, sizes, threads, sums, [&](int64_t t, int64_t begin, int64_t end, double* out) {
    const float* p = parameters[t];
    const float* m = first[t];
    const float* v = second[t];
    if (m == nullptr) {
      in_lanes<1>(begin, end, out, [p](Lanes* s, int j, int64_t i) { s[0].lane[j] += p[i] * p[i]; },
                  ahead_of(sizes[t], p));
      out[1] = out[2] = out[3] = 0;
      return;
    }
    const float scale = (float)scales[t], epsilon = (float)eps[t];
    in_lanes<4>(begin, end, out, [=](Lanes* s, int j, int64_t i) {
      const float q = m[i] / (std::sqrt(v[i]) * scale + epsilon);
      s[0].lane[j] += p[i] * p[i];
      s[1].lane[j] += m[i] * m[i];
      s[2].lane[j] += v[i] * v[i];
      s[3].lane[j] += q * q;
    }, ahead_of(sizes[t], p, m, v));
  });
}
