// Entry points of capture_extension.cpp that api_calls.cpp calls directly, as Python would call
// them (borrowed arguments, a new reference or null with a Python error set), and api_calls.cpp's
// and calls_table.cpp's own, in the extension's method table.
#pragma once

#include <Python.h>

namespace pi0align {
// tensors_of(*values) -> the tensors in them, depth-first
PyObject* tensors_of(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// record(recorder, call_id, name, role, arg_index, tensors) -> the last record's row
PyObject* record_tensors(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// input_edges(tensors) -> opaque edges, or None
PyObject* input_edges(PyObject*, PyObject* tensors);
// watch(outputs, edges, sink)
PyObject* watch(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// backward_call(recorder, name, opener, forward_id) -> a call's gradient sink
PyObject* new_backward_call(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// api_handler(mode, capture, plans, filtered) -> the mode's __torch_function__
PyObject* api_handler(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// open_call(columns, name, module, api, direction, stack_id, args) -> call id (calls_table.cpp)
PyObject* open_call(PyObject*, PyObject* const* args, Py_ssize_t nargs);
// open_backward(columns, forward_id) -> call id (calls_table.cpp)
PyObject* open_backward(PyObject*, PyObject* const* args, Py_ssize_t nargs);
}  // namespace pi0align
