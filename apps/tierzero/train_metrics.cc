// The run's metrics file, written line by line for the whole run: its lock against another run
// writing it, and each line whole or not at all (TrainRun, train_run.h).
#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <system_error>

#include "signals.h"
#include "tierzero/files.h"
#include "train_run.h"

namespace tierzero::app {

using json = nlohmann::json;

// A metrics file is appended to line by line for the whole run: two runs naming the same file
// (outside their run directories, which are locked) interleaved their lines and tore some. It is
// locked (flock, exclusive, held to the end): `fd` -1, the file as it exists before the run's
// outputs are replaced (a second run is refused before it removes anything), nothing created;
// then the descriptor the run writes (the file may have been replaced or made since), the first
// lock let go. Regular files only (a FIFO or a device streams). A file system without locks: the
// run goes on unlocked.
namespace {

// flock(LOCK_EX | LOCK_NB), tried a few times over 0.1 s: another command checking whether the
// file is locked holds a shared lock for an instant (Note [A file another tierzero process
// holds], src/core/file_io.cc), which must not pass for a run writing it. errno says why not.
bool FlockBriefly(int fd) {
  for (int attempt = 0;; ++attempt) {
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return true;
    if (errno != EWOULDBLOCK || attempt == 4) return false;
    ::usleep(20000);
  }
}

}  // namespace

Status TrainRun::LockMetrics(int fd) {
  auto refuse = [&] {
    return FailedPreconditionError("another tierzero process is writing the metrics file " +
                                   out_.metrics +
                                   " (it holds its lock): give this run its own --metrics");
  };
  struct stat st {};
  if (fd < 0) {
    if (out_.metrics.rfind("/dev/", 0) == 0 || out_.metrics.rfind("/proc/", 0) == 0 ||
        ::stat(out_.metrics.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
      return Status::OK();
    const int early = ::open(out_.metrics.c_str(), O_WRONLY | O_CLOEXEC | O_NOCTTY);
    if (early < 0) return Status::OK();  // OpenOutputStream says why, if it matters
    if (!FlockBriefly(early)) {
      const int err = errno;
      ::close(early);
      return err == EWOULDBLOCK ? refuse() : Status::OK();
    }
    metrics_lock_fd_ = early;
    return Status::OK();
  }
  if (metrics_lock_fd_ >= 0) {
    ::close(metrics_lock_fd_);  // (one open of the file locking against another: let go first)
    metrics_lock_fd_ = -1;
  }
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return Status::OK();
  if (!FlockBriefly(fd) && errno == EWOULDBLOCK) return refuse();
  return Status::OK();
}

// Note [Run files removed under the run]
// The metrics file is written through the descriptor the set-up opened. Removed during a run
// (with its run directory, `rm -rf RUN`), every line went on into a file no name reached, and
// the run ended saying "metrics: RUN/metrics.jsonl", no such file there; its config.json was
// gone too, which a resume reads (hunt 50). So before each save and at the end the names are
// compared with what the run wrote:
// - the metrics file removed: written again at its name from the descriptor (every line so
//   far), and the lines go on into that; its name taken by another file meanwhile, beside it as
//   NAME.recovered instead; said;
// - the metrics file moved (still linked): its lines go on there, and the run says where;
// - config.json removed: written again, said.
void TrainRun::KeepRunFilesNamed() {
  if (!lead_) return;
  // Note [A directory made again is locked again] (dir_lock.cc): the run directory removed is
  // made again and locked before anything is written into it. Another run that has taken its
  // path since keeps it: nothing of this run is written there (its metrics were, before the
  // lock was tried: review 51), said once.
  bool run_dir_ours = true;
  std::error_code ec;
  if (lock_ != nullptr && lock_->Where(out_.run_dir) == std::optional<std::string>("")) {
    std::filesystem::create_directories(out_.run_dir, ec);
    if (Status s = lock_->Relock(out_.run_dir, "run directory"); !s.ok()) {
      run_dir_ours = false;
      if (!relock_said_)
        std::fprintf(stderr, "warning: %s; its metrics and config.json are not written again\n",
                     std::string(s.message()).c_str());
      relock_said_ = true;
    }
  }
  auto inside_run_dir = [&](const std::string& path) {
    std::error_code pec;
    const std::filesystem::path dir =
        std::filesystem::absolute(out_.run_dir, pec).lexically_normal();
    const std::string p = std::filesystem::absolute(path, pec).lexically_normal().string();
    return p.rfind(dir.string() + "/", 0) == 0;
  };
  struct stat held {
  }, now{};
  if ((run_dir_ours || !inside_run_dir(out_.metrics)) && metrics_fd_ >= 0 &&
      ::fstat(metrics_fd_, &held) == 0 && S_ISREG(held.st_mode) &&
      !(::stat(out_.metrics.c_str(), &now) == 0 && now.st_dev == held.st_dev &&
        now.st_ino == held.st_ino)) {
    const std::string self = "/proc/self/fd/" + std::to_string(metrics_fd_);
    if (held.st_nlink > 0) {
      char at[PATH_MAX + 1];
      const ssize_t n = ::readlink(self.c_str(), at, PATH_MAX);
      if (!metrics_moved_said_ && n > 0)
        progress_->Line("note: the metrics file " + out_.metrics + " was moved to " +
                        std::string(at, static_cast<size_t>(n)) +
                        " while the run trained: its lines go on there");
      metrics_moved_said_ = true;
    } else {
      std::error_code ec;
      const std::filesystem::path parent = std::filesystem::path(out_.metrics).parent_path();
      if (!parent.empty()) std::filesystem::create_directories(parent, ec);
      const bool taken = ::lstat(out_.metrics.c_str(), &now) == 0;
      const std::string to = taken ? out_.metrics + ".recovered" : out_.metrics;
      const int from = ::open(self.c_str(), O_RDONLY | O_CLOEXEC);
      const int fd = ::open(to.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      bool copied = from >= 0 && fd >= 0;
      char buf[1 << 16];
      for (off_t off = 0; copied;) {
        const ssize_t r = ::pread(from, buf, sizeof buf, off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
          copied = r == 0;
          break;
        }
        copied = WriteAll(fd, std::string_view(buf, static_cast<size_t>(r))) == 0;
        off += r;
      }
      if (copied) copied = ::fsync(fd) == 0;
      if (from >= 0) ::close(from);
      if (copied) {
        (void)::flock(fd, LOCK_EX | LOCK_NB);
        ::close(metrics_fd_);
        metrics_fd_ = fd;
        progress_->Line("note: the metrics file " + out_.metrics +
                        " was removed while the run trained: its lines are written again at " + to +
                        (taken ? " (" + out_.metrics + " is another file now)" : "") +
                        ", and go on there");
      } else {
        if (fd >= 0) {
          ::close(fd);
          ::unlink(to.c_str());
        }
        if (!metrics_moved_said_)
          std::fprintf(stderr,
                       "warning: the metrics file %s was removed while the run trained, and could "
                       "not be written again at %s: its lines are lost from here on too\n",
                       out_.metrics.c_str(), to.c_str());
        metrics_moved_said_ = true;
      }
    }
  }
  if (run_dir_ours && !outputs_.config_path.empty() && !config_text_.empty() &&
      ::lstat(outputs_.config_path.c_str(), &now) != 0 && errno == ENOENT) {
    std::filesystem::create_directories(std::filesystem::path(outputs_.config_path).parent_path(),
                                        ec);
    if (WriteFileAtomically(outputs_.config_path, config_text_).ok())
      progress_->Line("note: the run's " + outputs_.config_path +
                      " was removed while it trained: written again (a resume reads it)");
  }
}

Status TrainRun::Defer(Status s) {
  if (!s.ok() && pending_.ok()) {
    pending_ = std::move(s);
    pending_when_ = resume_when_;
  }
  return Status::OK();
}

// Note [Metrics lines a stop left unwritten]
// A metrics line that cannot be written (a full disk) stops the run after the step it records,
// and the stop saves that step: a resume continues after it, so its line would be missing for
// good (and a torn part of it is trimmed). So every line computed but not written from the
// failure on is kept, the save records them (the user state's "metrics_unwritten"), and a
// resume in place writes them after trimming the file (TrimMetrics): the resumed file then
// holds every step once, as an uninterrupted run's does.
Status TrainRun::WriteMetrics(const json& line) {
  if (metrics_fd_ < 0) return Status::OK();  // ranks other than 0 write their metrics nowhere
  if (!pending_.ok()) {
    // (One failed already: said at the next agreement.)
    unwritten_metrics_.push_back(line.dump());
    return Status::OK();
  }
  const std::string text = line.dump() + "\n";
  // Note [A metrics reader that stopped reading]
  // A FIFO or pipe whose reader holds it open and reads nothing (a paused `less`) blocked the
  // write, and with it the stop a signal asks for, until the reader went: the first Ctrl-C was
  // held for as long, a second one ended the run without saving. So a stream is waited on with
  // poll, a quarter second at a time, reading the stop flag between: asked to stop, the line
  // counts as unwritten (the save records it: Note [Metrics lines a stop left unwritten]) and
  // the run stops as after any failed metrics line. A regular file is never waited on.
  struct stat mst {};
  if (::fstat(metrics_fd_, &mst) == 0 && !S_ISREG(mst.st_mode)) {
    pollfd p{metrics_fd_, POLLOUT, 0};
    for (;;) {
      const int r = ::poll(&p, 1, 250);
      if (r > 0 || (r < 0 && errno != EINTR)) break;  // writable, or the write says why not
      if (InterruptRequested()) {
        resume_when_ = "the metrics file " + out_.metrics + " is read";
        unwritten_metrics_.push_back(line.dump());
        return Defer(FailedPreconditionError(
            "the metrics file " + out_.metrics +
            " is not being read (its reader holds it open and has stopped reading) and a stop "
            "was asked for"));
      }
    }
  }
  // Where the line begins: a write that fails part-way (a full disk) is cut back to it, so the
  // file stays whole lines (a torn last line stayed until a resume trimmed it: hunt 49).
  const off_t before = S_ISREG(mst.st_mode) ? ::lseek(metrics_fd_, 0, SEEK_END) : -1;
  if (const int err = WriteAll(metrics_fd_, text); err != 0) {
    if (before >= 0) (void)::ftruncate(metrics_fd_, before);
    // Note [A checkpoint after a data error]: a failed write leaves the run between steps.
    resume_when_ = "the metrics file " + out_.metrics + " can be written";
    unwritten_metrics_.push_back(line.dump());
    return Defer(ErrnoError("writing the metrics file " + out_.metrics, err));
  }
  return Status::OK();
}

}  // namespace tierzero::app
