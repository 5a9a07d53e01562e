// Status and StatusOr: errors as values.
//
// Every operation that can fail because of the environment (out of device memory, a full disk,
// an I/O error, a rank gone, bad input) returns a Status or a StatusOr<T>. An OK Status holds no
// allocation and costs one pointer compare. A failed Status carries a code, a message that says
// what was wrong and what to do, context added by the callers it travelled through, and the call
// sites that TZ_RETURN_IF_ERROR passed on the way (NCCL-style: the message prints where it came
// from).
//
// Broken invariants (bugs) are not Statuses: they abort through TZ_CHECK (src/core/check.h).
//
// Thread-safety: a Status is a value; distinct objects may be used from different threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace tierzero {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,     // the caller passed something wrong: a bad config value, a bad shape
  kNotFound,            // a named file, tensor or checkpoint does not exist
  kAlreadyExists,       // something that must be new exists already
  kFailedPrecondition,  // called in the wrong state (acquire in the wrong phase, ...)
  kOutOfMemory,         // a device, host or disk budget cannot hold the request
  kIoError,             // a read, write, open or sync failed
  kUnavailable,         // a backend is absent (no GPU, built without CUDA or MPI, no io_uring)
  kRemote,              // another rank failed; the message is that rank's
  kInternal,            // a foreign library failed in a way we cannot attribute
  kDataLoss,            // stored data is corrupt (checksum mismatch, truncated file)
  kCancelled,           // the operation was stopped on request
  kDeadlineExceeded,    // a wait timed out
  kUnsupported,         // a valid request this build or platform cannot serve
};

// Returns the enumerator's name without the leading 'k' ("OutOfMemory").
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  // An OK status.
  Status() noexcept = default;
  // REQUIRES: code != kOk.
  Status(StatusCode code, std::string message);

  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;
  ~Status() = default;

  static Status OK() { return Status(); }

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const { return state_ ? state_->code : StatusCode::kOk; }
  // The message, with context prefixes ("loading chunk 3: open /x failed: ENOENT").
  std::string_view message() const;
  // "OutOfMemory: message [at a.cc:10 <- b.cc:20]", or "OK".
  std::string ToString() const;

  // Returns this status with "context: " prepended to the message. No effect on OK.
  Status WithContext(std::string_view context) &&;
  Status WithContext(std::string_view context) const&;
  // Records a call site the error passed through (used by TZ_RETURN_IF_ERROR). No effect on OK.
  Status& AddFrame(const char* file, int line);

 private:
  struct State {
    StatusCode code;
    std::string message;
    std::string frames;  // " <- file:line" entries, oldest first
  };
  std::unique_ptr<State> state_;
};

// Convenience constructors: tierzero::InvalidArgument("bad value ", 3) etc. take one string.
Status InvalidArgumentError(std::string message);
Status NotFoundError(std::string message);
Status FailedPreconditionError(std::string message);
Status OutOfMemoryError(std::string message);
Status IoError(std::string message);
Status UnavailableError(std::string message);
Status InternalError(std::string message);
Status DataLossError(std::string message);
Status UnsupportedError(std::string message);
Status DeadlineExceededError(std::string message);
// An I/O error from an errno value: "what: strerror(err) (errno N)".
Status ErrnoError(std::string_view what, int err, StatusCode code = StatusCode::kIoError);

// The exception being handled, as a Status (call inside a catch block): std::bad_alloc is
// OutOfMemory (the host would give no memory); a thread the system would not start or memory
// it would not map (std::system_error's EAGAIN or ENOMEM, oneTBB's "pthread_create has failed")
// is OutOfMemory naming the process's limits; anything else is Internal, a bug. For the
// boundaries an exception must not cross: a thread's function (past it std::terminate ends the
// process), a host function on a stream, a command's last net.
Status StatusOfCurrentException();
// fn()'s Status, or the exception escaping it as one (StatusOfCurrentException): a Status-
// returning call at such a boundary.
template <typename Fn>
Status CatchingExceptions(Fn&& fn) {
  try {
    return fn();
  } catch (...) {
    return StatusOfCurrentException();
  }
}

// Note [A reserve for running out] (src/core/memory_reserve.cc): maps `blocks` blocks of
// `block_bytes` (never touched: address space, not memory) and installs a std::new_handler that
// unmaps one block each time an allocation fails: the first failure throws std::bad_alloc as
// before; later ones (the destructors run as the stack unwinds, the error path) retry in what was
// given back. Once every block is given back, allocation fails as without it. Process-wide
// (std::set_new_handler); call once, early in main, before any thread of ours.
void InstallMemoryReserve(size_t block_bytes = size_t{32} << 20, int blocks = 2);

// How many times the reserve was drawn on (an allocation failed) since it was installed.
int MemoryReserveDrawn();

[[noreturn]] void DieOnBadStatusAccess(const Status& status);

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  // REQUIRES: !status.ok().
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) status_ = Status(StatusCode::kInternal, "StatusOr constructed from OK");
  }
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  // REQUIRES: ok(). Aborts with the status otherwise.
  // (A moved-from StatusOr has neither: that aborts too.)
  T& value() & {
    if (!ok() || !value_) DieOnBadStatusAccess(status_);
    return *value_;
  }
  const T& value() const& {
    if (!ok() || !value_) DieOnBadStatusAccess(status_);
    return *value_;
  }
  T&& value() && {
    if (!ok() || !value_) DieOnBadStatusAccess(status_);
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace tierzero

#define TZ_STATUS_CONCAT_INNER(a, b) a##b
#define TZ_STATUS_CONCAT(a, b) TZ_STATUS_CONCAT_INNER(a, b)

// Returns the Status of `expr` from the enclosing function if it is not OK, recording the call
// site. Works in functions returning Status or StatusOr<T>. (Inside tierzero, core/status.h
// also spells it RETURN_IF_ERROR; the exported name carries the prefix so that a trainer's own
// macros of that name do not collide.)
#define TZ_RETURN_IF_ERROR(expr)                                                     \
  do {                                                                               \
    ::tierzero::Status tz_status_ = (expr);                                          \
    if (!tz_status_.ok()) return std::move(tz_status_.AddFrame(__FILE__, __LINE__)); \
  } while (0)

// TZ_ASSIGN_OR_RETURN(auto x, Foo()); or TZ_ASSIGN_OR_RETURN(x, Foo()); declares or assigns the
// value of a StatusOr, or returns its Status from the enclosing function.
#define TZ_ASSIGN_OR_RETURN(lhs, expr) \
  TZ_ASSIGN_OR_RETURN_IMPL(TZ_STATUS_CONCAT(tz_statusor_, __COUNTER__), lhs, expr)
#define TZ_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr)          \
  auto tmp = (expr);                                      \
  if (!tmp.ok()) {                                        \
    ::tierzero::Status tz_s_ = std::move(tmp).status();   \
    return std::move(tz_s_.AddFrame(__FILE__, __LINE__)); \
  }                                                       \
  lhs = std::move(tmp).value()
