// Note [Writing outputs] in file_io.h.
#include "core/file_io.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace tierzero {
namespace {

std::string DirOf(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string BaseOf(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// A name beside `target` no one else uses: ".NAME.tz-PID-N.tmp", created with O_EXCL.
int CreateTemporary(const std::string& target, mode_t mode, std::string* tmp) {
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0; attempt < 100; ++attempt) {
    const std::string dir = DirOf(target);
    // A long name is left out (the file system's 255 bytes must hold the temporary's too).
    const std::string base = BaseOf(target).size() > 200 ? "" : BaseOf(target);
    *tmp = (dir == "/" ? "" : dir) + "/." + base + ".tz-" + std::to_string(::getpid()) + "-" +
           std::to_string(counter.fetch_add(1)) + ".tmp";
    if (target.find('/') == std::string::npos) *tmp = tmp->substr(2);  // "./" dropped
    // Registered before it exists: a signal exit between the two would miss it otherwise.
    AddPending(*tmp);
    const int fd = ::open(tmp->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd >= 0) return fd;
    const int err = errno;
    DropPending(*tmp);
    errno = err;
    if (err != EEXIST) return fd;
  }
  errno = EEXIST;
  return -1;
}

Status Refuse(const std::string& path, const std::string& why) {
  return InvalidArgumentError("will not write " + path + ": " + why);
}

// Note [A file another tierzero process holds]
// A running run locks its metrics file (flock, exclusive) for as long as it writes it. A rename
// over that path (another command's -o, a report, a plan's --json) left the run appending to an
// unlinked file, every line of it lost, while both said they had succeeded. So a regular file
// that some open file description holds locked is not replaced: the refusal names it. This
// process's own lock counts too (flock locks belong to open file descriptions): a caller that
// replaces a file it locked itself says so (AtomicFile::Create's `replace_own_locked`).
bool HeldLocked(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) return false;
  struct stat st {};
  const bool held = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
                    ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);
  return held;
}

Status RefuseLocked(const std::string& path) {
  return FailedPreconditionError(
      "will not write " + path +
      ": a process holds it locked (a tierzero run writing its metrics there?); it is kept: "
      "name another file, or wait for that process to end");
}

}  // namespace

const char* FileKindName(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG:
      return "a regular file";
    case S_IFDIR:
      return "a directory";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    case S_IFIFO:
      return "a FIFO";
    case S_IFSOCK:
      return "a socket";
    case S_IFLNK:
      return "a symbolic link";
    default:
      return "a special file";
  }
}

int StandardStreamFd(const std::string& given) {
  // In any spelling ("/dev//stdout", "/dev/./stdout", "/dev/fd//1"): another followed the link
  // and replaced the file the shell redirected into (hunt 48).
  std::string path = given;
  if (!path.empty() && path[0] == '/') path = std::filesystem::path(given).lexically_normal();
  if (path == "/dev/stdout") return STDOUT_FILENO;
  if (path == "/dev/stderr") return STDERR_FILENO;
  if (path == "/dev/stdin") return STDIN_FILENO;
  for (const char* prefix : {"/dev/fd/", "/proc/self/fd/", "/proc/thread-self/fd/"}) {
    const std::string p = prefix;
    if (path.size() > p.size() && path.compare(0, p.size(), p) == 0) {
      const std::string n = path.substr(p.size());
      if (n.size() > 6 || n.find_first_not_of("0123456789") != std::string::npos) return -1;
      return std::atoi(n.c_str());
    }
  }
  return -1;
}

