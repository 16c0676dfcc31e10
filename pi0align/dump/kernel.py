"""A fused single-pass statistics kernel for CPU tensors, compiled on first use.

The torch-op path reads a tensor about six times (min, max, sum, sum of squares, the checksum's
row and column sums) and allocates for the conversions; this kernel reads it once, accumulating
in float64, and counts NaN and Inf in a second pass only when the sums say there are any. It is
plain C++ behind C entry points, built with the system compiler on first use (native.py) into
one torch extension with `observer.py`, whose entry points take the tensors themselves; where
that extension cannot be built, the kernel alone is called through ctypes. Calls run at once, or
queued for the kernel's own C++ thread, which works beside training without the GIL; one tensor,
one core. Without a compiler the dumper keeps the torch-op path; `KERNEL.status` says which path
runs. It also gathers sample mode's elements, for the same reasons.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import os

import torch

from pi0align.dump import observer
from pi0align.native import FLAGS, Extension, Library

_SOURCE = r"""
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unistd.h>

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
    walk<K>(x, ndim, size, stride, step,
            [&](const Raw* r, int64_t n, int64_t s, int64_t) { masked_row<K>(r, n, s, m); });
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

// A queued statistics job (offsets == nullptr) or gather job; sizes copied, the caller's arrays
// may go as soon as it is queued.
struct Job {
  const void* data; int kind, ndim;
  int64_t size[16], stride[16], step[16];
  double* out_f; int64_t* out_i;
  const int64_t* offsets; int64_t n;
  int64_t elements;  // read by the job
};

void execute(const Job& job) {
  if (job.offsets == nullptr) KINDS[job.kind](job.data, job.ndim, job.size, job.stride, job.step, job.out_f, job.out_i);
  else GATHERS[job.kind](job.data, job.offsets, job.n, job.out_f);
}

// A sleeping worker is woken once this much work is queued, or by wait(): waking a thread costs
// the caller tens of microseconds on a virtual machine, too much to pay per tensor.
constexpr int64_t WAKE_ELEMENTS = 1 << 20;
constexpr size_t WAKE_JOBS = 64;

// One worker thread that runs queued jobs in order while the caller goes on. It is created on
// first use and never destroyed (detached, so interpreter exit never joins or destroys it); a
// forked child, which has no such thread, makes its own.
struct Queue {
  std::mutex mutex;
  std::condition_variable work, idle;
  std::deque<Job> jobs;
  int64_t queued_elements = 0;
  bool sleeping = false, busy = false;
  std::atomic<int64_t> finished{0};  // jobs run so far, in queue order
  pid_t pid = getpid();

  Queue() { std::thread([this] { run(); }).detach(); }

  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    while (true) {
      if (jobs.empty()) {
        sleeping = true;
        idle.notify_all();
        work.wait(lock, [this] { return !sleeping; });
        continue;
      }
      Job job = jobs.front();
      jobs.pop_front();
      queued_elements -= job.elements;
      busy = true;
      lock.unlock();
      execute(job);
      lock.lock();
      busy = false;
      finished.fetch_add(1, std::memory_order_release);
    }
  }

  void wake() {  // with the lock held
    if (sleeping && !jobs.empty()) sleeping = false, work.notify_one();
  }

  void push(const Job& job) {
    std::lock_guard<std::mutex> lock(mutex);
    jobs.push_back(job);
    queued_elements += job.elements;
    if (queued_elements >= WAKE_ELEMENTS || jobs.size() >= WAKE_JOBS) wake();
  }

  void wait() {
    std::unique_lock<std::mutex> lock(mutex);
    wake();
    idle.wait(lock, [this] { return jobs.empty() && !busy; });
  }
};

Queue* the_queue = nullptr;
std::mutex creating;

Queue& queue() {
  std::lock_guard<std::mutex> lock(creating);
  if (the_queue == nullptr || the_queue->pid != getpid()) the_queue = new Queue();
  return *the_queue;
}

Job job_of(const void* data, int kind, int ndim, const int64_t* size, const int64_t* stride, const int64_t* step) {
  Job job{data, kind, ndim, {}, {}, {}, nullptr, nullptr, nullptr, 0, 1};
  for (int d = 0; d < ndim; ++d) job.elements *= size[d];
  std::memcpy(job.size, size, ndim * sizeof(int64_t));
  std::memcpy(job.stride, stride, ndim * sizeof(int64_t));
  std::memcpy(job.step, step, ndim * sizeof(int64_t));
  return job;
}

}  // namespace

