// The native dump backend's Python extension (pi0align/dump/native_backend.py):
// - input_edges / watch / watch_tensor_grads: backward hooks on the autograd nodes a call created
//   (torch_backend.py has the same in Python): finding and hooking them costs Python about 10 us a
//   call, here well under one, and the hooks call Python only with a gradient to record;
// - tensors_of: the tensors of a call's arguments or results;
// - recorder / record / set_call / columns / statistics: a step's records, deduplicated, with
//   their statistics by element_statistics.cpp (queued on its thread) or, for tensors it does not
//   take, by the Python callback it is given;
// - stats / gather / wait: the kernel's entry points taking the tensor itself;
// - sample_cache / remember / set_host: sample mode's layouts seen before, by which record()
//   gathers a record's sample without calling the Python sampler;
// - describe_arguments / call_site: what a forward call's row says of it (call_description.cpp);
// - api_handler: the capture's __torch_function__, which records a call with them, and
//   enter_module / leave_module, around each module's forward (api_calls.cpp);
// - open_call / open_backward: rows of a step's calls table (calls_table.cpp).
#include <Python.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/util/SmallVector.h>
#include <c10/util/flat_hash_map.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "call_description.h"
#include "capture_extension.h"
#include "element_statistics.h"

namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;
using NodeRef = decltype(torch::autograd::Edge::function);  // shared_ptr or intrusive_ptr, by torch version

// A call made of more autograd nodes than this (a composite) keeps only its output gradients.
constexpr size_t kMaxNodes = 16;

PyObject* role_grad_output;
PyObject* role_grad_input;

// A gradient's index at the node, the call's argument, and whether it flows into a leaf's
// accumulator (`.grad`): such a gradient is read now, not queued, since autograd copies a gradient
// someone else holds into `.grad` instead of moving it there (PI0 small: 23 MB a step copied, and
// the heap grown and trimmed again at each step, 5,700 page faults).
struct Slot { uint32_t index; long arg; bool to_leaf; };
// A call's slots: most calls have one or two outputs and inputs, held inline rather than on the
// heap (a call's watch allocated and freed about ten small vectors).
using Slots = c10::SmallVector<Slot, 2>;

using pi0align::arity;

// A Python object held by a hook, which autograd may free on a thread without the GIL.
struct PyRef {
  PyObject* object;
  explicit PyRef(PyObject* o) : object(Py_NewRef(o)) {}
  PyRef(const PyRef&) = delete;
  ~PyRef() {
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
      pybind11::gil_scoped_acquire gil;
      Py_DECREF(object);
    }
  }
};

using pi0align::Quiet;

// A forward call's backward row and where its gradients are recorded (defined with the recorder).
struct BackwardCall;
// The backward call a capsule holds, or null with a Python error set.
std::shared_ptr<BackwardCall> backward_call_of(PyObject* capsule);
// Records one gradient of the call (now, not queued, where `to_leaf`), with the GIL held; a Python
// error is raised through autograd.
void deliver(BackwardCall& call, PyObject* role, long arg, const at::TensorBase& grad, bool to_leaf);

// Records the gradients a node receives (the call's output gradients) and those it produces
// towards the call's inputs. Changes nothing.
class SinkHook final : public torch::autograd::FunctionPostHook {
 public:
  SinkHook(std::shared_ptr<BackwardCall> call, Slots outs, Slots ins)
      : call_(std::move(call)), outs_(std::move(outs)), ins_(std::move(ins)) {}

  variable_list operator()(const variable_list& grad_inputs, const variable_list& grad_outputs) override {
    pybind11::gil_scoped_acquire gil;
    Quiet quiet;
    deliver_all(role_grad_output, outs_, grad_outputs);
    deliver_all(role_grad_input, ins_, grad_inputs);
    return grad_inputs;
  }

 private:
  void deliver_all(PyObject* role, const Slots& slots, const variable_list& grads) {
    for (const Slot& slot : slots)
      if (slot.index < grads.size() && grads[slot.index].defined())
        deliver(*call_, role, slot.arg, grads[slot.index], slot.to_leaf);
  }

  std::shared_ptr<BackwardCall> call_;
  Slots outs_, ins_;
};

}  // namespace

namespace pi0align {

// watch_tensor_grads(tensors, role, sink): records each tensor's full gradient as the sink's
// (backward.watch_tensor_grads: module inputs)
PyObject* watch_tensor_grads(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!arity(nargs, 3, "watch_tensor_grads(tensors, role, sink)")) return nullptr;
  std::shared_ptr<BackwardCall> call = backward_call_of(args[2]);
  if (!call) return nullptr;
  PyObject* seq = PySequence_Fast(args[0], "watch_tensor_grads takes a list of tensors");
  if (seq == nullptr) return nullptr;
  auto role = std::make_shared<PyRef>(args[1]);
  for (Py_ssize_t arg = 0; arg < PySequence_Fast_GET_SIZE(seq); ++arg) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, arg);
    if (!pi0align::is_tensor(item) || !THPVariable_Unpack(item).requires_grad()) continue;
    const bool leaf = THPVariable_Unpack(item).is_leaf();  // its gradient goes on into `.grad`
    THPVariable_Unpack(item).register_hook([role, call, arg, leaf](const at::TensorBase& grad) {
      pybind11::gil_scoped_acquire gil;
      Quiet quiet;
      deliver(*call, role->object, (long)arg, grad, leaf);
    });
  }
  Py_DECREF(seq);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}
}  // namespace pi0align

namespace {

// The inputs that share one gradient edge (x * x passes x twice), in argument order.
struct Target { Node* node; uint32_t nr; c10::SmallVector<long, 2> args; };

// The gradient edges of a call's inputs: taken before an in-place call rebases them.
struct InputEdges {
  c10::SmallVector<NodeRef, 3> nodes;  // alive until the call is watched
  c10::SmallVector<Target, 3> targets;

  Target* find(const Node* node, uint32_t nr) {
    for (Target& t : targets) if (t.node == node && t.nr == nr) return &t;
    return nullptr;
  }
  bool has_node(const Node* node) const {
    for (const Target& t : targets) if (t.node == node) return true;
    return false;
  }
};

void free_edges(PyObject* capsule) {
  delete static_cast<InputEdges*>(PyCapsule_GetPointer(capsule, "pi0align.input_edges"));
}

}  // namespace

