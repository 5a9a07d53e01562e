// Reading JSON that came from outside the process (a config, a checkpoint manifest, a report, a
// safetensors header) without exceptions and without undefined behaviour.
//
// Note [Reading outside JSON]: nlohmann's accessors are made for trusted data. `get<T>()` and
// `value(key, default)` throw on a type mismatch (`"version": "2"` ends the process with an
// uncaught type_error), and const `operator[]` on a missing key is undefined behaviour in a
// release build. JsonIn wraps a parsed value with the path that reached it and the code its
// errors carry; every read returns StatusOr, and an error names the source and the field:
//   "run/report.json: profile.events[3].start must be a number, not \"x\"".
// It only reads; it never inserts (non-const operator[] on a missing key would).
//
// Header-only, so core does not link nlohmann_json; its users do.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/status.h"
#include "tierzero/files.h"
#include "tierzero/utf8.h"

namespace tierzero {

// Deeper than any file tierzero writes (reports nest 5 levels), shallow enough for any stack.
inline constexpr int kMaxJsonDepth = 64;

class JsonIn {
 public:
  // `source` names where the value came from ("run/report.json"); errors carry `code`.
  JsonIn(const nlohmann::json& value, std::string source,
         StatusCode code = StatusCode::kInvalidArgument)
      : v_(&value), source_(std::move(source)), code_(code) {}

  const nlohmann::json& raw() const { return *v_; }
  // "source: a.b[2]" (or just the source at the top).
  std::string where() const { return path_.empty() ? source_ : source_ + ": " + path_; }
  Status Error(const std::string& what) const { return Status(code_, where() + " " + what); }

  bool is_object() const { return v_->is_object(); }
  bool has(std::string_view key) const { return v_->is_object() && v_->contains(key); }

  // An error when arrays and objects nest deeper than `most` levels. nlohmann parses any depth
  // without recursing, but printing (dump) and comparing recurse once per level, so a file of a
  // million '[' would overflow the stack there: call this before either on outside data.
  Status CheckDepth(int most) const {
    std::vector<std::pair<const nlohmann::json*, int>> stack = {{v_, 1}};
    while (!stack.empty()) {
      const auto [v, depth] = stack.back();
      stack.pop_back();
      if (!v->is_structured()) continue;
      if (depth > most)
        return Error("nests arrays and objects deeper than " + std::to_string(most) + " levels");
      for (const nlohmann::json& c : *v) stack.emplace_back(&c, depth + 1);
    }
    return Status::OK();
  }

  // The member `key`: an error when this is not an object or the member is missing.
  StatusOr<JsonIn> at(std::string_view key) const {
    if (!v_->is_object()) return Error("must be an object, not " + Shown(*v_));
    auto it = v_->find(key);
    if (it == v_->end()) return Child(*v_, key).Error("is missing");
    return Child(*it, key);
  }
  // The elements of this array.
  StatusOr<std::vector<JsonIn>> elements() const {
    if (!v_->is_array()) return Error("must be an array, not " + Shown(*v_));
    std::vector<JsonIn> out;
    out.reserve(v_->size());
    for (size_t i = 0; i < v_->size(); ++i) {
      JsonIn e = *this;
      e.v_ = &(*v_)[i];
      e.path_ = path_ + "[" + std::to_string(i) + "]";
      out.push_back(std::move(e));
    }
    return out;
  }
  StatusOr<std::vector<JsonIn>> elements(std::string_view key) const {
    ASSIGN_OR_RETURN(JsonIn a, at(key));
    return a.elements();
  }

