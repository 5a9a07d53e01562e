// The run directory and the files a run writes (run_dir.h, docs/outputs.md).
#include "run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>

#include "tierzero/files.h"

namespace tierzero::app {
namespace fs = std::filesystem;

namespace {

// Where a path leads: the file's identity when it exists (links followed), and its absolute path
// with the links of its existing part resolved either way.
struct FileId {
  bool exists = false;
  mode_t mode = 0;
  dev_t dev = 0;
  ino_t ino = 0;
  fs::path path;
};

FileId Identify(const std::string& p) {
  FileId id;
  std::error_code ec;
  id.path = fs::weakly_canonical(fs::absolute(p, ec), ec).lexically_normal();
  if (ec) id.path = fs::absolute(p, ec).lexically_normal();
  struct stat st {};
  if (::stat(p.c_str(), &st) == 0) {
    id.exists = true;
    id.mode = st.st_mode;
    id.dev = st.st_dev;
    id.ino = st.st_ino;
  }
  return id;
}

bool Same(const FileId& a, const FileId& b) {
  if (a.exists && b.exists) return a.dev == b.dev && a.ino == b.ino;
  return a.path == b.path;
}

// `file` lies under the directory `dir` (not equal to it).
bool Inside(const FileId& file, const FileId& dir) {
  const std::string d = dir.path.string(), f = file.path.string();
  if (f.size() <= d.size() || f.compare(0, d.size(), d) != 0) return false;
  return d.back() == '/' || f[d.size()] == '/';
}

bool IsRegular(const std::string& p, off_t* size = nullptr) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  if (size != nullptr) *size = st.st_size;
  return true;
}

// A checkpoint's own files in `dir`: the manifest first (so what remains is no checkpoint), then
// its states files. Regular files of these names only.
void RemoveCheckpointFiles(const std::string& dir) {
  std::error_code ec;
  if (IsRegular(dir + "/manifest.json")) fs::remove(dir + "/manifest.json", ec);
  std::vector<fs::path> states;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("states-", 0) == 0 && IsRegular(it->path().string()))
      states.push_back(it->path());
  }
  for (const fs::path& p : states) fs::remove(p, ec);
}

}  // namespace

RunDirLock::~RunDirLock() {
  for (int fd : fds_) ::close(fd);  // releases the flock
}

Status RunDirLock::Acquire(const std::string& dir, const std::string& what) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("opening the " + what + " " + dir, errno);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return FailedPreconditionError(
          "another tierzero process is writing the " + what + " " + dir +
          " (it holds the directory's lock): a run directory has one writer; wait for that run "
          "to end, or give this one another --run-dir (and --checkpoint)");
    }
    return ErrnoError("locking the " + what + " " + dir, err);
  }
  fds_.push_back(fd);
  return Status::OK();
}

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
  if (cfg.engine.nvme_path.empty()) cfg.engine.nvme_path = out.run_dir + "/nvme";
}

std::vector<std::string> RunFileNames() {
  return {"metrics.jsonl", "report.json",       "report.html",
          "trace.json",    "warmup_trace.json", "config.json"};
}