namespace pi0align {

// input_edges(tensors) -> opaque edges, or None when no tensor requires grad
PyObject* input_edges(PyObject*, PyObject* tensors) {
  HANDLE_TH_ERRORS
  PyObject* seq = PySequence_Fast(tensors, "input_edges takes a list of tensors");
  if (seq == nullptr) return nullptr;
  auto edges = std::make_unique<InputEdges>();
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    if (!pi0align::is_tensor(item)) continue;
    const at::Tensor& tensor = THPVariable_Unpack(item);
    if (!tensor.defined() || !tensor.requires_grad()) continue;
    torch::autograd::Edge edge = torch::autograd::impl::gradient_edge(tensor);  // a leaf's: its accumulator
    if (!edge.function) continue;
    Target* target = edges->find(edge.function.get(), edge.input_nr);
    if (target == nullptr) {
      edges->targets.push_back({edge.function.get(), edge.input_nr, {}});
      edges->nodes.push_back(std::move(edge.function));
      target = &edges->targets.back();
    }
    target->args.push_back((long)i);
  }
  Py_DECREF(seq);
  if (edges->targets.empty()) Py_RETURN_NONE;
  PyObject* capsule = PyCapsule_New(edges.get(), "pi0align.input_edges", free_edges);
  if (capsule != nullptr) edges.release();
  return capsule;
  END_HANDLE_TH_ERRORS
}
}  // namespace pi0align

namespace {

struct Watched { NodeRef node; Slots outs, ins; };
using WatchedNodes = c10::SmallVector<Watched, 2>;

Watched& watched_entry(WatchedNodes& watched, const NodeRef& node) {
  for (Watched& w : watched) if (w.node == node) return w;
  return watched.emplace_back(Watched{node, {}, {}});
}

}  // namespace

namespace pi0align {

// watch(outputs, edges, sink): hooks the nodes that produced `outputs` and, walking back from
// them, the nodes whose gradients flow to the inputs' edges, as backward.watch does.
PyObject* watch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!arity(nargs, 3, "watch(outputs, edges, sink)")) return nullptr;
  InputEdges* edges = nullptr;
  if (args[1] != Py_None) {
    edges = static_cast<InputEdges*>(PyCapsule_GetPointer(args[1], "pi0align.input_edges"));
    if (edges == nullptr) return nullptr;
  }
  std::shared_ptr<BackwardCall> call = backward_call_of(args[2]);
  if (!call) return nullptr;
  PyObject* seq = PySequence_Fast(args[0], "watch takes a list of tensors");
  if (seq == nullptr) return nullptr;
  WatchedNodes watched;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  for (Py_ssize_t arg = 0; arg < n; ++arg) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, arg);
    if (!pi0align::is_tensor(item)) continue;
    const at::Tensor& out = THPVariable_Unpack(item);
    if (!out.defined()) continue;
    NodeRef node = out.grad_fn();
    // no gradient, or an input handed back unchanged: not this call's node
    if (!node || (edges != nullptr && edges->has_node(node.get()))) continue;
    watched_entry(watched, node).outs.push_back({(uint32_t)out.output_nr(), (long)arg, false});
  }
  Py_DECREF(seq);
  if (watched.empty()) Py_RETURN_NONE;
  c10::SmallVector<const Node*, kMaxNodes + 1> seen;
  for (const Watched& w : watched) seen.push_back(w.node.get());
  c10::SmallVector<NodeRef, 4> frontier;
  if (edges != nullptr) for (const Watched& w : watched) frontier.push_back(w.node);
  c10::SmallVector<size_t, 4> used;
  while (!frontier.empty() && seen.size() <= kMaxNodes) {
    NodeRef node = std::move(frontier.back());
    frontier.pop_back();
    used.assign(edges->targets.size(), 0);
    const auto& next = node->next_edges();
    for (uint32_t j = 0; j < next.size(); ++j) {
      const NodeRef& following = next[j].function;
      if (!following) continue;
      Target* target = edges->find(following.get(), next[j].input_nr);
      if (target != nullptr) {
        // the k-th use of an edge at this node is the k-th input with that edge
        size_t k = used[target - edges->targets.data()]++;
        if (k < target->args.size())
          watched_entry(watched, node).ins.push_back(
              {j, target->args[k], dynamic_cast<torch::autograd::AccumulateGrad*>(following.get()) != nullptr});
      } else if (!edges->has_node(following.get()) &&
                 std::find(seen.begin(), seen.end(), following.get()) == seen.end()) {
        seen.push_back(following.get());
        frontier.push_back(following);
      }
    }
  }
  for (Watched& w : watched) {
    if (seen.size() > kMaxNodes) w.ins.clear();  // a composite: its input edges are not all found, report none
    if (!w.outs.empty() || !w.ins.empty())
      w.node->add_post_hook(std::make_unique<SinkHook>(call, std::move(w.outs), std::move(w.ins)));
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}
}  // namespace pi0align