  // This value as T: bool, std::string, double, float (finite), or an integer type (a JSON
  // integer in T's range).
  template <class T>
  StatusOr<T> as() const {
    const nlohmann::json& v = *v_;
    if constexpr (std::is_same_v<T, bool>) {
      if (!v.is_boolean()) return Error("must be true or false, not " + Shown(v));
      return v.get<bool>();
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (!v.is_string()) return Error("must be a string, not " + Shown(v));
      return v.get<std::string>();
    } else if constexpr (std::is_floating_point_v<T>) {
      if (!v.is_number()) return Error("must be a number, not " + Shown(v));
      const double d = v.get<double>();
      if (!std::isfinite(d) || std::fabs(d) > static_cast<double>(std::numeric_limits<T>::max()))
        return Error("is out of range: " + Shown(v));
      return static_cast<T>(d);
    } else {
      static_assert(std::is_integral_v<T>);
      if (!v.is_number_integer()) return Error("must be an integer, not " + Shown(v));
      if (v.is_number_unsigned()) {
        const uint64_t u = v.get<uint64_t>();
        if (u > static_cast<uint64_t>(std::numeric_limits<T>::max()))
          return Error("is out of range: " + Shown(v));
        return static_cast<T>(u);
      }
      const int64_t s = v.get<int64_t>();
      if constexpr (std::is_unsigned_v<T>) {
        if (s < 0) return Error("must not be negative: " + Shown(v));
        if (static_cast<uint64_t>(s) > static_cast<uint64_t>(std::numeric_limits<T>::max()))
          return Error("is out of range: " + Shown(v));
      } else {
        if (s < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
            s > static_cast<int64_t>(std::numeric_limits<T>::max()))
          return Error("is out of range: " + Shown(v));
      }
      return static_cast<T>(s);
    }
  }
  // The member `key` as T (missing: an error).
  template <class T>
  StatusOr<T> get(std::string_view key) const {
    ASSIGN_OR_RETURN(JsonIn m, at(key));
    return m.as<T>();
  }
  // The member `key` as T, or `fallback` when it is missing (present with the wrong type: an
  // error, never the fallback).
  template <class T>
  StatusOr<T> get_or(std::string_view key, T fallback) const {
    if (!has(key)) {
      if (!v_->is_object()) return Error("must be an object, not " + Shown(*v_));
      return fallback;
    }
    return get<T>(key);
  }

  // A value for a message: a scalar's JSON, cut to 80 characters (invalid UTF-8 replaced); an
  // array or object only by its size (printing one recurses once per level of nesting).
  static std::string Shown(const nlohmann::json& v) {
    if (v.is_array()) return "an array of " + std::to_string(v.size()) + " elements";
    if (v.is_object()) return "an object of " + std::to_string(v.size()) + " members";
    std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (s.size() > 80) s = s.substr(0, 77) + "...";
    return s;
  }

 private:
  JsonIn Child(const nlohmann::json& v, std::string_view key) const {
    JsonIn c = *this;
    c.v_ = &v;
    c.path_ = path_.empty() ? std::string(key) : path_ + "." + std::string(key);
    return c;
  }

  const nlohmann::json* v_;
  std::string source_;
  StatusCode code_;
  std::string path_;
};

// Note [Outside JSON parsed strictly]
// Outside JSON is first walked by a SAX pass that stops at the first problem, before any value is
// built: more than kMaxJsonDepth levels of nesting (printing or comparing a value recurses once per
// level: a config of 100,000 '[' segfaulted when its error message printed it), or a key an object
// names twice (nlohmann keeps the last silently, so `{"lr": 1e-3, ..., "lr": 10}` trained at 10).
// Then it is parsed. `source` names the text in errors, which carry `code`.
namespace json_in_internal {

// `s` as a message may quote it: bytes that are not UTF-8 (a damaged file's header, binary data
// given as JSON) and control characters as \xNN, so an error line stays one line of text.
inline std::string Printable(std::string_view s) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(s.size());
  auto escape = [&](unsigned char c) {
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  };
  while (!s.empty()) {
    const int64_t bad = FirstInvalidUtf8(s);
    const std::string_view good = s.substr(0, bad < 0 ? s.size() : static_cast<size_t>(bad));
    for (const char ch : good) {
      const auto c = static_cast<unsigned char>(ch);
      if (c < 0x20 || c == 0x7f)
        escape(c);
      else
        out += ch;
    }
    if (bad < 0) break;
    escape(static_cast<unsigned char>(s[static_cast<size_t>(bad)]));
    s.remove_prefix(static_cast<size_t>(bad) + 1);
  }
  return out;
}

class StrictSax {
 public:
  using json = nlohmann::json;
  explicit StrictSax(int max_depth) : max_depth_(max_depth) {}