StatusOr<AtomicFile> AtomicFile::Create(const std::string& path, bool replace_own_locked) {
  if (path.empty()) return InvalidArgumentError("an output path is empty");
  AtomicFile f;
  f.path_ = path;
  f.replace_own_locked_ = replace_own_locked;
  f.target_ = path;
  if (const int std_fd = StandardStreamFd(path); std_fd >= 0) {
    // The process's own descriptor, duplicated: written where the shell pointed it, at its
    // offset (`--json /dev/stdout > plan.txt` must not replace plan.txt through the link).
    f.fd_ = ::fcntl(std_fd, F_DUPFD_CLOEXEC, 3);
    if (f.fd_ < 0) return ErrnoError("cannot write " + path, errno);
    f.streamed_ = true;
    return f;
  }
  if (path.back() == '/')
    return Refuse(path,
                  "it ends in '/', which names a directory; name the file to write "
                  "(without the trailing slash)");
  struct stat lst {};
  mode_t mode = 0644;
  bool exists = true;
  if (::lstat(path.c_str(), &lst) != 0) {
    if (errno != ENOENT) return ErrnoError("cannot write " + path, errno);
    exists = false;
  }
  struct stat st = lst;
  if (exists && S_ISLNK(lst.st_mode)) {
    if (::stat(path.c_str(), &st) != 0) {
      if (errno == ENOENT)
        return Refuse(path,
                      "it is a symbolic link to a file that does not exist; name the file "
                      "to write itself");
      return ErrnoError("cannot write " + path + " (a symbolic link)", errno);
    }
    if (S_ISREG(st.st_mode)) {
      char real[PATH_MAX];
      if (::realpath(path.c_str(), real) == nullptr)
        return ErrnoError("resolving the symbolic link " + path, errno);
      f.target_ = real;
    }
  }
  if (exists) {
    if (S_ISCHR(st.st_mode) || S_ISFIFO(st.st_mode)) {
      // Streamed (Note [Writing outputs]). O_NONBLOCK: a FIFO without a reader fails (ENXIO)
      // instead of blocking; then blocking writes.
      f.fd_ = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
      if (f.fd_ < 0) {
        if (errno == ENXIO && S_ISFIFO(st.st_mode))
          return Refuse(path, "it is a FIFO with no reader (start the reader first)");
        return ErrnoError("cannot write " + path + " (" + FileKindName(st.st_mode) + ")", errno);
      }
      const int flags = ::fcntl(f.fd_, F_GETFL);
      if (flags >= 0) ::fcntl(f.fd_, F_SETFL, flags & ~O_NONBLOCK);
      f.streamed_ = true;
      return f;
    }
    if (!S_ISREG(st.st_mode)) {
      return Refuse(path, std::string("it is ") + FileKindName(st.st_mode) +
                              "; tierzero writes regular files, and streams into character "
                              "devices and FIFOs");
    }
    mode = st.st_mode & 07777;
    // A file this user may not write (read-only, or another user's in a shared directory) is
    // not replaced through the directory's permission, as `cp` and `>` would not write it
    // (root writes it, as theirs do).
    const int denied = ::access(f.target_.c_str(), W_OK) != 0 ? errno : 0;
    if (denied == EACCES || denied == EROFS || denied == EPERM) {
      char m[8];
      std::snprintf(m, sizeof m, "%04o", static_cast<unsigned>(mode));
      return Refuse(path, std::string("this user may not write it (mode ") + m +
                              (denied == EROFS ? ", on a read-only file system" : "") +
                              "); it is kept: make it writable, or name another file");
    }
    // Checked again before the rename.
    if (!replace_own_locked && HeldLocked(f.target_)) return RefuseLocked(path);
  }
  f.fd_ = CreateTemporary(f.target_, mode, &f.tmp_);
  if (f.fd_ < 0 && (errno == ENOENT || errno == ENOTDIR)) {
    const int err = errno;
    struct stat dst {};
    // The directory is there but makes no new file (/proc, /sys): said as such.
    if (::stat(DirOf(f.target_).c_str(), &dst) == 0 && S_ISDIR(dst.st_mode))
      return Refuse(path, "no new file can be made in " + DirOf(f.target_) +
                              " (a file system such as /proc or /sys), and an output is written "
                              "beside itself first, then renamed: name a file on a disk");
    return ErrnoError("cannot write " + path + ": its directory " + DirOf(f.target_), err,
                      StatusCode::kNotFound);
  }
  if (f.fd_ < 0) return ErrnoError("creating " + f.tmp_, errno);
  // The mode asked for is masked by the umask; a replaced file keeps exactly its own bits.
  if (exists) (void)::fchmod(f.fd_, mode);
  return f;
}

AtomicFile::AtomicFile(AtomicFile&& o) noexcept
    : path_(std::move(o.path_)),
      target_(std::move(o.target_)),
      tmp_(std::move(o.tmp_)),
      fd_(std::exchange(o.fd_, -1)),
      streamed_(o.streamed_),
      replace_own_locked_(o.replace_own_locked_),
      bytes_(o.bytes_) {}

