#include "tierzero/status.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

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
      m += "; over the disk quota of this user";
      break;
    default:
      break;
  }
  return Status(code, std::move(m));
}

void DieOnBadStatusAccess(const Status& status) {
  std::fprintf(stderr, "tierzero: value() called on a StatusOr holding an error: %s\n",
               status.ToString().c_str());
  std::abort();
}

}  // namespace tierzero
