// The native backend's handlers of the capture's calls, without a Python frame per call.
// - `__torch_function__` (capture.py's _ApiMode): the capture's common call, one that writes none
//   of its arguments, is run and recorded here as Capture.api_call records it (where the capture's
//   filter has patterns, each name is asked of it); every other call takes the mode's Python
//   handler, the reference: one with no plan yet (the handler makes it), backward, and a call that
//   writes its arguments (by its API, or an `out` or `inplace` keyword).
// - enter_module / leave_module: Capture._enter_module and _leave_module, around each module's
//   forward (PI0 small: 169 a step, ~10 us each in Python).
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <charconv>
#include <cstring>
#include <memory>
#include <utility>

#include "call_description.h"
#include "capture_extension.h"

namespace {

// Interned names (intern_call_names): attributes of the Capture, the StepLog and its records, and roles.
struct Names {
  PyObject *log, *after_backward, *module_paths, *param_calls, *read_parameters, *name_counts, *stacks,
      *running, *records, *recorder, *open_call, *open_backward, *selected, *out, *inplace, *forward, *input,
      *output, *empty, *handler, *planned, *open_modules, *resume, *record_data, *grad_input;
};
Names names;


// What a mode's handler holds, in a capsule on the mode (the handler's `self` must be the mode).
// Nothing here refers back to the mode: a capsule is not traversed by the garbage collector, so
// such a cycle would keep every removed mode alive.
struct Handler {
  PyObject* capture;  // the Capture
  PyObject* plans;  // func -> its API's name (recorded here), None (run, not recorded) or False (Python's)
  bool filtered;  // the capture's filter has patterns: names go through Python
  ~Handler() {
    Py_XDECREF(capture);
    Py_XDECREF(plans);
  }
};

void free_handler(PyObject* capsule) {
  delete static_cast<Handler*>(PyCapsule_GetPointer(capsule, "pi0align.api_handler"));
}

// A Python object's new reference, released when it goes out of scope.
struct Owned {
  PyObject* object;
  Owned() : object(nullptr) {}
  explicit Owned(PyObject* o) : object(o) {}
  Owned(Owned&& other) noexcept : object(other.object) { other.object = nullptr; }
  Owned(const Owned&) = delete;
  Owned& operator=(Owned&& other) noexcept {
    std::swap(object, other.object);
    return *this;
  }
  ~Owned() { Py_XDECREF(object); }
  PyObject* get() const { return object; }
  explicit operator bool() const { return object != nullptr; }
};

// `module/api#k`, a call's name (naming.py's next_name), written directly where both texts are
// ASCII: PyUnicode_FromFormat's printf of the number was a third of a call's naming.
PyObject* call_name(PyObject* module, PyObject* api, Py_ssize_t k) {
  if (!PyUnicode_IS_ASCII(module) || !PyUnicode_IS_ASCII(api)) return PyUnicode_FromFormat("%U/%U#%zd", module, api, k);
  char digits[24];
  const Py_ssize_t count = std::to_chars(digits, digits + sizeof digits, (long long)k).ptr - digits;
  const Py_ssize_t m = PyUnicode_GET_LENGTH(module), a = PyUnicode_GET_LENGTH(api);
  PyObject* name = PyUnicode_New(m + 1 + a + 1 + count, 127);
  if (name == nullptr) return nullptr;
  Py_UCS1* out = PyUnicode_1BYTE_DATA(name);
  std::memcpy(out, PyUnicode_1BYTE_DATA(module), m);
  out[m] = '/';
  std::memcpy(out + m + 1, PyUnicode_1BYTE_DATA(api), a);
  out[m + 1 + a] = '#';
  std::memcpy(out + m + 1 + a + 1, digits, count);
  return name;
}

// Capture._open: the call named (next_name) and its row opened; its (call id, name), or a null id
// (no error set) when the filter leaves it out, or with a Python error set.
std::pair<Owned, Owned> open_forward_call(PyObject* capture, bool filtered, PyObject* log, PyObject* module,
                                          PyObject* api, PyObject* args, PyObject* kwargs) {
  Owned param_calls(PyObject_GetAttr(capture, names.param_calls));
  if (!param_calls) return {};
  if (param_calls.get() == Py_None) {
    Owned read(PyObject_CallMethodNoArgs(capture, names.read_parameters));
    if (!read) return {};
  }
  Owned counts(PyObject_GetAttr(capture, names.name_counts));
  Owned key(counts ? PyTuple_Pack(3, module, api, names.forward) : nullptr);
  if (!key) return {};
  PyObject* known = PyDict_GetItemWithError(counts.get(), key.get());  // borrowed
  if (known == nullptr && PyErr_Occurred()) return {};
  Py_ssize_t k = known != nullptr ? PyLong_AsSsize_t(known) : 0;
  Owned next(PyLong_FromSsize_t(k + 1));
  if (!next || PyDict_SetItem(counts.get(), key.get(), next.get()) < 0) return {};
  Owned name(call_name(module, api, k));
  if (!name) return {};
  if (filtered) {
    Owned chosen(PyObject_CallMethodOneArg(capture, names.selected, name.get()));
    int taken = chosen ? PyObject_IsTrue(chosen.get()) : -1;
    if (taken <= 0) return {};
  }
  Owned stacks(PyObject_GetAttr(capture, names.stacks));
  if (!stacks) return {};
  PyObject* site_args[] = {stacks.get(), module};
  Owned site(pi0align::call_site(nullptr, site_args, 2));
  PyObject* described_args[] = {args, kwargs};
  Owned described(site ? pi0align::describe_arguments(nullptr, described_args, 2) : nullptr);
  if (!described) return {};
  PyObject* row[] = {log, name.get(), module, api, names.forward, site.get(), described.get()};
  Owned call_id(PyObject_VectorcallMethod(names.open_call, row, 7 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
  if (!call_id) return {};
  return {std::move(call_id), std::move(name)};
}

// The step's recorder (log.records._recorder).
Owned recorder_of_log(PyObject* log) {
  Owned records(PyObject_GetAttr(log, names.records));
  return Owned(records ? PyObject_GetAttr(records.get(), names.recorder) : nullptr);
}

// StepLog.add_tensors: `tensors` recorded as the call's of `role`, numbered from 0.
bool record_all(PyObject* recorder, PyObject* call_id, PyObject* name, PyObject* role, PyObject* tensors) {
  Owned first(PyLong_FromLong(0));
  if (!first) return false;
  PyObject* in[] = {recorder, call_id, name, role, first.get(), tensors};
  return (bool)Owned(pi0align::record_tensors(nullptr, in, 6));
}

// StepLog.grad_sink: where the forward call's gradients go, its backward row opened at the first.
Owned gradient_sink(PyObject* log, PyObject* recorder, PyObject* name, PyObject* call_id) {
  Owned opener(PyObject_GetAttr(log, names.open_backward));
  if (!opener) return {};
  PyObject* sink_args[] = {recorder, name, opener.get(), call_id};
  return Owned(pi0align::new_backward_call(nullptr, sink_args, 4));
}

bool any_requires_grad(PyObject* tensors) {
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tensors); ++i)
    if (THPVariable_Unpack(PyList_GET_ITEM(tensors, i)).requires_grad()) return true;
  return false;
}

// Capture.api_call of a call that writes none of its arguments; a new reference to its result.
PyObject* record_call(const Handler& h, PyObject* log, PyObject* func, PyObject* api, PyObject* args,
                      PyObject* kwargs) {
  Owned paths(PyObject_GetAttr(h.capture, names.module_paths));
  if (!paths) return nullptr;
  Py_ssize_t depth = PyList_Size(paths.get());
  if (depth < 0) return nullptr;
  Owned module_ref(Py_NewRef(depth ? PyList_GET_ITEM(paths.get(), depth - 1) : names.empty));
  PyObject* module = module_ref.get();
  static PyObject* no_keywords = PyDict_New();  // read only: one empty dict, not one made per call
  PyObject* keywords = kwargs != nullptr ? kwargs : no_keywords;
  if (keywords == nullptr) return nullptr;
  PyObject* both[] = {args, keywords};
  Owned inputs(pi0align::tensors_of(nullptr, both, 2));
  if (!inputs || PyObject_SetAttr(h.capture, names.running, Py_True) < 0) return nullptr;
  Owned result_ref(PyObject_Call(func, args, kwargs));
  PyObject* result = result_ref.get();
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);  // the call's error, if any, kept while the flag is reset
  int reset = PyObject_SetAttr(h.capture, names.running, Py_False);
  if (type != nullptr) {
    PyErr_Restore(type, value, traceback);
    return nullptr;
  }
  if (reset < 0 || result == nullptr) return nullptr;
  Owned outputs(pi0align::tensors_of(nullptr, &result, 1));
  if (!outputs) return nullptr;
  if (PyList_GET_SIZE(outputs.get()) == 0) return Py_NewRef(result);  // a query, or an action
  auto [call_id, name] = open_forward_call(h.capture, h.filtered, log, module, api, args, keywords);
  if (!call_id) return PyErr_Occurred() ? nullptr : Py_NewRef(result);
  Owned recorder(recorder_of_log(log));
  if (!recorder || !record_all(recorder.get(), call_id.get(), name.get(), names.input, inputs.get())) return nullptr;
  Owned edges(torch::autograd::GradMode::is_enabled() ? pi0align::input_edges(nullptr, inputs.get())
                                                       : Py_NewRef(Py_None));
  if (!edges || !record_all(recorder.get(), call_id.get(), name.get(), names.output, outputs.get())) return nullptr;
  if (edges.get() != Py_None || any_requires_grad(outputs.get())) {
    Owned sink(gradient_sink(log, recorder.get(), name.get(), call_id.get()));
    if (!sink) return nullptr;
    PyObject* watch_args[] = {outputs.get(), edges.get(), sink.get()};
    Owned watched(pi0align::watch(nullptr, watch_args, 3));
    if (!watched) return nullptr;
  }
  return Py_NewRef(result);
}