Status CheckOutputs(const RunConfig& cfg, const std::string& config_path, bool overwrite) {
  const OutputOptions& out = cfg.output;
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
  add_output("the run's config", out.run_dir + "/config.json");
  add_output("the warm-up trace", out.run_dir + "/warmup_trace.json");
  for (const Named& o : outputs) TZ_RETURN_IF_ERROR(CheckOutputPath(o.path, o.what));

  std::vector<Named> inputs;
  auto add_input = [&](const std::string& what, const std::string& path) {
    if (!path.empty()) inputs.push_back({what, path, Identify(path)});
  };
  add_input("--config", config_path);
  if (cfg.data.kind == "text") add_input("--text", cfg.data.text_path);
  add_input("--init-from", out.init_from);
  add_input("--plan", out.plan);
  const std::optional<FileId> resume =
      out.resume.empty() ? std::nullopt : std::optional<FileId>(Identify(out.resume));
  const std::optional<FileId> ckpt = out.checkpoint_dir.empty()
                                         ? std::nullopt
                                         : std::optional<FileId>(Identify(out.checkpoint_dir));
  if (ckpt && ckpt->exists && !S_ISDIR(ckpt->mode)) {
    return InvalidArgumentError("the checkpoint directory " + out.checkpoint_dir + " is " +
                                FileKindName(ckpt->mode) + ", not a directory");
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
      // rewritten as the run's effective config (what a resume and an export read).
      if (o.what == "the run's config" && in.what == "--config") continue;
      if (Same(o.id, in.id))
        return InvalidArgumentError(o.what + " " + o.path + " is the run's input " + in.what +
                                    ": writing it would destroy what the run reads");
    }
    if (resume && Inside(o.id, *resume))
      return InvalidArgumentError(o.what + " " + o.path + " lies inside the checkpoint --resume " +
                                  out.resume + " reads");
    if (ckpt && Inside(o.id, *ckpt))
      return InvalidArgumentError(o.what + " " + o.path + " lies inside the checkpoint directory " +
                                  out.checkpoint_dir + ", which holds the checkpoint's files only");
  }
  if (ckpt) {
    for (const Named& in : inputs) {
      if (Same(*ckpt, in.id) || Inside(in.id, *ckpt))
        return InvalidArgumentError("the checkpoint directory " + out.checkpoint_dir +
                                    " holds the run's input " + in.what + " " + in.path);
    }
  }

  // Note [One run per run directory]: a new run into a directory holding another's checkpoint or
  // metrics replaced them silently (the default run's 1600-step checkpoint lost to a 40-step
  // run), or left the directory holding pieces of two. As Hugging Face's Trainer does for its
  // output_dir, the run is refused unless it continues that run in place or is told to replace it.
  // (--checkpoint none resuming the run directory's own checkpoint continues that run too.)
  const bool in_place = resume && ((ckpt && Same(*resume, *ckpt)) ||
                                   (!ckpt && Same(*resume, Identify(out.run_dir + "/checkpoint"))));
  if (in_place) return Status::OK();
  std::vector<std::string> held;
  if (ckpt && IsRegular(out.checkpoint_dir + "/manifest.json"))
    held.push_back(out.checkpoint_dir + " (a checkpoint)");
  off_t size = 0;
  if (IsRegular(out.metrics, &size) && size > 0) held.push_back(out.metrics + " (metrics)");
  for (const std::string* f : {&out.report, &out.html, &out.trace}) {
    if (!f->empty() && IsRegular(*f)) held.push_back(*f);
  }
  if (!overwrite) {
    if (held.empty()) return Status::OK();
    std::string list;
    for (size_t i = 0; i < held.size(); ++i) list += (i == 0 ? "" : ", ") + held[i];
    std::string resume_hint = "--resume CHECKPOINT continues a run in place";
    if (ckpt && IsRegular(out.checkpoint_dir + "/manifest.json"))
      resume_hint = "--resume " + out.checkpoint_dir + " continues that run";
    return FailedPreconditionError("the outputs of another run are here: " + list +
                                   ". A new run would replace them: " + resume_hint +
                                   ", --overwrite replaces it, or --run-dir DIR starts this run "
                                   "elsewhere");
  }
  // --overwrite: the earlier run's files this run will not write again go now.
  for (const std::string& name : RunFileNames()) {
    const std::string p = out.run_dir + "/" + name;
    const FileId id = Identify(p);
    bool rewritten = false;
    for (const Named& o : outputs) rewritten = rewritten || Same(o.id, id);
    std::error_code ec;
    if (!rewritten && IsRegular(p)) fs::remove(p, ec);
  }
  std::error_code ec;
  if (ckpt && fs::is_directory(out.checkpoint_dir, ec)) RemoveCheckpointFiles(out.checkpoint_dir);
  const std::string default_ckpt = out.run_dir + "/checkpoint";
  if (!ckpt || !Same(Identify(default_ckpt), *ckpt)) {
    if (fs::is_directory(default_ckpt, ec) && !(resume && Same(Identify(default_ckpt), *resume)))
      RemoveCheckpointFiles(default_ckpt);
  }
  return Status::OK();
}

Status CheckNotAnInput(const std::string& output, const std::string& what,
                       const std::vector<InputPath>& inputs) {
  const FileId out = Identify(output);
  if (out.exists && S_ISCHR(out.mode)) return Status::OK();  // /dev/null, /dev/stdout
  for (const InputPath& in : inputs) {
    if (in.path.empty()) continue;
    const FileId id = Identify(in.path);
    if (Same(out, id))
      return InvalidArgumentError(what + " " + output + " is the " + in.what +
                                  " this command reads: writing it would destroy its input");
    if (in.directory && Inside(out, id))
      return InvalidArgumentError(what + " " + output + " lies inside the " + in.what + " " +
                                  in.path + " this command reads: write it elsewhere");
  }
  return Status::OK();
}

}  // namespace tierzero::app
