// Termination signals (SIGINT, SIGTERM, SIGHUP) for the CLI, taken on one thread of ours.
//
// Note [Signals on one thread of ours]
// No asynchronous signal handler runs in this process. main() blocks SIGINT, SIGTERM and SIGHUP
// before any other thread exists, so every thread inherits the blocked mask, and one thread of ours
// takes them with sigwait(). A handler would run on whichever thread the kernel picks, possibly one
// inside a JIT-compiled oneDNN kernel that points its stack pointer into heap memory (oneDNN issue
// 4845, fixed upstream after the 2.6 that Debian 12 ships), whose signal frame then overwrites the
// heap: 2-25% of Ctrl-Cs during training ended in SIGSEGV, SIGBUS, a corrupt free or a hang.
// While a GracefulInterrupts is alive (tierzero train), a signal only asks the run to stop: the
// step finishes, a checkpoint is saved, and the process exits 0: once a stop has been asked for,
// later signals of the same burst (under 3 s) are ignored until the process exits (a burst of
// Ctrl-Cs whose last one lands after the scope ended, while the process is exiting, used to end
// it with status 130); one 3 s or more after the first ends the process at once (status 128 + the
// signal), for a step or save blocked where no flag reaches it. Otherwise a signal ends the
// process as its default action would (status 128 + the signal). Whenever the process ends on a
// signal, the temporary files of the outputs it was writing are removed first
// (RemovePendingTemporaries, tierzero/files.h).
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include "tierzero/status.h"

namespace tierzero::app {

// Blocks SIGINT, SIGTERM and SIGHUP in the calling thread, and so in every thread created after it,
// and starts the thread that takes them. REQUIRES: called first in main, before any thread exists.
Status StartSignalThread();

// True once SIGINT, SIGTERM or SIGHUP has arrived inside a GracefulInterrupts scope (until Clear).
bool InterruptRequested();
void ClearInterrupt();
// The run's set-up is over: from now on signals only ask it to stop (GracefulInterrupts).
void EndSetUp();
// What a stop does, for what a signal says: `saves`, whether the run saves a checkpoint when it
// stops (not with --checkpoint none); `checkpoint_exists`, whether one is there to resume from
// (resumed, or saved since). Defaults: saves, exists.
void SetStopSaves(bool saves, bool checkpoint_exists);
// What a stop asked now cuts, for what a signal says: an evaluation (`in`) is ended at its next
// batch, not after it and a step; the `last` one is then not made, any other is left to the
// resume (Note [An evaluation a signal cuts short], train_loop.cc). Default: a step.
void SetInEvaluation(bool in, bool last);
// While set (a run of several ranks, until its first step ends), a signal ends the process at
// once as during the set-up (Note [A stop before the first step of several ranks], signals.cc).
void SetStopsAtOnce(bool at_once);

// While one is alive, SIGINT, SIGTERM and SIGHUP set InterruptRequested() instead of ending the
// process. `during_setup`: until EndSetUp() is called, a signal ends the process at once instead,
// with a message and status 128 + the signal: a run's set-up can block (a FIFO named as an input
// with no writer, a slow file system, a long initialisation) and has nothing to save yet, and a
// Ctrl-C there used to be held until the first step ended, i.e. forever while a read blocked.
class GracefulInterrupts {
 public:
  // `ending`: what a signal during the set-up says as it ends the process (default: a run's
  // set-up, nothing trained or saved); a command that is all set-up (eval) says its own.
  explicit GracefulInterrupts(bool during_setup = false, const char* ending = nullptr);
  ~GracefulInterrupts();
  GracefulInterrupts(const GracefulInterrupts&) = delete;
  GracefulInterrupts& operator=(const GracefulInterrupts&) = delete;
};

}  // namespace tierzero::app
