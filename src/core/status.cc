#include "tierzero/status.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <system_error>

namespace tierzero {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kAlreadyExists:
      return "AlreadyExists";
    case StatusCode::kFailedPrecondition:
      return "FailedPrecondition";
    case StatusCode::kOutOfMemory:
      return "OutOfMemory";
    case StatusCode::kIoError:
      return "IoError";
    case StatusCode::kUnavailable:
      return "Unavailable";
    case StatusCode::kRemote:
      return "Remote";
    case StatusCode::kInternal:
      return "Internal";
    case StatusCode::kDataLoss:
      return "DataLoss";
    case StatusCode::kCancelled:
      return "Cancelled";
    case StatusCode::kDeadlineExceeded:
      return "DeadlineExceeded";
    case StatusCode::kUnsupported:
      return "Unsupported";
  }
  return "Unknown";
}

Status::Status(StatusCode code, std::string message) {
  if (code == StatusCode::kOk) {
    std::fprintf(stderr, "tierzero: Status constructed with kOk and message '%s'\n",
                 message.c_str());
    std::abort();
  }
  state_ = std::make_unique<State>(State{code, std::move(message), {}});
}

Status::Status(const Status& other)
    : state_(other.state_ ? std::make_unique<State>(*other.state_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) state_ = other.state_ ? std::make_unique<State>(*other.state_) : nullptr;
  return *this;
}

std::string_view Status::message() const {
  return state_ ? std::string_view(state_->message) : std::string_view();
}

std::string Status::ToString() const {
  if (!state_) return "OK";
  std::string out(StatusCodeName(state_->code));
  out += ": ";
  out += state_->message;
  if (!state_->frames.empty()) {
    out += " [at";
    out += state_->frames;
    out += "]";
  }
  return out;
}

Status Status::WithContext(std::string_view context) && {
  if (state_) {
    std::string m(context);
    m += ": ";
    m += state_->message;
    state_->message = std::move(m);
  }
  return std::move(*this);
}

Status Status::WithContext(std::string_view context) const& {
  return Status(*this).WithContext(context);
}

Status& Status::AddFrame(const char* file, int line) {
  if (state_) {
    // Keep the path from src/ on so frames stay short and stable across checkouts.
    const char* shown = file;
    for (const char* marker : {"/src/", "/models/", "/apps/", "/tests/", "/bench/"}) {
      if (const char* p = std::strstr(file, marker)) {
        shown = p + 1;
        break;
      }
    }
    state_->frames += state_->frames.empty() ? " " : " <- ";
    state_->frames += shown;
    state_->frames += ':';
    state_->frames += std::to_string(line);
  }
  return *this;
}

Status InvalidArgumentError(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
Status NotFoundError(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
Status FailedPreconditionError(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
Status OutOfMemoryError(std::string m) { return {StatusCode::kOutOfMemory, std::move(m)}; }
Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
Status UnavailableError(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
Status InternalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
Status DataLossError(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
Status UnsupportedError(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
Status DeadlineExceededError(std::string m) {
  return {StatusCode::kDeadlineExceeded, std::move(m)};
}

Status ErrnoError(std::string_view what, int err, StatusCode code) {
  std::string m(what);
  m += ": ";
  m += std::strerror(err);
  m += " (errno ";
  m += std::to_string(err);
  m += ")";
  // What a user can change for the errors of a process's limits (the advice of a caller, "free
  // space there", would not help).
  switch (err) {
    case EMFILE:
      m += "; this process's limit on open files is reached: raise it (ulimit -n)";
      break;
    case ENFILE:
      m += "; the system's limit on open files is reached (fs.file-max)";
      break;
    case EFBIG:
      m += "; past this process's file-size limit (raise it: ulimit -f) or the largest file this "
           "file system holds (FAT32: 4 GiB)";
      break;
    case EDQUOT:
      m += "; over the disk quota of this user: free space there, or give a path on another disk";
      break;
    case ENOSPC:
      m += "; the disk is full: free space there, or give a path on another disk";
      break;
    case ENAMETOOLONG:
      m += "; the path is longer than this system allows (4096 bytes, and 255 for one name in "
           "it): give a shorter directory";
      break;
    default:
      break;
  }
  return Status(code, std::move(m));
}

// tierzero/status.h
Status StatusOfCurrentException() {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    return OutOfMemoryError(
        "the host had no memory for an allocation; give the run less to hold at once (a smaller "
        "batch, context or model), or run it where there is more memory");
  } catch (const std::exception& e) {
    // A thread that would not start (std::thread's system_error, oneTBB's "pthread_create has
    // failed") or memory that would not map, EAGAIN or ENOMEM: the process's limits, not a bug
    // (`ulimit -v 100000` ended a run with "a bug in tierzero").
    const std::string what = e.what();
    const auto* sys = dynamic_cast<const std::system_error*>(&e);
    const bool limits =
        (sys != nullptr && (sys->code().value() == EAGAIN || sys->code().value() == ENOMEM)) ||
        what.find(std::strerror(EAGAIN)) != std::string::npos ||
        what.find(std::strerror(ENOMEM)) != std::string::npos;
    if (limits)
      return OutOfMemoryError(
          "the system would not start a thread or map memory (" + what +
          "): this process's limits are too low for the run (its address space, ulimit -v; its "
          "processes and threads, ulimit -u or a container's pids limit), or the machine has none "
          "left");
    return InternalError(what + " (a bug in tierzero: please report it)");
  } catch (...) {
    return InternalError("an unknown exception (a bug in tierzero: please report it)");
  }
}

void DieOnBadStatusAccess(const Status& status) {
  std::fprintf(stderr, "tierzero: value() called on a StatusOr holding an error: %s\n",
               status.ToString().c_str());
  std::abort();
}

}  // namespace tierzero
