// Scanner of msprobe's dump.json (pi0align/compare/reading/msprobe_scan.py loads it with ctypes):
// one pass over the bytes gives the columns the Python reference walk gives from parsed JSON
// (the calls' keys; per call its groups of tensors by role; per tensor its statistics, dtype,
// shape, requires_grad and file), without a Python object per value.
//
// It reads what msprobe writes. Whatever else a file holds (escapes where a name is read, text
// statistics, duplicate keys, a field of another type, invalid JSON or UTF-8, deep nesting) makes
// it give up on that file (status 0), and the Python reader reads it, or refuses it saying why:
// the scanner never decides anything the reference would decide otherwise.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace {

// The roles of a group, as msprobe_scan.ROLES orders them.
enum Role : int64_t { INPUT, OUTPUT, GRAD_OUTPUT, GRAD_INPUT, PARAMETER, PARAMETER_GRAD };
enum Task : int64_t { STATISTICS = 1, TENSOR = 2 };
constexpr int MAX_DEPTH = 256;
constexpr int64_t MAX_NUMEL = int64_t(1) << 62;  // as the reference: no tensor holds more

struct GiveUp {};  // thrown where the Python reader must read the file

struct Tensor {
  double stats[4];  // Min, Max, Mean, Norm
  int64_t requires_grad, dtype, shape, name_offset, name_length;
};

struct Group {
  int64_t call, role, count, name_offset, name_length;
};

enum Kind { STRING, NUMBER, TRUE_, FALSE_, NULL_, ARRAY, OBJECT };

// What the tensor rules need of a value once it is parsed.
struct Value {
  Kind kind = NULL_;
  std::string_view text;  // a string's contents as written
  bool escaped = false;   // the string holds an escape: its text is not its value
  double number = 0;
  bool integer = false;  // an integer literal within int64
  int64_t whole = 0;
  bool shape = false;  // an array of non-negative integer literals, left on Scanner::dims_
  size_t dims_start = 0, elements = 0;  // an array's or object's elements
};

class Scanner {
 public:
  Scanner(const char* text, int64_t length) : begin_(text), at_(text), end_(text + length) {}

  std::vector<int64_t> keys;  // offset, length of each call's key
  std::vector<Group> groups;
  std::vector<Tensor> tensors;
  std::vector<int64_t> dtypes;  // offset, length of each distinct dtype
  std::vector<int64_t> shape_offsets{0}, shape_dims;  // distinct shapes, their dims flat
  int64_t task = 0;

  void scan() {
    check_utf8();
    space();
    expect('{');
    bool seen_task = false, seen_framework = false, seen_data = false;
    if (!take('}')) {
      do {
        Value key = string_value();
        if (key.escaped) throw GiveUp();
        expect(':');
        if (key.text == "task") {
          once(seen_task);
          Value v = value(false, 1);
          if (v.kind != STRING || v.escaped) throw GiveUp();
          task = v.text == "statistics" ? STATISTICS : v.text == "tensor" ? TENSOR : throw GiveUp();
        } else if (key.text == "framework") {
          once(seen_framework);
          Value v = value(false, 1);
          if (v.kind != STRING || v.escaped || v.text != "pytorch") throw GiveUp();
        } else if (key.text == "data") {
          once(seen_data);
          data();
        } else {
          value(false, 1);
        }
        space();
      } while (take(','));
      expect('}');
    }
    space();
    if (at_ != end_ || !seen_task || !seen_data) throw GiveUp();
  }

 private:
  const char* begin_;
  const char* at_;
  const char* end_;
  std::vector<Tensor> found_;  // tensors of the field being read, depth first
  std::vector<int64_t> dims_;
  std::vector<std::string_view> dict_keys_;
  std::map<std::string_view, int64_t> dtype_codes_;
  std::map<std::vector<int64_t>, int64_t> shape_codes_;

  static void once(bool& seen) {
    if (seen) throw GiveUp();  // a duplicate key: the reference keeps the last value in the first place
    seen = true;
  }

