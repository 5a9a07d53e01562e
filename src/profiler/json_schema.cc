// The JSON Schema subset the report's schema uses: Note [A report checked against its schema]
// (json_schema.h).
#include "profiler/json_schema.h"

#include <cmath>
#include <set>
#include <string_view>
#include <vector>

#include "core/json_in.h"

namespace tierzero {
namespace {

using json = nlohmann::json;

const std::set<std::string_view>& KnownKeywords() {
  static const std::set<std::string_view> known = {"$schema",    "$id",
                                                   "title",      "description",
                                                   "$defs",      "$ref",
                                                   "type",       "const",
                                                   "enum",       "minimum",
                                                   "maximum",    "required",
                                                   "properties", "additionalProperties",
                                                   "items",      "minItems",
                                                   "oneOf",      "pattern"};
  return known;
}

std::string Field(const std::string& path) { return path.empty() ? "the report" : path; }
std::string Member(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}
// A key as text: a name a user edited in may hold anything.
std::string KeyShown(const std::string& key) { return JsonIn::Shown(json(key)); }

bool IsType(const json& v, const std::string& type) {
  if (type == "object") return v.is_object();
  if (type == "array") return v.is_array();
  if (type == "string") return v.is_string();
  if (type == "boolean") return v.is_boolean();
  if (type == "null") return v.is_null();
  if (type == "number") return v.is_number();
  if (type == "integer") {
    if (v.is_number_integer()) return true;
    if (!v.is_number_float()) return false;
    const double d = v.get<double>();  // 2020-12: 2.0 is an integer
    return std::isfinite(d) && std::floor(d) == d;
  }
  return false;
}

std::string TypeWords(const std::string& type) {
  if (type == "object") return "an object";
  if (type == "array") return "an array";
  if (type == "string") return "a string";
  if (type == "boolean") return "true or false";
  if (type == "integer") return "an integer";
  if (type == "number") return "a number";
  return type;
}

// "^[...]*$": the one form of `pattern` known here (a class of single characters and ranges).
StatusOr<bool> MatchesClassStar(const std::string& pattern, const std::string& s) {
  if (pattern.size() < 5 || pattern.compare(0, 2, "^[") != 0 ||
      pattern.compare(pattern.size() - 3, 3, "]*$") != 0)
    return InternalError("the schema's pattern " + pattern +
                         " is not of the one form checked here, ^[...]*$");
  const std::string cls = pattern.substr(2, pattern.size() - 5);
  bool allowed[256] = {};
  for (size_t i = 0; i < cls.size(); ++i) {
    const unsigned char c = cls[i];
    if (c == '\\' || c == '^' || c == '[' || c >= 0x80)
      return InternalError("the schema's pattern " + pattern +
                           " uses more than literal characters");
    if (i + 2 < cls.size() && cls[i + 1] == '-') {
      for (unsigned x = c; x <= static_cast<unsigned char>(cls[i + 2]); ++x) allowed[x] = true;
      i += 2;
    } else {
      allowed[c] = true;
    }
  }
  for (unsigned char c : s)
    if (!allowed[c]) return false;
  return true;
}

class Checker {
 public:
  explicit Checker(const json& root) : root_(root) {}

  Status Check(const json& v, const json& s, const std::string& path, int depth) const {
    if (depth > 64) return InternalError("the schema's $refs nest deeper than 64 levels");
    if (s.is_boolean()) {
      if (s.get<bool>()) return Status::OK();
      return InvalidArgumentError(Field(path) + " is not allowed here");
    }
    if (!s.is_object()) return InternalError("the schema at " + Field(path) + " is not an object");
    for (auto it = s.begin(); it != s.end(); ++it)
      if (!KnownKeywords().count(it.key()))
        return InternalError("the schema uses the keyword " + it.key() + ", not checked here");
    if (auto ref = s.find("$ref"); ref != s.end()) {
      ASSIGN_OR_RETURN(const json* target, Resolve(*ref));
      RETURN_IF_ERROR(Check(v, *target, path, depth + 1));
    }
    if (auto type = s.find("type"); type != s.end()) RETURN_IF_ERROR(CheckType(v, *type, path));
    if (auto c = s.find("const"); c != s.end() && v != *c)
      return InvalidArgumentError(Field(path) + " is " + JsonIn::Shown(v) + "; it must be " +
                                  JsonIn::Shown(*c));
    if (auto e = s.find("enum"); e != s.end()) {
      if (!e->is_array())
        return InternalError("the schema's enum at " + Field(path) + " is not a list");
      bool found = false;
      std::string names;
      for (const json& x : *e) {
        found = found || v == x;
        names += (names.empty() ? "" : ", ") + JsonIn::Shown(x);
      }
      if (!found)
        return InvalidArgumentError(Field(path) + " is " + JsonIn::Shown(v) +
                                    "; it must be one of " + names);
    }
    if (v.is_number()) RETURN_IF_ERROR(CheckBounds(v, s, path));
    if (v.is_string()) {
      if (auto p = s.find("pattern"); p != s.end()) {
        if (!p->is_string()) return InternalError("the schema's pattern is not a string");
        ASSIGN_OR_RETURN(const bool ok,
                         MatchesClassStar(p->get<std::string>(), v.get<std::string>()));
        if (!ok)
          return InvalidArgumentError(Field(path) + " is " + JsonIn::Shown(v) +
                                      ", which does not match " + p->get<std::string>());
      }
    }
    if (v.is_array()) RETURN_IF_ERROR(CheckArray(v, s, path, depth));
    if (v.is_object()) RETURN_IF_ERROR(CheckObject(v, s, path, depth));
    if (auto one = s.find("oneOf"); one != s.end())
      RETURN_IF_ERROR(CheckOneOf(v, *one, path, depth));
    return Status::OK();
  }

