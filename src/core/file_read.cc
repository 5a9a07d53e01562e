// Bounded reads of files from outside (tierzero/files.h: ReadFileBounded and its bounds) and
// the read-only descriptors of core/file_io.h (OpenRegularForRead, ReadFd).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "core/file_io.h"
#include "tierzero/files.h"

namespace tierzero {

namespace {

StatusOr<std::string> ReadBounded(const std::string& path, uint64_t max_bytes,
                                  const std::string& what, bool regular_only) {
  if (path.empty()) return InvalidArgumentError("the " + what + " path is empty");
  // A FIFO's open waits for its writer, as `cat` does (a shell's <(...) or a writer that comes
  // later); the CLI's signal thread ends a run's set-up blocked there (apps/tierzero/signals.h).
  // Where only a regular file will do, O_NONBLOCK refuses a FIFO without waiting.
  const int fd =
      ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | (regular_only ? O_NONBLOCK : 0));
  if (fd < 0) {
    const int err = errno;
    // A socket cannot be opened (ENXIO): said as what it is.
    struct stat sst {};
    if (err == ENXIO && ::stat(path.c_str(), &sst) == 0 && S_ISSOCK(sst.st_mode))
      return InvalidArgumentError("the " + what + " '" + path + "' is a socket, not a file");
    return ErrnoError("cannot open " + what + " '" + path + "'", err,
                      err == ENOENT ? StatusCode::kNotFound : StatusCode::kIoError);
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoError("cannot stat " + what + " '" + path + "'", errno);
  if (regular_only && !S_ISREG(st.st_mode)) {
    return InvalidArgumentError("the " + what + " '" + path + "' is " + FileKindName(st.st_mode) +
                                ", not a regular file");
  }
  if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode) && !S_ISCHR(st.st_mode)) {
    return InvalidArgumentError("the " + what + " '" + path + "' is " + FileKindName(st.st_mode) +
                                ", not a file");
  }
  auto too_large = [&](const std::string& size) {
    return InvalidArgumentError("the " + what + " '" + path + "' " + size + "; a " + what +
                                " is at most " + std::to_string(max_bytes) + " bytes");
  };
  if (S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) > max_bytes)
    return too_large("is " + std::to_string(st.st_size) + " bytes");
  const std::string more = "holds more than " + std::to_string(max_bytes) + " bytes";
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  std::string out;
  if (S_ISREG(st.st_mode)) out.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  for (;;) {
    const ssize_t r = ::read(fd, buf, sizeof buf);
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("reading " + what + " '" + path + "'", errno);
    }
    if (r == 0) break;
    if (out.size() + static_cast<uint64_t>(r) > max_bytes) return too_large(more);
    out.append(buf, static_cast<size_t>(r));
  }
  return out;
}

}  // namespace

StatusOr<std::string> ReadFileBounded(const std::string& path, uint64_t max_bytes,
                                      const std::string& what) {
  return ReadBounded(path, max_bytes, what, /*regular_only=*/false);
}

StatusOr<std::string> ReadRegularFileBounded(const std::string& path, uint64_t max_bytes,
                                             const std::string& what) {
  return ReadBounded(path, max_bytes, what, /*regular_only=*/true);
}

StatusOr<std::string> ReadWholeFile(const std::string& path) {
  return ReadFileBounded(path, kMaxReportBytes, "file");
}

StatusOr<int> OpenRegularForRead(const std::string& path, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    return ErrnoError("cannot open " + what + " '" + path + "'", err,
                      err == ENOENT ? StatusCode::kNotFound : StatusCode::kIoError);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(fd);
    if (st.st_mode == 0) return ErrnoError("cannot stat " + what + " '" + path + "'", err);
    return InvalidArgumentError("the " + what + " '" + path + "' is " + FileKindName(st.st_mode) +
                                ", not a regular file");
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

ReadFd::ReadFd(const std::string& path, const std::string& what) {
  auto fd = OpenRegularForRead(path, what);
  if (fd.ok()) {
    fd_ = *fd;
  } else {
    status_ = fd.status();
  }
}

}  // namespace tierzero
