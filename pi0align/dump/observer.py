"""The C++ half of the capture, built with the statistics kernel (kernel.py) into one torch
extension on first use.

- `input_edges` / `watch`: `backward.py`'s, in C++. Finding the autograd nodes a call created and
  hooking them costs Python about 10 µs a call; here well under one, and the hooks call the Python
  sink only with a gradient to record.
- `stats` / `gather` / `wait`: the kernel's entry points taking the tensor itself: the view layout,
  dtype and address are read in C++, and queued tensors are kept alive there (`kernel.py` has the
  ctypes path these replace).

Where the extension cannot be built (no compiler, no torch or Python headers) the dumper keeps
the Python and ctypes paths, and the dump file says which ran.
"""

from __future__ import annotations

import os
import sysconfig

import torch

SOURCE = r"""
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <deque>
#include <iterator>
#include <memory>
#include <utility>
#include <vector>

namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;
using NodeRef = decltype(torch::autograd::Edge::function);  // shared_ptr or intrusive_ptr, by torch version

// A call made of more autograd nodes than this (a composite) keeps only its output gradients.
constexpr size_t kMaxNodes = 16;

PyObject* role_grad_output;
PyObject* role_grad_input;

struct Slot { uint32_t index; long arg; };

// Whether a call got `expected` arguments; if not, a TypeError showing the signature is set.
bool arity(Py_ssize_t nargs, Py_ssize_t expected, const char* signature) {
  if (nargs == expected) return true;
  PyErr_SetString(PyExc_TypeError, signature);
  return false;
}  // a gradient's index at the node, the call's argument

// Reports, to the Python sink(role, arg, gradient), the gradients a node receives (the call's
// output gradients) and those it produces towards the call's inputs. Changes nothing.
class SinkHook final : public torch::autograd::FunctionPostHook {
 public:
  SinkHook(PyObject* sink, std::vector<Slot> outs, std::vector<Slot> ins)
      : sink_(sink), outs_(std::move(outs)), ins_(std::move(ins)) { Py_INCREF(sink_); }

  ~SinkHook() override {
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
      pybind11::gil_scoped_acquire gil;
      Py_DECREF(sink_);
    }
  }

  variable_list operator()(const variable_list& grad_inputs, const variable_list& grad_outputs) override {
    pybind11::gil_scoped_acquire gil;
    report(role_grad_output, outs_, grad_outputs);
    report(role_grad_input, ins_, grad_inputs);
    return grad_inputs;
  }

 private:
  void report(PyObject* role, const std::vector<Slot>& slots, const variable_list& grads) {
    for (const Slot& slot : slots) {
      if (slot.index >= grads.size() || !grads[slot.index].defined()) continue;
      PyObject* grad = THPVariable_Wrap(grads[slot.index]);
      PyObject* arg = PyLong_FromLong(slot.arg);
      PyObject* result = grad && arg ? PyObject_CallFunctionObjArgs(sink_, role, arg, grad, nullptr) : nullptr;
      Py_XDECREF(grad);
      Py_XDECREF(arg);
      if (result == nullptr) throw python_error();
      Py_DECREF(result);
    }
  }

  PyObject* sink_;
  std::vector<Slot> outs_, ins_;
};

// The inputs that share one gradient edge (x * x passes x twice), in argument order.
struct Target { Node* node; uint32_t nr; std::vector<long> args; };

// The gradient edges of a call's inputs: taken before an in-place call rebases them.
struct InputEdges {
  std::vector<NodeRef> nodes;  // alive until the call is watched
  std::vector<Target> targets;

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

// input_edges(tensors) -> opaque edges, or None when no tensor requires grad
PyObject* input_edges(PyObject*, PyObject* tensors) {
  PyObject* seq = PySequence_Fast(tensors, "input_edges takes a list of tensors");
  if (seq == nullptr) return nullptr;
  auto edges = std::make_unique<InputEdges>();
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    if (!THPVariable_Check(item)) continue;
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
}

struct Watched { NodeRef node; std::vector<Slot> outs, ins; };

Watched& watched_entry(std::vector<Watched>& watched, const NodeRef& node) {
  for (Watched& w : watched) if (w.node == node) return w;
  return watched.emplace_back(Watched{node, {}, {}});
}

// watch(outputs, edges, sink): hooks the nodes that produced `outputs` and, walking back from
// them, the nodes whose gradients flow to the inputs' edges, as backward.watch does.
PyObject* watch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 3, "watch(outputs, edges, sink)")) return nullptr;
  InputEdges* edges = nullptr;
  if (args[1] != Py_None) {
    edges = static_cast<InputEdges*>(PyCapsule_GetPointer(args[1], "pi0align.input_edges"));
    if (edges == nullptr) return nullptr;
  }
  PyObject* seq = PySequence_Fast(args[0], "watch takes a list of tensors");
  if (seq == nullptr) return nullptr;
  std::vector<Watched> watched;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  for (Py_ssize_t arg = 0; arg < n; ++arg) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, arg);
    if (!THPVariable_Check(item)) continue;
    const at::Tensor& out = THPVariable_Unpack(item);
    if (!out.defined()) continue;
    NodeRef node = out.grad_fn();
    // no gradient, or an input handed back unchanged: not this call's node
    if (!node || (edges != nullptr && edges->has_node(node.get()))) continue;
    watched_entry(watched, node).outs.push_back({(uint32_t)out.output_nr(), (long)arg});
  }
  Py_DECREF(seq);
  if (watched.empty()) Py_RETURN_NONE;
  std::vector<const Node*> seen;
  for (const Watched& w : watched) seen.push_back(w.node.get());
  std::vector<NodeRef> frontier;
  if (edges != nullptr) for (const Watched& w : watched) frontier.push_back(w.node);
  std::vector<size_t> used;
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
        if (k < target->args.size()) watched_entry(watched, node).ins.push_back({j, target->args[k]});
      } else if (!edges->has_node(following.get()) &&
                 std::find(seen.begin(), seen.end(), following.get()) == seen.end()) {
        seen.push_back(following.get());
        frontier.push_back(following);
      }
    }
  }
  for (Watched& w : watched) {
    if (seen.size() > kMaxNodes) w.ins.clear();  // a composite: its input edges are not all found, report none
    if (!w.outs.empty() || !w.ins.empty()) w.node->add_post_hook(std::make_unique<SinkHook>(args[2], w.outs, w.ins));
  }
  Py_RETURN_NONE;
}


// ---- the statistics kernel's entry points, taking tensors -------------------------------------

int kind_of_type[256];  // at::ScalarType -> the kernel's kind, -1: not taken (set by set_kind)
constexpr int kMaxDims = 16;  // the kernel's odometer
constexpr size_t kReleaseEvery = 64;  // queued calls between two looks at which have run

// Queued tensors, kept alive until their call has run (never freed at exit: no static destructor
// may free a tensor after the interpreter is gone).
std::deque<at::Tensor>& kept = *new std::deque<at::Tensor>();
int64_t released = 0;  // queued calls whose tensor was let go

void keep(const at::Tensor& tensor) {
  kept.push_back(tensor);
  if ((released + kept.size()) % kReleaseEvery == 0) {
    int64_t finished = 0;
    pi0align_finished(&finished);
    for (; released < finished && !kept.empty(); ++released) kept.pop_front();
  }
}

// The CPU tensor the kernel reads, or an undefined one when it takes no such tensor.
at::Tensor readable(PyObject* object, int* kind) {
  if (!THPVariable_Check(object)) return {};
  const at::Tensor& tensor = THPVariable_Unpack(object);
  if (!tensor.defined() || !tensor.device().is_cpu() || tensor.layout() != at::kStrided) return {};
  *kind = kind_of_type[(int)tensor.scalar_type()];
  if (*kind < 0) return {};
  return tensor.dim() > kMaxDims ? tensor.detach().contiguous() : tensor;
}


// set_kind(tensor, kind): the kernel's kind for the tensor's dtype (kernel.py's _KINDS, one source)
PyObject* set_kind(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "set_kind(tensor, kind)")) return nullptr;
  if (!THPVariable_Check(args[0])) return PyErr_Format(PyExc_TypeError, "set_kind(tensor, kind): not a tensor");
  long kind = PyLong_AsLong(args[1]);
  if (kind == -1 && PyErr_Occurred()) return nullptr;
  kind_of_type[(int)THPVariable_Unpack(args[0]).scalar_type()] = (int)kind;
  Py_RETURN_NONE;
}

// stats(tensor, floats, ints, queued) -> whether the kernel took it. Views are read in place in
// memory order (kernel.py's _layout: repeated dims outermost, then the largest strides, merged
// where memory allows), with row-major steps for the checksum positions.
PyObject* tensor_stats(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 4, "stats(tensor, floats, ints, queued)")) return nullptr;
  int kind = -1;
  at::Tensor tensor = readable(args[0], &kind);
  if (!tensor.defined()) Py_RETURN_FALSE;
  auto* floats = static_cast<double*>(PyLong_AsVoidPtr(args[1]));
  auto* ints = static_cast<int64_t*>(PyLong_AsVoidPtr(args[2]));
  if (PyErr_Occurred()) return nullptr;
  bool queued = PyObject_IsTrue(args[3]);
  const void* data = tensor.data_ptr();
  if (queued) keep(tensor);
  if (tensor.is_contiguous()) {
    (queued ? pi0align_queue_dense_stats : pi0align_dense_stats)(data, kind, tensor.numel(), floats, ints);
    Py_RETURN_TRUE;
  }
  const int64_t dims = tensor.dim();
  auto shape = tensor.sizes();
  auto strides = tensor.strides();
  int64_t row_major[kMaxDims];
  int order[kMaxDims];
  for (int64_t d = dims - 1, step = 1; d >= 0; step *= shape[d], --d) row_major[d] = step;
  int n = 0;
  for (int d = 0; d < dims; ++d) if (shape[d] > 1) order[n++] = d;
  std::stable_sort(order, order + n, [&](int a, int b) {
    bool a_repeats = strides[a] == 0, b_repeats = strides[b] == 0;
    if (a_repeats != b_repeats) return a_repeats;
    return strides[a] > strides[b];
  });
  int64_t size[kMaxDims], stride[kMaxDims], step[kMaxDims];
  int m = 0;
  for (int i = 0; i < n; ++i) {
    int d = order[i];
    if (m > 0 && stride[m - 1] == strides[d] * shape[d] && step[m - 1] == row_major[d] * shape[d]) {
      size[m - 1] *= shape[d], stride[m - 1] = strides[d], step[m - 1] = row_major[d];
    } else {
      size[m] = shape[d], stride[m] = strides[d], step[m] = row_major[d], ++m;
    }
  }
  (queued ? pi0align_queue_stats : pi0align_stats)(data, kind, m, size, stride, step, floats, ints);
  Py_RETURN_TRUE;
}

// gather(tensor, offsets, count, values, queued) -> whether the kernel took it
PyObject* tensor_gather(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
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

PyMethodDef methods[] = {
    {"set_kind", (PyCFunction)(void (*)(void))set_kind, METH_FASTCALL, "the kernel's kind of a dtype"},
    {"stats", (PyCFunction)(void (*)(void))tensor_stats, METH_FASTCALL, "statistics of a CPU tensor"},
    {"gather", (PyCFunction)(void (*)(void))tensor_gather, METH_FASTCALL, "sampled elements of a CPU tensor"},
    {"wait", wait_queue, METH_NOARGS, "until every queued call has run"},
    {"held", held, METH_NOARGS, "how many queued tensors are kept alive"},
    {"forget", forget_queue, METH_NOARGS, "after fork, in the child"},
    {"input_edges", input_edges, METH_O, "the gradient edges of the tensors that require grad"},
    {"watch", (PyCFunction)(void (*)(void))watch, METH_FASTCALL, "hook the nodes of a call's outputs"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "pi0align_observer", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_pi0align_observer() {
  std::fill(std::begin(kind_of_type), std::end(kind_of_type), -1);
  role_grad_output = PyUnicode_InternFromString("grad_output");
  role_grad_input = PyUnicode_InternFromString("grad_input");
  return PyModule_Create(&module);
}
"""



def flags() -> list[str]:
    """Build against the running torch and Python; the torch version is in the flags, hence in the
    cache key, so a reinstalled torch gets its own build."""
    root = os.path.dirname(torch.__file__)
    lib = os.path.join(root, "lib")
    return ["-std=c++20", "-w", f"-DPI0ALIGN_TORCH={torch.__version__}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
            "-I", os.path.join(root, "include"), "-I", sysconfig.get_paths()["include"],
            "-L", lib, "-ltorch", "-ltorch_cpu", "-ltorch_python", "-lc10", f"-Wl,-rpath,{lib}"]