  void check_utf8() const {
    const auto* p = reinterpret_cast<const unsigned char*>(begin_);
    const auto* end = reinterpret_cast<const unsigned char*>(end_);
    if (end - p >= 3 && p[0] == 0xEF && p[1] == 0xBB && p[2] == 0xBF) throw GiveUp();  // a byte order mark
    while (p < end) {
      uint64_t eight;
      if (end - p >= 8 && (std::memcpy(&eight, p, 8), (eight & 0x8080808080808080ull) == 0)) {  // ASCII
        p += 8;
        continue;
      }
      unsigned char c = *p;
      if (c < 0x80) { ++p; continue; }
      int more = (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xE ? 2 : (c >> 3) == 0x1E ? 3 : -1;
      if (more < 0 || end - p <= more) throw GiveUp();
      uint32_t point = c & (0x3F >> more);
      for (int i = 1; i <= more; ++i) {
        if ((p[i] & 0xC0) != 0x80) throw GiveUp();
        point = (point << 6) | (p[i] & 0x3F);
      }
      static const uint32_t smallest[] = {0, 0x80, 0x800, 0x10000};
      if (point < smallest[more] || point > 0x10FFFF || (point >= 0xD800 && point <= 0xDFFF)) throw GiveUp();
      p += more + 1;
    }
  }

  void space() {
    while (at_ < end_ && (*at_ == ' ' || *at_ == '\n' || *at_ == '\r' || *at_ == '\t')) ++at_;
  }
  bool take(char c) {
    space();
    if (at_ < end_ && *at_ == c) { ++at_; return true; }
    return false;
  }
  void expect(char c) {
    if (!take(c)) throw GiveUp();
  }
  static bool digit(char c) { return c >= '0' && c <= '9'; }

  bool word(std::string_view w) {
    if (end_ - at_ >= int64_t(w.size()) && std::memcmp(at_, w.data(), w.size()) == 0) {
      at_ += w.size();
      return true;
    }
    return false;
  }

  Value string_value() {
    space();
    if (at_ >= end_ || *at_ != '"') throw GiveUp();
    const char* start = ++at_;
    Value v;
    v.kind = STRING;
    while (true) {
      if (at_ >= end_) throw GiveUp();
      unsigned char c = *at_;
      if (c == '"') break;
      if (c < 0x20) throw GiveUp();
      if (c == '\\') {
        v.escaped = true;
        if (++at_ >= end_) throw GiveUp();
        if (*at_ == 'u') {
          for (int i = 0; i < 4; ++i)
            if (++at_ >= end_ || !std::isxdigit(static_cast<unsigned char>(*at_))) throw GiveUp();
        } else if (!std::strchr("\"\\/bfnrt", *at_) || *at_ == 0) {
          throw GiveUp();
        }
      }
      ++at_;
    }
    v.text = std::string_view(start, at_ - start);
    ++at_;
    return v;
  }

  Value number_value() {
    Value v;
    v.kind = NUMBER;
    const char* start = at_;
    if (word("NaN")) { v.number = std::numeric_limits<double>::quiet_NaN(); return v; }
    if (word("Infinity")) { v.number = std::numeric_limits<double>::infinity(); return v; }
    if (word("-Infinity")) { v.number = -std::numeric_limits<double>::infinity(); return v; }
    const char* p = at_;
    if (p < end_ && *p == '-') ++p;
    if (p >= end_ || !digit(*p)) throw GiveUp();
    if (*p == '0') ++p;
    else while (p < end_ && digit(*p)) ++p;
    bool integer = true;
    if (p < end_ && *p == '.') {
      integer = false;
      if (++p >= end_ || !digit(*p)) throw GiveUp();
      while (p < end_ && digit(*p)) ++p;
    }
    if (p < end_ && (*p == 'e' || *p == 'E')) {
      integer = false;
      if (++p < end_ && (*p == '+' || *p == '-')) ++p;
      if (p >= end_ || !digit(*p)) throw GiveUp();
      while (p < end_ && digit(*p)) ++p;
    }
    if (integer) {  // an integer beyond int64 is a Python int the reference converts its own way
      auto [end, error] = std::from_chars(start, p, v.whole);
      if (error != std::errc() || end != p) throw GiveUp();
      v.integer = true;
      v.number = double(v.whole);  // rounded to nearest, as Python's float(int); -0 is 0
    } else {
      auto [end, error] = std::from_chars(start, p, v.number);  // correctly rounded, as Python's float()
      if (error != std::errc() || end != p) throw GiveUp();      // out of range: the reference's to judge
    }
    at_ = p;
    return v;
  }

  // A value; `collect`: the tensors in it are pushed onto found_, depth first, as the reference's
  // `_tensors` finds them.
  Value value(bool collect, int depth) {
    if (depth > MAX_DEPTH) throw GiveUp();
    space();
    if (at_ >= end_) throw GiveUp();
    switch (*at_) {
      case '"': return string_value();
      case '{': return object(collect, depth);
      case '[': return array(collect, depth);
      case 't': if (word("true")) { Value v; v.kind = TRUE_; return v; } throw GiveUp();
      case 'f': if (word("false")) { Value v; v.kind = FALSE_; return v; } throw GiveUp();
      case 'n': if (word("null")) { Value v; v.kind = NULL_; return v; } throw GiveUp();
      default: return number_value();
    }
  }

  Value array(bool collect, int depth) {
    ++at_;
    Value v;
    v.kind = ARRAY;
    v.shape = true;
    v.dims_start = dims_.size();
    std::vector<int64_t> own;  // this array's integers, kept apart from nested arrays' pushes
    if (!take(']')) {
      do {
        Value item = value(collect, depth + 1);
        ++v.elements;
        if (item.kind == NUMBER && item.integer && item.whole >= 0) own.push_back(item.whole);
        else v.shape = false;
      } while (take(','));
      expect(']');
    }
    dims_.resize(v.dims_start);
    if (v.shape) dims_.insert(dims_.end(), own.begin(), own.end());
    return v;
  }

  Value object(bool collect, int depth) {
    ++at_;
    Value v;
    v.kind = OBJECT;
    size_t mark = found_.size(), keys_mark = dict_keys_.size();
    Value type, dtype, shape, stats[4], requires_grad, data_name;
    int64_t shape_code = -1;
    bool has_type = false, has_dtype = false, has_shape = false, has_stat[4] = {}, has_requires_grad = false,
         has_data_name = false;
    if (!take('}')) {
      do {
        Value key = string_value();
        expect(':');
        Value item = value(collect, depth + 1);
        ++v.elements;
        if (!collect) continue;
        if (key.escaped) throw GiveUp();
        dict_keys_.push_back(key.text);
        std::string_view k = key.text;
        if (k == "type") keep(type, has_type, item);
        else if (k == "dtype") keep(dtype, has_dtype, item);
        else if (k == "shape") {
          keep(shape, has_shape, item);
          if (item.shape) shape_code = code_of_shape(item);  // before another array replaces its dims
        }
        else if (k == "Min") keep(stats[0], has_stat[0], item);
        else if (k == "Max") keep(stats[1], has_stat[1], item);
        else if (k == "Mean") keep(stats[2], has_stat[2], item);
        else if (k == "Norm") keep(stats[3], has_stat[3], item);
        else if (k == "requires_grad") keep(requires_grad, has_requires_grad, item);
        else if (k == "data_name") keep(data_name, has_data_name, item);
      } while (take(','));
      expect('}');
    }
    if (!collect) return v;
    if (!(has_dtype && has_shape)) {
      if (has_type && type.kind == STRING && (type.escaped || ends_with_tensor(type.text))) throw GiveUp();
      check_distinct(keys_mark);  // a container: the tensors found in its values stay, each value once
      return v;
    }
    dict_keys_.resize(keys_mark);  // a tensor entry: its other keys are not read (a field read twice: keep)
    found_.resize(mark);  // a tensor entry: what its values hold is not looked at
    if (has_type && type.kind == STRING && type.escaped) throw GiveUp();
    if (has_type && (type.kind != STRING || !ends_with_tensor(type.text))) return v;
    Tensor t{};
    if (dtype.kind != STRING || dtype.escaped) throw GiveUp();
    t.dtype = code_of_dtype(dtype.text);
    if (shape.kind == NULL_) t.shape = code_of_dims({});
    else if (shape_code >= 0) t.shape = shape_code;
    else throw GiveUp();
    for (int i = 0; i < 4; ++i) {
      if (!has_stat[i]) throw GiveUp();
      const Value& s = stats[i];
      if (s.kind == NUMBER) t.stats[i] = s.number;
      else if (s.kind == TRUE_) t.stats[i] = 1.0;
      else if (s.kind == FALSE_) t.stats[i] = 0.0;
      else if (s.kind == NULL_) t.stats[i] = std::numeric_limits<double>::quiet_NaN();
      else throw GiveUp();
    }
    t.requires_grad = -1;
    if (has_requires_grad) {
      const Value& r = requires_grad;
      if (r.kind == ARRAY || r.kind == OBJECT) throw GiveUp();  // unhashable: the reference fails on it
      if (r.kind == TRUE_ || (r.kind == NUMBER && r.number == 1.0)) t.requires_grad = 1;
      else if (r.kind == FALSE_ || (r.kind == NUMBER && r.number == 0.0)) t.requires_grad = 0;
    }
    t.name_offset = -1;
    if (has_data_name && truthy(data_name)) {
      if (data_name.kind != STRING || data_name.escaped) throw GiveUp();
      t.name_offset = data_name.text.data() - begin_;
      t.name_length = int64_t(data_name.text.size());
    }
    found_.push_back(t);
    return v;
  }

  // The code of a shape array's dims (the reference refuses a tensor of 2^62 elements or more).
  int64_t code_of_shape(const Value& item) {
    std::vector<int64_t> dims(dims_.begin() + item.dims_start, dims_.begin() + item.dims_start + item.elements);
    int64_t numel = 1;
    for (int64_t d : dims) {
      if (d != 0 && numel > MAX_NUMEL / d) throw GiveUp();
      numel *= d;
    }
    if (numel >= MAX_NUMEL) throw GiveUp();
    return code_of_dims(dims);
  }

  // A tensor entry's field, read once: twice, the reference would read the last value.
  static void keep(Value& field, bool& seen, const Value& item) {
    once(seen);
    field = item;
  }

  static bool truthy(const Value& v) {
    switch (v.kind) {
      case STRING: return !v.text.empty();
      case NUMBER: return v.number != 0.0;
      case TRUE_: return true;
      case ARRAY: case OBJECT: return v.elements != 0;
      default: return false;
    }
  }

  void check_distinct(size_t keys_mark) {
    auto first = dict_keys_.begin() + keys_mark;
    if (dict_keys_.end() - first > 1) {
      std::sort(first, dict_keys_.end());
      if (std::adjacent_find(first, dict_keys_.end()) != dict_keys_.end()) throw GiveUp();
    }
    dict_keys_.resize(keys_mark);
  }

  static bool ends_with_tensor(std::string_view text) {
    return text.size() >= 6 && text.substr(text.size() - 6) == "Tensor";
  }

  int64_t code_of_dtype(std::string_view text) {
    auto [at, added] = dtype_codes_.emplace(text, int64_t(dtype_codes_.size()));
    if (added) {
      dtypes.push_back(text.data() - begin_);
      dtypes.push_back(int64_t(text.size()));
    }
    return at->second;
  }

  int64_t code_of_dims(const std::vector<int64_t>& dims) {
    auto [at, added] = shape_codes_.emplace(dims, int64_t(shape_codes_.size()));
    if (added) {
      shape_dims.insert(shape_dims.end(), dims.begin(), dims.end());
      shape_offsets.push_back(int64_t(shape_dims.size()));
    }
    return at->second;
  }

  // What the reference's `_parse_key` makes of a key's direction: 0 forward, 1 another, 2 a
  // module's parameters' gradients.
  static int64_t key_kind(std::string_view key) {
    std::string_view direction;
    if (key.substr(0, 7) == "Module." && std::count(key.begin(), key.end(), '.') >= 4) {
      size_t last = key.rfind('.');
      size_t before = key.rfind('.', last - 1);
      direction = key.substr(before + 1, last - before - 1);
      if (direction == "parameters_grad") return 2;
    } else {
      size_t last = key.rfind('.');
      if (last == std::string_view::npos) return 0;
      std::string_view head = key.substr(0, last);
      direction = key.substr(last + 1);
      if (!((direction == "forward" || direction == "backward") && head.find('.') != std::string_view::npos))
        return 0;
    }
    return direction == "forward" ? 0 : 1;
  }

  void data() {
    space();
    if (at_ >= end_ || *at_ != '{') throw GiveUp();
    ++at_;
    std::unordered_set<std::string_view> seen;
    if (take('}')) return;
    do {
      Value key = string_value();
      if (key.escaped || !seen.insert(key.text).second) throw GiveUp();
      expect(':');
      int64_t call = int64_t(keys.size() / 2), kind = key_kind(key.text);
      keys.push_back(key.text.data() - begin_);
      keys.push_back(int64_t(key.text.size()));
      entry(call, kind);
      space();
    } while (take(','));
    expect('}');
  }

  // One call's entry: its groups, in the reference's order (forward: input = input_args then
  // input_kwargs, output; else grad_output = input, grad_input = output; then each parameter).
  void entry(int64_t call, int64_t kind) {
    space();
    if (at_ >= end_ || *at_ != '{') throw GiveUp();
    ++at_;
    static const char* const FIELDS[] = {"input_args", "input_kwargs", "output", "input", "parameters"};
    std::vector<Tensor> field[5];
    bool seen[5] = {};
    std::vector<std::pair<std::string_view, std::vector<Tensor>>> parameters;
    std::unordered_set<std::string_view> names;
    if (!take('}')) {
      do {
        Value key = string_value();
        if (key.escaped) throw GiveUp();
        expect(':');
        if (kind == 2) {  // every item is a parameter's gradient
          if (!names.insert(key.text).second) throw GiveUp();
          parameters.emplace_back(key.text, collected(1));
          continue;
        }
        int f = 0;
        while (f < 5 && key.text != FIELDS[f]) ++f;
        bool used = f == 4 || (kind == 0 ? f <= 2 : (f == 2 || f == 3));
        if (f < 5) once(seen[f]);
        if (f == 4) parameters_of(names, parameters);
        else if (used) field[f] = collected(1);
        else value(false, 1);
      } while (take(','));
      expect('}');
    }
    if (kind == 0) {
      field[0].insert(field[0].end(), field[1].begin(), field[1].end());
      add_group(call, INPUT, field[0]);
      add_group(call, OUTPUT, field[2]);
    } else if (kind == 1) {
      add_group(call, GRAD_OUTPUT, field[3]);
      add_group(call, GRAD_INPUT, field[2]);
    }
    for (auto& [name, found] : parameters) {
      if (found.size() > 1) found.resize(1);  // a parameter is its first tensor
      add_group(call, kind == 2 ? PARAMETER_GRAD : PARAMETER, found, name);
    }
  }

  void parameters_of(std::unordered_set<std::string_view>& names,
                     std::vector<std::pair<std::string_view, std::vector<Tensor>>>& parameters) {
    space();
    if (at_ < end_ && *at_ == '{') {
      ++at_;
      if (take('}')) return;
      do {
        Value key = string_value();
        if (key.escaped || !names.insert(key.text).second) throw GiveUp();
        expect(':');
        parameters.emplace_back(key.text, collected(2));
      } while (take(','));
      expect('}');
      return;
    }
    if (truthy(value(false, 1))) throw GiveUp();  // the reference reads `parameters or {}`
  }

  std::vector<Tensor> collected(int depth) {
    found_.clear();
    value(true, depth);
    return found_;
  }

  void add_group(int64_t call, Role role, const std::vector<Tensor>& found, std::string_view name = {}) {
    groups.push_back({call, role, int64_t(found.size()), name.empty() ? -1 : name.data() - begin_,
                      int64_t(name.size())});
    tensors.insert(tensors.end(), found.begin(), found.end());
  }
};

}  // namespace

