// What the capture writes of each forward call it records (capture.py, Capture._open):
// - describe_arguments: its arguments as JSON (arguments.py's describe_arguments);
// - call_site: the id of its call site's stack (stacks.py's call_site).
// The Python functions named are the torch backend's, and the reference: each gives what its
// Python twin gives (tests/test_dump_call_description.py), a few microseconds a call sooner.
#include "call_description.h"

#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>
#include <torch/csrc/autograd/python_variable.h>

#include <charconv>
#include <cmath>
#include <memory>
#include <string>
#include <unordered_map>

namespace pi0align {

bool arity(Py_ssize_t nargs, Py_ssize_t expected, const char* signature) {
  if (nargs == expected) return true;
  PyErr_SetString(PyExc_TypeError, signature);
  return false;
}

PyObject* interned(PyObject*& slot, const char* text) {
  if (slot == nullptr) slot = PyUnicode_InternFromString(text);
  return slot;
}

int is_mapping(PyObject* value) {
  static PyObject* mapping_type = nullptr;  // collections.abc.Mapping
  if (mapping_type == nullptr) {
    PyObject* abc = PyImport_ImportModule("collections.abc");
    mapping_type = abc ? PyObject_GetAttrString(abc, "Mapping") : nullptr;
    Py_XDECREF(abc);
    if (mapping_type == nullptr) return -1;
  }
  return PyObject_IsInstance(value, mapping_type);
}

namespace {

constexpr Py_ssize_t kMaxRepr = 200;  // arguments.py's _MAX_REPR

// `text` as a JSON string, ASCII only (json.dumps' escapes: what it parses to is the text).
void json_string(PyObject* text, std::string& out) {
  static const char hex[] = "0123456789abcdef";
  out += '"';
  const int kind = PyUnicode_KIND(text);
  const void* data = PyUnicode_DATA(text);
  auto escape = [&](Py_UCS4 unit) {
    out += "\\u";
    for (int shift = 12; shift >= 0; shift -= 4) out += hex[(unit >> shift) & 0xF];
  };
  for (Py_ssize_t i = 0, n = PyUnicode_GET_LENGTH(text); i < n; ++i) {
    Py_UCS4 c = PyUnicode_READ(kind, data, i);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
    } else if (c <= 0xFFFF) {
      escape(c);
    } else {  // a surrogate pair
      c -= 0x10000;
      escape(0xD800 | (c >> 10));
      escape(0xDC00 | (c & 0x3FF));
    }
  }
  out += '"';
}

// {"repr": repr(value)}, the repr cut at kMaxRepr characters with "…".
bool json_repr(PyObject* value, std::string& out) {
  PyObject* text = PyObject_Repr(value);
  if (text == nullptr) return false;
  if (PyUnicode_GET_LENGTH(text) > kMaxRepr) {
    PyObject* cut = PyUnicode_Substring(text, 0, kMaxRepr);
    PyObject* ellipsis = PyUnicode_FromOrdinal(0x2026);
    PyObject* marked = cut && ellipsis ? PyUnicode_Concat(cut, ellipsis) : nullptr;
    Py_XDECREF(ellipsis);
    Py_XDECREF(cut);
    Py_SETREF(text, marked);
    if (text == nullptr) return false;
  }
  out += "{\"repr\":";
  json_string(text, out);
  out += '}';
  Py_DECREF(text);
  return true;
}

void append_integer(long long number, std::string& out) {
  char digits[24];
  out.append(digits, std::to_chars(digits, digits + sizeof digits, number).ptr);
}

// Whether `value` is of a type that is certainly no mapping, common in torch calls (a dtype, a
// device, a slice, ...): its repr is described without asking collections.abc.Mapping, an
// isinstance check that cost more than the rest of a call's description.
bool is_plain_value(PyObject* value) {
  const PyTypeObject* type = Py_TYPE(value);
  return type == &THPDtypeType || type == &THPDeviceType || type == &THPLayoutType || type == &THPMemoryFormatType ||
         type == &PySlice_Type || value == Py_Ellipsis;
}

// Append text that a Python call made (the repr of an int or a float) to `out`.
bool append_text(PyObject* text, std::string& out) {
  if (text == nullptr) return false;
  Py_ssize_t size;
  const char* bytes = PyUnicode_AsUTF8AndSize(text, &size);
  if (bytes != nullptr) out.append(bytes, size);
  Py_DECREF(text);
  return bytes != nullptr;
}

bool describe(PyObject* value, std::string& out, long long& tensors);

bool describe_items(PyObject* key, PyObject* item, bool first, std::string& out, long long& tensors) {
  if (!first) out += ',';
  PyObject* text = PyObject_Str(key);
  if (text == nullptr) return false;
  json_string(text, out);
  Py_DECREF(text);
  out += ':';
  return describe(item, out, tensors);
}

// arguments.py's _describe, written to `out`; `tensors` counts the tensors met so far.
bool describe(PyObject* value, std::string& out, long long& tensors) {
  if (pi0align::is_tensor(value)) {
    out += "{\"tensor\":";
    append_integer(tensors++, out);
    out += '}';
    return true;
  }
  if (value == Py_None) {
    out += "null";
    return true;
  }
  if (PyBool_Check(value)) {
    out += value == Py_True ? "true" : "false";
    return true;
  }
  if (PyLong_Check(value)) {  // an IntEnum's value too
    int overflow = 0;
    long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow == 0 && !(number == -1 && PyErr_Occurred())) {
      append_integer(number, out);
      return true;
    }
    PyErr_Clear();
    return append_text(PyLong_Type.tp_repr(value), out);
  }
  if (PyUnicode_Check(value)) {
    json_string(value, out);
    return true;
  }
  if (PyFloat_Check(value)) {
    double number = PyFloat_AS_DOUBLE(value);
    if (!std::isfinite(number)) return json_repr(value, out);
    char* text = PyOS_double_to_string(number, 'r', 0, Py_DTSF_ADD_DOT_0, nullptr);
    if (text == nullptr) return false;
    out += text;
    PyMem_Free(text);
    return true;
  }
  if (PyTuple_Check(value) || PyList_Check(value)) {
    out += '[';
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(value); ++i) {
      if (i) out += ',';
      if (!describe(PySequence_Fast_GET_ITEM(value, i), out, tensors)) return false;
    }
    out += ']';
    return true;
  }
  if (PyDict_CheckExact(value)) {  // a subclass (OrderedDict) may order its items otherwise
    out += '{';
    PyObject *key, *item;
    for (Py_ssize_t at = 0, i = 0; PyDict_Next(value, &at, &key, &item); ++i)
      if (!describe_items(key, item, i == 0, out, tensors)) return false;
    out += '}';
    return true;
  }
  if (is_plain_value(value)) return json_repr(value, out);
  int mapping = is_mapping(value);
  if (mapping < 0) return false;
  if (mapping == 0) return json_repr(value, out);
  PyObject* items = PyObject_CallMethod(value, "items", nullptr);
  PyObject* listed = items ? PySequence_List(items) : nullptr;
  Py_XDECREF(items);
  if (listed == nullptr) return false;
  out += '{';
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PyList_GET_SIZE(listed); ++i) {
    PyObject* pair = PyList_GET_ITEM(listed, i);
    ok = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 &&
         describe_items(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), i == 0, out, tensors);
    if (!ok && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a mapping's items() must be pairs");
  }
  Py_DECREF(listed);
  out += '}';
  return ok;
}

