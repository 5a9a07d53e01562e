// The signal-exit registries (tierzero/files.h: RemoveOnSignalExit and the others, and
// RemovePendingTemporaries): the paths a process ending on a signal removes first, the
// temporaries of the outputs it was writing (AddPending, DropPending: core/file_io.h) among them.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/file_io.h"
#include "tierzero/files.h"

namespace tierzero {
namespace {

// The temporaries being written, for RemovePendingTemporaries (a process ending on a signal).
std::mutex& PendingMutex() {
  static std::mutex m;
  return m;
}
std::set<std::string>& Pending() {
  static auto* s = new std::set<std::string>;  // never destroyed: read until _exit
  return *s;
}
// Of some pending paths, the file they named when registered (RemoveOnSignalExitIfSame): what
// is there at exit is removed only if it is still that file.
std::map<std::string, std::pair<dev_t, ino_t>>& PendingIds() {
  static auto* m = new std::map<std::string, std::pair<dev_t, ino_t>>;  // read until _exit
  return *m;
}
// Of some pending directories, the lock file whose holder keeps them (RemoveOnSignalExitUnless
// Locked).
std::map<std::string, std::string>& PendingLocks() {
  static auto* m = new std::map<std::string, std::string>;  // read until _exit
  return *m;
}
// Whether `dir`, or a directory above it, holds `lock_name` locked by a process (the exit's own
// are released or unlinked by then: a lock file registered is removed before the directories).
bool UnderALock(const std::string& dir, const std::string& lock_name) {
  for (std::filesystem::path p(dir); !p.empty(); p = p.parent_path()) {
    const int fd = ::open((p / lock_name).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd >= 0) {
      const bool held = ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
      ::close(fd);
      if (held) return true;
    }
    if (p == p.parent_path()) break;
  }
  return false;
}
// A registered path as the registries hold it: absolute and in one spelling ("./x", "x" and
// "x/" are one path), so a chdir between registering and removing removes what was registered,
// not a user's file of that name where the process now is (hunt 48), and a Keep in another
// spelling cancels it.
std::string Registered(const std::string& path) {
  if (path.empty()) return path;
  std::error_code ec;
  std::string p = std::filesystem::absolute(path, ec).lexically_normal().string();
  if (ec) return path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

}  // namespace

// core/file_io.h
void AddPending(const std::string& tmp) {
  const std::string p = Registered(tmp);
  std::lock_guard<std::mutex> lock(PendingMutex());
  Pending().insert(p);
}
void DropPending(const std::string& tmp) {
  const std::string p = Registered(tmp);
  std::lock_guard<std::mutex> lock(PendingMutex());
  Pending().erase(p);
  PendingIds().erase(p);
}

void RemoveOnSignalExit(const std::string& path) { AddPending(path); }
void RemoveOnSignalExitIfSame(const std::string& path, int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return;  // nothing known of it: nothing removed
  const std::string p = Registered(path);
  std::lock_guard<std::mutex> lock(PendingMutex());
  Pending().insert(p);
  PendingIds()[p] = {st.st_dev, st.st_ino};
}
void KeepOnSignalExit(const std::string& path) {
  DropPending(path);
  std::lock_guard<std::mutex> lock(PendingMutex());
  PendingLocks().erase(Registered(path));
}
void RemoveOnSignalExitUnlessLocked(const std::string& dir, const std::string& lock_name) {
  AddPending(dir);
  std::lock_guard<std::mutex> lock(PendingMutex());
  PendingLocks()[Registered(dir)] = lock_name;
}

namespace {
std::set<std::string>& PendingTrees() {
  static auto* s = new std::set<std::string>;  // never destroyed: read until _exit
  return *s;
}
}  // namespace

void RemoveTreeOnSignalExit(const std::string& dir) {
  const std::string p = Registered(dir);
  std::lock_guard<std::mutex> lock(PendingMutex());
  PendingTrees().insert(p);
}
void KeepTreeOnSignalExit(const std::string& dir) {
  const std::string p = Registered(dir);
  std::lock_guard<std::mutex> lock(PendingMutex());
  PendingTrees().erase(p);
}

// Note [Nothing made after the last clean-up]
// The process ends next, and its other threads run on meanwhile: an export's main thread made
// its directory, registered and created a temporary, or committed a shard after the pass, and
// they stayed. So the lock is taken and never given back: whatever registers a path (before it
// makes it: CreateTemporary, RemoveOnSignalExit before a directory is made) waits until the
// process is gone, and a temporary the pass unlinked can no longer be renamed into place.
void RemovePendingTemporaries() {
  PendingMutex().lock();  // never unlocked: the process ends (above)
  // A directory is removed only when what went before left it empty (rmdir).
  // The trees first: a directory registered to go when empty may hold one.
  for (const std::string& dir : PendingTrees()) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  PendingTrees().clear();
  // The files first, then the directories deepest first: a directory's files and directories
  // go before it (the paths are registered absolute and in one spelling: Registered).
  std::vector<std::pair<size_t, std::string>> dirs;
  for (const std::string& p : Pending()) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      const std::filesystem::path dir(p);
      dirs.emplace_back(static_cast<size_t>(std::distance(dir.begin(), dir.end())), p);
    } else {
      const auto id = PendingIds().find(p);
      // A file registered as the one it was: another one at that name now is not ours.
      if (id != PendingIds().end() &&
          (id->second.first != st.st_dev || id->second.second != st.st_ino))
        continue;
      ::unlink(p.c_str());
    }
  }
  std::sort(dirs.begin(), dirs.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& d : dirs) {
    // (Note [Directories another process took], apps/tierzero/dir_lock.cc.)
    const auto lock = PendingLocks().find(d.second);
    if (lock != PendingLocks().end() && UnderALock(d.second, lock->second)) continue;
    ::rmdir(d.second.c_str());
  }
  Pending().clear();
}

}  // namespace tierzero
