// The directories a command makes and locks (run_dir.h): MadeDirs, ScratchDir and RunDirLock.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "run_dir.h"
#include "tierzero/files.h"

namespace tierzero::app {
namespace fs = std::filesystem;

namespace {

bool IsRegular(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

MadeDirs::~MadeDirs() { Undo(); }

// Note [Directories another process took]
// A directory this process made is not its own for good: between its mkdir and its removal
// another process may have started to use it. A train whose run directory an eval's
// --nvme-path had made lost its lock file and its swap directory (O_TMPFILE swap files leave it
// looking empty) when the eval ended, and a second run into it was then not refused; a train
// refused at its lock removed the winner's lock file and checkpoint directory (review 51). So a
// directory another process holds locked is left, whatever it looks like (and for eval's swap
// directory one inside such a directory), and a lock file only goes when no process holds it.
// (RunDirLock releases this process's own first: train destroys it before its MadeDirs.)
void MadeDirs::Undo() {
  auto held = [&](const std::string& dir) {  // (it, or with under_locks_kept_ one above it)
    for (fs::path p = fs::path(dir); !p.empty(); p = p.parent_path()) {
      if (LockedByAnother(p.string())) return true;
      if (!under_locks_kept_ || p == p.parent_path()) break;
    }
    return false;
  };
  // Deepest first; rmdir removes only an empty directory, so nothing else can go.
  for (auto it = dirs_.rbegin(); it != dirs_.rend(); ++it) {
    KeepOnSignalExit(*it);
    if (held(*it)) continue;
    const std::string lock_file = *it + "/" + kLockFileName;
    if (IsRegular(lock_file)) ::unlink(lock_file.c_str());  // (a stale one: no one holds it)
    ::rmdir(it->c_str());
  }
  dirs_.clear();
}

void MadeDirs::KeepOnSignal() {
  for (const std::string& d : dirs_) KeepOnSignalExit(d);
}

void MadeDirs::Keep() {
  for (const std::string& d : dirs_) KeepOnSignalExit(d);
  dirs_.clear();
}

void MadeDirs::Create(const std::string& path, std::error_code& ec) {
  // The levels that do not exist yet, outermost first.
  std::vector<std::string> missing;
  for (fs::path p = fs::absolute(path, ec).lexically_normal(); !p.empty(); p = p.parent_path()) {
    if (ec) break;
    std::error_code e;
    if (fs::exists(fs::symlink_status(p, e))) break;
    missing.push_back(p.string());
    if (p == p.parent_path()) break;
  }
  if (ec) return;
  // One mkdir a level: a directory is this process's only where its mkdir made it (ranks making
  // the same run directory at once each own only what they made).
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    std::string d = *it;
    while (d.size() > 1 && d.back() == '/') d.pop_back();
    if (::mkdir(d.c_str(), 0777) != 0) {
      if (errno == EEXIST) continue;  // another process's, made since
      ec = std::error_code(errno, std::generic_category());
      return;
    }
    dirs_.push_back(d);
    // Note [A set-up ended by a signal leaves nothing]: and if the process ends on a signal
    // before the run starts (removed only if empty by then).
    if (under_locks_kept_) {
      RemoveOnSignalExitUnlessLocked(d, kLockFileName);
    } else {
      RemoveOnSignalExit(d);
    }
  }
  fs::create_directories(path, ec);  // (an error if `path` is not a directory)
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  if (!path_.empty()) {
    fs::remove_all(path_, ec);
    KeepTreeOnSignalExit(path_);
  }
}

Status ScratchAdvice(const Status& s, const std::string& scratch) {
  if (s.ok() || scratch.empty() ||
      s.message().find("opening the NVMe tier under '" + scratch) == std::string_view::npos)
    return s;
  return Status(s.code(),
                std::string(s.message()) +
                    ". That directory is this command's scratch space under $TMPDIR (else /tmp): "
                    "point TMPDIR at a disk with the room, or give a larger --host-budget (less "
                    "then goes to NVMe)");
}

// run_dir.h
std::string TmpDirectory() {
  const char* tmp = std::getenv("TMPDIR");
  return tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
}

Status ScratchDir::Create(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string made = TmpDirectory() + "/" + prefix + "-XXXXXX";
  if (::mkdtemp(made.data()) == nullptr)
    return ErrnoError("creating a scratch directory " + made + " (under " +
                          (tmp != nullptr && *tmp != '\0' ? "$TMPDIR" : "/tmp") +
                          ": point TMPDIR at a writable directory)",
                      errno);
  path_ = made;
  RemoveTreeOnSignalExit(path_);  // a signal's exit does not run the destructor
  return Status::OK();
}

RunDirLock::~RunDirLock() { Release(); }

void RunDirLock::Release() {
  // Unlinked while still locked, then released: no other process can hold the old file.
  if (!keep_) {
    for (const std::string& f : created_) {
      ::unlink(f.c_str());
      KeepOnSignalExit(f);
    }
  }
  created_.clear();
  for (int fd : fds_) ::close(fd);  // releases the flock
  fds_.clear();
  dirs_.clear();
}

void RunDirLock::KeepOnSignal() {
  for (const std::string& f : created_) KeepOnSignalExit(f);
}

void RunDirLock::Keep() {
  keep_ = true;
  for (const std::string& f : created_) KeepOnSignalExit(f);
}

Status RunDirLock::Acquire(const std::string& dir, const std::string& what,
                           const std::string& advice) {
  const std::string path = dir + "/" + kLockFileName;
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
  const bool made = fd >= 0;
  if (fd < 0 && errno == EEXIST) fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0 && errno == ELOOP)
    return InvalidArgumentError("the lock file " + path + " of the " + what + " " + dir +
                                " is a symbolic link, which tierzero never makes: remove it");
  if (fd < 0) return ErrnoError("opening the lock of the " + what + " " + dir, errno);
  if (made) {
    created_.push_back(path);
    RemoveOnSignalExit(path);  // Note [A set-up ended by a signal leaves nothing]
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      ::close(fd);
      // (Made here, but taken by another process before this one locked it: its file now,
      // which this process's end must not remove: Note [Directories another process took].)
      if (made) {
        created_.pop_back();
        KeepOnSignalExit(path);
      }
      return FailedPreconditionError(
          "another tierzero process is writing the " + what + " " + dir +
          " (it holds the directory's lock): " +
          (advice.empty() ? "a run directory has one writer; wait for that run to end, or give "
                            "this one another --run-dir (and --checkpoint)"
                          : advice));
    }
    if (err == ENOLCK || err == ENOSYS || err == EOPNOTSUPP) {
      // A file system without locks: the run goes on unguarded, and says so.
      std::fprintf(stderr,
                   "warning: the file system of %s has no file locks (%s): a second run into "
                   "it at the same time would not be refused\n",
                   dir.c_str(), std::strerror(err));
      fds_.push_back(fd);
      dirs_.push_back(dir);
      return Status::OK();
    }
    ::close(fd);
    return ErrnoError("locking the " + what + " " + dir, err);
  }
  // The lock is the file at the path: one unlinked between the open and the flock (a process
  // ending whose set-up had made it, before it saw the lock) guards nothing, and is taken again.
  struct stat held {
  }, now{};
  if (::fstat(fd, &held) == 0 && !(::stat(path.c_str(), &now) == 0 && now.st_dev == held.st_dev &&
                                   now.st_ino == held.st_ino)) {
    ::close(fd);
    if (made) {
      created_.pop_back();
      KeepOnSignalExit(path);
    }
    if (++attempts_ > 16)
      return FailedPreconditionError("the lock file " + path + " of the " + what + " " + dir +
                                     " keeps being removed while this process takes it: another "
                                     "process is making and removing it; try again");
    return Acquire(dir, what, advice);
  }
  fds_.push_back(fd);
  dirs_.push_back(dir);
  return Status::OK();
}