// Whether `code` is the dumper's or torch's: its file starts with one of `hidden` (a tuple).
int is_hidden(PyCodeObject* code, PyObject* hidden) {
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(hidden); ++i) {
    Py_ssize_t found = PyUnicode_Tailmatch(code->co_filename, PyTuple_GET_ITEM(hidden, i), 0, PY_SSIZE_T_MAX, -1);
    if (found != 0) return static_cast<int>(found);  // 1, or -1 on an error
  }
  return 0;
}

}  // namespace

// describe_arguments(args, kwargs) -> {"args": [...], "kwargs": {...}} as compact JSON, tensors as
// {"tensor": k} in flattening order
PyObject* describe_arguments(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "describe_arguments(args: tuple, kwargs: dict)")) return nullptr;
  if (!PyTuple_Check(args[0]) || !PyDict_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "describe_arguments(args: tuple, kwargs: dict)");
    return nullptr;
  }
  std::string out = "{\"args\":";
  long long tensors = 0;
  if (!describe(args[0], out, tensors)) return nullptr;
  out += ",\"kwargs\":";
  PyObject *key, *item;
  out += '{';
  for (Py_ssize_t at = 0, i = 0; PyDict_Next(args[1], &at, &key, &item); ++i)
    if (!describe_items(key, item, i == 0, out, tensors)) return nullptr;
  out += "}}";
  return PyUnicode_FromStringAndSize(out.data(), static_cast<Py_ssize_t>(out.size()));
}