AtomicFile& AtomicFile::operator=(AtomicFile&& o) noexcept {
  if (this != &o) {
    this->~AtomicFile();
    new (this) AtomicFile(std::move(o));
  }
  return *this;
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    if (!streamed_) {  // not committed
      ::unlink(tmp_.c_str());
      DropPending(tmp_);
    }
  }
}

// files.h
int WriteAll(int fd, std::string_view text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    done += static_cast<size_t>(w);
  }
  return 0;
}

Status AtomicFile::Write(const void* data, size_t n) {
  if (fd_ < 0) return FailedPreconditionError("writing " + path_ + " after it was closed");
  // (Named by the path the caller gave: the temporary it goes through is removed.)
  const int err = WriteAll(fd_, std::string_view(static_cast<const char*>(data), n));
  if (err != 0) return ErrnoError("writing " + path_, err);
  bytes_ += n;
  return Status::OK();
}

Status AtomicFile::Commit() {
  if (fd_ < 0) return FailedPreconditionError("committing " + path_ + " twice");
  // Note [An output checked is the output replaced]
  if (!streamed_) {
    if (std::optional<std::string> stamp = TakeCheckedStamp(path_))
      return CommitIfUnchanged(*stamp);
  }
  if (streamed_) {
    const int closed = ::close(fd_);
    fd_ = -1;
    if (closed != 0) return ErrnoError("closing " + path_, errno);
    return Status::OK();
  }
  if (::fsync(fd_) != 0) return ErrnoError("fsync " + tmp_, errno);  // the destructor unlinks
  const int closed = ::close(fd_);
  fd_ = -1;
  if (closed != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    DropPending(tmp_);
    return ErrnoError("close " + tmp_, err);
  }
  // Note [A file another tierzero process holds]: locked since Create?
  if (!replace_own_locked_ && HeldLocked(target_)) {
    ::unlink(tmp_.c_str());
    DropPending(tmp_);
    return RefuseLocked(path_);
  }
  const int renamed = ::rename(tmp_.c_str(), target_.c_str());
  const int err = errno;
  if (renamed != 0) ::unlink(tmp_.c_str());
  DropPending(tmp_);
  if (renamed != 0) return ErrnoError("renaming " + tmp_ + " to " + target_, err);
  // The rename itself durable (a crash now keeps the new file, not a name pointing nowhere).
  (void)SyncDir(DirOf(target_));
  return Status::OK();
}

Status AtomicFile::CommitNew() {
  if (fd_ < 0 || streamed_) return FailedPreconditionError("committing " + path_ + " anew");
  if (::fsync(fd_) != 0) return ErrnoError("fsync " + tmp_, errno);  // the destructor unlinks
  const int closed = ::close(fd_);
  fd_ = -1;
  // A rename that replaces nothing (renameat2 RENAME_NOREPLACE: ext4, XFS, Btrfs, tmpfs), else a
  // hard link (a file system without the flag), else, on one with neither (FAT, some FUSE
  // mounts), a look before an ordinary rename (a race with another writer is possible there
  // only).
  int linked = -1, err = 0;
  if (closed == 0) {
    linked = ::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, target_.c_str(), RENAME_NOREPLACE);
    err = errno;
    if (linked != 0 && (err == EINVAL || err == ENOSYS || err == ENOTSUP)) {
      linked = ::link(tmp_.c_str(), target_.c_str());
      err = errno;
      if (linked != 0 && (err == EPERM || err == ENOTSUP || err == EMLINK || err == ENOSYS)) {
        struct stat st {};
        if (::lstat(target_.c_str(), &st) == 0) {
          err = EEXIST;
        } else {
          linked = ::rename(tmp_.c_str(), target_.c_str());
          err = errno;
        }
      }
    }
  } else {
    err = errno;
  }
  ::unlink(tmp_.c_str());  // (gone already after a rename)
  DropPending(tmp_);
  if (closed != 0) return ErrnoError("close " + tmp_, err);
  if (linked != 0 && err == EEXIST)
    return Status(StatusCode::kAlreadyExists,
                  target_ + " appeared while it was written; it is kept");
  if (linked != 0) return ErrnoError("renaming " + tmp_ + " to " + target_, err);
  (void)SyncDir(DirOf(target_));
  return Status::OK();
}

std::string FileStamp(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return "";
  return std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) + ":" +
         std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) + "." +
         std::to_string(st.st_mtim.tv_nsec);
}

