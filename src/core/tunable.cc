#include "core/tunable.h"

#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/bytes.h"
#include "core/logging.h"
#include "core/mutex.h"

namespace tierzero {
namespace {

Mutex& RegistryMutex() {
  static Mutex mu;
  return mu;
}
std::vector<const TunableBase*>& Registry() {
  static std::vector<const TunableBase*> registry;
  return registry;
}

}  // namespace

TunableBase::TunableBase(const char* env_name, const char* help)
    : env_name_(env_name), help_(help) {
  MutexLock lock(RegistryMutex());
  Registry().push_back(this);
}

std::optional<std::string> TunableBase::EnvValue() const {
  const char* v = std::getenv(env_name_);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::vector<const TunableBase*> AllTunables() {
  MutexLock lock(RegistryMutex());
  return Registry();
}

std::vector<TunableInfo> ListTunables() {
  std::vector<TunableInfo> out;
  for (const TunableBase* t : AllTunables())
    out.push_back({t->env_name(), t->ValueString(), t->DefaultString(), t->help()});
  return out;
}

Status ValidateTunables() {
  std::string problems;
  for (const TunableBase* t : AllTunables()) {
    if (Status st = t->ValidateEnv(); !st.ok()) {
      if (!problems.empty()) problems += "; ";
      problems += st.message();
    }
  }
  // The logging variables too (read where logging starts, which can only warn).
  for (const char* var : {"TZ_LOG_LEVEL", "TZ_LOG_SUBSYS"}) {
    const char* env = std::getenv(var);
    if (env == nullptr || *env == '\0') continue;
    const Status st = std::string(var) == "TZ_LOG_LEVEL" ? ParseLogLevel(env).status()
                                                         : ParseSubsysMask(env).status();
    if (!st.ok())
      problems +=
          (problems.empty() ? "" : "; ") + std::string(var) + ": " + std::string(st.message());
  }
  if (problems.empty()) return Status::OK();
  return InvalidArgumentError("bad environment tunable(s): " + problems +
                              " (fix or unset the variable)");
}

namespace internal {

StatusOr<bool> ParseTunable(std::string_view t, bool*) {
  if (t == "1" || t == "true" || t == "yes" || t == "on") return true;
  if (t == "0" || t == "false" || t == "no" || t == "off") return false;
  return InvalidArgumentError("'" + std::string(t) + "' is not a boolean (use 1/0, true/false)");
}

StatusOr<int64_t> ParseTunable(std::string_view t, int64_t*) {
  std::string s(t);
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || errno == ERANGE) {
    return InvalidArgumentError("'" + s + "' is not an integer");
  }
  return static_cast<int64_t>(v);
}

StatusOr<double> ParseTunable(std::string_view t, double*) {
  std::string s(t);
  // A decimal number, as written: no leading space, no hexadecimal ("0x10" read as 16), and a
  // decimal point whatever the process's locale (strtod took "0,5" and refused "0.5" in a
  // trainer that had set a comma-decimal locale: hunt 48). std::from_chars reads the C locale's.
  const bool decimal =
      !s.empty() && s.find_first_of("xX") == std::string::npos &&
      (std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '-' || s[0] == '+' || s[0] == '.');
  const char* begin = s.data() + (!s.empty() && s[0] == '+' ? 1 : 0);
  double v = 0;
  const auto [end, ec] = std::from_chars(begin, s.data() + s.size(), v);
  if (!decimal || (!s.empty() && s[0] == '+' && s.size() > 1 && s[1] == '-') || ec != std::errc() ||
      end != s.data() + s.size() || !std::isfinite(v)) {
    return InvalidArgumentError("'" + s + "' is not a finite decimal number");
  }
  return v;
}

StatusOr<std::string> ParseTunable(std::string_view t, std::string*) { return std::string(t); }

StatusOr<ByteSize> ParseTunable(std::string_view t, ByteSize*) {
  ASSIGN_OR_RETURN(uint64_t bytes, ParseByteSize(t));
  return ByteSize{bytes};
}

std::string TunableToString(bool v) { return v ? "true" : "false"; }
std::string TunableToString(int64_t v) { return std::to_string(v); }
// The shortest of 6..17 significant digits that reads back as `v` (1000001 printed as "1e+06"
// was refused as beyond a limit of 1e+06).
std::string TunableToString(double v) {
  // (std::to_chars: the shortest that reads back, in the C locale's notation whatever the
  // process's.)
  char b[64];
  const auto r = std::to_chars(b, b + sizeof b, v);
  return std::string(b, r.ptr);
}
std::string TunableToString(const std::string& v) { return v; }
std::string TunableToString(ByteSize v) { return FormatBytes(v.bytes); }

void WarnBadTunable(const char* env_name, const Status& status) {
  TZ_LOG(kWarn, kCore) << "ignoring " << env_name << ": " << status.message()
                       << "; using the default";
}

}  // namespace internal
}  // namespace tierzero
