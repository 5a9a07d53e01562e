// The files one `tierzero train` run writes and the run directory that holds them: defaults under
// RUN_DIR, one writer per run directory, no run replacing another's files unless asked, no output
// that is one of the run's inputs (docs/outputs.md).
//
// Thread-safety: called from the main thread only.
#pragma once

#include <string>
#include <vector>

#include "tierzero/status.h"
#include "train.h"

namespace tierzero::app {

// Holds the run directory's advisory lock (flock on the directory itself, and on the checkpoint
// directory when that is elsewhere) for as long as it lives: a second `tierzero train` into the
// same directory is refused while this one runs. Released when the process ends, however it ends.
class RunDirLock {
 public:
  RunDirLock() = default;
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;
  // FailedPrecondition naming the directory when another process holds it.
  Status Acquire(const std::string& dir, const std::string& what);

 private:
  std::vector<int> fds_;
};

// The outputs' paths defaulted under the run directory (metrics, report, html, trace, checkpoint,
// NVMe), "none" turned into empty. Touches no file.
void DefaultOutputPaths(RunConfig& cfg);

// Before anything is written (the lead rank): every output distinct from the others and from
// every input (the config file, the text, --init-from, --plan, the checkpoint resumed from); no
// output a directory, block device or socket; and, unless the run resumes in place or
// `overwrite`, no output that already holds another run's files (FailedPrecondition naming them
// and saying --resume, --overwrite or another --run-dir). With `overwrite` the earlier run's files
// in the run directory that this run does not write again are removed (tierzero's own names
// only), so the directory never holds pieces of two runs.
Status CheckOutputs(const RunConfig& cfg, const std::string& config_path, bool overwrite);

// A path a command reads: a file, or a directory whose files it reads.
struct InputPath {
  std::string what, path;
  bool directory = false;
};
// `output` (named `what` in the error) is none of `inputs` and lies inside none of the input
// directories: InvalidArgument otherwise (an export overwrote a file of the checkpoint it read).
Status CheckNotAnInput(const std::string& output, const std::string& what,
                       const std::vector<InputPath>& inputs);

// A file that some output may replace: the known names of a run's files in `run_dir`.
std::vector<std::string> RunFileNames();

}  // namespace tierzero::app