// Note [A replace that checks what it replaces]
// A run records its report's path as it was at set-up and writes it hours later only if it is
// still that file (another run naming the same --report wrote it meanwhile: kept). Checked and
// then renamed, the two runs that end together both passed the check, and the later rename
// replaced the other's report, both saying they had written it. So the replace is an exchange
// (renameat2 RENAME_EXCHANGE): the new file takes the name, the old one the temporary's, and
// only then is the old one compared with the stamp; another file there is exchanged back and
// kept. Nothing there is a RENAME_NOREPLACE (CommitNew). Where the file system cannot exchange,
// the check is made just before an ordinary rename (a race is possible there only).
void (*AtomicFile::before_exchange_for_test)(const std::string& target) = nullptr;

namespace {

// The stamp of what `path` itself is (a link not followed): a regular file's, else "".
std::string OwnStamp(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return "";
  return FileStamp(path);
}

}  // namespace

Status AtomicFile::CommitIfUnchanged(const std::string& stamp) {
  if (fd_ < 0) return FailedPreconditionError("committing " + path_ + " twice");
  if (streamed_) return Commit();
  auto refuse = [&] {
    return FailedPreconditionError(path_ +
                                   " was written by another process meanwhile; it is kept, "
                                   "not replaced");
  };
  auto drop = [&] {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    ::unlink(tmp_.c_str());
    DropPending(tmp_);
  };
  // Nothing there when stamped: only a commit that replaces nothing (whatever is there now,
  // a file, a link, a directory or a FIFO, is kept).
  if (stamp.empty()) {
    Status s = CommitNew();
    if (s.code() == StatusCode::kAlreadyExists) return refuse();
    return s;
  }
  const std::string now = OwnStamp(target_);
  struct stat lst {};
  if (now.empty() && ::lstat(target_.c_str(), &lst) != 0 && errno == ENOENT) {
    // Removed meanwhile: written anew, over nothing.
    Status s = CommitNew();
    if (s.code() == StatusCode::kAlreadyExists) return refuse();
    return s;
  }
  if (now != stamp) {
    drop();
    return refuse();
  }
  if (!replace_own_locked_ && HeldLocked(target_)) {
    drop();
    return RefuseLocked(path_);
  }
  if (::fsync(fd_) != 0) return ErrnoError("fsync " + tmp_, errno);  // the destructor unlinks
  const int closed = ::close(fd_);
  fd_ = -1;
  if (closed != 0) {
    const int err = errno;
    drop();
    return ErrnoError("close " + tmp_, err);
  }
  if (before_exchange_for_test != nullptr) before_exchange_for_test(target_);
  // From the exchange on, the temporary's name may hold another's file: it is never removed on
  // a signal's exit (a leftover temporary is the worst a signal here leaves).
  DropPending(tmp_);
  int swapped = ::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, target_.c_str(), RENAME_EXCHANGE);
  int err = errno;
  if (swapped != 0 && (err == EINVAL || err == ENOSYS || err == ENOTSUP)) {
    // No exchange on this file system: the check above, then an ordinary rename.
    swapped = ::rename(tmp_.c_str(), target_.c_str());
    err = errno;
    if (swapped != 0) ::unlink(tmp_.c_str());
    if (swapped != 0) return ErrnoError("renaming " + tmp_ + " to " + target_, err);
    (void)SyncDir(DirOf(target_));
    return Status::OK();
  }
  if (swapped != 0 && err == ENOENT) {
    // Removed since the check: written anew, over nothing.
    swapped = ::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, target_.c_str(), RENAME_NOREPLACE);
    err = errno;
    if (swapped == 0) {
      (void)SyncDir(DirOf(target_));
      return Status::OK();
    }
    ::unlink(tmp_.c_str());
    if (err == EEXIST) return refuse();
    return ErrnoError("renaming " + tmp_ + " to " + target_, err);
  }
  if (swapped != 0) {
    ::unlink(tmp_.c_str());
    return ErrnoError("exchanging " + tmp_ + " with " + target_, err);
  }
  // The temporary's name now holds what was at the path.
  if (OwnStamp(tmp_) != stamp) {
    const int back =
        ::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, target_.c_str(), RENAME_EXCHANGE);
    if (back != 0)
      return ErrnoError("another process wrote " + path_ +
                            " meanwhile, and exchanging it back failed: it is in " + tmp_ + " now",
                        errno);
    ::unlink(tmp_.c_str());  // ours, exchanged back
    return refuse();
  }
  ::unlink(tmp_.c_str());  // the file replaced
  (void)SyncDir(DirOf(target_));
  return Status::OK();
}