namespace {


// ---- the statistics kernel's entry points, taking tensors -------------------------------------

int kind_of_type[256];  // at::ScalarType -> the kernel's kind, -1: not taken (set by set_kind)
constexpr int kMaxDims = 16;  // the kernel's odometer

// Queued tensors, kept alive until their call has run (never freed at exit: no static destructor
// may free a tensor after the interpreter is gone). The tensor, not only its memory: autograd then
// copies a gradient into `.grad` rather than move it there, so that hooks and DDP changing `.grad`
// in place before the queue is drained (at backward's end) never change what is queued. (A gradient
// known to go into `.grad` is not queued at all but read at once: record()'s `now`.)
std::deque<at::Tensor>& kept = *new std::deque<at::Tensor>();
int64_t released = 0;  // queued calls whose tensor was let go

// Those whose calls have run are let go at each call: one atomic load. Looking once every 64 calls
// held up to 64 more tensors, which made PI0 small's heap grow by tens of MB each step and glibc
// give it back at the step's end (3,500 page faults a step against 700; the step 7.7 ms slower).
void keep(const at::Tensor& tensor) {
  kept.push_back(tensor);
  int64_t finished = 0;
  pi0align_finished(&finished);
  for (; released < finished && !kept.empty(); ++released) kept.pop_front();
}

// The CPU tensor the kernel reads (a contiguous copy beyond its dims), or an undefined one when
// it takes no such tensor.
at::Tensor readable(const at::Tensor& tensor, int* kind) {
  if (!tensor.defined() || !tensor.device().is_cpu() || tensor.layout() != at::kStrided) return {};
  *kind = kind_of_type[(int)tensor.scalar_type()];
  if (*kind < 0) return {};
  return tensor.dim() > kMaxDims ? tensor.detach().contiguous() : tensor;
}

at::Tensor readable(PyObject* object, int* kind) {
  return pi0align::is_tensor(object) ? readable(THPVariable_Unpack(object), kind) : at::Tensor();
}

// How the kernel reads a view in place: in memory order (repeated dims outermost, then the largest
// strides, merged where memory allows), with row-major steps (the checksum's positions, a copy's
// places); returns the number of dims in size, stride and step.
int memory_order(const at::Tensor& tensor, int64_t* size, int64_t* stride, int64_t* step) {
  const int64_t dims = tensor.dim();
  auto shape = tensor.sizes();
  auto strides = tensor.strides();
  int64_t row_major[kMaxDims];
  int order[kMaxDims];
  for (int64_t d = dims - 1, place = 1; d >= 0; place *= shape[d], --d) row_major[d] = place;
  int n = 0;
  for (int d = 0; d < dims; ++d) if (shape[d] > 1) order[n++] = d;
  std::stable_sort(order, order + n, [&](int a, int b) {
    bool a_repeats = strides[a] == 0, b_repeats = strides[b] == 0;
    if (a_repeats != b_repeats) return a_repeats;
    return strides[a] > strides[b];
  });
  int m = 0;
  for (int i = 0; i < n; ++i) {
    int d = order[i];
    if (m > 0 && stride[m - 1] == strides[d] * shape[d] && step[m - 1] == row_major[d] * shape[d]) {
      size[m - 1] *= shape[d], stride[m - 1] = strides[d], step[m - 1] = row_major[d];
    } else {
      size[m] = shape[d], stride[m] = strides[d], step[m] = row_major[d], ++m;
    }
  }
  return m;
}

// Statistics of a tensor by the kernel, now or queued; false when the kernel does not take it.
// Views are read in place (memory_order).
bool kernel_stats(const at::Tensor& given, double* floats, int64_t* ints, bool queued) {
  int kind = -1;
  at::Tensor tensor = readable(given, &kind);
  if (!tensor.defined()) return false;
  const void* data = tensor.data_ptr();
  if (queued) keep(tensor);
  if (tensor.is_contiguous()) {
    (queued ? pi0align_queue_dense_stats : pi0align_dense_stats)(data, kind, tensor.numel(), floats, ints);
    return true;
  }
  int64_t size[kMaxDims], stride[kMaxDims], step[kMaxDims];
  const int m = memory_order(tensor, size, stride, step);
  (queued ? pi0align_queue_stats : pi0align_stats)(data, kind, m, size, stride, step, floats, ints);
  return true;
}

// set_kind(tensor, kind): the kernel's kind for the tensor's dtype (native_backend.py's KINDS, one source)
PyObject* set_kind(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "set_kind(tensor, kind)")) return nullptr;
  if (!pi0align::is_tensor(args[0])) return PyErr_Format(PyExc_TypeError, "set_kind(tensor, kind): not a tensor");
  long kind = PyLong_AsLong(args[1]);
  if (kind == -1 && PyErr_Occurred()) return nullptr;
  kind_of_type[(int)THPVariable_Unpack(args[0]).scalar_type()] = (int)kind;
  Py_RETURN_NONE;
}

// stats(tensor, floats, ints, queued) -> whether the kernel took it
PyObject* tensor_stats(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!arity(nargs, 4, "stats(tensor, floats, ints, queued)")) return nullptr;
  if (!pi0align::is_tensor(args[0])) Py_RETURN_FALSE;
  auto* floats = static_cast<double*>(PyLong_AsVoidPtr(args[1]));
  auto* ints = static_cast<int64_t*>(PyLong_AsVoidPtr(args[2]));
  if (PyErr_Occurred()) return nullptr;
  return PyBool_FromLong(kernel_stats(THPVariable_Unpack(args[0]), floats, ints, PyObject_IsTrue(args[3])));
  END_HANDLE_TH_ERRORS
}

// gather(tensor, offsets, count, values, queued) -> whether the kernel took it
PyObject* tensor_gather(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!arity(nargs, 5, "gather(tensor, offsets, count, values, queued)")) return nullptr;
  int kind = -1;
  at::Tensor tensor = readable(args[0], &kind);
  if (!tensor.defined()) Py_RETURN_FALSE;
  void* offsets = PyLong_AsVoidPtr(args[1]);
  int64_t count = PyLong_AsLongLong(args[2]);
  void* values = PyLong_AsVoidPtr(args[3]);
  if (PyErr_Occurred()) return nullptr;
  bool queued = PyObject_IsTrue(args[4]);
  if (queued) keep(tensor);
  (queued ? pi0align_queue_gather : pi0align_gather)(tensor.data_ptr(), kind, static_cast<const int64_t*>(offsets),
                                                     count, static_cast<double*>(values));
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// queue_copy(tensor, address) -> the queued call to wait for (finished() reaching it), 0 when the
// kernel does not take the tensor: its bytes copied to `address` on the kernel's thread, as they
// are now (the tensor kept alive, and waited for before an in-place call could change it)
PyObject* queue_copy(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!arity(nargs, 2, "queue_copy(tensor, address)")) return nullptr;
  void* dest = PyLong_AsVoidPtr(args[1]);
  if (PyErr_Occurred()) return nullptr;
  if (!pi0align::is_tensor(args[0])) return PyLong_FromLong(0);
  const at::Tensor& given = THPVariable_Unpack(args[0]);
  if (!given.device().is_cpu() || given.layout() != at::kStrided || given.is_quantized() || given.is_neg() ||
      given.is_conj())
    return PyLong_FromLong(0);
  // a view is read as kernel_stats reads it, and copied element by element in row-major order
  int kind = -1;
  const at::Tensor tensor = given.is_contiguous() ? given : readable(given, &kind);
  if (!tensor.defined()) return PyLong_FromLong(0);
  keep(tensor);
  if (tensor.is_contiguous()) {
    pi0align_queue_copy(tensor.data_ptr(), dest, (int64_t)tensor.nbytes());
  } else {
    int64_t size[kMaxDims], stride[kMaxDims], step[kMaxDims];
    const int m = memory_order(tensor, size, stride, step);
    pi0align_queue_strided_copy(tensor.data_ptr(), kind, m, size, stride, step, dest);
  }
  return PyLong_FromLongLong(released + (int64_t)kept.size());  // each queued call keeps one tensor
  END_HANDLE_TH_ERRORS
}

// finished(): how many queued calls have run
PyObject* finished_calls(PyObject*, PyObject*) {
  int64_t finished = 0;
  pi0align_finished(&finished);
  return PyLong_FromLongLong(finished);
}

// wait(): once every queued call has run, their tensors are let go
PyObject* wait_queue(PyObject*, PyObject*) {
  Py_BEGIN_ALLOW_THREADS
  pi0align_wait();
  Py_END_ALLOW_THREADS
  released += kept.size();
  kept.clear();
  Py_RETURN_NONE;
}

// held(): how many queued tensors are kept alive
PyObject* held(PyObject*, PyObject*) { return PyLong_FromSize_t(kept.size()); }

// forget(): in a forked child, the parent's queue is not here; the child counts its own
PyObject* forget_queue(PyObject*, PyObject*) {
  kept.clear();
  released = 0;
  Py_RETURN_NONE;
}

// ---- sample mode's layouts, for a record's sample without Python (sampling.py's Sampler) ------

