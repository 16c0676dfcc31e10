// The fused statistics kernel of the native dump backend (element_statistics.h): each tensor read
// once, accumulating in float64; NaN and Inf counted in a second pass only when the sums say there
// are any. Also sample mode's gather. Torch-free: capture_extension.cpp hands it raw memory.
#include "element_statistics.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <pthread.h>
#include <thread>
#include <vector>

namespace {

float as_float(uint32_t bits) { float f; std::memcpy(&f, &bits, 4); return f; }
double as_double(uint64_t bits) { double d; std::memcpy(&d, &bits, 8); return d; }

// One element kind per dtype: Raw is how it is read, value() its number, bits() the integer the
// checksum weighs (docs/dump-format.md: unsigned for 1 byte, sign-extended for 2, 4 and 8 bytes),
// Check the width the checksum wraps at.
struct Bool { using Value = double; using Raw = uint8_t; using Check = uint32_t;
  static double value(Raw r) { return r != 0; } static Check bits(Raw r) { return r; } };
struct U8 { using Value = double; using Raw = uint8_t; using Check = uint32_t;
  static double value(Raw r) { return r; } static Check bits(Raw r) { return r; } };
struct I8 { using Value = double; using Raw = uint8_t; using Check = uint32_t;
  static double value(Raw r) { return (int8_t)r; } static Check bits(Raw r) { return r; } };
struct I16 { using Value = double; using Raw = int16_t; using Check = uint32_t;
  static double value(Raw r) { return r; } static Check bits(Raw r) { return (uint32_t)(int32_t)r; } };
struct BF16 { using Raw = int16_t; using Check = uint32_t; using Value = float;
  static float value(Raw r) { return as_float((uint32_t)(uint16_t)r << 16); }
  static Check bits(Raw r) { return (uint32_t)(int32_t)r; } };
struct F16 { using Raw = int16_t; using Check = uint32_t; using Value = float;
  static float value(Raw r) {  // exact: the exponent is rebased by a multiplication, Inf/NaN kept
    uint32_t h = (uint16_t)r, magnitude = (h & 0x7fffu) << 13;
    float v = as_float(magnitude) * 0x1p112f;
    if ((h & 0x7c00u) == 0x7c00u) v = as_float(magnitude | 0x7f800000u);
    return (h & 0x8000u) ? -v : v;
  }
  static Check bits(Raw r) { return (uint32_t)(int32_t)r; } };
struct I32 { using Value = double; using Raw = int32_t; using Check = uint32_t;
  static double value(Raw r) { return r; } static Check bits(Raw r) { return (uint32_t)r; } };
struct F32 { using Raw = uint32_t; using Check = uint32_t; using Value = float;
  static float value(Raw r) { return as_float(r); } static Check bits(Raw r) { return r; } };
struct I64 { using Value = double; using Raw = int64_t; using Check = uint64_t;
  static double value(Raw r) { return (double)r; } static Check bits(Raw r) { return (uint64_t)r; } };
struct F64 { using Value = double; using Raw = uint64_t; using Check = uint64_t;
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
  using Value = typename K::Value;  // float where every value is one: half the lanes' work for min and max
  Value lo = (Value)a.lo, hi = (Value)a.hi;
  double sum = a.sum, sq = a.sq;
  Check check = 0, weight = (Check)(first + 1), increment = (Check)step;
#pragma omp simd reduction(min : lo) reduction(max : hi) reduction(+ : sum, sq, check)
  for (int64_t j = 0; j < n; ++j) {
    typename K::Raw r = x[Dense ? j : j * stride];
    Value v = K::value(r);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
    double d = v;
    sum += d;
    sq += d * d;
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

// The elements of a strided tensor, read as `walk` visits them, written to `dest` at their
// row-major positions: tensor mode's copy of a view.
template <class K>
void copy_elements(const void* data, int ndim, const int64_t* size, const int64_t* stride, const int64_t* step,
                   void* dest) {
  using Raw = typename K::Raw;
  Raw* out = static_cast<Raw*>(dest);
  const int64_t row_step = step[ndim - 1];
  walk<K>(static_cast<const Raw*>(data), ndim, size, stride, step,
          [&](const Raw* r, int64_t n, int64_t s, int64_t first) {
            for (int64_t j = 0; j < n; ++j) out[first + j * row_step] = r[j * s];
          });
}

using Reduce = void (*)(const void*, int, const int64_t*, const int64_t*, const int64_t*, double*, int64_t*);
const Reduce KINDS[] = {reduce<Bool>, reduce<U8>, reduce<I8>, reduce<I16>, reduce<BF16>, reduce<F16>,
                        reduce<I32>, reduce<F32>, reduce<I64>, reduce<F64>};

using Gather = void (*)(const void*, const int64_t*, int64_t, double*);
const Gather GATHERS[] = {gather<Bool>, gather<U8>, gather<I8>, gather<I16>, gather<BF16>, gather<F16>,
                          gather<I32>, gather<F32>, gather<I64>, gather<F64>};

using Copy = void (*)(const void*, int, const int64_t*, const int64_t*, const int64_t*, void*);
const Copy COPIES[] = {copy_elements<Bool>, copy_elements<U8>, copy_elements<I8>, copy_elements<I16>,
                       copy_elements<BF16>, copy_elements<F16>, copy_elements<I32>, copy_elements<F32>,
                       copy_elements<I64>, copy_elements<F64>};

// A queued statistics job (offsets == nullptr), gather job, copy job (dest: n bytes of data
// copied there when ndim is 0, else the strided elements), or call (call(argument)); sizes
// copied, the caller's arrays may go as soon as it is queued.
struct Job {
  const void* data; int kind, ndim;
  int64_t size[16], stride[16], step[16];
  double* out_f; int64_t* out_i;
  const int64_t* offsets; int64_t n;
  int64_t elements;  // read by the job
  void* dest = nullptr;
  void (*call)(void*) = nullptr;
  void* argument = nullptr;
};

void execute(const Job& job) {
  if (job.call != nullptr) job.call(job.argument);
  else if (job.dest != nullptr && job.ndim == 0) std::memcpy(job.dest, job.data, job.n);
  else if (job.dest != nullptr) COPIES[job.kind](job.data, job.ndim, job.size, job.stride, job.step, job.dest);
  else if (job.offsets == nullptr) KINDS[job.kind](job.data, job.ndim, job.size, job.stride, job.step, job.out_f, job.out_i);
  else GATHERS[job.kind](job.data, job.offsets, job.n, job.out_f);
}

// A sleeping worker is woken once this much work is queued, or by wait(): waking a thread costs
// the caller tens of microseconds on a virtual machine, too much to pay per tensor.
constexpr int64_t WAKE_ELEMENTS = 1 << 20;
constexpr size_t WAKE_JOBS = 64;
// Even so, a dumped step of PI0 small woke it ~70 times (each large tensor is past WAKE_ELEMENTS
// and the worker had run dry since the last), ~28 µs each on the training thread. So while jobs
// keep coming the worker does not sleep until woken but looks for more every POLL_EVERY (its own
// timed wake-ups cost the training thread nothing; a job waits at most that long); POLL_FOR after
// its last job (past a dumped step) it sleeps until woken again.
constexpr auto POLL_EVERY = std::chrono::milliseconds(1);
constexpr auto POLL_FOR = std::chrono::milliseconds(50);

// Queued jobs in order, in a ring that grows as needed: a job costs no allocation (a deque of
// jobs this size allocated one block per job on the training thread and freed it on the worker's).
struct Jobs {
  std::vector<Job> ring = std::vector<Job>(256);
  size_t head = 0, count = 0;

  bool empty() const { return count == 0; }
  size_t size() const { return count; }
  void push_back(const Job& job) {
    if (count == ring.size()) {  // full: unroll into one twice as large
      std::vector<Job> larger(2 * ring.size());
      for (size_t i = 0; i < count; ++i) larger[i] = ring[(head + i) % ring.size()];
      ring.swap(larger);
      head = 0;
    }
    ring[(head + count++) % ring.size()] = job;
  }
  Job pop_front() {
    Job job = ring[head];
    head = (head + 1) % ring.size();
    --count;
    return job;
  }
};

// One worker thread that runs queued jobs in order while the caller goes on. It is created on
// first use and never destroyed (detached, so interpreter exit never joins or destroys it); a
// forked child, which has no such thread, makes its own (queue()). A caller that waits runs
// queued jobs too, rather than sleep while they wait on one core.
struct Queue {
  std::mutex mutex;
  std::condition_variable work, idle;
  Jobs jobs;
  int64_t queued_elements = 0;
  bool sleeping = false;
  int running = 0;  // jobs being run: by the worker, and by callers that wait
  // jobs run so far, in queue order (keep()'s release reads it between waits; within a wait,
  // where callers run jobs too, it may count one ahead of another still running); on a cache line
  // of its own, which the training thread reads at every record while the worker writes the rest
  alignas(64) std::atomic<int64_t> finished{0};
  std::chrono::steady_clock::time_point last_job;  // when the worker last took a job

  Queue() { std::thread([this] { run(); }).detach(); }

  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    while (true) {
      if (jobs.empty()) {
        idle.notify_all();
        if (std::chrono::steady_clock::now() - last_job < POLL_FOR) {
          work.wait_for(lock, POLL_EVERY);
          continue;
        }
        sleeping = true;
        work.wait(lock, [this] { return !sleeping; });
        continue;
      }
      last_job = std::chrono::steady_clock::now();
      run_front(lock);
    }
  }

  // The front job, run with the lock released meanwhile (held on entry and on return).
  void run_front(std::unique_lock<std::mutex>& lock) {
    Job job = jobs.pop_front();
    queued_elements -= job.elements;
    ++running;
    lock.unlock();
    execute(job);
    lock.lock();
    --running;
    finished.fetch_add(1, std::memory_order_release);
    if (jobs.empty() && running == 0) idle.notify_all();
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
    while (!jobs.empty()) run_front(lock);
    idle.wait(lock, [this] { return jobs.empty() && running == 0; });
  }
};

// The process's queue, made on first use. A forked child forgets its parent's (whose worker is
// not in the child, and whose lock may have been held at the fork) and makes its own: a fork
// handler rather than a getpid() per job, a system call that cost more than queueing the job.
std::atomic<Queue*> the_queue{nullptr};
std::mutex creating;

Queue& queue() {
  Queue* existing = the_queue.load(std::memory_order_acquire);
  if (existing != nullptr) return *existing;
  std::lock_guard<std::mutex> lock(creating);
  static const int forgets_at_fork =
      pthread_atfork(nullptr, nullptr, [] { the_queue.store(nullptr, std::memory_order_relaxed); });
  (void)forgets_at_fork;
  if (the_queue.load(std::memory_order_relaxed) == nullptr) the_queue.store(new Queue(), std::memory_order_release);
  return *the_queue.load(std::memory_order_relaxed);
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

extern "C" void pi0align_queue_copy(const void* data, void* dest, int64_t nbytes) {
  Job job{data, 0, 0, {}, {}, {}, nullptr, nullptr, nullptr, nbytes, nbytes / 4, dest};  // a copy costs as a read
  queue().push(job);
}

extern "C" void pi0align_queue_strided_copy(const void* data, int kind, int ndim, const int64_t* size,
                                             const int64_t* stride, const int64_t* step, void* dest) {
  Job job = job_of(data, kind, ndim, size, stride, step);
  job.dest = dest;
  queue().push(job);
}

extern "C" void pi0align_queue_call(void (*call)(void*), void* argument) {
  Job job{nullptr, 0, 0, {}, {}, {}, nullptr, nullptr, nullptr, 0, 0};
  job.call = call, job.argument = argument;
  queue().push(job);
}

extern "C" void pi0align_wait() {
  Queue* existing = the_queue.load(std::memory_order_acquire);
  if (existing != nullptr) existing->wait();
}

extern "C" void pi0align_finished(int64_t* out) {
  Queue* existing = the_queue.load(std::memory_order_acquire);
  *out = existing == nullptr ? 0 : existing->finished.load(std::memory_order_acquire);
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
