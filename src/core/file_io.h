// Files the engine writes and reads whole: outputs written so that nothing tierzero did not
// create is ever destroyed (Note [Writing outputs]), bounded reads of files from outside, the
// directory sync that makes a rename durable, and exact reads at an offset. Used by checkpoints,
// safetensors, the report, and the CLI's inputs and outputs.
//
// Thread-safety: an AtomicFile or ReadFd is used by one thread; the functions are reentrant.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <optional>
#include <string>

#include "tierzero/files.h"
#include "tierzero/status.h"

namespace tierzero {

// Note [Writing outputs]
// What an output path names decides how it is written (docs/outputs.md):
// - nothing, or a regular file: a new temporary file beside it (a name no one else uses, created
//   with O_EXCL, so no user file is ever truncated), fsync, rename over the path, fsync of the
//   directory: the file is whole or as it was. A replaced file keeps its permission bits.
// - a symbolic link to a regular file: written through the link, atomically replacing the file
//   it resolves to; the link stays a link. A dangling link is refused (name the target itself).
//   A link to a device or FIFO streams into it, as below.
// - a character device or a FIFO (/dev/null, /dev/stdout, a pipe a reader waits on): streamed
//   into it as it is, never replaced. A FIFO needs its reader already waiting (refused otherwise
//   rather than blocking); what was streamed before a failure cannot be taken back.
// - /dev/stdout, /dev/stderr, /dev/fd/N, /proc/self/fd/N: the process's own descriptor N,
//   duplicated and streamed into, wherever the shell pointed it (a file `> plan.txt` is written
//   at the shell's offset, not replaced through the link).
// - a directory, a block device or a socket: refused, naming what the path is.
// A rename over a device node, a FIFO or a symlink used to replace it with a regular file (as
// root, `export -o /dev/null` turned the system's /dev/null into one).
class AtomicFile {
 public:
  // Opens the output for `path` as above. REQUIRES: the path's directory exists.
  // `replace_own_locked`: the file may be one this process holds locked (a run rewriting its own
  // metrics file); otherwise a regular file some process holds locked is refused
  // (FailedPrecondition: Note [A file another tierzero process holds], file_io.cc).
  static StatusOr<AtomicFile> Create(const std::string& path, bool replace_own_locked = false);

  AtomicFile() = default;
  AtomicFile(AtomicFile&& o) noexcept;
  AtomicFile& operator=(AtomicFile&& o) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  // Uncommitted: the temporary file is removed and the path is as it was (a stream is closed).
  ~AtomicFile();

  Status Write(const void* data, size_t n);
  // On any failure the temporary file is removed and the path is as it was.
  Status Commit();
  // Commit to a path where nothing is (link, not rename: AlreadyExists when something appeared
  // there meanwhile, which is kept). For a new file only (not streamed).
  Status CommitNew();
  // Commit only over what FileStamp(path) read as `stamp` earlier (or over nothing, if nothing
  // is there now): FailedPrecondition when another file is there, which is kept (Note [A replace
  // that checks what it replaces], file_io.cc). A stream is written as Commit does.
  Status CommitIfUnchanged(const std::string& stamp);
  // Tests only: called in CommitIfUnchanged after its check, before the exchange (another
  // process writing the file in between).
  static void (*before_exchange_for_test)(const std::string& target);
  uint64_t bytes() const { return bytes_; }
  // Written straight into a device or FIFO (not atomic).
  bool streamed() const { return streamed_; }

 private:
  std::string path_;    // what the caller named
  std::string target_;  // what is replaced (the link's target for a symlink)
  std::string tmp_;     // empty when streamed
  int fd_ = -1;
  bool streamed_ = false;
  bool replace_own_locked_ = false;
  uint64_t bytes_ = 0;
};

// RemovePendingTemporaries: tierzero/files.h.
// A path a process ending on a signal removes (a temporary being written; pending_files.cc), and
// no longer: the registries behind RemovePendingTemporaries. Thread-safe.
void AddPending(const std::string& path);
void DropPending(const std::string& path);
// Note [An output checked is the output replaced] (file_io.cc): what CheckNotReplacedUnasked
// saw at `path` (its FileStamp, "" for nothing), once; nullopt where it was not checked.
std::optional<std::string> TakeCheckedStamp(const std::string& path);

// WriteFileAtomically, ReadFileBounded and the bounds: tierzero/files.h.

Status SyncDir(const std::string& dir);

// StandardStreamFd: tierzero/files.h.

// ReadFileBounded of a regular file only (a file tierzero wrote: a manifest): a FIFO, a device
// or a directory is InvalidArgument at once, never waited on.
StatusOr<std::string> ReadRegularFileBounded(const std::string& path, uint64_t max_bytes,
                                             const std::string& what);

// ReadFileBounded at the report bound (the files tierzero writes and reads back).
StatusOr<std::string> ReadWholeFile(const std::string& path);

// Opens `path` for reading, a regular file only: NotFound when missing, InvalidArgument naming
// what it is otherwise (a FIFO is refused without waiting for a writer). `what` names it.
StatusOr<int> OpenRegularForRead(const std::string& path, const std::string& what);

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

// A file opened for reading (regular files only: OpenRegularForRead); get() < 0 when it could
// not be, with status() saying why.
class ReadFd {
 public:
  explicit ReadFd(const std::string& path, const std::string& what = "file");
  ~ReadFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  ReadFd(const ReadFd&) = delete;
  ReadFd& operator=(const ReadFd&) = delete;
  int get() const { return fd_; }
  const Status& status() const { return status_; }

 private:
  int fd_ = -1;
  Status status_;
};

}  // namespace tierzero
