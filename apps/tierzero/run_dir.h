// The files one `tierzero train` run writes and the run directory that holds them: defaults under
// RUN_DIR, one writer per run directory, no run replacing another's files unless asked, no output
// that is one of the run's inputs (docs/outputs.md).
//
// Thread-safety: called from the main thread only.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "file_identity.h"
#include "tierzero/status.h"
#include "train.h"

namespace tierzero::app {

// Holds a run directory's advisory lock for as long as it lives: an exclusive flock on
// DIR/.tierzero.lock (a file tierzero creates and leaves; regular, opened read-write, so NFS's
// byte-range emulation of flock works too). A second `tierzero train` into the same run or
// checkpoint directory is refused while this one runs. The kernel releases it when the process
// ends, however it ends. A file system without locks (ENOLCK, ENOSYS, EOPNOTSUPP) is warned about,
// not refused.
class RunDirLock {
 public:
  RunDirLock() = default;
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;
  // FailedPrecondition naming the directory when another process holds it.
  // `advice`: what the refusal says to do (default: a run's, another --run-dir).
  Status Acquire(const std::string& dir, const std::string& what, const std::string& advice = "");
  // Releases every lock now, removing the lock files this process made (as the destructor does
  // without Keep): a command whose output directory it locked while it wrote.
  void Release();
  // The run started: the lock files it made stay (without Keep they are removed at the end, so a
  // refused run leaves none in a directory of the user's).
  void Keep();
  // Its first step ended: a signal's exit no longer removes the lock files (Keep still to come).
  void KeepOnSignal();
  // Note [A directory moved under the run]: where the directory locked as `dir` is now: `dir`
  // while that path still names it; its new path when it was moved (its lock file's, as
  // /proc/self/fd tells it); "" when it was removed; nullopt when `dir` was not locked here.
  std::optional<std::string> Where(const std::string& dir) const;
  // Note [A directory made again is locked again]: the directory locked as `dir`, removed and
  // made again at its path, locked there anew. FailedPrecondition when another process holds the
  // new one's lock (it took the path meanwhile).
  Status Relock(const std::string& dir, const std::string& what);

 private:
  std::vector<int> fds_;
  std::vector<std::string> dirs_;     // as locked, one a descriptor
  std::vector<std::string> created_;  // lock files this process made
  bool keep_ = false;
  int attempts_ = 0;  // Acquire's takes of a lock file removed under it
};

// The directories a run made for its outputs, removed again (when still empty but for the run's
// own lock file) unless Keep() is called: a run refused in its set-up (a bad flag, a missing
// input, another run in the way) leaves no trace of itself behind.
//
// Note [A set-up ended by a signal leaves nothing]
// The same holds when the set-up does not return: a Ctrl-C during it ends the process at once
// (Note [Signals on one thread of ours]), and under mpirun a rank that fails alone ends the job
// (Note [A failing rank ends the run]), the others by SIGTERM. So the directories made and the
// lock files created are also registered with RemoveOnSignalExit (tierzero/files.h) until Keep:
// the signal's exit removes the lock files, then each directory that is empty by then, deepest
// first. (The failing rank itself unwinds, removing them, before it ends the job.)
class MadeDirs {
 public:
  // `under_locks_kept`: a directory inside one another process holds locked stays too, not
  // only one it holds itself (Note [Directories another process took], dir_lock.cc): eval's
  // swap directory, where a train may have started meanwhile. (Not train's: its ranks make
  // their own inside the lead's locked run directory, and remove them.)
  explicit MadeDirs(bool under_locks_kept = false) : under_locks_kept_(under_locks_kept) {}
  ~MadeDirs();
  MadeDirs(const MadeDirs&) = delete;
  MadeDirs& operator=(const MadeDirs&) = delete;
  // fs::create_directories, remembering each directory it made (its own mkdir made it).
  void Create(const std::string& path, std::error_code& ec);
  // Removes now what it made (the run was refused before it started), as going out of scope does.
  void Undo();
  // The run started: what it made stays.
  void Keep();
  // Its first step ended: a signal's exit no longer removes them (Keep still to come).
  void KeepOnSignal();