// Queued versions: results land in out_f / out_i (out) after pi0align_wait() returns. The data
// must stay alive and unchanged until then.
extern "C" void pi0align_queue_stats(const void* data, int kind, int ndim, const int64_t* size, const int64_t* stride,
                                     const int64_t* step, double* out_f, int64_t* out_i) {
  Job job = job_of(data, kind, ndim, size, stride, step);
  job.out_f = out_f, job.out_i = out_i;
  queue().push(job);
}

extern "C" void pi0align_queue_dense_stats(const void* data, int kind, int64_t numel, double* out_f, int64_t* out_i) {
  const int64_t one = 1;
  pi0align_queue_stats(data, kind, 1, &numel, &one, &one, out_f, out_i);
}

extern "C" void pi0align_queue_gather(const void* data, int kind, const int64_t* offsets, int64_t n, double* out) {
  Job job{data, kind, 0, {}, {}, {}, out, nullptr, offsets, n, n};
  queue().push(job);
}

extern "C" void pi0align_wait() {
  if (the_queue != nullptr && the_queue->pid == getpid()) the_queue->wait();
}

extern "C" void pi0align_finished(int64_t* out) {
  *out = the_queue == nullptr ? 0 : the_queue->finished.load(std::memory_order_acquire);
}

extern "C" void pi0align_stats(const void* data, int kind, int ndim, const int64_t* size, const int64_t* stride,
                               const int64_t* step, double* out_f, int64_t* out_i) {
  KINDS[kind](data, ndim, size, stride, step, out_f, out_i);
}

extern "C" void pi0align_dense_stats(const void* data, int kind, int64_t numel, double* out_f, int64_t* out_i) {
  const int64_t one = 1;
  KINDS[kind](data, 1, &numel, &one, &one, out_f, out_i);
}