namespace {

// A call site by its instruction: (module path, code object, instruction offset), each held.
struct Site {
  PyObject* module;
  PyCodeObject* code;
  int instruction;
  bool operator==(const Site& other) const = default;
};

struct SiteHash {
  size_t operator()(const Site& site) const {
    return std::hash<const void*>()(site.module) ^ std::hash<const void*>()(site.code) * 31 ^ (size_t)site.instruction;
  }
};

// A Stacks' call sites seen so far, by instruction, with their stack ids: the line number that
// stacks.ids is keyed by is found by scanning the code's line table, and its key is a tuple to
// build and hash, together most of call_site's cost for a site seen before.
struct Sites {
  std::unordered_map<Site, PyObject*, SiteHash> ids;  // -> stack id
  ~Sites() {
    for (auto& [site, id] : ids) {
      Py_DECREF(site.module);
      Py_DECREF(site.code);
      Py_DECREF(id);
    }
  }
};

void free_sites(PyObject* capsule) { delete static_cast<Sites*>(PyCapsule_GetPointer(capsule, "pi0align.sites")); }

// The Sites kept on `stacks` (as its `native_sites`), made on first use; null with an error set.
Sites* sites_of(PyObject* stacks) {
  static PyObject* name = nullptr;
  if (interned(name, "native_sites") == nullptr) return nullptr;
  PyObject* capsule = PyObject_GetAttr(stacks, name);
  if (capsule == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return nullptr;
    PyErr_Clear();
    auto sites = std::make_unique<Sites>();
    capsule = PyCapsule_New(sites.get(), "pi0align.sites", free_sites);
    if (capsule == nullptr || PyObject_SetAttr(stacks, name, capsule) < 0) {
      Py_XDECREF(capsule);
      return nullptr;
    }
    sites.release();
  }
  Sites* sites = static_cast<Sites*>(PyCapsule_GetPointer(capsule, "pi0align.sites"));
  Py_DECREF(capsule);  // the stacks object holds it
  return sites;
}

// The stack id of a site not among `sites` yet: stacks.ids by (module, id(code), line), or
// stacks.intern(frame, key) on first sight; a new reference, remembered in `sites`.
PyObject* new_site(PyObject* stacks, Sites& sites, PyObject* module, PyFrameObject* frame, PyCodeObject* code) {
  static PyObject *ids_name = nullptr, *intern_name = nullptr;
  if (interned(ids_name, "ids") == nullptr || interned(intern_name, "intern") == nullptr) return nullptr;
  PyObject* address = PyLong_FromVoidPtr(code);
  PyObject* line = PyLong_FromLong(PyFrame_GetLineNumber(frame));
  PyObject* key = address && line ? PyTuple_Pack(3, module, address, line) : nullptr;
  PyObject* ids = key ? PyObject_GetAttr(stacks, ids_name) : nullptr;
  PyObject* known = ids ? PyDict_GetItemWithError(ids, key) : nullptr;  // borrowed: (stack id, code)
  PyObject* result = nullptr;
  if (known != nullptr && PyTuple_Check(known) && PyTuple_GET_SIZE(known) == 2) {
    result = Py_NewRef(PyTuple_GET_ITEM(known, 0));
  } else if (ids != nullptr && !PyErr_Occurred()) {
    PyObject* call[] = {stacks, reinterpret_cast<PyObject*>(frame), key};
    result = PyObject_VectorcallMethod(intern_name, call, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  }
  Py_XDECREF(ids);
  Py_XDECREF(key);
  Py_XDECREF(line);
  Py_XDECREF(address);
  if (result != nullptr) {
    Site site{Py_NewRef(module), reinterpret_cast<PyCodeObject*>(Py_NewRef(code)), PyFrame_GetLasti(frame)};
    sites.ids.emplace(site, Py_NewRef(result));
  }
  return result;
}

}  // namespace

// call_site(stacks, module) -> the id of the call site's stack: the innermost frame whose file
// starts with none of stacks.hidden, looked up in stacks.ids by (module, id(code), line), or
// stacks.intern(frame, key) on first sight; -1 when every frame is hidden. A site seen before is
// found by its instruction instead (Sites).
PyObject* call_site(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "call_site(stacks, module)")) return nullptr;
  static PyObject* hidden_name = nullptr;
  Sites* sites = interned(hidden_name, "hidden") ? sites_of(args[0]) : nullptr;
  PyObject* hidden = sites ? PyObject_GetAttr(args[0], hidden_name) : nullptr;
  if (hidden == nullptr) return nullptr;
  if (!PyTuple_Check(hidden)) {
    Py_DECREF(hidden);
    PyErr_SetString(PyExc_TypeError, "stacks.hidden must be a tuple of str");
    return nullptr;
  }
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  PyObject* result = nullptr;
  bool failed = false;
  while (frame != nullptr && result == nullptr && !failed) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    int hide = is_hidden(code, hidden);
    if (hide < 0) {
      failed = true;
    } else if (hide == 0) {
      auto known = sites->ids.find(Site{args[1], code, PyFrame_GetLasti(frame)});
      result = known != sites->ids.end() ? Py_NewRef(known->second) : new_site(args[0], *sites, args[1], frame, code);
      failed = result == nullptr;
    }
    Py_DECREF(code);
    if (result == nullptr && !failed) {
      PyFrameObject* back = PyFrame_GetBack(frame);
      Py_DECREF(frame);
      frame = back;
    }
  }
  Py_XDECREF(frame);
  Py_DECREF(hidden);
  if (failed) return nullptr;
  return result != nullptr ? result : PyLong_FromLong(-1);
}

}  // namespace pi0align