// Note [A directory moved under the run]
// A run locks its directories once, by path, at its set-up, and writes its checkpoints by path,
// hours later. A checkpoint directory moved aside and replaced by a symbolic link to another
// run's, during a run, had that run's checkpoint replaced by this one's (its states file
// removed); one removed was made again, empty but for the new checkpoint (hunt 50). The lock
// file's descriptor still names the directory locked, wherever it is now: before each save the
// path is compared with it, and a save goes only where the locked directory is.
std::optional<std::string> RunDirLock::Where(const std::string& dir) const {
  for (size_t i = 0; i < dirs_.size(); ++i) {
    if (dirs_[i] != dir) continue;
    struct stat held {
    }, now{};
    if (::fstat(fds_[i], &held) != 0) return "";
    const std::string path = dir + "/" + kLockFileName;
    if (::stat(path.c_str(), &now) == 0 && now.st_dev == held.st_dev && now.st_ino == held.st_ino)
      return dir;
    if (held.st_nlink == 0) return "";  // removed
    char buf[PATH_MAX + 1];
    const std::string link = "/proc/self/fd/" + std::to_string(fds_[i]);
    const ssize_t n = ::readlink(link.c_str(), buf, PATH_MAX);
    if (n <= 0) return "";
    const std::string at(buf, static_cast<size_t>(n));
    const std::string tail = std::string("/") + kLockFileName;
    if (at.size() <= tail.size() || at.compare(at.size() - tail.size(), tail.size(), tail) != 0)
      return "";  // (" (deleted)", or a name not its own)
    return at.substr(0, at.size() - tail.size());
  }
  return std::nullopt;
}

// Note [A directory made again is locked again]
// A run directory or checkpoint directory removed under a run is made again by the run's next
// write into it (Note [Run files removed under the run], Note [A directory moved under the run]),
// and its lock went with it: the lock file this process holds has no name any more. A second run
// started there meanwhile found no lock and wrote beside this one. So the directory made again
// gets a lock file of its own, held in place of the one removed; another process already holding
// it (it took the path first) is said, and this run writes nothing there.
Status RunDirLock::Relock(const std::string& dir, const std::string& what) {
  for (size_t i = 0; i < dirs_.size(); ++i) {
    if (dirs_[i] != dir) continue;
    const std::string path = dir + "/" + kLockFileName;
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0 && errno == EEXIST) fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return ErrnoError("locking the " + what + " " + dir + " made again", errno);
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
      ::close(fd);
      return FailedPreconditionError(
          "the " + what + " " + dir +
          " was removed while the run trained, and another tierzero process has taken its path "
          "since (it holds the lock of the directory there): this run writes nothing there");
    }
    ::close(fds_[i]);
    fds_[i] = fd;
    return Status::OK();
  }
  return Status::OK();  // (not locked here: nothing to renew)
}

bool LockedByAnother(const std::string& dir) {
  const std::string path = dir + "/" + kLockFileName;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return false;
  // A shared lock is refused while another open file description holds the exclusive one (this
  // process's own lock is another description too, so callers skip the directories they hold).
  const bool held = ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);
  return held;
}

}  // namespace tierzero::app