extern "C" void pi0align_gather(const void* data, int kind, const int64_t* offsets, int64_t n, double* out) {
  GATHERS[kind](data, offsets, n, out);
}
"""

# dtype -> index into KINDS above
_KINDS = {torch.bool: 0, torch.uint8: 1, torch.int8: 2, torch.int16: 3, torch.bfloat16: 4, torch.float16: 5,
          torch.int32: 6, torch.float32: 7, torch.int64: 8, torch.float64: 9}
_MAX_DIMS = 16  # the kernel's odometer
_P, _INT, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_STATS = [_P, _INT, _INT, _P, _P, _P, _P, _P]  # data, kind, ndim, sizes, strides, steps, floats, ints
_DENSE = [_P, _INT, _I64, _P, _P]  # data, kind, numel, floats, ints
_GATHER = [_P, _INT, _P, _I64, _P]  # data, kind, offsets, count, values
_FUNCTIONS = {"pi0align_stats": _STATS, "pi0align_dense_stats": _DENSE, "pi0align_gather": _GATHER,
              "pi0align_queue_stats": _STATS, "pi0align_queue_dense_stats": _DENSE, "pi0align_queue_gather": _GATHER,
              "pi0align_wait": [], "pi0align_finished": [ctypes.POINTER(ctypes.c_int64)]}
_RELEASE_EVERY = 64  # queued calls between two looks at which have run


class Kernel:
    """The compiled kernel, loaded by the first `supports` (or `load`) call.

    Each call runs now, or is queued (`queued=True`) for the kernel's own thread, which works
    through the queue while training goes on: `wait()` returns once it is empty. Queued tensors
    are kept alive until then; they must not change meanwhile (the caller waits before an
    in-place call).
    """

    def __init__(self) -> None:
        self._extension = Extension("pi0align_observer", _SOURCE + observer.SOURCE,
                                    [*FLAGS, "-pthread", *observer.flags()])
        self._library = Library("stats", _SOURCE, _FUNCTIONS, [*FLAGS, "-pthread"])
        self.status = ""  # "" until loaded, then "fused" or "torch ops: <why>"
        self.observer = None  # the extension (observer.py), once loaded: the kernel taking tensors
        self.observer_status = ""  # "compiled", or "python: <why>" when the extension cannot be built
        self._c: dict[str, ctypes._CFuncPtr] | None = None  # the ctypes entry points, without the extension
        self._queued: collections.deque[torch.Tensor] = collections.deque()  # in queue order
        self._released = 0  # queued calls whose tensor was let go
        self._finished = ctypes.c_int64()
        os.register_at_fork(after_in_child=self._forget_queue)

    def load(self) -> str:
        """Build or find the kernel once per process (the extension, else the ctypes library);
        returns `status`."""
        if self.status:
            return self.status
        module = self._extension.load()
        if module is not None:
            for dtype, kind in _KINDS.items():
                module.set_kind(torch.empty(0, dtype=dtype), kind)
            self.observer, self.observer_status, self.status = module, "compiled", "fused"
        else:
            self.observer_status = f"python: {self._extension.error}"
            loaded = self._library.load()
            self.status = "fused" if loaded else f"torch ops: {self._library.error}"
            self._c = self._library.functions if loaded else None
            if loaded:  # the library (and its queue) may be shared with an earlier Kernel of this process
                self._c["pi0align_finished"](self._finished)
                self._released = self._finished.value
        if self.status == "fused":
            atexit.register(self.wait)  # no queued job may outlive the tensors it reads
        return self.status

    def supports(self, tensor: torch.Tensor) -> bool:
        """Whether `stats` and `gather` take this tensor (a strided CPU tensor of a known dtype)."""
        return tensor.device.type == "cpu" and tensor.dtype in _KINDS and (self.status or self.load()) == "fused"

    def stats(self, tensor: torch.Tensor, floats: int, ints: int, queued: bool = False) -> None:
        """Write min, max, sum and sum of squares of the finite elements to the 4 float64 at address
        `floats`, and the NaN count, Inf count and checksum to the 3 int64 at address `ints`."""
        if self.observer is not None:
            self.observer.stats(tensor, floats, ints, queued)
            return
        if tensor.dim() > _MAX_DIMS:
            tensor = tensor.contiguous()
        if queued:
            self._keep(tensor)
        prefix = "pi0align_queue_" if queued else "pi0align_"
        if tensor.is_contiguous():
            self._c[prefix + "dense_stats"](tensor.data_ptr(), _KINDS[tensor.dtype], tensor.numel(), floats, ints)
            return
        size, stride, step = _layout(tensor)
        n = len(size)
        self._c[prefix + "stats"](tensor.data_ptr(), _KINDS[tensor.dtype], n, (ctypes.c_int64 * n)(*size),
                                  (ctypes.c_int64 * n)(*stride), (ctypes.c_int64 * n)(*step), floats, ints)

    def gather(self, tensor: torch.Tensor, offsets: int, count: int, values: int, queued: bool = False) -> None:
        """Write the `count` elements at the memory offsets held by the int64 array at address
        `offsets` (from the first element; kept alive and unchanged until `wait()` when queued) to
        the float64 array at address `values`."""
        if self.observer is not None:
            self.observer.gather(tensor, offsets, count, values, queued)
            return
        if queued:
            self._keep(tensor)
        function = self._c["pi0align_queue_gather" if queued else "pi0align_gather"]
        function(tensor.data_ptr(), _KINDS[tensor.dtype], offsets, count, values)

    def wait(self) -> None:
        """Return once every queued call has run."""
        if self.observer is not None:
            self.observer.wait()
        elif self._queued:
            self._c["pi0align_wait"]()
            self._released += len(self._queued)
            self._queued.clear()

    def held(self) -> int:
        """How many queued tensors are still kept alive."""
        return self.observer.held() if self.observer is not None else len(self._queued)

    def _forget_queue(self) -> None:
        """In a forked child: the parent's queue and thread are not here; the child counts its own."""
        self._queued, self._released = collections.deque(), 0
        if self.observer is not None:
            self.observer.forget()

    def _keep(self, tensor: torch.Tensor) -> None:
        """Hold a queued tensor until its call has run; let go of those that have (a step's
        temporaries must not all live until its end)."""
        self._queued.append(tensor)
        if (self._released + len(self._queued)) % _RELEASE_EVERY == 0:  # calls queued so far
            self._c["pi0align_finished"](self._finished)
            for _ in range(self._finished.value - self._released):
                self._queued.popleft()
            self._released = self._finished.value


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