  bool null() { return Value(); }
  bool boolean(bool) { return Value(); }
  bool number_integer(json::number_integer_t) { return Value(); }
  bool number_unsigned(json::number_unsigned_t) { return Value(); }
  // A whole number written without a fraction or exponent that 64 bits do not hold is read as
  // a double, another value: refused (a seed of 2^64 + 1 came back as 1.8446744073709552e19).
  // (Only digits after an optional '-': the parser writes the C locale's decimal mark into the
  // text, a ',' under de_DE.)
  bool number_float(json::number_float_t value, const json::string_t& raw) {
    const size_t digits = raw.size() > 0 && raw[0] == '-' ? 1 : 0;
    if (raw.size() > digits && raw.find_first_not_of("0123456789", digits) == std::string::npos) {
      error_ = "holds the whole number " + raw + Here() +
               ", beyond what 64 bits hold (it would be read as an approximation, and no field "
               "takes a number that large)";
      return false;
    }
    // A number too small for a double is read as 0, another value (1e-400 for an lr trained at
    // lr 0, exit 0; hunt 51): a nonzero digit before the exponent, and 0 read.
    const std::string mantissa = raw.substr(0, raw.find_first_of("eE"));
    if (value == 0 && mantissa.find_first_of("123456789") != std::string::npos) {
      error_ = "holds the number " + raw + Here() +
               ", too small for a double: it would be read as 0 (write 0 if 0 is meant)";
      return false;
    }
    return Value();
  }
  bool string(json::string_t&) { return Value(); }
  bool binary(json::binary_t&) { return Value(); }
  bool start_object(std::size_t) { return Open(true); }
  bool end_object() { return Close(); }
  bool start_array(std::size_t) { return Open(false); }
  bool end_array() { return Close(); }
  bool key(json::string_t& k) {
    Frame& f = frames_.back();
    if (!f.keys.insert(k).second) {
      error_ = "names the key \"" + Printable(k) + "\" twice" + Where(k) +
               " (each key once: which one is meant?)";
      return false;
    }
    f.key = k;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) {
    error_ = "is not valid JSON: " + Printable(ex.what());
    return false;
  }
  const std::string& error() const { return error_; }

 private:
  struct Frame {
    bool object;
    std::set<std::string> keys;
    std::string key;
    size_t index = 0;
  };
  bool Value() {
    if (!frames_.empty() && !frames_.back().object) ++frames_.back().index;
    return true;
  }
  bool Open(bool object) {
    if (static_cast<int>(frames_.size()) >= max_depth_) {
      error_ = "nests arrays and objects deeper than " + std::to_string(max_depth_) + " levels";
      return false;
    }
    if (!frames_.empty() && !frames_.back().object) ++frames_.back().index;
    frames_.push_back({object, {}, {}, 0});
    return true;
  }
  bool Close() {
    frames_.pop_back();
    return true;
  }
  // " (at a.b[2])" for the value being read, or "" at the top.
  std::string Here() const {
    if (frames_.empty()) return "";
    const Frame& f = frames_.back();
    if (f.object) return Where(f.key);
    std::string path = Where("");
    path.pop_back();  // ")"
    if (!path.empty() && path.back() == '.') path.pop_back();
    return path + "[" + std::to_string(f.index) + "])";
  }
  // " at a.b[2]" for the key `k` of the innermost object.
  std::string Where(const std::string& k) const {
    std::string path;
    for (size_t i = 0; i + 1 < frames_.size(); ++i) {
      const Frame& f = frames_[i];
      if (f.object) {
        path += (path.empty() ? "" : ".") + f.key;
      } else {
        path += "[" + std::to_string(f.index - 1) + "]";
      }
    }
    path += (path.empty() ? "" : ".") + k;
    return " (at " + Printable(path) + ")";
  }

  int max_depth_;
  std::vector<Frame> frames_;
  std::string error_;
};

// Where text holds a NUL: JSON has none, and the parser took one as the end of the text, what
// followed unread (a config, then binary junk, was read as the config alone; hunt 51). "" when
// none.
inline std::string NulInText(std::string_view text) {
  const size_t at = text.find('\0');
  if (at == std::string_view::npos) return "";
  return " holds a NUL byte at offset " + std::to_string(at) +
         ", which JSON text never does (a binary file, or a file joined to one?)";
}

}  // namespace json_in_internal

// Parses outside JSON strictly (Note [Outside JSON parsed strictly]): an error with `code` naming
// `source` when it is not JSON, nests deeper than `max_depth`, names a key twice, or writes a
// whole number 64 bits do not hold. Never throws.
inline StatusOr<nlohmann::json> ParseOutsideJson(std::string_view text, const std::string& source,
                                                 StatusCode code = StatusCode::kInvalidArgument,
                                                 bool allow_comments = false,
                                                 int max_depth = kMaxJsonDepth) {
  if (std::string nul = json_in_internal::NulInText(text); !nul.empty())
    return Status(code, source + nul);
  json_in_internal::StrictSax sax(max_depth);
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(text, &sax, nlohmann::json::input_format_t::json,
                                   /*strict=*/true, allow_comments);
  } catch (const nlohmann::json::exception& e) {
    return Status(code, source + " is not valid JSON: " + json_in_internal::Printable(e.what()));
  }
  if (!ok) {
    return Status(code, source + " " + (sax.error().empty() ? "is not valid JSON" : sax.error()));
  }
  nlohmann::json j =
      nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false, allow_comments);
  if (j.is_discarded()) return Status(code, source + " is not valid JSON");
  return j;
}

}  // namespace tierzero