// mode.__torch_function__(func, types, args, kwargs=None), the mode being `self`
PyObject* handle(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs < 3 || nargs > 4) return PyErr_Format(PyExc_TypeError, "__torch_function__(func, types, args, kwargs)");
  Owned capsule(PyObject_GetAttr(self, names.handler));
  const Handler* h = capsule ? static_cast<Handler*>(PyCapsule_GetPointer(capsule.get(), "pi0align.api_handler"))
                             : nullptr;
  if (h == nullptr) return nullptr;
  PyObject *func = args[0], *call_args = args[2];
  PyObject* kwargs = nargs == 4 && args[3] != Py_None ? args[3] : nullptr;
  PyObject* plan = PyDict_GetItemWithError(h->plans, func);  // borrowed
  if (plan == nullptr) PyErr_Clear();  // none yet, or unhashable: Python's
  Owned plan_ref(Py_XNewRef(plan));  // kept while Python code runs
  bool writes = kwargs != nullptr && (PyDict_GetItemWithError(kwargs, names.out) != nullptr ||
                                      PyDict_GetItemWithError(kwargs, names.inplace) != nullptr);
  if (PyErr_Occurred()) return nullptr;
  if (plan == nullptr || plan == Py_False || writes) {  // mode._planned(func, types, args, kwargs)
    PyObject* planned[] = {self, args[0], args[1], args[2], nargs == 4 ? args[3] : Py_None};
    return PyObject_VectorcallMethod(names.planned, planned, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  }
  if (plan == Py_None) return PyObject_Call(func, call_args, kwargs);
  Owned log(PyObject_GetAttr(h->capture, names.log));
  Owned after(log ? PyObject_GetAttr(h->capture, names.after_backward) : nullptr);
  int idle = !after ? -1 : log.get() == Py_None ? 1 : PyObject_IsTrue(after.get());
  if (idle < 0) return nullptr;
  if (idle) return PyObject_Call(func, call_args, kwargs);
  return record_call(*h, log.get(), func, plan, call_args, kwargs);
  END_HANDLE_TH_ERRORS
}

