// The run directory and the files a run writes (run_dir.h, docs/outputs.md).
#include "run_dir.h"

#include <fcntl.h>
#include <glob.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>

#include "file_identity.h"
#include "resume.h"
#include "tierzero/files.h"
#include "tierzero/utf8.h"

namespace tierzero::app {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Note [Room for the names a run writes late]
// The run's checkpoint files and its report, page and trace are written after its steps, each
// through a temporary beside it (".NAME.tz-PID-N.tmp"). A directory path near the system's limit
// (4096 bytes a path, 255 a name: a run directory nested deep) let the set-up pass, trained every
// step, and lost them all at the first save: "File name too long" (hunt 42). So the set-up asks,
// of each such directory, for room for the longest name written there: a checkpoint's states file
// ("states-<step>.w<world>.rank<r>.b.bin", 40 bytes at most) or the output's own name, each with
// its temporary's 24 more.
constexpr size_t kTemporaryExtra = 24;  // "." ".tz-" pid (at most 7 digits) "-" counter ".tmp"
constexpr size_t kLongestStatesName = 40;

Status CheckRoomForName(const std::string& dir, size_t name_bytes, const std::string& what) {
  // The temporary's name as CreateTemporary (src/core/file_io.cc) makes it: its base left out
  // past 200 bytes.
  const size_t temporary = (name_bytes > 200 ? 0 : name_bytes) + kTemporaryExtra;
  const size_t name = std::max(name_bytes, temporary);
  const std::string shown = dir.empty() ? "." : dir;
  const long name_max = ::pathconf(shown.c_str(), _PC_NAME_MAX);
  const long path_max = ::pathconf(shown.c_str(), _PC_PATH_MAX);
  const size_t limit_path = path_max > 0 ? static_cast<size_t>(path_max) : 4096;
  if (name_max > 0 && name > static_cast<size_t>(name_max))
    return InvalidArgumentError(what + ": a name of " + std::to_string(name) +
                                " bytes is longer than a name in " + shown + " may be (" +
                                std::to_string(name_max) + "): give a shorter one");
  if (dir.size() + 1 + name + 1 > limit_path)
    return InvalidArgumentError(
        what + ": the directory " + shown + " is a path of " + std::to_string(dir.size()) +
        " bytes, too long for the files written there at the end (a path may be " +
        std::to_string(limit_path) + " bytes, its files' names " + std::to_string(name) +
        "): give it a shorter path (--run-dir, or the flag named)");
  return Status::OK();
}

bool IsRegular(const std::string& p, off_t* size = nullptr) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  if (size != nullptr) *size = st.st_size;
  return true;
}

bool IsLink(const std::string& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

// The outputs the run directory's config.json records (its metrics, report, page, trace and
// checkpoint directory, relative paths taken from here): the files of the run that wrote it.
std::vector<FileId> RecordedOutputs(const std::string& run_dir) {
  std::vector<FileId> out;
  auto text = ReadFileBounded(run_dir + "/config.json", kMaxConfigBytes, "run config");
  if (!text.ok() || !CheckOutsideJson(*text, "config.json").ok()) return out;
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("output") || !j["output"].is_object()) return out;
  for (const char* key : {"metrics", "report", "html", "trace", "checkpoint_dir"}) {
    const auto it = j["output"].find(key);
    if (it == j["output"].end() || !it->is_string()) continue;
    const std::string p = it->get<std::string>();
    if (!p.empty() && p != "none") out.push_back(Identify(p));
  }
  return out;
}

// The path the run directory's config.json records for output `key`, where the run named one
// of its own: "" without one. A path inside the recorded run directory is taken inside this one
// (a run directory copied or moved since records the old one's paths: its metrics.jsonl, or a
// --metrics RUN_DIR/m.jsonl, are the copy's own).
std::string RecordedOutputPath(const std::string& run_dir, const char* key) {
  auto text = ReadFileBounded(run_dir + "/config.json", kMaxConfigBytes, "run config");
  if (!text.ok() || !CheckOutsideJson(*text, "config.json").ok()) return "";
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("output") || !j["output"].is_object()) return "";
  const auto it = j["output"].find(key);
  if (it == j["output"].end() || !it->is_string()) return "";
  const std::string p = it->get<std::string>();
  if (p.empty() || p == "none") return "";
  const auto dir = j["output"].find("run_dir");
  if (dir != j["output"].end() && dir->is_string()) {
    const std::string prefix = dir->get<std::string>() + "/";
    if (p.compare(0, prefix.size(), prefix) == 0) return run_dir + "/" + p.substr(prefix.size());
  }
  return p;
}

