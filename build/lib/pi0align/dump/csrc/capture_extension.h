// Entry points of capture_extension.cpp that api_calls.cpp calls directly, as Python would call
// them (borrowed arguments, a new reference or null with a Python error set), and api_calls.cpp's
// and calls_table.cpp's own, in the extension's method table; and Quiet, which both use.
#pragma once

#include <Python.h>
#include <ATen/PythonTorchFunctionTLS.h>

namespace pi0align {
// While one lives, the dumper's own tensor work is never captured (capture.py's _quiet).
struct Quiet {
  at::impl::TorchFunctionDisabledState previous = at::impl::PythonTorchFunctionTLS::get_disabled_state();
  Quiet() { at::impl::PythonTorchFunctionTLS::set_disabled_state(at::impl::TorchFunctionDisabledState::ALL_DISABLED); }
  ~Quiet() { at::impl::PythonTorchFunctionTLS::set_disabled_state(previous); }
};

// tensors_of(*values) -> the tensors in them, depth-first
PyObject* tensors_of(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// record(recorder, call_id, name, role, arg_index, tensors) -> the last record's row
PyObject* record_tensors(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// input_edges(tensors) -> opaque edges, or None
PyObject* input_edges(PyObject*, PyObject* tensors);
// watch(outputs, edges, sink)
PyObject* watch(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// watch_tensor_grads(tensors, role, sink)
PyObject* watch_tensor_grads(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// backward_call(recorder, name, opener, forward_id) -> a call's gradient sink
PyObject* new_backward_call(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// The names api_calls.cpp's handlers use, interned; false with a Python error set (at load)
bool intern_call_names();
// api_handler(mode, capture, plans, filtered) -> the mode's __torch_function__
PyObject* api_handler(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// enter_module(capture, filtered, module_level, path, module, args, kwargs) (api_calls.cpp)
PyObject* enter_module(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// leave_module(capture, path, output) (api_calls.cpp)
PyObject* leave_module(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// open_call(columns, name, module, api, direction, stack_id, args) -> call id (calls_table.cpp)
PyObject* open_call(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// open_backward(columns, forward_id) -> call id (calls_table.cpp)
PyObject* open_backward(PyObject*, PyObject* const* args, Py_ssize_t nargs);
}  // namespace pi0align