PyMethodDef handle_method = {"__torch_function__", (PyCFunction)(void (*)(void))handle, METH_FASTCALL,
                             "the capture's handler of a torch call"};

}  // namespace

namespace pi0align {

// enter_module(capture, filtered, module_level, path, module, args, kwargs): the module's path
// pushed; where the level records modules, its call named and opened, its inputs recorded and their
// gradients watched; (call id, name, sink), or None, pushed on the capture's open modules
PyObject* enter_module(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!arity(nargs, 7, "enter_module(capture, filtered, module_level, path, module, args, kwargs)")) return nullptr;
  PyObject *capture = args[0], *path = args[3], *module = args[4], *call_args = args[5], *kwargs = args[6];
  const int filtered = PyObject_IsTrue(args[1]), module_level = PyObject_IsTrue(args[2]);
  if (filtered < 0 || module_level < 0) return nullptr;
  Owned paths(PyObject_GetAttr(capture, names.module_paths));
  if (!paths || PyList_Append(paths.get(), path) < 0) return nullptr;
  Owned resumed(PyObject_CallMethodNoArgs(capture, names.resume));
  Owned log(resumed ? PyObject_GetAttr(capture, names.log) : nullptr);
  if (!log) return nullptr;
  Owned opened(Py_NewRef(Py_None));
  if (log.get() != Py_None && PyUnicode_GetLength(path) == 0) {  // the model's own: its inputs are the data
    Owned data(PyObject_CallMethodObjArgs(capture, names.record_data, call_args, kwargs, nullptr));
    if (!data) return nullptr;
  }
  if (log.get() != Py_None && module_level) {
    Quiet quiet;
    Owned type_name(PyType_GetName(Py_TYPE(module)));
    Owned api(type_name ? PyUnicode_FromFormat("Module.%U", type_name.get()) : nullptr);
    if (!api) return nullptr;
    auto [call_id, name] = open_forward_call(capture, filtered, log.get(), path, api.get(), call_args, kwargs);
    if (!call_id && PyErr_Occurred()) return nullptr;
    if (call_id) {
      PyObject* both[] = {call_args, kwargs};
      Owned inputs(pi0align::tensors_of(nullptr, both, 2));
      Owned recorder(inputs ? recorder_of_log(log.get()) : Owned());
      if (!recorder || !record_all(recorder.get(), call_id.get(), name.get(), names.input, inputs.get()))
        return nullptr;
      Owned sink(gradient_sink(log.get(), recorder.get(), name.get(), call_id.get()));
      if (!sink) return nullptr;
      PyObject* watch_args[] = {inputs.get(), names.grad_input, sink.get()};
      if (!Owned(watch_tensor_grads(nullptr, watch_args, 3))) return nullptr;
      opened = Owned(PyTuple_Pack(3, call_id.get(), name.get(), sink.get()));
      if (!opened) return nullptr;
    }
  }
  Owned open_modules(PyObject_GetAttr(capture, names.open_modules));
  if (!open_modules || PyList_Append(open_modules.get(), opened.get()) < 0) return nullptr;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// leave_module(capture, path, output): the module's path and open call popped; where it was
// recorded, its outputs recorded and their gradients watched
PyObject* leave_module(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!arity(nargs, 3, "leave_module(capture, path, output)")) return nullptr;
  PyObject *capture = args[0], *path = args[1], *output = args[2];
  Owned paths(PyObject_GetAttr(capture, names.module_paths));
  const Py_ssize_t depth = paths ? PyList_Size(paths.get()) : -1;
  if (depth < 0) return nullptr;
  const int innermost = depth ? PyObject_RichCompareBool(PyList_GET_ITEM(paths.get(), depth - 1), path, Py_EQ) : 0;
  if (innermost < 0) return nullptr;
  if (!innermost) Py_RETURN_NONE;  // installed while this module was already running
  if (PyList_SetSlice(paths.get(), depth - 1, depth, nullptr) < 0) return nullptr;
  Owned open_modules(PyObject_GetAttr(capture, names.open_modules));
  const Py_ssize_t open = open_modules ? PyList_Size(open_modules.get()) : -1;
  if (open < 0) return nullptr;
  if (open == 0) return PyErr_Format(PyExc_IndexError, "pop from empty list");
  Owned opened(Py_NewRef(PyList_GET_ITEM(open_modules.get(), open - 1)));
  if (PyList_SetSlice(open_modules.get(), open - 1, open, nullptr) < 0) return nullptr;
  Owned log(PyObject_GetAttr(capture, names.log));
  if (!log) return nullptr;
  if (opened.get() == Py_None || log.get() == Py_None || output == Py_None) Py_RETURN_NONE;
  PyObject *call_id = PyTuple_GET_ITEM(opened.get(), 0), *name = PyTuple_GET_ITEM(opened.get(), 1),
           *sink = PyTuple_GET_ITEM(opened.get(), 2);
  Quiet quiet;
  Owned outputs(pi0align::tensors_of(nullptr, &output, 1));
  Owned recorder(outputs ? recorder_of_log(log.get()) : Owned());
  if (!recorder || !record_all(recorder.get(), call_id, name, names.output, outputs.get())) return nullptr;
  PyObject* watch_args[] = {outputs.get(), Py_None, sink};
  if (!Owned(watch(nullptr, watch_args, 3))) return nullptr;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// The handlers' attribute and role names, interned once, when the extension loads.
bool intern_call_names() {
  const std::pair<PyObject**, const char*> all[] = {
      {&names.log, "log"}, {&names.after_backward, "after_backward"}, {&names.module_paths, "_module_paths"},
      {&names.param_calls, "_param_calls"}, {&names.read_parameters, "_read_parameters"},
      {&names.name_counts, "name_counts"}, {&names.stacks, "stacks"}, {&names.running, "_running"},
      {&names.records, "records"}, {&names.recorder, "_recorder"}, {&names.open_call, "open_call"},
      {&names.open_backward, "open_backward"}, {&names.selected, "selected"}, {&names.out, "out"},
      {&names.inplace, "inplace"}, {&names.forward, "forward"}, {&names.input, "input"},
      {&names.output, "output"}, {&names.empty, ""}, {&names.handler, "_native_handler"},
      {&names.planned, "_planned"}, {&names.open_modules, "_open_modules"}, {&names.resume, "_resume"},
      {&names.record_data, "_record_data"}, {&names.grad_input, "grad_input"}};
  for (const auto& [slot, text] : all)
    if (pi0align::interned(*slot, text) == nullptr) return false;
  return true;
}

// api_handler(mode, capture, plans, filtered) -> mode's __torch_function__, to set on it; calls
// without a plan, or planned False, go to mode._planned(func, types, args, kwargs)
PyObject* api_handler(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 4, "api_handler(mode, capture, plans, filtered)")) return nullptr;
  if (!PyDict_Check(args[2])) return PyErr_Format(PyExc_TypeError, "api_handler: plans must be a dict");
  auto handler = std::make_unique<Handler>();
  handler->capture = Py_NewRef(args[1]);
  handler->plans = Py_NewRef(args[2]);
  handler->filtered = PyObject_IsTrue(args[3]);
  Owned capsule(PyCapsule_New(handler.get(), "pi0align.api_handler", free_handler));
  if (!capsule) return nullptr;
  handler.release();
  if (PyObject_SetAttr(args[0], names.handler, capsule.get()) < 0) return nullptr;
  return PyCFunction_New(&handle_method, args[0]);
}

}  // namespace pi0align
