// Files the engine writes and reads whole: atomic writes (a temporary name, fsync, rename), the
// directory sync that makes a rename durable, and exact reads at an offset. Used by checkpoints,
// safetensors, the report, and the CLI's outputs.
//
// Thread-safety: an AtomicFile or ReadFd is used by one thread; the functions are reentrant.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>

#include "tierzero/status.h"

namespace tierzero {

// A file written under `path`.tmp, fsynced and renamed to `path`.
class AtomicFile {
 public:
  static StatusOr<AtomicFile> Create(const std::string& path) {
    AtomicFile f;
    f.path_ = path;
    f.tmp_ = path + ".tmp";
    f.fd_ = ::open(f.tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f.fd_ < 0) return ErrnoError("creating " + f.tmp_, errno);
    return f;
  }
  AtomicFile() = default;
  AtomicFile(AtomicFile&& o) noexcept : path_(o.path_), tmp_(o.tmp_), fd_(o.fd_), bytes_(o.bytes_) {
    o.fd_ = -1;
  }
  ~AtomicFile() {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(tmp_.c_str());  // not committed
    }
  }
  Status Write(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        return ErrnoError("writing " + tmp_ + (errno == ENOSPC ? " (disk full)" : ""), errno);
      }
      p += w;
      n -= static_cast<size_t>(w);
      bytes_ += static_cast<uint64_t>(w);
    }
    return Status::OK();
  }
  // On any failure the temporary file is removed and `path` is as it was.
  Status Commit() {
    if (::fsync(fd_) != 0) return ErrnoError("fsync " + tmp_, errno);  // the destructor unlinks
    const int closed = ::close(fd_);
    fd_ = -1;
    if (closed != 0) {
      const int err = errno;
      ::unlink(tmp_.c_str());
      return ErrnoError("close " + tmp_, err);
    }
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      const int err = errno;
      ::unlink(tmp_.c_str());
      return ErrnoError("renaming " + tmp_ + " to " + path_, err);
    }
    return Status::OK();
  }
  uint64_t bytes() const { return bytes_; }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  uint64_t bytes_ = 0;
};

// Writes `text` to `path` whole or not at all, durable once this returns.
inline Status WriteFileAtomically(const std::string& path, const std::string& text) {
  auto f = AtomicFile::Create(path);
  if (!f.ok()) return f.status();
  if (Status s = f->Write(text.data(), text.size()); !s.ok()) return s;
  return f->Commit();
}

inline Status SyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("opening directory " + dir, errno);
  const int r = ::fsync(fd);
  ::close(fd);
  if (r != 0) return ErrnoError("fsync directory " + dir, errno);
  return Status::OK();
}

inline StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError("cannot open " + path);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return s;
}

inline Status ReadAt(int fd, const std::string& path, uint64_t offset, void* data, size_t n) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("reading " + path, errno);
    }
    if (r == 0) return DataLossError(path + " is shorter than its manifest says (truncated?)");
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return Status::OK();
}

class ReadFd {
 public:
  explicit ReadFd(const std::string& path) : fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {}
  ~ReadFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace tierzero