Status WriteFileAtomicallyIfUnchanged(const std::string& path, const std::string& text,
                                      const std::string& stamp) {
  auto f = AtomicFile::Create(path);
  if (!f.ok()) return f.status();
  if (Status s = f->Write(text.data(), text.size()); !s.ok()) return s;
  return f->CommitIfUnchanged(stamp);
}

Status WriteNewFile(const std::string& path, const std::string& text) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0)
    return Status(StatusCode::kAlreadyExists,
                  path + " exists (" + FileKindName(st.st_mode) + "); it is kept");
  auto f = AtomicFile::Create(path);
  if (!f.ok()) return f.status();
  if (f->streamed()) return FailedPreconditionError(path + " is not a new file");
  if (Status s = f->Write(text.data(), text.size()); !s.ok()) return s;
  return f->CommitNew();
}

namespace {

// CheckOutputPath less the checks of a regular file's replacing (OpenOutputStream appends to a
// file this process may already hold locked).
Status CheckOutputKind(const std::string& path, const std::string& what) {
  if (path.empty()) return InvalidArgumentError(what + ": the path is empty");
  if (StandardStreamFd(path) >= 0) return Status::OK();
  if (path.back() == '/')
    return InvalidArgumentError("will not write " + what + " " + path +
                                ": it ends in '/', which names a directory; name the file to "
                                "write (without the trailing slash)");
  struct stat lst {};
  if (::lstat(path.c_str(), &lst) != 0) {
    if (errno == ENOENT) return Status::OK();  // made by the writer
    return ErrnoError("cannot write " + what + " " + path, errno);
  }
  struct stat st = lst;
  if (S_ISLNK(lst.st_mode) && ::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT)
      return InvalidArgumentError("will not write " + what + " " + path +
                                  ": it is a symbolic link to a file that does not exist; name "
                                  "the file to write itself");
    return ErrnoError("cannot write " + what + " " + path + " (a symbolic link)", errno);
  }
  if (S_ISREG(st.st_mode) || S_ISCHR(st.st_mode) || S_ISFIFO(st.st_mode)) return Status::OK();
  return InvalidArgumentError("will not write " + what + " " + path + ": it is " +
                              FileKindName(st.st_mode) +
                              "; tierzero writes regular files, and streams into character "
                              "devices and FIFOs");
}

}  // namespace

Status CheckOutputPath(const std::string& path, const std::string& what) {
  TZ_RETURN_IF_ERROR(CheckOutputKind(path, what));
  // A regular file there: what AtomicFile::Create would refuse to replace, refused before the
  // work (Note [A file another tierzero process holds]; a file this user may not write).
  struct stat st {};
  if (StandardStreamFd(path) >= 0 || ::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
    return Status::OK();
  if (HeldLocked(path)) return RefuseLocked(what + " " + path);
  const int denied = ::access(path.c_str(), W_OK) != 0 ? errno : 0;
  if (denied == EACCES || denied == EROFS || denied == EPERM)
    return InvalidArgumentError("will not write " + what + " " + path +
                                ": this user may not write it" +
                                (denied == EROFS ? " (a read-only file system)" : "") +
                                "; it is kept: make it writable, or name another file");
  return Status::OK();
}

// Note [An output checked is the output replaced]
// A command checks its output before it works (CheckNotReplacedUnasked: nothing there, or
// --overwrite) and writes it minutes later. Two exports to one new path both passed the check
// and both ended 0, the later one's rename replacing the other's file; a user's file put there
// meanwhile was replaced unasked too (hunt 51). So the check records what it saw, and the
// output's commit replaces only that (AtomicFile::CommitIfUnchanged: over nothing, or over the
// very file checked), once; else the file there is kept and the command fails, saying so.
namespace {
std::mutex& CheckedMutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, std::string>& CheckedOutputs() {  // absolute path -> FileStamp then
  static auto* m = new std::map<std::string, std::string>;
  return *m;
}
std::string CheckedKey(const std::string& path) {
  std::error_code ec;
  const std::string p = std::filesystem::absolute(path, ec).lexically_normal().string();
  return ec ? path : p;
}
}  // namespace

std::optional<std::string> TakeCheckedStamp(const std::string& path) {
  std::lock_guard<std::mutex> lock(CheckedMutex());
  const auto it = CheckedOutputs().find(CheckedKey(path));
  if (it == CheckedOutputs().end()) return std::nullopt;
  std::string stamp = std::move(it->second);
  CheckedOutputs().erase(it);
  return stamp;
}

Status CheckNotReplacedUnasked(const std::string& path, const std::string& what,
                               const std::string& command, bool overwrite) {
  struct stat st {};
  if (StandardStreamFd(path) < 0 && !(::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))) {
    std::lock_guard<std::mutex> lock(CheckedMutex());
    CheckedOutputs()[CheckedKey(path)] = FileStamp(path);
  }
  if (overwrite || StandardStreamFd(path) >= 0 || ::stat(path.c_str(), &st) != 0 ||
      !S_ISREG(st.st_mode))
    return Status::OK();
  return FailedPreconditionError(what + " " + path + " exists: " + command +
                                 " replaces no file unasked; name a new file, or give "
                                 "--overwrite to replace it");
}