// A manifest.json in `dir` that is not known to be tierzero's: a directory of the user's, never
// a checkpoint to replace or remove. Known positively: a JSON object whose "format" is
// "tierzero-checkpoint"; anything else (another program's JSON, text, an empty or unreadable
// file) is foreign.
bool ForeignManifest(const std::string& dir) {
  const std::string path = dir + "/manifest.json";
  if (!IsRegular(path)) return false;
  const StatusOr<std::string> text =
      ReadFileBounded(path, uint64_t{256} << 20, "checkpoint manifest");
  if (!text.ok()) return true;
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return true;
  const auto f = j.find("format");
  return f == j.end() || !f->is_string() || f->get<std::string>() != "tierzero-checkpoint";
}

// A checkpoint's own files in `dir`: the manifest first (so what remains is no checkpoint), then
// its states files. Regular files of these names only, and only where the manifest is ours.
void RemoveCheckpointFiles(const std::string& dir) {
  std::error_code ec;
  if (ForeignManifest(dir)) return;
  if (IsRegular(dir + "/manifest.json")) fs::remove(dir + "/manifest.json", ec);
  std::vector<fs::path> states;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (IsCheckpointStatesFileName(name) && IsRegular(it->path().string()) &&
        !IsLink(it->path().string()))
      states.push_back(it->path());
  }
  for (const fs::path& p : states) fs::remove(p, ec);
}

// Temporary files of outputs (Note [Writing outputs]: ".NAME.tz-PID-N.tmp") whose writer is no
// longer alive: a process killed while it saved (mpirun's SIGKILL a second after SIGTERM, the OOM
// killer) leaves one as large as what it wrote. Only in a directory whose lock this run holds.
void RemoveDeadTemporaries(const std::string& dir) {
  std::error_code ec;
  std::vector<fs::path> dead;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name[0] != '.' || name.size() < 8 ||
        name.compare(name.size() - 4, 4, ".tmp") != 0)
      continue;
    const size_t tz = name.rfind(".tz-");
    if (tz == std::string::npos) continue;
    const size_t dash = name.find('-', tz + 4);
    if (dash == std::string::npos) continue;
    const std::string pid_text = name.substr(tz + 4, dash - tz - 4);
    if (pid_text.empty() || pid_text.size() > 9 ||
        pid_text.find_first_not_of("0123456789") != std::string::npos)
      continue;
    const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
    if (pid == ::getpid() || (::kill(pid, 0) != 0 && errno == ESRCH)) {
      if (IsRegular(it->path().string()) && !IsLink(it->path().string()))
        dead.push_back(it->path());
    }
  }
  for (const fs::path& p : dead) fs::remove(p, ec);
}

}  // namespace

void DefaultOutputPaths(RunConfig& cfg) {
  OutputOptions& out = cfg.output;
  if (out.metrics.empty()) out.metrics = out.run_dir + "/metrics.jsonl";
  if (out.report.empty()) out.report = out.run_dir + "/report.json";
  if (out.checkpoint_dir.empty()) out.checkpoint_dir = out.run_dir + "/checkpoint";
  if (out.html.empty()) out.html = out.run_dir + "/report.html";
  if (out.trace.empty()) out.trace = out.run_dir + "/trace.json";
  if (out.html == "none") out.html.clear();
  if (out.trace == "none") out.trace.clear();
  if (out.checkpoint_dir == "none") out.checkpoint_dir.clear();
  if (out.plan == "none") out.plan.clear();  // (none: a resume's recorded plan left out)
  if (cfg.engine.nvme_path.empty()) cfg.engine.nvme_path = out.run_dir + "/nvme";
}

