// Note [Signals on one thread of ours] in signals.h.
#include "signals.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tierzero/files.h"

namespace tierzero::app {
namespace {

const char* SignalName(int sig) {
  return sig == SIGINT    ? "SIGINT"
         : sig == SIGTERM ? "SIGTERM"
         : sig == SIGXCPU ? "SIGXCPU"
                          : "SIGHUP";
}

std::atomic<int> g_graceful{0};  // live GracefulInterrupts scopes
std::atomic<int> g_signal{0};    // the signal that asked to stop
std::atomic<bool> g_started{false};
std::atomic<bool> g_setup{false};              // a run's set-up: a signal ends the process
std::atomic<bool> g_saves{true};               // a stop saves a checkpoint (SetStopSaves)
std::atomic<bool> g_before_first_step{false};  // SetStopsAtOnce
std::atomic<bool> g_checkpoint{true};          // a checkpoint is there to resume from
std::atomic<int> g_evaluating{0};  // SetInEvaluation: 0 a step, 1 an evaluation, 2 the last
// What a signal then says (GracefulInterrupts' `ending`).
constexpr const char* kSetupEnding =
    "during the run's set-up: stopping now (nothing was trained or saved)";
std::atomic<const char*> g_ending{kSetupEnding};
// When the stop was asked for (steady clock, ns): a signal this long after it ends the process.
std::atomic<int64_t> g_asked_ns{0};
constexpr int64_t kForceAfterNs = int64_t{3} * 1000 * 1000 * 1000;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A message on stderr that never blocks this thread: stderr may be the pipe nobody reads that
// the process is stuck on (`2>&1 | less`), and this thread must stay free to take the next
// signal and to end the process. write(2), not stdio (the main thread may hold stderr's lock);
// only when the descriptor takes it now (a pipe then takes the whole message: PIPE_BUF), else
// the message is dropped.
std::atomic<int> g_stderr{STDERR_FILENO};  // where Say writes (SilenceOtherThreads)

void Say(const char* text, size_t n) {
  const int fd = g_stderr.load();
  pollfd p{fd, POLLOUT, 0};
  if (::poll(&p, 1, 0) == 1 && (p.revents & POLLOUT) != 0) (void)!::write(fd, text, n);
}

// Note [An ending process says nothing false]
// Removing the partial outputs of a process that ends on a signal pulls a temporary file from
// under a write or a rename the main thread may be in the middle of; that thread then fails and
// would print an error ("renaming ... .tmp: No such file or directory") the signal caused, a
// moment before the process ends. So before the removal the process's stderr is pointed at
// /dev/null (dup2: every thread's at once), and this thread says its own line on a copy.
void SilenceOtherThreads() {
  const int copy = ::fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 3);
  const int null_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  if (copy < 0 || null_fd < 0) return;  // (said as before)
  g_stderr.store(copy);
  (void)::dup2(null_fd, STDERR_FILENO);
}

// Ends the process now with status 128 + sig, leaving no partial output behind.
// Whether a launcher started several ranks of this job (mpirun, srun): a SIGTERM in set-up is
// then most often the launcher ending every rank after one failed (hunt 40: it read as if the user
// had stopped the run).
bool SeveralRanks() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS"}) {
    if (const char* x = std::getenv(v); x != nullptr && std::atoi(x) > 1) return true;
  }
  return false;
}

[[noreturn]] void EndNow(int sig, const char* why) {
  SilenceOtherThreads();
  RemovePendingTemporaries();
  char msg[384];
  const char* launcher =
      sig == SIGTERM && SeveralRanks()
          ? " (several ranks: the launcher ends them all this way when one fails or is stopped; "
            "another rank's message says why)"
          : "";
  const int n = std::snprintf(msg, sizeof msg, "\ntierzero: %s received %s%s\n", SignalName(sig),
                              why, launcher);
  if (n > 0) Say(msg, static_cast<size_t>(n));
  _exit(128 + sig);
}

// SIGHUP too: a terminal or ssh session that goes away hangs the run up, and a run that dies
// then loses every step since its last checkpoint; it is a request to stop like the others.
// SIGHUP stays ignored when the process was started ignoring it (`nohup`): blocked, it would be
// queued and taken here all the same, and a run under nohup would stop when the session drops.
// (SIGINT and SIGTERM are taken even so: a script's background job starts with SIGINT ignored,
// and `kill -INT` sent to it on purpose must stop it as Ctrl-C does.)
// SIGXCPU (the soft CPU-time limit, `ulimit -t`, which batch schedulers such as LSF and SGE send
// as the warning before their kill) is a request to stop as well: its default dumps core and
// loses every step since the last checkpoint (hunt 41). The kernel repeats it every second past
// the soft limit, so a repeat never escalates to the stop without saving that a second SIGINT
// does.
sigset_t g_taken;