 private:
  std::vector<std::string> dirs_;  // in the order made (parents first)
  bool under_locks_kept_ = false;
};

// $TMPDIR, or /tmp where it is unset or empty: where a command's scratch space goes.
std::string TmpDirectory();

// A directory of its own under $TMPDIR (else /tmp), made with mkdtemp("PREFIX-XXXXXX") and
// removed with everything in it when this goes: the NVMe swap space of export and eval, which
// must not share a run's (relative to where that run ran, and maybe in use).
class ScratchDir {
 public:
  ScratchDir() = default;
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  // Makes the directory (`prefix`: "tierzero-eval"); an error naming errno when it cannot.
  Status Create(const std::string& prefix);
  const std::string& path() const { return path_; }  // empty until Create

 private:
  std::string path_;
};

// `s` with what to do when it is the NVMe tier failing to open in `scratch` (a ScratchDir's
// path): that directory is under $TMPDIR, which is what to move; `s` otherwise.
Status ScratchAdvice(const Status& s, const std::string& scratch);

// The name of the lock file in a locked directory.
inline constexpr const char* kLockFileName = ".tierzero.lock";

// Whether a process other than this one holds `dir`'s run lock (a run is writing there).
bool LockedByAnother(const std::string& dir);

// A checkpoint named by `flag` (--resume, export's argument) that exists and is not a directory
// (its manifest.json, a states file) is refused naming the directory meant; one that is not
// there, in a run directory whose config.json records that it saved elsewhere, is refused naming
// where (with `with_config`, train's advice: that config with it).
Status CheckCheckpointArgument(const std::string& path, const std::string& flag,
                               bool with_config = false);

// The outputs' paths defaulted under the run directory (metrics, report, html, trace, checkpoint,
// NVMe), "none" turned into empty. Touches no file.
void DefaultOutputPaths(RunConfig& cfg);

// What a run changes in its outputs' directories before its first step, once its set-up is
// known to be good (RemoveStaleOutputs, WriteRunConfigJson): nothing is removed or written while a
// bad flag can still refuse the run.
struct OutputsPlan {
  std::vector<std::string> stale_files;        // an earlier run's files (--overwrite)
  std::vector<std::string> stale_checkpoints;  // checkpoint directories of an earlier run
  std::vector<std::string> locked_dirs;        // scanned for dead processes' temporary files
  bool in_place = false;                       // resumes the run directory's own checkpoint
  std::string config_path;                     // RUN_DIR/config.json
  std::string config_text;                     // what it is written with
};

// Before anything is written (the lead rank, holding the locks): every output distinct from the
// others and from every input (the config file, the text, --init-from, --plan, the checkpoint
// resumed from); no output a directory, block device, socket or dangling link, nor inside a
// directory another running run holds; and, unless the run resumes in place or `overwrite`, no
// earlier run's files where this run writes (Note [One run per run directory]):
// FailedPrecondition listing every such file and saying --resume, --overwrite or --run-dir. With
// `overwrite`, exactly the files listed become the plan's stale files.
StatusOr<OutputsPlan> CheckOutputs(const RunConfig& cfg, const std::string& config_path,
                                   bool overwrite);

// The outputs' paths defaulted under the run directory; on the lead rank (rank 0) the locks of the
// run and checkpoint directories (held by `lock` to the end of the run) and CheckOutputs; every
// directory the outputs need created before the first step. Nothing is removed or written yet:
// the plan carries the run's config.json (as configured: without the per-rank NVMe path) for
// WriteRunConfigJson. Ranks after the first swap to RUN_DIR/nvme/rankN.
StatusOr<OutputsPlan> PrepareOutputs(RunConfig& cfg, const std::string& config_path, int rank,
                                     int world, RunDirLock& lock, MadeDirs& made);

// Carries out the plan, in two parts: first the stale files and checkpoints removed (tierzero's
// names, regular files only) and the temporary files of dead processes removed from the locked
// directories; last of the set-up, the run's config.json written (an error stops the run: export
// and resume read it; Note [A resume's config.json written last], train.cc).
Status RemoveStaleOutputs(const OutputsPlan& plan);
Status WriteRunConfigJson(const OutputsPlan& plan);

// Note [Data on standard output]
// An output named as the process's standard output (/dev/stdout, /dev/fd/1, /proc/self/fd/1)
// is the command's data: `export -o /dev/stdout > f` appended its "exported ..." line to the
// file, which then no reader took, and `report --trace /dev/stdout` its summary to the trace.
// Before anything is printed, the command's own lines move to standard error and the data keeps
// the original stream (a duplicate of it): returns the path to write the data to (`path` itself
// when it is not standard output). Call it before the command prints anything.
std::string TakeStdoutForData(const std::string& path);

}  // namespace tierzero::app