StatusOr<OutputsPlan> CheckOutputs(const RunConfig& cfg, const std::string& config_path,
                                   bool overwrite) {
  const OutputOptions& out = cfg.output;
  // "none" turns the page, the trace and the checkpoint off; the metrics and the report are
  // always written (the run's record, what a resume and `tierzero report` read): a file named
  // "none" in the working directory is not what was meant.
  for (const auto& [what, path] :
       {std::pair<const char*, const std::string&>{"metrics", out.metrics},
        {"report", out.report}}) {
    if (path == "none")
      return InvalidArgumentError(std::string("output.") + what +
                                  " is \"none\": a run always writes its " + what +
                                  " (html, trace and checkpoint_dir take \"none\"); name a "
                                  "path, or /dev/null to discard it");
  }
  OutputsPlan plan;
  plan.config_path = out.run_dir + "/config.json";
  struct Named {
    std::string what, path;
    FileId id;
  };
  std::vector<Named> outputs;
  auto add_output = [&](const std::string& what, const std::string& path) {
    if (!path.empty()) outputs.push_back({what, path, Identify(path)});
  };
  add_output("--metrics", out.metrics);
  add_output("--report", out.report);
  add_output("--html", out.html);
  add_output("--trace", out.trace);
  add_output("the run's config", plan.config_path);
  add_output("the warm-up trace", out.run_dir + "/warmup_trace.json");
  for (const Named& o : outputs) TZ_RETURN_IF_ERROR(CheckOutputPath(o.path, o.what));
  if (IsLink(plan.config_path)) {
    return InvalidArgumentError(
        plan.config_path +
        " is a symbolic link: the run writes its resolved config there, which would replace the "
        "file it links to; remove the link or use another --run-dir");
  }

  std::vector<Named> inputs;
  auto add_input = [&](const std::string& what, const std::string& path) {
    if (!path.empty()) inputs.push_back({what, path, Identify(path)});
  };
  add_input("--config", config_path);
  if (cfg.data.kind == "text") add_input("--text", cfg.data.text_path);
  if (cfg.data.kind == "tokens") {
    // Every file the pattern matches (a glob of shards), and the path as named.
    add_input("--data", cfg.data.token_path);
    glob_t g{};
    if (::glob(cfg.data.token_path.c_str(), 0, nullptr, &g) == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) add_input("--data", g.gl_pathv[i]);
    }
    ::globfree(&g);
  }
  add_input("--init-from", out.init_from);
  add_input("--plan", out.plan);
  // A Hugging Face model directory (--init-from DIR): nothing is written inside it, nor over
  // any file it holds, which may be a link to a file elsewhere (the Hugging Face hub's cache
  // keeps a snapshot's files as links into its blobs).
  std::error_code ec;
  const std::optional<FileId> init_dir =
      !out.init_from.empty() && std::filesystem::is_directory(out.init_from, ec)
          ? std::optional<FileId>(Identify(out.init_from))
          : std::nullopt;
  if (init_dir) {
    int listed = 0;
    for (auto it = std::filesystem::directory_iterator(out.init_from, ec);
         !ec && it != std::filesystem::directory_iterator() && listed < 100000;
         it.increment(ec), ++listed)
      add_input("--init-from", it->path().string());
  }
  const std::optional<FileId> resume =
      out.resume.empty() ? std::nullopt : std::optional<FileId>(Identify(out.resume));
  const std::optional<FileId> ckpt = out.checkpoint_dir.empty()
                                         ? std::nullopt
                                         : std::optional<FileId>(Identify(out.checkpoint_dir));
  if (ckpt && ckpt->exists && !S_ISDIR(ckpt->mode)) {
    return InvalidArgumentError("the checkpoint directory " + out.checkpoint_dir + " is " +
                                FileKindName(ckpt->mode) + ", not a directory");
  }
  // A checkpoint directory never holds a config.json: one that does is a run directory (this
  // run's or another's) or a model directory, whose files a checkpoint's would mix with (export
  // and eval then read the config beside it, in its parent).
  if (ckpt && ckpt->exists && IsRegular(out.checkpoint_dir + "/config.json"))
    return InvalidArgumentError(
        "--checkpoint " + out.checkpoint_dir +
        " holds a config.json: it is a run directory (its checkpoint is " + out.checkpoint_dir +
        "/checkpoint) or a model directory, not a checkpoint directory; give --checkpoint a "
        "directory of its own");
  const FileId run_dir = Identify(out.run_dir);
  // The checkpoint and NVMe swap directories are written too (their files, not outputs above):
  // never inside the model directory either.
  for (const auto& [dir, flag] :
       {std::pair{out.checkpoint_dir, "--checkpoint"},
        {cfg.engine.nvme_budget > 0 ? cfg.engine.nvme_path : "", "--nvme-path"}}) {
    if (const FileId id = Identify(dir);
        init_dir && !dir.empty() && (Same(id, *init_dir) || Inside(id, *init_dir)))
      return InvalidArgumentError(std::string(flag) + " " + dir +
                                  " lies inside the model directory --init-from " + out.init_from +
                                  " reads; give " + flag + " a directory elsewhere");
  }

  for (size_t i = 0; i < outputs.size(); ++i) {
    const Named& o = outputs[i];
    // Streaming into one character device twice (/dev/null) is harmless.
    const bool device = o.id.exists && S_ISCHR(o.id.mode);
    for (size_t k = 0; k < i && !device; ++k) {
      if (Same(o.id, outputs[k].id))
        return InvalidArgumentError(o.what + " and " + outputs[k].what + " name the same file " +
                                    o.path + "; give each output its own");
    }
    for (const Named& in : inputs) {
      // The run's config.json may be the config it was started from: read already, and
      // rewritten as the run's resolved config (what a resume and an export read).
      if (o.what == "the run's config" && in.what == "--config") continue;
      if (Same(o.id, in.id))
        return InvalidArgumentError(o.what + " " + o.path + " is the run's input " + in.what +
                                    ": writing it would destroy what the run reads");
    }
    if (init_dir && (Same(o.id, *init_dir) || Inside(o.id, *init_dir)))
      return InvalidArgumentError(o.what + " " + o.path +
                                  " lies inside the model directory --init-from " + out.init_from +
                                  " reads; write the run elsewhere (--run-dir)");
    if (resume && Inside(o.id, *resume))
      return InvalidArgumentError(o.what + " " + o.path + " lies inside the checkpoint --resume " +
                                  out.resume + " reads");
    if (ckpt && Inside(o.id, *ckpt))
      return InvalidArgumentError(o.what + " " + o.path + " lies inside the checkpoint directory " +
                                  out.checkpoint_dir + ", which holds the checkpoint's files only");
    // Another running run's directory (a report into it would replace that run's when it ends).
    const std::string parent = o.id.path.parent_path().string();
    const FileId parent_id = Identify(parent);
    if (!device && !Same(parent_id, run_dir) && !(ckpt && Same(parent_id, *ckpt)) &&
        LockedByAnother(parent))
      return FailedPreconditionError(o.what + " " + o.path +
                                     " lies in the directory of another tierzero run that is "
                                     "running; write it elsewhere");
  }
  if (ckpt) {
    for (const Named& in : inputs) {
      if (Same(*ckpt, in.id) || Inside(in.id, *ckpt))
        return InvalidArgumentError("the checkpoint directory " + out.checkpoint_dir +
                                    " holds the run's input " + in.what + " " + in.path);
    }
  }
  plan.locked_dirs.push_back(out.run_dir);
  if (ckpt) plan.locked_dirs.push_back(out.checkpoint_dir);

  // Note [One run per run directory]: a new run into a directory holding another's checkpoint or
  // metrics replaced them silently (the default run's 1600-step checkpoint lost to a 40-step
  // run), or left the directory holding pieces of two. As Hugging Face's Trainer does for its
  // output_dir, the run is refused unless it continues that run in place or is told to replace
  // it; the refusal lists every file --overwrite would then remove, and it removes no other.
  // (--checkpoint none resuming the run directory's own checkpoint continues that run too.)
  // In place: the checkpoint resumed is the one this run writes, and it is the run directory's
  // own (inside it, or the one its config.json records). Then the run directory's files are
  // the run's; an output elsewhere that its config.json does not record is checked as for a new
  // run (a --report naming someone's file is not the run's to replace).
  const std::string default_ckpt = out.run_dir + "/checkpoint";
  const std::vector<FileId> recorded = RecordedOutputs(out.run_dir);
  auto own = [&](const FileId& id) {
    if (Inside(id, run_dir)) return true;
    for (const FileId& r : recorded)
      if (Same(r, id)) return true;
    return false;
  };
  plan.in_place = resume && ((ckpt && Same(*resume, *ckpt) && own(*ckpt)) ||
                             (!ckpt && Same(*resume, Identify(default_ckpt))));
  // A run resumed in place whose metrics file is elsewhere (its config.json records --metrics
  // FILE) and not named again: its history would go on in a new file, split in two, with a note
  // that the old one is gone.
  if (plan.in_place && cfg.given.count("output.metrics") == 0) {
    const std::string recorded_metrics = RecordedOutputPath(out.run_dir, "metrics");
    // (Only a file that is there: a stream or a device is written where it points, and a file
    // gone since has no history to continue.)
    if (!recorded_metrics.empty() && IsRegular(recorded_metrics) &&
        !Same(Identify(recorded_metrics), Identify(out.metrics)))
      return InvalidArgumentError(
          "the run in " + out.run_dir + " writes its metrics to " + recorded_metrics +
          " (its config.json records --metrics), and this resume would start " + out.metrics +
          ": give --metrics " + recorded_metrics +
          " to continue them there, or --metrics PATH "
          "for a new file");
  }
  // A manifest that cannot be read (its permissions, the open-file limit, an I/O error) says
  // nothing of the checkpoint: that error, not "damaged" with advice to restore a good
  // checkpoint from a copy (hunt 41).
  if (ckpt && IsRegular(out.checkpoint_dir + "/manifest.json")) {
    const StatusOr<std::string> text = ReadFileBounded(out.checkpoint_dir + "/manifest.json",
                                                       uint64_t{256} << 20, "checkpoint manifest");
    if (!text.ok() && text.status().code() != StatusCode::kInvalidArgument)
      return text.status().WithContext("reading the checkpoint's manifest in " +
                                       out.checkpoint_dir + " (nothing there is changed)");
  }
  // A checkpoint directory whose manifest.json is another program's: the save would write over
  // it, and --overwrite would remove the user's files beside it.
  if (ckpt && ForeignManifest(out.checkpoint_dir)) {
    // The checkpoint this run resumes from: a manifest of its own cut short or overwritten.
    if (resume && Same(*resume, *ckpt))
      return DataLossError(
          "the checkpoint " + out.checkpoint_dir +
          " has a manifest.json that is not a whole tierzero manifest (damaged: cut short or "
          "overwritten?); restore the checkpoint from a copy, or resume from another one "
          "(tierzero will not write over it, nor remove anything there)");
    return FailedPreconditionError(
        "the checkpoint directory " + out.checkpoint_dir +
        " holds a manifest.json that is not a tierzero checkpoint's; a checkpoint saved there "
        "would replace it, so tierzero will not write one there (nor remove anything, with "
        "--overwrite): name another directory with --checkpoint DIR, or move that file");
  }
  // A new run (not in place) saving into the very checkpoint it resumes: its saves would
  // replace a checkpoint that is not its own (another run directory's, whose metrics would
  // then miss the steps this run trains there). Asked for only with --overwrite, which removes
  // nothing here (the checkpoint is read first; each save replaces it whole, at its manifest).
  if (!plan.in_place && !overwrite && ckpt && resume && Same(*ckpt, *resume) &&
      IsRegular(out.checkpoint_dir + "/manifest.json") && !ForeignManifest(out.checkpoint_dir))
    return FailedPreconditionError(
        "--checkpoint " + out.checkpoint_dir +
        " is the checkpoint this run resumes, and not this run directory's: its saves would "
        "replace it. Leave --checkpoint out to save in " +
        default_ckpt +
        ", resume in place from the run directory that owns it, or --overwrite to save over it");
  std::vector<std::string> held;
  // An output a flag names outside the run directory may be the user's own, not a run's: the
  // refusal names the flag, and --run-dir would not move it (a checkpoint directory given with
  // --checkpoint: `--run-dir DIR` alone was refused again on that same checkpoint).
  std::vector<std::string> flagged;
  auto hold_checkpoint = [&](const std::string& dir, bool flag) {
    if (!IsRegular(dir + "/manifest.json") || ForeignManifest(dir)) return;
    if (resume && Same(Identify(dir), *resume)) return;  // what this run reads
    for (const std::string& c : plan.stale_checkpoints)
      if (Same(Identify(c), Identify(dir))) return;
    const bool outside = flag && !Inside(Identify(dir), run_dir);
    held.push_back(dir + (outside ? " (a checkpoint, --checkpoint)" : " (a checkpoint)"));
    if (outside) flagged.push_back("--checkpoint");
    plan.stale_checkpoints.push_back(dir);
  };
  if (ckpt && !plan.in_place) hold_checkpoint(out.checkpoint_dir, true);
  if (!plan.in_place) hold_checkpoint(default_ckpt, false);
  auto hold_file = [&](const std::string& p, bool nonempty, const char* flag) {
    off_t size = 0;
    if (!IsRegular(p, &size) || (nonempty && size == 0)) return;
    const FileId id = Identify(p);
    if (plan.in_place && own(id)) return;
    for (const std::string& f : plan.stale_files)
      if (Same(Identify(f), id)) return;
    for (const Named& in : inputs)
      if (Same(in.id, id)) return;  // an input is never removed (config.json as --config)
    const bool outside = flag != nullptr && !Inside(id, run_dir);
    held.push_back(outside ? p + " (" + flag + ")" : p);
    if (outside) flagged.push_back(flag);
    plan.stale_files.push_back(p);
  };
  hold_file(out.metrics, /*nonempty=*/true, "--metrics");
  const std::pair<const std::string*, const char*> named[] = {
      {&out.report, "--report"}, {&out.html, "--html"}, {&out.trace, "--trace"}};
  for (const auto& [f, flag] : named) {
    if (!f->empty()) hold_file(*f, false, flag);
  }
  for (const char* name : {"metrics.jsonl", "report.json", "report.html", "trace.json",
                           "warmup_trace.json", "config.json"}) {
    if (!plan.in_place)
      hold_file(out.run_dir + "/" + name, std::string(name) == "metrics.jsonl", nullptr);
  }
  if (held.empty()) return plan;
  if (!overwrite) {
    std::string list;
    for (size_t i = 0; i < held.size(); ++i) list += (i == 0 ? "" : ", ") + held[i];
    // (No checkpoint there: nothing to resume, and no advice to.)
    std::string resume_hint;
    if (ckpt && IsRegular(out.checkpoint_dir + "/manifest.json"))
      resume_hint = "--resume " + out.checkpoint_dir + " continues that run";
    else if (IsRegular(default_ckpt + "/manifest.json"))
      resume_hint = "--resume " + default_ckpt + " continues that run";
    // The run's checkpoint is elsewhere (its config.json records --checkpoint DIR): the run's
    // own config.json, which names that directory, its run directory and its model, continues
    // it in place (`--resume DIR --checkpoint DIR` alone took the default run directory and the
    // built-in model: review 40, F9).
    const std::string recorded_ckpt = RecordedOutputPath(out.run_dir, "checkpoint_dir");
    if (!recorded_ckpt.empty() && !Same(Identify(recorded_ckpt), Identify(default_ckpt)) &&
        IsRegular(recorded_ckpt + "/manifest.json"))
      resume_hint = "--config " + out.run_dir + "/config.json --resume " + recorded_ckpt +
                    " continues that run (its config.json records that checkpoint directory)";
    else if (ckpt && std::find(flagged.begin(), flagged.end(), std::string("--checkpoint")) !=
                         flagged.end())
      // (Resumed with that --checkpoint too, the run would save over it: refused above.)
      resume_hint = "--resume " + out.checkpoint_dir +
                    " without --checkpoint continues from it, "
                    "saving in " +
                    default_ckpt;
    // The run's own checkpoint resumed, but another --checkpoint to write: not in place (a
    // resume in place writes the checkpoint it reads), and the advice to --resume it is given.
    // (Its config.json recording another checkpoint directory: resume_hint says to name it.)
    if (resume && ckpt && !Same(*ckpt, *resume) && Same(*resume, Identify(default_ckpt)))
      return FailedPreconditionError(
          "--resume " + out.resume + " is this run directory's checkpoint, but --checkpoint " +
          out.checkpoint_dir +
          " is another: a resume in place writes the checkpoint it reads (drop --checkpoint), "
          "and a copy elsewhere takes another --run-dir; the outputs here (" +
          list + ") are kept");
    std::string elsewhere = "--run-dir DIR starts this run elsewhere";
    if (!flagged.empty()) {
      std::string flags;
      for (size_t i = 0; i < flagged.size(); ++i)
        flags += (i == 0 ? "" : i + 1 == flagged.size() ? " or " : ", ") + flagged[i];
      elsewhere =
          (flagged.size() == held.size() ? "" : elsewhere + " and ") + flags +
          " PATH names another " +
          (flagged.size() == 1 && flagged[0] == std::string("--checkpoint") ? "directory" : "path");
    }
    return FailedPreconditionError(
        (flagged.size() == held.size() ? "the files this run would write are here already: "
                                       : "the outputs of another run are here: ") +
        list +
        ". A new run would replace them: " + (resume_hint.empty() ? "" : resume_hint + ", ") +
        "--overwrite replaces them (removes exactly these), or " + elsewhere);
  }
  return plan;
}

