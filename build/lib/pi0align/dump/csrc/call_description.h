// What the capture writes of each forward call it records (call_description.cpp): entry points of
// the pi0align_capture extension (capture_extension.cpp's method table), and the helpers both use.
#pragma once

#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

namespace pi0align {
PyObject* describe_arguments(PyObject*, PyObject* const* args, Py_ssize_t nargs);
PyObject* call_site(PyObject*, PyObject* const* args, Py_ssize_t nargs);

// Whether a call got `expected` arguments; if not, a TypeError showing the signature is set.
bool arity(Py_ssize_t nargs, Py_ssize_t expected, const char* signature);
// `slot`, the interned str of `text` once made (made on the first call): null with an error set
// where it cannot be.
PyObject* interned(PyObject*& slot, const char* text);
// isinstance(value, torch.Tensor), by the value's type: THPVariable_Check asks Python's isinstance
// of anything but a Tensor or a Parameter, which makes a bound method per int, float or None of a
// call's arguments (PI0 small: thousands a step, and garbage collections they set off).
inline bool is_tensor(PyObject* value) {
  return THPVariable_CheckExact(value) ||
         (THPVariableClass != nullptr && PyType_IsSubtype(Py_TYPE(value), (PyTypeObject*)THPVariableClass));
}
// isinstance(value, collections.abc.Mapping): 1, 0, or -1 with a Python error set.
int is_mapping(PyObject* value);
}  // namespace pi0align
