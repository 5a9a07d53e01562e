// Levelled logging filtered by subsystem, in the manner of NCCL_DEBUG / NCCL_DEBUG_SUBSYS.
//
//   TZ_LOG(kInfo, kOffload) << "pinned arena: " << FormatBytes(n);
//   TZ_LOG_ONCE(kWarn, kNvme) << "O_DIRECT unsupported on " << path << ", using buffered I/O";
//
// The threshold comes from TZ_LOG_LEVEL (error|warn|info|debug|trace; default warn) and the
// subsystem filter from TZ_LOG_SUBSYS (a comma list such as "offload,nvme", or "^chunk" to
// exclude; default all). Both are read once at first use and can be changed with
// SetLogLevel/SetLogSubsystems. Lines go to stderr, one write per line, with the time since
// process start, the rank (SetLogRank; omitted until set) and the subsystem.
//
// Thread-safety: all functions may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <sstream>
#include <string_view>

#include "core/status.h"

namespace tierzero {

enum class LogLevel : uint8_t { kError = 0, kWarn, kInfo, kDebug, kTrace };
enum class LogSubsys : uint8_t {
  kCore = 0,
  kOffload,
  kNvme,
  kKernels,
  kAdam,
  kZero,
  kChunk,
  kProfiler,
  kEngine,
  kModel,
  kApp,
  kCount
};

std::string_view LogLevelName(LogLevel level);
std::string_view LogSubsysName(LogSubsys subsys);
StatusOr<LogLevel> ParseLogLevel(std::string_view text);
// TZ_LOG_SUBSYS's value: a comma list of subsystem names, or ^list to exclude them.
StatusOr<uint32_t> ParseSubsysMask(std::string_view spec);

// True when a message at `level` for `subsys` would be printed.
bool LogEnabled(LogLevel level, LogSubsys subsys);
void SetLogLevel(LogLevel level);
// Accepts the TZ_LOG_SUBSYS syntax; an unknown name is an InvalidArgument naming it.
Status SetLogSubsystems(std::string_view spec);
void SetLogRank(int rank);

namespace internal {

class LogMessage {
 public:
  LogMessage(LogLevel level, LogSubsys subsys);
  ~LogMessage();
  std::ostringstream& stream() { return stream_; }

 private:
  LogLevel level_;
  LogSubsys subsys_;
  std::ostringstream stream_;
};

struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace internal
}  // namespace tierzero

#define TZ_LOG(level, subsys)                                                         \
  !::tierzero::LogEnabled(::tierzero::LogLevel::level, ::tierzero::LogSubsys::subsys) \
      ? (void)0                                                                       \
      : ::tierzero::internal::LogVoidify() &                                          \
            ::tierzero::internal::LogMessage(::tierzero::LogLevel::level,             \
                                             ::tierzero::LogSubsys::subsys)           \
                .stream()

// Logs the first time this line is reached in the process, then never again.
#define TZ_LOG_ONCE(level, subsys)                                                        \
  for (static std::atomic<bool> tz_logged_once_{false}; !tz_logged_once_.exchange(true);) \
  TZ_LOG(level, subsys)
