// resume.h: a run's own config.json, as a resume in place or a command given no config reads it.
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>
#include <vector>

#include "resume.h"
#include "tierzero/files.h"

namespace tierzero::app {
namespace fs = std::filesystem;
using nlohmann::json;

// Note [A config train wrote]
// A config.json in a run directory is taken as that run's (for a checkpoint's records, for a
// resume in place, for eval and export without --config) only when it is one train wrote: a
// regular file (a FIFO would block the read), within kMaxConfigBytes, with every section train
// writes, that parses. Its paths are then as they resolve from where the run ran
// (RebaseOnItsRunDir: a run moved, or used from another working directory).
// resume.h
StatusOr<RunConfig> ReadConfigTrainWrote(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return NotFoundError(path + " is not there");
  if (!S_ISREG(st.st_mode)) return InvalidArgumentError(path + " is not a regular file");
  TZ_ASSIGN_OR_RETURN(const std::string text, ReadFileBounded(path, kMaxConfigBytes, "run config"));
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
  if (j.is_discarded()) return InvalidArgumentError(path + " is not JSON");
  const char* const kSections[] = {"model", "data", "train", "engine", "output"};
  if (!j.is_object()) return InvalidArgumentError(path + " is not a JSON object");
  // Another program's config (a model directory's) has none of them: it is no run's.
  if (std::none_of(std::begin(kSections), std::end(kSections),
                   [&](const char* s) { return j.contains(s); }))
    return NotFoundError(path + " is no run's config (it has none of train's sections)");
  for (const char* section : kSections)
    if (!j.contains(section))
      return InvalidArgumentError(path + " has no " + section +
                                  " section (train writes every section)");
  StatusOr<RunConfig> parsed = ParseRunConfig(text, DefaultRunConfig());
  if (!parsed.ok()) return std::move(parsed).status().WithContext(path);
  RunConfig cfg = std::move(*parsed);
  RebaseOnItsRunDir(cfg, path);
  return cfg;
}

std::optional<RunConfig> ConfigTrainWrote(const std::string& path) {
  StatusOr<RunConfig> cfg = ReadConfigTrainWrote(path);
  if (!cfg.ok()) return std::nullopt;
  return std::move(*cfg);
}

// Note [A resumed run's own config]
// `train --resume RUN_DIR/checkpoint` without --config continues that run in place: its config
// is the config.json train wrote beside the checkpoint (as `eval --resume` and `export` read it),
// the flags given over it. With the built-in defaults as the base instead, a run made with shape
// flags was refused as a model of another shape, though the help and the refusal of a used run
// directory promised that very command (hunt 40 D, A3). Taken only when it is provably that
// run's and the run continues where it is (review 40): a regular file (a FIFO would block the
// read) that train wrote (every section), whose checkpoint directory and run directory, as
// they resolve from here, are the very directories of the checkpoint resumed (through links) and
// its parent, and no --run-dir names another directory. Otherwise (a run moved or renamed, a
// config resolved from another working directory, a checkpoint named through a link beside
// another config, a copy into a new run directory, which would carry the old run's outputs
// along) the run is as before: its flags and defaults, and a model that differs is refused.
// resume.h
StatusOr<std::vector<std::string>> WithResumedRunsConfig(const std::vector<std::string>& args) {
  std::string resume, run_dir;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config") return args;
    if (args[i] == "--resume" && i + 1 < args.size()) resume = args[i + 1];
    if (args[i] == "--run-dir" && i + 1 < args.size()) run_dir = args[i + 1];
  }
  if (resume.empty()) return args;
  std::error_code ec;
  const fs::path checkpoint = fs::canonical(resume, ec);
  if (ec) return args;
  const fs::path dir = checkpoint.parent_path();
  if (!run_dir.empty() && !SameDirectory(run_dir, dir.string())) return args;
  const std::string run_config = (dir / "config.json").string();
  StatusOr<RunConfig> cfg = ReadConfigTrainWrote(run_config);
  if (cfg.status().code() == StatusCode::kNotFound) return args;
  // Note [A resumed run's broken config]: the run's config beside its checkpoint is there but
  // cannot be read. Going on without it trained on the built-in defaults' data, schedule and
  // budgets, into runs/default (hunt 49): it is said instead.
  if (!cfg.ok())
    return Status(cfg.status().code(),
                  std::string(cfg.status().message()) +
                      "; it is the config of the run resumed (train wrote it; was it edited or "
                      "cut short?): mend it, or give the run's config with --config FILE");
  if (!SameDirectory(cfg->output.checkpoint_dir, checkpoint.string()) ||
      !SameDirectory(cfg->output.run_dir, dir.string()))
    return args;
  if (LaunchedRanks().rank == 0)
    std::printf("note: continuing with the run's config %s (--config FILE gives another)\n",
                run_config.c_str());
  std::vector<std::string> with = {"--config", run_config};
  with.insert(with.end(), args.begin(), args.end());
  return with;
}

}  // namespace tierzero::app