extern "C" {

// Scans `length` bytes of a dump.json. sizes[0]: 1 when scanned, 0 when the Python reader must read
// the file; then the counts of calls, groups, tensors, distinct dtypes, distinct shapes and their
// dims, the task (1 statistics, 2 tensor), and the bytes of the keys, each followed by a newline
// (which a JSON string cannot hold unescaped). `*handle` holds the columns until
// pi0align_msprobe_columns copies them out and frees it.
void pi0align_msprobe_scan(const char* text, int64_t length, void** handle, int64_t* sizes) {
  *handle = nullptr;
  std::fill(sizes, sizes + 9, 0);
  Scanner* scanner = nullptr;
  try {
    scanner = new Scanner(text, length);
    scanner->scan();
  } catch (...) {  // GiveUp, or memory running out: no exception crosses into Python's C
    delete scanner;
    return;
  }
  *handle = scanner;
  sizes[0] = 1;
  sizes[1] = int64_t(scanner->keys.size() / 2);
  sizes[2] = int64_t(scanner->groups.size());
  sizes[3] = int64_t(scanner->tensors.size());
  sizes[4] = int64_t(scanner->dtypes.size() / 2);
  sizes[5] = int64_t(scanner->shape_offsets.size() - 1);
  sizes[6] = int64_t(scanner->shape_dims.size());
  sizes[7] = scanner->task;
  for (size_t i = 1; i < scanner->keys.size(); i += 2) sizes[8] += scanner->keys[i] + 1;
}

// Copies the columns out, into arrays of the sizes pi0align_msprobe_scan gave, and frees the handle:
// keys (the calls' keys, each followed by a newline), groups (groups x 5: call, role, count, name
// offset, name length), stats (tensors x 4), tensor_ints (tensors x 5: requires_grad, dtype, shape,
// file name offset, its length), dtypes (x 2), shape_offsets (shapes + 1), shape_dims.
void pi0align_msprobe_columns(void* handle, const char* text, char* keys, int64_t* groups, double* stats,
                              int64_t* tensor_ints, int64_t* dtypes, int64_t* shape_offsets, int64_t* shape_dims) {
  auto* s = static_cast<Scanner*>(handle);
  for (size_t i = 0; i < s->keys.size(); i += 2) {
    keys = std::copy(text + s->keys[i], text + s->keys[i] + s->keys[i + 1], keys);
    *keys++ = '\n';
  }
  for (size_t i = 0; i < s->groups.size(); ++i) {
    const Group& g = s->groups[i];
    int64_t* out = groups + 5 * i;
    out[0] = g.call; out[1] = g.role; out[2] = g.count; out[3] = g.name_offset; out[4] = g.name_length;
  }
  for (size_t i = 0; i < s->tensors.size(); ++i) {
    const Tensor& t = s->tensors[i];
    std::copy(t.stats, t.stats + 4, stats + 4 * i);
    int64_t* out = tensor_ints + 5 * i;
    out[0] = t.requires_grad; out[1] = t.dtype; out[2] = t.shape; out[3] = t.name_offset; out[4] = t.name_length;
  }
  std::copy(s->dtypes.begin(), s->dtypes.end(), dtypes);
  std::copy(s->shape_offsets.begin(), s->shape_offsets.end(), shape_offsets);
  std::copy(s->shape_dims.begin(), s->shape_dims.end(), shape_dims);
  delete s;
}

}  // extern "C"
