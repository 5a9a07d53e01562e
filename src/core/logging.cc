#include "core/logging.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "core/mutex.h"

namespace tierzero {
namespace {

constexpr std::array<std::string_view, static_cast<size_t>(LogSubsys::kCount)> kSubsysNames = {
    "core",  "offload",  "nvme",   "kernels", "adam", "zero",
    "chunk", "profiler", "engine", "model",   "app"};
constexpr std::array<std::string_view, 5> kLevelNames = {"error", "warn", "info", "debug", "trace"};

struct LogState {
  std::atomic<int> level{static_cast<int>(LogLevel::kWarn)};
  std::atomic<uint32_t> subsys_mask{~0u};
  std::atomic<int> rank{-1};
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  Mutex write_mu;
};

}  // namespace

// logging.h
StatusOr<uint32_t> ParseSubsysMask(std::string_view spec) {
  bool exclude = !spec.empty() && spec.front() == '^';
  if (exclude) spec.remove_prefix(1);
  uint32_t mask = 0;
  while (!spec.empty()) {
    size_t comma = spec.find(',');
    std::string_view name = spec.substr(0, comma);
    spec = comma == std::string_view::npos ? std::string_view() : spec.substr(comma + 1);
    if (name == "all") {
      mask = ~0u;
      continue;
    }
    size_t i = 0;
    while (i < kSubsysNames.size() && kSubsysNames[i] != name) ++i;
    if (i == kSubsysNames.size()) {
      return InvalidArgumentError("unknown log subsystem '" + std::string(name) +
                                  "'; expected all, core, offload, nvme, kernels, adam, zero, "
                                  "chunk, profiler, engine, model or app");
    }
    mask |= 1u << i;
  }
  return exclude ? ~mask : mask;
}

namespace {

LogState& State() {
  static LogState* state = [] {
    auto* s = new LogState();  // leaked on purpose: logging must work during static teardown
    if (const char* env = std::getenv("TZ_LOG_LEVEL"); env && *env) {
      if (auto level = ParseLogLevel(env); level.ok()) {
        s->level = static_cast<int>(*level);
      } else {
        std::fprintf(stderr, "tierzero: ignoring TZ_LOG_LEVEL: %s\n",
                     level.status().ToString().c_str());
      }
    }
    if (const char* env = std::getenv("TZ_LOG_SUBSYS"); env && *env) {
      if (auto mask = ParseSubsysMask(env); mask.ok()) {
        s->subsys_mask = *mask;
      } else {
        std::fprintf(stderr, "tierzero: ignoring TZ_LOG_SUBSYS: %s\n",
                     mask.status().ToString().c_str());
      }
    }
    return s;
  }();
  return *state;
}

}  // namespace

std::string_view LogLevelName(LogLevel level) { return kLevelNames[static_cast<size_t>(level)]; }
std::string_view LogSubsysName(LogSubsys subsys) {
  return kSubsysNames[static_cast<size_t>(subsys)];
}

StatusOr<LogLevel> ParseLogLevel(std::string_view text) {
  for (size_t i = 0; i < kLevelNames.size(); ++i) {
    if (text == kLevelNames[i]) return static_cast<LogLevel>(i);
  }
  return InvalidArgumentError("unknown log level '" + std::string(text) +
                              "'; expected one of error, warn, info, debug, trace");
}

bool LogEnabled(LogLevel level, LogSubsys subsys) {
  LogState& s = State();
  return static_cast<int>(level) <= s.level.load(std::memory_order_relaxed) &&
         (s.subsys_mask.load(std::memory_order_relaxed) >> static_cast<int>(subsys) & 1u);
}

void SetLogLevel(LogLevel level) { State().level = static_cast<int>(level); }
void SetLogRank(int rank) { State().rank = rank; }

Status SetLogSubsystems(std::string_view spec) {
  ASSIGN_OR_RETURN(uint32_t mask, ParseSubsysMask(spec));
  State().subsys_mask = mask;
  return Status::OK();
}

namespace internal {

LogMessage::LogMessage(LogLevel level, LogSubsys subsys) : level_(level), subsys_(subsys) {}

LogMessage::~LogMessage() {
  LogState& s = State();
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - s.start).count();
  std::string line;
  char prefix[96];
  // The seconds with a decimal point whatever the process's locale (snprintf's "%9.3f" wrote
  // "0,000" in a comma-decimal one a trainer set).
  char secs[32];
  const auto r = std::to_chars(secs, secs + sizeof secs, t, std::chars_format::fixed, 3);
  const std::string when = r.ec == std::errc() ? std::string(secs, r.ptr) : "?";
  int rank = s.rank.load();
  if (rank >= 0) {
    std::snprintf(prefix, sizeof(prefix), "[%9s r%d %s %s] ", when.c_str(), rank,
                  LogLevelName(level_).data(), LogSubsysName(subsys_).data());
  } else {
    std::snprintf(prefix, sizeof(prefix), "[%9s %s %s] ", when.c_str(), LogLevelName(level_).data(),
                  LogSubsysName(subsys_).data());
  }
  line = prefix;
  line += stream_.str();
  line += '\n';
  MutexLock lock(s.write_mu);
  ssize_t unused = ::write(STDERR_FILENO, line.data(), line.size());
  (void)unused;
}

}  // namespace internal
}  // namespace tierzero