// Where the sampler gathers a record's elements: its layout, found by name, role and argument.
struct SampleLayout {
  std::vector<int64_t> shape, strides;
  const int64_t* offsets;  // memory offsets of the sampled elements, kept alive by the Sampler
  int64_t count;
  std::shared_ptr<PyRef> position_row, count_object;  // what the Sampler's lists take for the record
};

// The layouts' key: name, role and argument index (the sample's positions depend on these and the
// shape). Its texts are compared as str objects, not copied: a record's name is a new str at each
// step, and a copy of it per record cost PI0 small's sample mode an allocation a record. The
// key stored in the map holds references to its two str (SampleCache releases them).
struct SampleKey {
  PyObject* name;
  PyObject* role;
  long arg;
  Py_hash_t hash;
  bool operator==(const SampleKey& other) const {
    return arg == other.arg && hash == other.hash && same_text(name, other.name) && same_text(role, other.role);
  }
  static bool same_text(PyObject* a, PyObject* b) { return a == b || PyUnicode_Compare(a, b) == 0; }
};

struct SampleKeyHash {
  size_t operator()(const SampleKey& key) const { return (size_t)key.hash; }
};

// The key of a record; false with a Python error set.
bool sample_key(PyObject* name, PyObject* role, long arg_index, SampleKey& key) {
  Py_hash_t name_hash = PyObject_Hash(name), role_hash = name_hash == -1 ? -1 : PyObject_Hash(role);
  if (role_hash == -1) return false;
  key = {name, role, arg_index, (Py_hash_t)((size_t)name_hash * 1000003u ^ (size_t)role_hash * 31u ^ (size_t)arg_index)};
  return true;
}

// A Sampler's layouts seen in earlier steps and its host table. A record whose layout is known
// and whose row fits in the table is gathered here; the rest, and every first sight, go to the
// Sampler, which tells this cache (remember, set_host).
struct SampleCache {
  std::unordered_map<SampleKey, SampleLayout, SampleKeyHash> layouts;
  char* host = nullptr;  // the Sampler's float64 table: rows of row_bytes
  int64_t row_bytes = 0, rows = 0;
  bool queued = false;
  PyRef position_rows, counts;  // the Sampler's per-step lists, one entry per row
  SampleCache(PyObject* p, PyObject* c, bool q) : queued(q), position_rows(p), counts(c) {}
  ~SampleCache() {
    for (auto& [key, layout] : layouts) {
      Py_DECREF(key.name);
      Py_DECREF(key.role);
    }
  }
};

void free_sample_cache(PyObject* capsule) {
  delete static_cast<SampleCache*>(PyCapsule_GetPointer(capsule, "pi0align.sample_cache"));
}

SampleCache* sample_cache_of(PyObject* capsule) {
  return static_cast<SampleCache*>(PyCapsule_GetPointer(capsule, "pi0align.sample_cache"));
}

// The kernel's kind of a tensor it gathers from in place (one readable() takes as it is, within
// the kernel's dims), or -1.
int in_place_kind(const at::Tensor& tensor) {
  int kind = -1;
  return tensor.dim() <= kMaxDims && readable(tensor, &kind).defined() ? kind : -1;
}

// The record's sample row, gathered here; -1 when the Sampler must take it, -2 with a Python error set.
int64_t cached_sample(SampleCache& cache, const at::Tensor& tensor, PyObject* name, PyObject* role, long arg_index,
                      bool now) {
  const int kind = in_place_kind(tensor);
  if (kind < 0) return -1;
  SampleKey key;
  if (!sample_key(name, role, arg_index, key)) return -2;
  auto found = cache.layouts.find(key);
  if (found == cache.layouts.end()) return -1;
  const SampleLayout& layout = found->second;
  if (!std::equal(layout.shape.begin(), layout.shape.end(), tensor.sizes().begin(), tensor.sizes().end()) ||
      !std::equal(layout.strides.begin(), layout.strides.end(), tensor.strides().begin(), tensor.strides().end()))
    return -1;
  int64_t row = PyList_GET_SIZE(cache.position_rows.object);
  if (row + 1 >= cache.rows) return -1;  // one row to spare, as the Sampler keeps: it grows the table
  auto* values = reinterpret_cast<double*>(cache.host + cache.row_bytes * row);
  const bool queued = cache.queued && !now;
  if (queued) keep(tensor);
  (queued ? pi0align_queue_gather : pi0align_gather)(tensor.data_ptr(), kind, layout.offsets, layout.count, values);
  if (PyList_Append(cache.position_rows.object, layout.position_row->object) < 0 ||
      PyList_Append(cache.counts.object, layout.count_object->object) < 0)
    return -2;
  return row;
}

// sample_cache(position_rows, counts, queued) -> a Sampler's cache
PyObject* new_sample_cache(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 3, "sample_cache(position_rows, counts, queued)")) return nullptr;
  if (!PyList_Check(args[0]) || !PyList_Check(args[1]))
    return PyErr_Format(PyExc_TypeError, "sample_cache: position_rows and counts must be lists");
  auto cache = std::make_unique<SampleCache>(args[0], args[1], PyObject_IsTrue(args[2]));
  PyObject* capsule = PyCapsule_New(cache.get(), "pi0align.sample_cache", free_sample_cache);
  if (capsule != nullptr) cache.release();
  return capsule;
}

// remember(cache, tensor, name, role, arg_index, position_row, count, offsets): a layout the Sampler
// made, for the next records of that name, role, argument and layout (the int64 offsets at
// address `offsets` kept alive and unchanged by the Sampler)
PyObject* remember_layout(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!arity(nargs, 8, "remember(cache, tensor, name, role, arg_index, position_row, count, offsets)"))
    return nullptr;
  SampleCache* cache = sample_cache_of(args[0]);
  if (cache == nullptr) return nullptr;
  if (!pi0align::is_tensor(args[1])) return PyErr_Format(PyExc_TypeError, "remember: not a tensor");
  const at::Tensor& tensor = THPVariable_Unpack(args[1]);
  long arg_index = PyLong_AsLong(args[4]);
  int64_t count = PyLong_AsLongLong(args[6]);
  const void* offsets = PyLong_AsVoidPtr(args[7]);
  SampleKey key;
  if (PyErr_Occurred() || !sample_key(args[2], args[3], arg_index, key)) return nullptr;
  if (in_place_kind(tensor) < 0) Py_RETURN_NONE;
  auto [entry, added] = cache->layouts.insert_or_assign(
      key, SampleLayout{{tensor.sizes().begin(), tensor.sizes().end()},
                        {tensor.strides().begin(), tensor.strides().end()},
                        static_cast<const int64_t*>(offsets), count, std::make_shared<PyRef>(args[5]),
                        std::make_shared<PyRef>(args[6])});
  if (added) {  // the map's key holds its texts
    Py_INCREF(entry->first.name);
    Py_INCREF(entry->first.role);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// set_host(cache, address, row_bytes, rows): the Sampler's host table, after it grew
PyObject* set_host(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 4, "set_host(cache, address, row_bytes, rows)")) return nullptr;
  SampleCache* cache = sample_cache_of(args[0]);
  if (cache == nullptr) return nullptr;
  cache->host = static_cast<char*>(PyLong_AsVoidPtr(args[1]));
  cache->row_bytes = PyLong_AsLongLong(args[2]);
  cache->rows = PyLong_AsLongLong(args[3]);
  if (PyErr_Occurred()) return nullptr;
  Py_RETURN_NONE;
}