 private:
  StatusOr<const json*> Resolve(const json& ref) const {
    const std::string prefix = "#/$defs/";
    if (!ref.is_string() || ref.get<std::string>().compare(0, prefix.size(), prefix) != 0)
      return InternalError("the schema's $ref " + JsonIn::Shown(ref) + " is not #/$defs/NAME");
    const std::string name = ref.get<std::string>().substr(prefix.size());
    auto defs = root_.find("$defs");
    if (defs == root_.end() || !defs->is_object() || !defs->contains(name))
      return InternalError("the schema has no $defs/" + name);
    return &(*defs)[name];
  }

  static Status CheckType(const json& v, const json& type, const std::string& path) {
    std::vector<std::string> types;
    if (type.is_string()) {
      types.push_back(type.get<std::string>());
    } else if (type.is_array()) {
      for (const json& t : type) {
        if (!t.is_string()) return InternalError("the schema's type list holds a non-string");
        types.push_back(t.get<std::string>());
      }
    } else {
      return InternalError("the schema's type at " + Field(path) + " is not a name or a list");
    }
    std::string words;
    for (const std::string& t : types) {
      if (IsType(v, t)) return Status::OK();
      words += (words.empty() ? "" : " or ") + TypeWords(t);
    }
    return InvalidArgumentError(Field(path) + " is " + JsonIn::Shown(v) + ", not " + words);
  }

  static Status CheckBounds(const json& v, const json& s, const std::string& path) {
    const double x = v.get<double>();
    if (auto m = s.find("minimum"); m != s.end()) {
      if (!m->is_number()) return InternalError("the schema's minimum is not a number");
      if (x < m->get<double>())
        return InvalidArgumentError(Field(path) + " is " + JsonIn::Shown(v) +
                                    ", below its least, " + JsonIn::Shown(*m));
    }
    if (auto m = s.find("maximum"); m != s.end()) {
      if (!m->is_number()) return InternalError("the schema's maximum is not a number");
      if (x > m->get<double>())
        return InvalidArgumentError(Field(path) + " is " + JsonIn::Shown(v) + ", above its most, " +
                                    JsonIn::Shown(*m));
    }
    return Status::OK();
  }

  Status CheckArray(const json& v, const json& s, const std::string& path, int depth) const {
    if (auto m = s.find("minItems"); m != s.end()) {
      if (!m->is_number_unsigned()) return InternalError("the schema's minItems is not a count");
      if (v.size() < m->get<size_t>())
        return InvalidArgumentError(Field(path) + " has " + std::to_string(v.size()) +
                                    " elements; it needs at least " + m->dump());
    }
    if (auto items = s.find("items"); items != s.end()) {
      for (size_t i = 0; i < v.size(); ++i)
        RETURN_IF_ERROR(Check(v[i], *items, path + "[" + std::to_string(i) + "]", depth + 1));
    }
    return Status::OK();
  }

