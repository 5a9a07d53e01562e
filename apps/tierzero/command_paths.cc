// What the commands other than train share: the paths they are given (run_dir.h: a checkpoint
// argument that names something else, an output that is the process's standard output), and
// as commands of one process that never step (train.h: their errors and their engine config).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>

#include "resume.h"
#include "run_dir.h"
#include "tierzero/files.h"
#include "train.h"

namespace tierzero::app {
namespace fs = std::filesystem;

// run_dir.h
std::string TakeStdoutForData(const std::string& path) {
  if (StandardStreamFd(path) != STDOUT_FILENO) return path;
  static int data_fd = -1;
  if (data_fd < 0) {
    std::fflush(stdout);
    const int fd = ::fcntl(STDOUT_FILENO, F_DUPFD_CLOEXEC, 3);
    if (fd < 0 || ::dup2(STDERR_FILENO, STDOUT_FILENO) < 0) return path;  // (as before)
    data_fd = fd;
  }
  return "/dev/fd/" + std::to_string(data_fd);
}

namespace {

// A checkpoint path that is not there, in a run directory whose config.json (the run's, which
// train wrote) records that the run saved its checkpoints elsewhere (--checkpoint PATH): said,
// with the path to give, where "no such directory" alone sent the user looking. Nothing
// otherwise (the load says what is missing).
Status NotThereButRecorded(const std::string& path, const std::string& flag, bool with_config) {
  std::error_code ec;
  fs::path dir = fs::absolute(path, ec).lexically_normal();
  if (ec) return Status::OK();
  if (dir.has_parent_path() && dir.filename().empty()) dir = dir.parent_path();
  const std::string config = (dir.parent_path() / "config.json").string();
  std::optional<RunConfig> cfg = ConfigTrainWrote(config);
  if (!cfg || cfg->output.checkpoint_dir.empty()) return Status::OK();
  // Only where its paths resolve from here as they did for it: its run directory, as resolved,
  // is the directory of the config (a run moved would name another run's checkpoint).
  struct stat run_st {};
  struct stat here_st {};
  if (::stat(cfg->output.run_dir.c_str(), &run_st) != 0 ||
      ::stat(dir.parent_path().c_str(), &here_st) != 0 || run_st.st_dev != here_st.st_dev ||
      run_st.st_ino != here_st.st_ino)
    return Status::OK();
  const std::string saved = cfg->output.checkpoint_dir;
  // (A relative one beside an absolute run directory is relative to a directory not recorded.)
  if (fs::path(saved).is_relative() && fs::path(cfg->output.run_dir).is_absolute())
    return Status::OK();
  if (fs::absolute(saved, ec).lexically_normal() == dir) return Status::OK();
  // And what is there is that run's model's checkpoint.
  const StatusOr<CheckpointInfo> info = ReadCheckpointInfo(saved);
  if (!info.ok() || !IsCheckpointOf(info->user_state, *cfg, saved)) return Status::OK();
  return NotFoundError("no checkpoint at '" + path + "': there is no such directory; the run of " +
                       config + " saved its checkpoints in " + saved +
                       " (its output.checkpoint_dir: --checkpoint PATH): " +
                       (with_config ? "--config " + config + " " : std::string()) +
                       (flag.rfind("--", 0) == 0 ? flag + " " : std::string("give ")) + saved);
}

}  // namespace

// run_dir.h
Status CheckCheckpointArgument(const std::string& path, const std::string& flag, bool with_config) {
  struct stat st {};
  if (path.empty()) return Status::OK();
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    TZ_RETURN_IF_ERROR(NotThereButRecorded(path, flag, with_config));
    // Said first: a mistyped --resume was refused for the outputs of the run directory it fell
    // back on ("the outputs of another run are here: runs/default/..."; hunt 51).
    if (err == ENOENT || err == ENOTDIR)
      return NotFoundError("no checkpoint at '" + path + "' (" + flag +
                           "): there is no such directory");
  }
  if (S_ISDIR(st.st_mode)) {
    // A run directory named for its checkpoint: said first, before what follows from it.
    const std::string inner = (fs::path(path) / "checkpoint").string();
    if (::stat((path + "/manifest.json").c_str(), &st) != 0 &&
        ::stat((inner + "/manifest.json").c_str(), &st) == 0)
      return InvalidArgumentError(
          flag + " '" + path + "' is a run directory, not a checkpoint: its checkpoint is " +
          inner + " (" + (flag.rfind("--", 0) == 0 ? flag + " " : std::string("give ")) + inner +
          ")");
    return Status::OK();
  }
  const std::string parent = fs::path(path).parent_path().string();
  return InvalidArgumentError(flag + " '" + path + "' is " + FileKindName(st.st_mode) +
                              ", not a checkpoint: a checkpoint is the directory holding "
                              "manifest.json" +
                              (parent.empty() ? "" : " (" + flag + " " + parent + "?)"));
}

// train.h
Status ForOneProcess(const Status& s, bool forward_only) {
  if (s.ok()) return s;
  std::string m(s.message());
  auto drop = [&m](std::string_view phrase) {
    for (size_t at = m.find(phrase); at != std::string::npos; at = m.find(phrase, at))
      m.erase(at, phrase.size());
  };
  drop(", or use more ranks");
  if (forward_only) {
    drop(" checkpoint activations (where the model does not already),");
    drop(", or fewer activations (checkpointing)");
  }
  return Status(s.code(), std::move(m));
}

// Note [The states of a command that never steps]
// eval and export load a checkpoint through the engine, which holds every chunk's optimizer
// states and gradient shard as a run does: fp32 master, m and v and a gradient of the compute
// type (fp32 with accumulation), 16 bytes a parameter in bf16 of which they read only the
// master's 4. They hold no moments and no gradient shards (MomentFormat::kNone, Note [An engine
// that never steps] in src/engine/engine.cc: the checkpoint's moments are not read): the
// weights are the masters' to the bit (each parameter is its master, rounded), and nothing reads
// a moment or a gradient. A bf16 checkpoint with accumulation 2 placed 11.95 MiB of model state
// with the run's states, 6.72 MiB with int8 moments (session 43), 5.31 MiB without moments
// (session 44; bench/RESULTS.md); cli_trust `never_steps`'s placed 1008 KiB with gradient
// shards and 756 KiB without (session 48), and checks the bytes a parameter and the same losses
// and exports at the budget said.
// train.h
void NeverSteps(EngineConfig& ec) {
  ec.optimizer_states = MomentFormat::kNone;
  ec.grad_accumulation = 1;
}

}  // namespace tierzero::app