// ---- a step's records (torch_backend.py's TorchRecords, in C++) --------------------------------

PyTypeObject* plain_types[2];  // torch.Tensor and torch.nn.Parameter; other types are subclasses
PyObject* no_text;  // ""
PyObject* dtype_namer;  // dtype_namer(tensor) -> its dtype's name, asked once per dtype
PyObject* dtype_names[256];  // at::ScalarType -> that name

constexpr int64_t kBlockRows = 4096;

// Statistics rows in blocks that never move: queued kernel calls write into them.
struct StatsBlock {
  double floats[kBlockRows][4];
  int64_t ints[kBlockRows][3];
  StatsBlock() {
    for (auto& row : floats) std::fill(std::begin(row), std::end(row), NAN);
    for (auto& row : ints) std::fill(std::begin(row), std::end(row), 0);
  }
};

// Equal keys, while the first tensor lives, mean the same elements in the same row-major order
// (torch_backend.py's _elements_key): views of contiguous memory share one.
struct ElementsKey {
  const void* data;
  int dtype;
  int64_t numel, version;
  std::vector<int64_t> layout;  // shape and strides, when not contiguous
  bool operator==(const ElementsKey& other) const = default;
};

struct ElementsKeyHash {
  size_t operator()(const ElementsKey& key) const {
    size_t h = std::hash<const void*>()(key.data) ^ (size_t)key.numel * 0x9e3779b97f4a7c15ULL;
    h ^= (size_t)key.version * 0xc2b2ae3d27d4eb4fULL + (size_t)key.dtype;
    for (int64_t v : key.layout) h = h * 31 + (size_t)v;
    return h;
  }
};

struct Seen {
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor;  // while it lives, its memory holds no other data
  int64_t slot;
  c10::SmallVector<int64_t, 6> shape;
  PyObject* path;
};

struct Recorder {
  bool queued = false;
  bool queued_any = false;  // it queued statistics: their calls must have run before it is freed
  bool closed = false;  // the step has ended: gradients arriving later (a graph kept past it) are not its
  PyObject* fallback = nullptr;  // fallback(tensor, slot): statistics the kernel does not compute
  PyObject* sink = nullptr;  // sink(tensor, now) -> its stored path (tensor mode), or None
  PyObject* sampler = nullptr;  // sampler(tensor, name, role, arg_index, now) -> its sample row, or None
  SampleCache* samples = nullptr;  // the sampler's cache, or null: each record's sample asked of the sampler
  PyObject* samples_capsule = nullptr;  // holds `samples`
  std::vector<int64_t> call_id, numel, slot, sample_row, shape_end, dims;
  std::vector<int32_t> arg_index;
  std::vector<PyObject*> role, dtype, path, skipped;  // references held
  std::vector<std::unique_ptr<StatsBlock>> blocks;
  std::vector<int64_t> slot_numel;
  // open addressing, entries inline: a step's ~1,500 entries and ~4,000 lookups (PI0 small) cost
  // std::unordered_map's node per entry and a pointer chase per lookup
  ska::flat_hash_map<ElementsKey, Seen, ElementsKeyHash> seen;

  // Its Python references, let go with the GIL held; the rest of it may then go on any thread.
  void release_python() {
    for (auto* column : {&role, &dtype, &path, &skipped}) {
      for (PyObject* text : *column) Py_DECREF(text);
      column->clear();
    }
    for (auto& entry : seen) Py_CLEAR(entry.second.path);
    Py_CLEAR(fallback);
    Py_CLEAR(sink);
    Py_CLEAR(sampler);
    Py_CLEAR(samples_capsule);
  }

  ~Recorder() { release_python(); }  // nothing left to release where free_recorder released it

  int64_t new_slot(int64_t elements) {
    int64_t at = (int64_t)slot_numel.size();
    if (at / kBlockRows >= (int64_t)blocks.size()) blocks.push_back(std::make_unique<StatsBlock>());
    slot_numel.push_back(elements);
    return at;
  }
  double* floats_of(int64_t at) { return blocks[at / kBlockRows]->floats[at % kBlockRows]; }
  int64_t* ints_of(int64_t at) { return blocks[at / kBlockRows]->ints[at % kBlockRows]; }
};

void delete_recorder(void* recorder) { delete static_cast<Recorder*>(recorder); }

// A step's recorder is freed on the kernel's thread: its thousands of allocations, and the weak
// references to the step's tensors, took the training thread 2-5 ms at each step end of PI0 small.
// Its Python references go here, with the GIL.
void free_recorder(PyObject* capsule) {
  Recorder* recorder = static_cast<Recorder*>(PyCapsule_GetPointer(capsule, "pi0align.recorder"));
  // Its queued calls done: none writes into its blocks once freed (a caller that waits runs queued
  // calls beside the worker, so the queue's order alone does not say so). A step started but not
  // run (`stop()` after `step()`) queued none, and need not wait for the calls of earlier steps.
  if (recorder->queued_any) pi0align_wait();
  recorder->release_python();
  pi0align_queue_call(delete_recorder, recorder);
  keep(at::Tensor());  // keep()'s count: one kept tensor per queued call, none read here
}

Recorder* recorder_of(PyObject* capsule) {
  return static_cast<Recorder*>(PyCapsule_GetPointer(capsule, "pi0align.recorder"));
}

// Why a tensor gets no statistics (stats.py's skip_reason), a new reference; "" when it gets them.
PyObject* skip_reason(PyObject* object, const at::Tensor& tensor) {
  PyTypeObject* type = Py_TYPE(object);
  if (type != plain_types[0] && type != plain_types[1]) {
    PyObject* name = PyType_GetName(type);
    PyObject* reason = name ? PyUnicode_FromFormat("subclass:%U", name) : nullptr;
    Py_XDECREF(name);
    return reason;
  }
  const char* reason = nullptr;
  if (tensor.layout() != at::kStrided) reason = "sparse";
  else if (tensor.is_meta()) reason = "meta";
  else if (tensor.is_complex()) reason = "complex";
  else if (tensor.is_quantized()) reason = "subclass:quantized";
  else if (tensor.numel() == 0) reason = "empty";
  if (reason == nullptr) return Py_NewRef(no_text);
  return PyUnicode_FromString(reason);
}

