// A step's calls table for the native backend: steplog.py's StepLog.open_call and open_backward,
// the reference, without a Python frame per call. The table is StepLog's: its seven column lists
// (steplog.CAPTURED_CALL_COLUMNS, in order), given as a tuple.
#include "call_description.h"
#include "capture_extension.h"

namespace {

constexpr Py_ssize_t kColumns = 7;  // seq, name, module, api, direction, stack_id, args

// The column lists of `columns` into `lists`; false with a TypeError set when it is no such tuple.
bool column_lists(PyObject* columns, PyObject** lists) {
  bool ok = PyTuple_Check(columns) && PyTuple_GET_SIZE(columns) == kColumns;
  for (Py_ssize_t i = 0; ok && i < kColumns; ++i) ok = PyList_Check(lists[i] = PyTuple_GET_ITEM(columns, i));
  if (!ok) PyErr_SetString(PyExc_TypeError, "the calls table is a tuple of its 7 column lists");
  return ok;
}

// Appends a row (its call id, then the six other columns' values); its call id.
PyObject* append_row(PyObject** lists, PyObject* const* values) {
  PyObject* call_id = PyLong_FromSsize_t(PyList_GET_SIZE(lists[0]));
  if (call_id == nullptr || PyList_Append(lists[0], call_id) < 0) {
    Py_XDECREF(call_id);
    return nullptr;
  }
  for (Py_ssize_t i = 1; i < kColumns; ++i) {
    if (PyList_Append(lists[i], values[i - 1]) < 0) {
      Py_DECREF(call_id);
      return nullptr;
    }
  }
  return call_id;
}

}  // namespace

namespace pi0align {

// open_call(columns, name, module, api, direction, stack_id, args) -> the new call's id
PyObject* open_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  PyObject* lists[kColumns];
  if (!arity(nargs, kColumns, "open_call(columns, name, module, api, direction, stack_id, args)") ||
      !column_lists(args[0], lists))
    return nullptr;
  return append_row(lists, args + 1);
}

// open_backward(columns, forward_id) -> the id of a new backward row of the forward call
PyObject* open_backward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  static PyObject* backward = nullptr;
  PyObject* lists[kColumns];
  if (interned(backward, "backward") == nullptr || !arity(nargs, 2, "open_backward(columns, forward_id)") ||
      !column_lists(args[0], lists))
    return nullptr;
  Py_ssize_t forward = PyLong_AsSsize_t(args[1]);
  if (forward == -1 && PyErr_Occurred()) return nullptr;
  if (forward < 0 || forward >= PyList_GET_SIZE(lists[0]))
    return PyErr_Format(PyExc_IndexError, "no call %zd", forward);
  PyObject* values[] = {PyList_GET_ITEM(lists[1], forward), PyList_GET_ITEM(lists[2], forward),
                        PyList_GET_ITEM(lists[3], forward), backward,
                        PyList_GET_ITEM(lists[5], forward), PyList_GET_ITEM(lists[6], forward)};
  return append_row(lists, values);
}

}  // namespace pi0align