  Status CheckObject(const json& v, const json& s, const std::string& path, int depth) const {
    if (auto req = s.find("required"); req != s.end()) {
      if (!req->is_array()) return InternalError("the schema's required is not a list");
      for (const json& k : *req) {
        if (!k.is_string()) return InternalError("the schema's required holds a non-string");
        if (!v.contains(k.get<std::string>()))
          return InvalidArgumentError(Field(Member(path, k.get<std::string>())) + " is missing");
      }
    }
    const auto props = s.find("properties");
    if (props != s.end() && !props->is_object())
      return InternalError("the schema's properties is not an object");
    const auto extra = s.find("additionalProperties");
    for (auto it = v.begin(); it != v.end(); ++it) {
      const std::string child = Member(path, it.key());
      if (props != s.end()) {
        if (auto p = props->find(it.key()); p != props->end()) {
          RETURN_IF_ERROR(Check(it.value(), *p, child, depth + 1));
          continue;
        }
      }
      if (extra == s.end()) continue;
      if (extra->is_boolean() && !extra->get<bool>())
        return InvalidArgumentError(Field(path) + " has a field " + KeyShown(it.key()) +
                                    " it may not have");
      RETURN_IF_ERROR(Check(it.value(), *extra, child, depth + 1));
    }
    return Status::OK();
  }

  // The form a value meant: the branches whose `const` members it has and agrees with (profile's
  // "available": true or false). When one is meant, its own error is the one to show.
  static bool Meant(const json& v, const json& branch) {
    if (!v.is_object() || !branch.is_object()) return false;
    auto props = branch.find("properties");
    if (props == branch.end() || !props->is_object()) return false;
    bool any = false;
    for (auto it = props->begin(); it != props->end(); ++it) {
      if (!it.value().is_object() || !it.value().contains("const")) continue;
      auto mine = v.find(it.key());
      if (mine == v.end() || *mine != it.value()["const"]) return false;
      any = true;
    }
    return any;
  }

  Status CheckOneOf(const json& v, const json& branches, const std::string& path, int depth) const {
    if (!branches.is_array() || branches.empty())
      return InternalError("the schema's oneOf is not a list of forms");
    int valid = 0, meant = 0;
    Status meant_error, first_error;
    for (const json& b : branches) {
      Status st = Check(v, b, path, depth + 1);
      if (st.code() == StatusCode::kInternal) return st;
      if (st.ok()) {
        ++valid;
        continue;
      }
      if (first_error.ok()) first_error = st;
      if (Meant(v, b)) {
        ++meant;
        meant_error = st;
      }
    }
    if (valid == 1) return Status::OK();
    if (valid > 1)
      return InvalidArgumentError(Field(path) + " matches more than one of its " +
                                  std::to_string(branches.size()) + " forms");
    if (meant == 1) return meant_error;
    return InvalidArgumentError(Field(path) + " matches none of its " +
                                std::to_string(branches.size()) +
                                " forms (the first: " + std::string(first_error.message()) + ")");
  }

  const json& root_;
};

// The report's schema (docs/report.schema.json), made a string literal at configure time.
constexpr const char kReportSchema[] =
#include "report_schema.inc"
    ;

}  // namespace

const json& ReportSchema() {
  static const json schema = json::parse(kReportSchema);
  return schema;
}

Status CheckSchemaKeywords(const json& schema) {
  std::vector<std::pair<const json*, std::string>> stack = {{&schema, "the schema"}};
  while (!stack.empty()) {
    const auto [s, where] = stack.back();
    stack.pop_back();
    if (s->is_boolean()) continue;
    if (!s->is_object()) return InternalError(where + " is not a schema");
    for (auto it = s->begin(); it != s->end(); ++it) {
      const std::string at = where + "/" + it.key();
      if (!KnownKeywords().count(it.key()))
        return InternalError(at + ": the keyword " + it.key() + " is not checked here");
      if (it.key() == "properties" || it.key() == "$defs") {
        if (!it.value().is_object()) return InternalError(at + " is not an object");
        for (auto p = it.value().begin(); p != it.value().end(); ++p)
          stack.emplace_back(&p.value(), at + "/" + p.key());
      } else if (it.key() == "items" || it.key() == "additionalProperties") {
        stack.emplace_back(&it.value(), at);
      } else if (it.key() == "oneOf") {
        if (!it.value().is_array()) return InternalError(at + " is not a list");
        for (size_t i = 0; i < it.value().size(); ++i)
          stack.emplace_back(&it.value()[i], at + "/" + std::to_string(i));
      } else if (it.key() == "pattern") {
        if (!it.value().is_string()) return InternalError(at + " is not a string");
        RETURN_IF_ERROR(MatchesClassStar(it.value().get<std::string>(), "").status());
      }
    }
  }
  return Status::OK();
}

Status CheckAgainstSchema(const json& value, const json& schema) {
  return Checker(schema).Check(value, schema, "", 0);
}

}  // namespace tierzero