PyObject* dtype_name(PyObject* object, const at::Tensor& tensor) {
  PyObject*& name = dtype_names[(int)tensor.scalar_type()];
  if (name == nullptr) name = PyObject_CallOneArg(dtype_namer, object);
  return name == nullptr ? nullptr : Py_NewRef(name);
}

ElementsKey elements_key(const at::Tensor& tensor) {
  ElementsKey key{tensor.data_ptr(), (int)tensor.scalar_type(), tensor.numel(), (int64_t)tensor._version(), {}};
  if (!tensor.is_contiguous()) {
    key.layout.assign(tensor.sizes().begin(), tensor.sizes().end());
    key.layout.insert(key.layout.end(), tensor.strides().begin(), tensor.strides().end());
  }
  return key;
}

// One record: its statistics (reused when the same elements were recorded this step), stored copy
// and sample, read now where `now` (else queued where the recorder queues); false with a Python
// error set when a Python part failed.
bool record(Recorder& r, int64_t call_id, PyObject* name, PyObject* role, int32_t arg_index, PyObject* object,
            bool now = false) {
  PyObject* const stored_now = now ? Py_True : Py_False;  // the sink's and the sampler's `now`
  const at::Tensor& tensor = THPVariable_Unpack(object);
  PyObject* skipped = skip_reason(object, tensor);
  PyObject* dtype = skipped ? dtype_name(object, tensor) : nullptr;
  if (dtype == nullptr) {
    Py_XDECREF(skipped);
    return false;
  }
  const c10::IntArrayRef shape = tensor.sizes();  // copied only where kept: no allocation per record
  int64_t slot = -1, sample_row = -1;
  PyObject* path = Py_NewRef(no_text);
  bool ok = true;
  if (skipped == no_text) {
    ElementsKey key = elements_key(tensor);
    auto known = r.seen.find(key);
    if (known != r.seen.end() && !known->second.tensor.expired()) {
      slot = known->second.slot;
      if (r.sink == Py_None || c10::IntArrayRef(known->second.shape) == shape)
        Py_SETREF(path, Py_NewRef(known->second.path));
      else Py_SETREF(path, PyObject_CallFunctionObjArgs(r.sink, object, stored_now, nullptr));
    } else {
      if (known != r.seen.end()) {  // its tensor is gone: these are new elements. Let go before the
        Py_DECREF(known->second.path);  // Python calls below, which could add entries and so move it
        r.seen.erase(known);
      }
      slot = r.new_slot(tensor.numel());
      const bool queued = r.queued && !now;
      if (kernel_stats(tensor, r.floats_of(slot), r.ints_of(slot), queued)) {
        r.queued_any = r.queued_any || queued;
      } else {
        PyObject* at = PyLong_FromLongLong(slot);
        PyObject* done = at ? PyObject_CallFunctionObjArgs(r.fallback, object, at, nullptr) : nullptr;
        Py_XDECREF(at);
        ok = done != nullptr;
        Py_XDECREF(done);
      }
      if (ok && r.sink != Py_None) Py_SETREF(path, PyObject_CallFunctionObjArgs(r.sink, object, stored_now, nullptr));
      if (ok && path != nullptr) {
        r.seen.emplace(std::move(key), Seen{c10::weak_intrusive_ptr<c10::TensorImpl>(tensor.getIntrusivePtr()), slot,
                                            c10::SmallVector<int64_t, 6>(shape.begin(), shape.end()), Py_NewRef(path)});
      }
    }
    ok = ok && path != nullptr;
    if (ok && r.samples != nullptr) {
      sample_row = cached_sample(*r.samples, tensor, name, role, arg_index, now);
      ok = sample_row != -2;
    }
    if (ok && r.sampler != Py_None && sample_row == -1) {
      PyObject* index = PyLong_FromLong(arg_index);
      PyObject* row =
          index ? PyObject_CallFunctionObjArgs(r.sampler, object, name, role, index, stored_now, nullptr) : nullptr;
      Py_XDECREF(index);
      ok = row != nullptr && (sample_row = PyLong_AsLongLong(row), !PyErr_Occurred());
      Py_XDECREF(row);
    }
  }
  if (!ok) {
    Py_DECREF(skipped);
    Py_DECREF(dtype);
    Py_XDECREF(path);
    return false;
  }
  r.call_id.push_back(call_id);
  r.arg_index.push_back(arg_index);
  r.numel.push_back(tensor.numel());
  r.slot.push_back(slot);
  r.sample_row.push_back(sample_row);
  r.dims.insert(r.dims.end(), shape.begin(), shape.end());
  r.shape_end.push_back((int64_t)r.dims.size());
  r.role.push_back(Py_NewRef(role));
  r.dtype.push_back(dtype);
  r.path.push_back(path);
  r.skipped.push_back(skipped);
  return true;
}

// recorder(queued, fallback, sink, sampler, sample_cache) -> a step's records; sample_cache: the
// sampler's (sample_cache()), or None
PyObject* new_recorder(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 5, "recorder(queued, fallback, sink, sampler, sample_cache)")) return nullptr;
  SampleCache* samples = args[4] == Py_None ? nullptr : sample_cache_of(args[4]);
  if (args[4] != Py_None && samples == nullptr) return nullptr;
  auto recorder = std::make_unique<Recorder>();
  recorder->samples = samples;
  recorder->samples_capsule = Py_NewRef(args[4]);
  recorder->queued = PyObject_IsTrue(args[0]);
  recorder->fallback = Py_NewRef(args[1]);
  recorder->sink = Py_NewRef(args[2]);
  recorder->sampler = Py_NewRef(args[3]);
  PyObject* capsule = PyCapsule_New(recorder.get(), "pi0align.recorder", free_recorder);
  if (capsule != nullptr) recorder.release();
  return capsule;
}

}  // namespace

namespace pi0align {

// record(recorder, call_id, name, role, arg_index, tensors): one record per tensor of the list, the
// first at arg_index; returns the row of the last
PyObject* record_tensors(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!arity(nargs, 6, "record(recorder, call_id, name, role, arg_index, tensors)")) return nullptr;
  Recorder* r = recorder_of(args[0]);
  int64_t call_id = PyLong_AsLongLong(args[1]);
  long first = PyLong_AsLong(args[4]);
  if (r == nullptr || PyErr_Occurred()) return nullptr;
  PyObject* seq = PySequence_Fast(args[5], "record takes a list of tensors");
  if (seq == nullptr) return nullptr;
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(seq); ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    ok = pi0align::is_tensor(item) && record(*r, call_id, args[2], args[3], (int32_t)(first + i), item);
    if (!ok && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "record takes a list of tensors");
  }
  Py_DECREF(seq);
  return ok ? PyLong_FromSsize_t((Py_ssize_t)r->call_id.size() - 1) : nullptr;
  END_HANDLE_TH_ERRORS
}
}  // namespace pi0align