Status RemoveStaleOutputs(const OutputsPlan& plan) {
  std::error_code ec;
  for (const std::string& f : plan.stale_files) {
    if (IsRegular(f) && !IsLink(f)) fs::remove(f, ec);
  }
  for (const std::string& d : plan.stale_checkpoints) RemoveCheckpointFiles(d);
  for (const std::string& d : plan.locked_dirs) RemoveDeadTemporaries(d);
  return Status::OK();
}

Status WriteRunConfigJson(const OutputsPlan& plan) {
  Status s = WriteFileAtomically(plan.config_path, plan.config_text);
  if (!s.ok()) return std::move(s).WithContext("writing the run's config.json");
  return Status::OK();
}

// The outputs' paths defaulted under the run directory; on the lead rank the locks of the run and
// checkpoint directories, and the outputs checked against each other, the inputs and another
// run's files (run_dir.h); every directory they need created before the first step, so a bad path
// fails now and not after the training it was to record. Nothing is removed or written yet: the
// plan says what TrainRun::SetUp does once the set-up is known to be good (RemoveStaleOutputs,
// WriteRunConfigJson), the run's config.json (as configured: without the per-rank NVMe path) among
// it. run_dir.h
StatusOr<OutputsPlan> PrepareOutputs(RunConfig& cfg, const std::string& config_path, int rank,
                                     int world, RunDirLock& lock, MadeDirs& made) {
  const bool lead = rank == 0;
  RunConfig written = cfg;  // config.json: "none" stays "none", the rest as resolved below
  DefaultOutputPaths(cfg);
  OutputOptions& out = cfg.output;
  written.output = out;
  written.engine.nvme_path = cfg.engine.nvme_path;
  if (out.html.empty()) written.output.html = "none";
  if (out.trace.empty()) written.output.trace = "none";
  if (out.checkpoint_dir.empty()) written.output.checkpoint_dir = "none";
  // The run, not how it began: a resumed run's config.json that recorded its --resume, given as
  // a template (`--config RUN/config.json --run-dir NEW`, or in place with --overwrite to start
  // again, as docs/signals.md says), resumed that checkpoint instead (hunt 47). A resume names
  // its checkpoint itself.
  written.output.resume.clear();
  // Note [A run's config from another working directory] (run_flags.cc) takes a relative run
  // directory's recorded paths from the directory the run began in, which it can tell. With an
  // absolute run directory it cannot: a relative --data (or --metrics, --init-from, ...) was
  // recorded as given, and `eval --resume RUN/checkpoint --config RUN/config.json` or a resume
  // from another working directory read another directory's data.bin (hunt 52). Recorded
  // absolute there.
  if (fs::path(written.output.run_dir).is_absolute()) {
    for (std::string* p :
         {&written.output.metrics, &written.output.report, &written.output.html,
          &written.output.trace, &written.output.checkpoint_dir, &written.output.init_from,
          &written.output.plan, &written.engine.nvme_path, &written.data.text_path,
          &written.data.token_path}) {
      if (p->empty() || *p == "none" || *p == "-" || (*p)[0] == '/') continue;
      std::error_code aec;
      std::string a = fs::absolute(*p, aec).string();
      // A glob of token files under a working directory whose name has glob characters
      // ("br[1]/shards/*.bin"): the directory's part escaped, or the glob would read it as a
      // pattern and match nothing (review 52). A file that exists is read as named.
      if (!aec && p == &written.data.token_path) {
        const std::string escaped = EscapedTokenPattern(fs::current_path(aec), *p);
        if (!escaped.empty()) a = escaped;
      }
      if (!aec && FirstInvalidUtf8(a) < 0) *p = a;  // (else as given: JSON)
    }
  }
  // Each rank swaps to its own files.
  if (world > 1) cfg.engine.nvme_path += "/rank" + std::to_string(rank);
  std::error_code ec;
  made.Create(out.run_dir, ec);
  if (ec) {
    // What is in the way, said as what it is (it read "File exists").
    std::string bare = out.run_dir;
    while (bare.size() > 1 && bare.back() == '/') bare.pop_back();
    struct stat lst {
    }, st{};
    if (::lstat(bare.c_str(), &lst) == 0 && S_ISLNK(lst.st_mode) && ::stat(bare.c_str(), &st) != 0)
      return InvalidArgumentError(
          "the run directory " + out.run_dir + " is a symbolic link " +
          (errno == ELOOP ? "in a loop of links" : "to nothing (a dangling link)") +
          ": remove it, make the directory it names, or give --run-dir another path");
    if (::stat(bare.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
      return InvalidArgumentError("the run directory " + out.run_dir + " is " +
                                  FileKindName(st.st_mode) +
                                  ", not a directory: give --run-dir another path");
    return IoError("creating run directory " + out.run_dir + ": " + ec.message());
  }
  if (!fs::is_directory(out.run_dir, ec))
    return InvalidArgumentError("the run directory " + out.run_dir + " is not a directory");
  // The checkpoint directory too, and it must be writable: found before step 1, not at the end.
  // "none": no checkpoint at all (benchmark runs of models whose states would fill the disk).
  if (!out.checkpoint_dir.empty()) made.Create(out.checkpoint_dir, ec);
  if (ec)
    return IoError("creating the checkpoint directory " + out.checkpoint_dir + ": " + ec.message());
  if (!out.checkpoint_dir.empty() && access(out.checkpoint_dir.c_str(), W_OK | X_OK) != 0)
    return IoError("the checkpoint directory " + out.checkpoint_dir +
                   " is not writable: " + std::strerror(errno) +
                   "; give --checkpoint a writable directory (a read-only checkpoint can still "
                   "be resumed from: --resume it with another --run-dir and --checkpoint)");
  // Note [Room for the names a run writes late]
  if (!out.checkpoint_dir.empty())
    TZ_RETURN_IF_ERROR(
        CheckRoomForName(out.checkpoint_dir, kLongestStatesName,
                         "the checkpoint directory (--checkpoint, by default RUN_DIR/checkpoint)"));
  for (const auto& [file, flag] :
       {std::pair{&out.report, "--report"}, std::pair{&out.html, "--html"},
        std::pair{&out.trace, "--trace"}}) {
    if (file->empty()) continue;
    const fs::path f(*file);
    TZ_RETURN_IF_ERROR(CheckRoomForName(f.parent_path().string(), f.filename().string().size(),
                                        std::string(flag) + " " + *file));
  }
  OutputsPlan plan;
  if (lead) {
    // Both locks before any check, so a second run changes nothing.
    TZ_RETURN_IF_ERROR(lock.Acquire(out.run_dir, "run directory"));
    if (!out.checkpoint_dir.empty() && !fs::equivalent(out.checkpoint_dir, out.run_dir, ec))
      TZ_RETURN_IF_ERROR(lock.Acquire(out.checkpoint_dir, "checkpoint directory"));
    TZ_ASSIGN_OR_RETURN(plan, CheckOutputs(cfg, config_path, out.overwrite));
    plan.config_text = RunConfigToJson(written) + "\n";
  }
  for (const std::string* file : {&out.metrics, &out.report, &out.html, &out.trace}) {
    const fs::path dir = fs::path(*file).parent_path();
    if (file->empty() || dir.empty() || !lead) continue;
    made.Create(dir.string(), ec);
    if (ec) return IoError("creating the directory of " + *file + ": " + ec.message());
  }
  if (cfg.engine.nvme_budget > 0) {
    made.Create(cfg.engine.nvme_path, ec);
    if (ec)
      return IoError("creating NVMe directory " + cfg.engine.nvme_path + ": " + ec.message() +
                     (ec == std::errc::not_a_directory || ec == std::errc::file_exists
                          ? " (a file is where the swap directory goes: move it away, or give "
                            "--nvme-path another directory)"
                          : ""));
  }
  return plan;
}

}  // namespace tierzero::app