sigset_t TerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  for (const int sig : {SIGINT, SIGTERM, SIGHUP, SIGXCPU}) {
    struct sigaction old {};
    if (sig == SIGHUP && sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    sigaddset(&set, sig);
  }
  return set;
}

void* WaitForSignals(void*) {
  const sigset_t set = g_taken;
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    if (g_before_first_step.load() && g_signal.load() == 0) {
      // Note [A stop before the first step of several ranks]
      // Under mpirun a stop before the first step has ended (the job ended because a rank
      // died, or a Ctrl-C as the ranks leave their set-up) would wait for a step that may
      // never end (its collectives wait for the dead rank) until mpirun kills the process,
      // leaving the run's config.json and metrics file behind. Nothing is trained yet, so it
      // ends the process as a set-up does, removing what the run made.
      EndNow(sig,
             "before the run's first step ended: stopping now (nothing was trained or saved since "
             "it started)");
    }
    if (g_setup.load() && g_signal.load() == 0) {
      // A run's set-up: nothing is trained or saved yet, and the main thread may be blocked in
      // a read that no flag would interrupt. (This is a thread of ours, not a handler; the main
      // thread's buffered stdout is not flushed.)
      EndNow(sig, g_ending.load());
    }
    // Inside a run, or after one was asked to stop (it is saving or exiting): only a request.
    if (g_graceful.load() > 0 || g_signal.load() != 0) {
      if (g_signal.exchange(sig) == 0) {
        g_asked_ns.store(NowNs());
        char msg[400];
        const int evaluating = g_evaluating.load();
        const char* cut = evaluating == 2 ? "ending the last evaluation at its next batch (it "
                                            "is not made), then "
                          : evaluating == 1 && g_saves.load()
                              ? "ending the evaluation at its next batch (the resume makes it "
                                "first), then "
                          : evaluating == 1 ? "ending the evaluation at its next batch, then "
                                            : "finishing this step, then ";
        const int n = std::snprintf(
            msg, sizeof msg, "\ntierzero: %s received: %s%s\n", SignalName(sig), cut,
            g_saves.load()
                ? "saving a checkpoint (another signal 3 s or more from now stops at once "
                  "without saving; the last complete checkpoint stays valid)"
                : "stopping (--checkpoint none: nothing is saved, so the run cannot be "
                  "resumed; another signal 3 s or more from now stops at once)");
        if (n > 0) Say(msg, static_cast<size_t>(n));
      } else if (sig != SIGXCPU && NowNs() - g_asked_ns.load() >= kForceAfterNs) {
        // Asked again, not in the same burst: the step or the save may be blocked where no
        // flag reaches it (a write into a full pipe, a link throttled to nothing).
        EndNow(sig, g_checkpoint.load()
                        ? "again: stopping now without saving (the last complete checkpoint "
                          "stays valid; --resume from it)"
                        : "again: stopping now without saving (no checkpoint of this run "
                          "exists: its steps are lost)");
      }
      continue;
    }
    // No run to stop gracefully: the signal's default action, on this thread, for the process,
    // after the partial outputs it was writing are removed (an export's temporary file).
    SilenceOtherThreads();
    RemovePendingTemporaries();
    signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    raise(sig);
    _exit(128 + sig);  // not reached: their default action ends the process
  }
  return nullptr;
}

}  // namespace

Status StartSignalThread() {
  if (g_started.exchange(true)) return Status::OK();
  g_taken = TerminationSignals();
  const sigset_t set = g_taken;
  if (int e = pthread_sigmask(SIG_BLOCK, &set, nullptr); e != 0)
    return InternalError(std::string("blocking SIGINT, SIGTERM, SIGHUP and SIGXCPU: ") +
                         std::strerror(e));
  pthread_t thread;
  if (int e = pthread_create(&thread, nullptr, WaitForSignals, nullptr); e != 0)
    return InternalError(std::string("starting the signal thread: ") + std::strerror(e));
  pthread_detach(thread);
  return Status::OK();
}

bool InterruptRequested() { return g_signal.load() != 0; }
void ClearInterrupt() { g_signal.store(0); }

void EndSetUp() { g_setup.store(false); }
void SetInEvaluation(bool in, bool last) { g_evaluating.store(!in ? 0 : last ? 2 : 1); }
void SetStopsAtOnce(bool at_once) { g_before_first_step.store(at_once); }
void SetStopSaves(bool saves, bool checkpoint_exists) {
  g_saves.store(saves);
  g_checkpoint.store(checkpoint_exists);
}

GracefulInterrupts::GracefulInterrupts(bool during_setup, const char* ending) {
  g_ending.store(ending != nullptr ? ending : kSetupEnding);
  if (during_setup) g_setup.store(true);
  g_graceful.fetch_add(1);
}
GracefulInterrupts::~GracefulInterrupts() {
  g_setup.store(false);
  g_before_first_step.store(false);
  g_graceful.fetch_sub(1);
  g_ending.store(kSetupEnding);
}

}  // namespace tierzero::app