namespace {

// set_call(recorder, row, call_id): a record's call, given later (-1: dropped)
PyObject* set_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 3, "set_call(recorder, row, call_id)")) return nullptr;
  Recorder* r = recorder_of(args[0]);
  Py_ssize_t row = PyLong_AsSsize_t(args[1]);
  int64_t call_id = PyLong_AsLongLong(args[2]);
  if (r == nullptr || PyErr_Occurred()) return nullptr;
  if (row < 0 || row >= (Py_ssize_t)r->call_id.size()) return PyErr_Format(PyExc_IndexError, "no record row %zd", row);
  r->call_id[row] = call_id;
  Py_RETURN_NONE;
}

template <class T>
PyObject* as_bytes(const std::vector<T>& values) {
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// A str column as (codes as int32 bytes, its distinct values as a list), the values told apart by
// identity: a step's records (PI0 small: 4,000) share a few roles, dtypes and reasons, each a str
// to hand to the writer process (captured_step.CodedColumn).
PyObject* coded(const std::vector<PyObject*>& texts) {
  ska::flat_hash_map<PyObject*, int32_t> codes;
  std::vector<int32_t> column(texts.size());
  PyObject* values = PyList_New(0);
  for (size_t i = 0; values != nullptr && i < texts.size(); ++i) {
    auto [at, added] = codes.emplace(texts[i], (int32_t)codes.size());
    if (added && PyList_Append(values, texts[i]) < 0) Py_CLEAR(values);
    column[i] = at->second;
  }
  return values == nullptr ? nullptr : Py_BuildValue("(NN)", as_bytes(column), values);
}

// The shapes as a coded column, its values the texts ("[8, 816, 1024]") of the distinct shapes
// (torch_backend.py's _shape_json): a step has a few hundred.
PyObject* coded_shapes(const Recorder& r) {
  std::unordered_map<std::string_view, int32_t> codes;  // over the bytes of a record's dims
  std::vector<int32_t> column(r.shape_end.size());
  PyObject* values = PyList_New(0);
  std::string text;
  for (size_t i = 0, start = 0; values != nullptr && i < r.shape_end.size(); start = r.shape_end[i++]) {
    std::string_view dims(reinterpret_cast<const char*>(r.dims.data() + start),
                          (r.shape_end[i] - start) * sizeof(int64_t));
    auto [at, added] = codes.try_emplace(dims, (int32_t)codes.size());
    column[i] = at->second;
    if (!added) continue;
    text = "[";
    for (size_t d = start; d < (size_t)r.shape_end[i]; ++d) text += (d > start ? ", " : "") + std::to_string(r.dims[d]);
    text += "]";
    PyObject* shape = PyUnicode_FromStringAndSize(text.data(), (Py_ssize_t)text.size());
    if (shape == nullptr || PyList_Append(values, shape) < 0) Py_CLEAR(values);
    Py_XDECREF(shape);
  }
  return values == nullptr ? nullptr : Py_BuildValue("(NN)", as_bytes(column), values);
}

// columns(recorder) -> (call_id, arg_index, numel, slot, sample_row as int64/int32/... bytes;
// role, dtype, shape, tensor, skipped as coded columns)
PyObject* columns(PyObject*, PyObject* capsule) {
  Recorder* r = recorder_of(capsule);
  if (r == nullptr) return nullptr;
  return Py_BuildValue("(NNNNNNNNNN)", as_bytes(r->call_id), as_bytes(r->arg_index), as_bytes(r->numel),
                       as_bytes(r->slot), as_bytes(r->sample_row), coded(r->role), coded(r->dtype), coded_shapes(*r),
                       coded(r->path), coded(r->skipped));
}

// statistics(recorder) -> (float64 [slots, 4], int64 [slots, 3], int64 numel [slots]) as bytes,
// once every queued kernel call has run (kernel wait())
PyObject* statistics(PyObject*, PyObject* capsule) {
  Recorder* r = recorder_of(capsule);
  if (r == nullptr) return nullptr;
  int64_t slots = (int64_t)r->slot_numel.size();
  std::vector<double> floats(slots * 4);
  std::vector<int64_t> ints(slots * 3);
  for (int64_t at = 0; at < slots; ++at) {
    std::copy_n(r->floats_of(at), 4, floats.begin() + at * 4);
    std::copy_n(r->ints_of(at), 3, ints.begin() + at * 3);
  }
  return Py_BuildValue("(NNN)", as_bytes(floats), as_bytes(ints), as_bytes(r->slot_numel));
}

// describe_records(tensor_type, parameter_type, dtype_namer): what record() needs from Python
PyObject* describe_records(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 3, "describe_records(tensor_type, parameter_type, dtype_namer)")) return nullptr;
  if (!PyType_Check(args[0]) || !PyType_Check(args[1])) return PyErr_Format(PyExc_TypeError, "not types");
  for (int i = 0; i < 2; ++i) plain_types[i] = (PyTypeObject*)Py_NewRef(args[i]);
  dtype_namer = Py_NewRef(args[2]);
  Py_RETURN_NONE;
}

struct BackwardCall {
  // opener(forward_id) -> the backward row's call id, asked at the first gradient. Nothing here
  // is a Python object made per call: a step's hooks leave the garbage collector nothing to scan.
  PyRef recorder, name, opener, forward_id;
  int64_t id = -1;
  BackwardCall(PyObject* r, PyObject* n, PyObject* o, PyObject* f) : recorder(r), name(n), opener(o), forward_id(f) {}
};

void free_backward_call(PyObject* capsule) {
  delete static_cast<std::shared_ptr<BackwardCall>*>(PyCapsule_GetPointer(capsule, "pi0align.backward_call"));
}

std::shared_ptr<BackwardCall> backward_call_of(PyObject* capsule) {
  auto* call = static_cast<std::shared_ptr<BackwardCall>*>(PyCapsule_GetPointer(capsule, "pi0align.backward_call"));
  return call == nullptr ? nullptr : *call;
}

void deliver(BackwardCall& call, PyObject* role, long arg, const at::TensorBase& grad, bool to_leaf) {
  Recorder* r = recorder_of(call.recorder.object);
  if (r == nullptr) throw python_error();
  if (r->closed) return;
  if (call.id < 0) {
    PyObject* id = PyObject_CallOneArg(call.opener.object, call.forward_id.object);
    if (id == nullptr) throw python_error();
    call.id = PyLong_AsLongLong(id);
    Py_DECREF(id);
    if (PyErr_Occurred()) throw python_error();
  }
  PyObject* wrapped = THPVariable_Wrap(grad);
  if (wrapped == nullptr) throw python_error();
  bool ok = record(*r, call.id, call.name.object, role, (int32_t)arg, wrapped, to_leaf);
  Py_DECREF(wrapped);
  if (!ok) throw python_error();
}

}  // namespace