Status CheckOutputDirectory(const std::string& path, const std::string& what) {
  if (StandardStreamFd(path) >= 0) return Status::OK();
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) return Status::OK();  // there (CheckOutputPath says more)
  const std::string dir = DirOf(path);
  if (::stat(dir.c_str(), &st) != 0)
    return ErrnoError("cannot write " + what + " " + path + ": its directory " + dir, errno,
                      errno == ENOENT ? StatusCode::kNotFound : StatusCode::kIoError);
  if (!S_ISDIR(st.st_mode))
    return InvalidArgumentError("cannot write " + what + " " + path + ": " + dir + " is " +
                                FileKindName(st.st_mode) + ", not a directory");
  // (Said before the work: the write failed at the end, naming its temporary; hunt 48.)
  if (::access(dir.c_str(), W_OK | X_OK) != 0 && (errno == EACCES || errno == EROFS))
    return ErrnoError("cannot write " + what + " " + path + ": this user may not make files in " +
                          dir + " (its permissions, or a read-only file system); name a file " +
                          "in a directory you may write",
                      errno);
  return Status::OK();
}

StatusOr<int> OpenOutputStream(const std::string& path, bool append, const std::string& what,
                               bool own_locked) {
  TZ_RETURN_IF_ERROR(CheckOutputKind(path, what));
  if (const int std_fd = StandardStreamFd(path); std_fd >= 0) {
    const int fd = ::fcntl(std_fd, F_DUPFD_CLOEXEC, 3);
    if (fd < 0) return ErrnoError("cannot write " + what + " " + path, errno);
    return fd;
  }
  struct stat st {};
  const bool special = ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode);
  // (Truncated, or appended to between another run's lines, while CheckOutputPath refused the
  // same path: hunt 48. Note [A file another tierzero process holds].)
  if (!special && !own_locked && HeldLocked(path)) return RefuseLocked(what + " " + path);
  int flags = O_WRONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK;
  if (!special) flags |= O_CREAT | (append ? O_APPEND : O_TRUNC);
  const int fd = ::open(path.c_str(), flags, 0644);
  if (fd < 0) {
    if (errno == ENXIO)
      return FailedPreconditionError(what + " " + path +
                                     " is a FIFO with no reader (start the reader first)");
    if (errno == EACCES || errno == EROFS)
      return ErrnoError(
          "cannot write " + what + " " + path + " (make it writable, or name another file)", errno);
    return ErrnoError("cannot write " + what + " " + path, errno);
  }
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl >= 0) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  return fd;
}

Status WriteFileAtomically(const std::string& path, const std::string& text,
                           bool replace_own_locked) {
  auto f = AtomicFile::Create(path, replace_own_locked);
  if (!f.ok()) return f.status();
  if (Status s = f->Write(text.data(), text.size()); !s.ok()) return s;
  return f->Commit();
}

Status SyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("opening directory " + dir, errno);
  const int r = ::fsync(fd);
  ::close(fd);
  if (r != 0) return ErrnoError("fsync directory " + dir, errno);
  return Status::OK();
}

}  // namespace tierzero