namespace pi0align {

// backward_call(recorder, name, opener, forward_id) -> the sink of one forward call's gradients,
// for watch and watch_tensor_grads
PyObject* new_backward_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 4, "backward_call(recorder, name, opener, forward_id)")) return nullptr;
  if (recorder_of(args[0]) == nullptr) return nullptr;
  auto* call = new std::shared_ptr<BackwardCall>(std::make_shared<BackwardCall>(args[0], args[1], args[2], args[3]));
  PyObject* capsule = PyCapsule_New(call, "pi0align.backward_call", free_backward_call);
  if (capsule == nullptr) delete call;
  return capsule;
}
}  // namespace pi0align

namespace {

// close(recorder): the step has ended
PyObject* close_recorder(PyObject*, PyObject* capsule) {
  Recorder* r = recorder_of(capsule);
  if (r == nullptr) return nullptr;
  r->closed = true;
  Py_RETURN_NONE;
}

// ---- the tensors of a call: arguments.py's tensors_of -----------------------------------------

// Append every tensor in `value`, depth-first through tuples, lists and mappings, to `out`.
bool flatten_into(PyObject* value, PyObject* out) {
  if (pi0align::is_tensor(value)) return PyList_Append(out, value) == 0;
  if (PyTuple_Check(value) || PyList_Check(value)) {
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(value); ++i)
      if (!flatten_into(PySequence_Fast_GET_ITEM(value, i), out)) return false;
    return true;
  }
  if (value == Py_None || PyLong_Check(value) || PyFloat_Check(value) || PyUnicode_Check(value)) return true;
  if (PyDict_CheckExact(value)) {  // a subclass (OrderedDict) may order its values otherwise
    PyObject *key, *item;
    for (Py_ssize_t at = 0; PyDict_Next(value, &at, &key, &item);)
      if (!flatten_into(item, out)) return false;
    return true;
  }
  int mapping = pi0align::is_mapping(value);
  if (mapping <= 0) return mapping == 0;
  PyObject* values = PyObject_CallMethod(value, "values", nullptr);
  PyObject* items = values ? PySequence_Fast(values, "values() is not iterable") : nullptr;
  Py_XDECREF(values);
  bool ok = items != nullptr && flatten_into(items, out);
  Py_XDECREF(items);
  return ok;
}

}  // namespace

namespace pi0align {

// tensors_of(*values) -> the tensors in them, in order
PyObject* tensors_of(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  PyObject* out = PyList_New(0);
  for (Py_ssize_t i = 0; out != nullptr && i < nargs; ++i)
    if (!flatten_into(args[i], out)) Py_CLEAR(out);
  return out;
}
}  // namespace pi0align

namespace {

PyMethodDef methods[] = {
    {"backward_call", (PyCFunction)(void (*)(void))pi0align::new_backward_call, METH_FASTCALL, "a call's gradient sink"},
    {"close", close_recorder, METH_O, "the step has ended"},
    {"describe_records", (PyCFunction)(void (*)(void))describe_records, METH_FASTCALL, "types and dtype names"},
    {"recorder", (PyCFunction)(void (*)(void))new_recorder, METH_FASTCALL, "a step's records"},
    {"record", (PyCFunction)(void (*)(void))pi0align::record_tensors, METH_FASTCALL, "records of tensors"},
    {"set_call", (PyCFunction)(void (*)(void))set_call, METH_FASTCALL, "a record's call, given later"},
    {"columns", columns, METH_O, "the records' columns"},
    {"statistics", statistics, METH_O, "the records' statistics"},
    {"set_kind", (PyCFunction)(void (*)(void))set_kind, METH_FASTCALL, "the kernel's kind of a dtype"},
    {"stats", (PyCFunction)(void (*)(void))tensor_stats, METH_FASTCALL, "statistics of a CPU tensor"},
    {"gather", (PyCFunction)(void (*)(void))tensor_gather, METH_FASTCALL, "sampled elements of a CPU tensor"},
    {"sample_cache", (PyCFunction)(void (*)(void))new_sample_cache, METH_FASTCALL, "a sampler's layouts"},
    {"remember", (PyCFunction)(void (*)(void))remember_layout, METH_FASTCALL, "a sampler's layout, for later"},
    {"set_host", (PyCFunction)(void (*)(void))set_host, METH_FASTCALL, "a sampler's host table"},
    {"queue_copy", (PyCFunction)(void (*)(void))queue_copy, METH_FASTCALL, "a CPU tensor's bytes, copied queued"},
    {"finished", finished_calls, METH_NOARGS, "how many queued calls have run"},
    {"wait", wait_queue, METH_NOARGS, "until every queued call has run"},
    {"held", held, METH_NOARGS, "how many queued tensors are kept alive"},
    {"forget", forget_queue, METH_NOARGS, "after fork, in the child"},
    {"watch_tensor_grads", (PyCFunction)(void (*)(void))pi0align::watch_tensor_grads, METH_FASTCALL,
     "hook tensors' gradients"},
    {"input_edges", pi0align::input_edges, METH_O, "the gradient edges of the tensors that require grad"},
    {"watch", (PyCFunction)(void (*)(void))pi0align::watch, METH_FASTCALL, "hook the nodes of a call's outputs"},
    {"tensors_of", (PyCFunction)(void (*)(void))pi0align::tensors_of, METH_FASTCALL, "the tensors in the values"},
    {"describe_arguments", (PyCFunction)(void (*)(void))pi0align::describe_arguments, METH_FASTCALL,
     "a call's arguments as JSON"},
    {"call_site", (PyCFunction)(void (*)(void))pi0align::call_site, METH_FASTCALL, "a call site's stack id"},
    {"open_call", (PyCFunction)(void (*)(void))pi0align::open_call, METH_FASTCALL, "a row of the calls table"},
    {"open_backward", (PyCFunction)(void (*)(void))pi0align::open_backward, METH_FASTCALL,
     "a forward call's backward row in the calls table"},
    {"api_handler", (PyCFunction)(void (*)(void))pi0align::api_handler, METH_FASTCALL,
     "a capture mode's __torch_function__"},
    {"enter_module", (PyCFunction)(void (*)(void))pi0align::enter_module, METH_FASTCALL,
     "a module's forward begins"},
    {"leave_module", (PyCFunction)(void (*)(void))pi0align::leave_module, METH_FASTCALL, "a module's forward ends"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "pi0align_capture", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_pi0align_capture() {
  std::fill(std::begin(kind_of_type), std::end(kind_of_type), -1);
  no_text = PyUnicode_InternFromString("");
  role_grad_output = PyUnicode_InternFromString("grad_output");
  role_grad_input = PyUnicode_InternFromString("grad_input");
  if (!pi0align::intern_call_names()) return nullptr;
  return PyModule_Create(&module);
}
