#include "train.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <system_error>
#include <utility>
#include <vector>

#include "plan_check.h"
#include "progress.h"
#include "resume.h"
#include "run_dir.h"
#include "signals.h"
#include "tierzero/files.h"
#include "tierzero/report.h"
#include "train_run.h"

namespace tierzero::app {
namespace fs = std::filesystem;
using nlohmann::json;

StatusOr<std::string> ReadTextFile(const std::string& path, const std::string& what) {
  return ReadFileBounded(path, kMaxConfigBytes * 4, what);
}

// train.h
LauncherRanks LaunchedRanks() {
  static constexpr const char* kVars[][2] = {{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                                             {"PMI_RANK", "PMI_SIZE"},
                                             {"PMIX_RANK", "PMIX_SIZE"},
                                             // (Per srun step: SLURM_NTASKS is also set in
                                             // an sbatch script or salloc shell, one process.)
                                             {"SLURM_PROCID", "SLURM_STEP_NUM_TASKS"}};
  for (const auto& v : kVars) {
    const char* rank = std::getenv(v[0]);
    const char* size = std::getenv(v[1]);
    if (size != nullptr && std::atoi(size) > 1)
      return {rank != nullptr ? std::atoi(rank) : 0, std::atoi(size)};
  }
  return {};
}

// train.h
int RefuseUnderLauncher(const char* command, const char* why) {
  const LauncherRanks l = LaunchedRanks();
  if (l.size <= 1) return 0;
  if (l.rank == 0)
    std::fprintf(stderr, "error: tierzero %s runs in one process (%s): run it without mpirun\n",
                 command, why);
  return 2;
}

StatusOr<std::shared_ptr<Communicator>> RunCommunicator(const RanksOptions& o) {
  const LauncherRanks l = LaunchedRanks();
  if (l.size <= 1) return Communicator::Single();
  auto comm = Communicator::Mpi(o.ranks_per_node);
  if (!comm.ok())
    return std::move(comm).status().WithContext("started by a launcher as rank " +
                                                std::to_string(l.rank) + " of " +
                                                std::to_string(l.size));
  (*comm)->SetTimeout(o.collective_timeout_s);
  return comm;
}

// train.h
double LearningRate(const TrainOptions& t, int step) {  // step: 0-based
  if (t.warmup_steps > 0 && step < t.warmup_steps)
    return t.lr * static_cast<double>(step + 1) / t.warmup_steps;
  const int decay = std::max(1, t.steps - t.warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - t.warmup_steps) / decay);
  return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + std::cos(3.14159265358979323846 * progress));
}

std::string Mib(uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", static_cast<double>(b) / (1 << 20));
  return buf;
}

namespace {

// The ranks of this run (mpirun) or one; Fail ends every rank when there are several.
std::shared_ptr<Communicator> g_comm;
// This rank joined the launcher's job at the start (Communicator::InitMpi).
bool g_joined = false;

int Fail(const Status& s) {
  if (g_comm && g_comm->size() > 1) {
    std::fprintf(stderr, "rank %d of %d: error: %s\n", g_comm->rank(), g_comm->size(),
                 s.ToString().c_str());
    // Note [A failing rank ends the run]
    // A rank that fails outside a collective (its set-up, a file it cannot read) cannot tell the
    // others, which would wait in their next collective until its timeout: it says which rank
    // failed and why, then aborts the job (MPI_Abort), so every rank ends at once and mpirun
    // reports the failure. Failures inside collectives are agreed on instead (Note [Agreeing on
    // an outcome], comm/collective.h) and every rank fails with the same message.
    g_comm->Abort(1);
  }
  // Before the communicator exists (the config would not load): the rank as the launcher
  // numbered it, so the failing one is named.
  if (const LauncherRanks l = LaunchedRanks(); !g_comm && l.size > 1) {
    std::fprintf(stderr, "rank %d of %d: error: %s\n", l.rank, l.size, s.ToString().c_str());
    // Joined, it ends the job at once, as a failing rank with its communicator does: its exit
    // would wait in MPI_Finalize for the others, and they in their first collective for its
    // deadline (review 49). (The joined world needs no collective to become a communicator.)
    if (g_joined) {
      if (auto c = Communicator::Mpi(); c.ok()) (*c)->Abort(1);
    }
    return 1;
  }
  std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int FailUncaught(const Status& s) { return Fail(s); }  // train.h

Status TrainRun::SetUp() {
  TZ_RETURN_IF_ERROR(ReadPlan());  // (train_plan.cc)
  // Note [Ranks agree on their data]: a rank that cannot read its data says so, and the others
  // end with it, not by the job's abort (which left the lead's directories behind) nor, where it
  // blocks, after the collective deadline. With several ranks each reads the text itself: a
  // FIFO there (one rank's blocked the others for the whole deadline: hunt 49) is refused.
  StatusOr<std::unique_ptr<gpt::Dataset>> data = [&]() -> StatusOr<std::unique_ptr<gpt::Dataset>> {
    struct stat st {};
    if (world_ > 1 && cfg_.data.kind == "text" && ::stat(cfg_.data.text_path.c_str(), &st) == 0 &&
        !S_ISREG(st.st_mode))
      return InvalidArgumentError("the text file '" + cfg_.data.text_path + "' is " +
                                  FileKindName(st.st_mode) +
                                  ", not a regular file: with several ranks each reads it itself "
                                  "(write it to a file first)");
    return gpt::Dataset::Create(cfg_.data, cfg_.model.seq_len, cfg_.model.vocab);
  }();
  if (world_ > 1) {
    TZ_ASSIGN_OR_RETURN(const std::vector<uint64_t> read_ok,
                        AllGatherValue(*comm_, uint64_t{data.ok()}));
    if (std::any_of(read_ok.begin(), read_ok.end(), [](uint64_t r) { return r == 0; })) {
      agreed_failure_ = true;
      speaks_ = !data.ok();  // each failing rank says its own; the others end quietly
      if (data.ok())
        return FailedPreconditionError("another rank could not read its data (it says why)");
    }
  }
  TZ_ASSIGN_OR_RETURN(dataset_, std::move(data));
  if (world_ > 1) {
    // Note [Ranks agree before they compute] (agree.cc) compares the configs, whose data is a
    // path: the same path on two machines can name different files.
    TZ_ASSIGN_OR_RETURN(const std::vector<uint64_t> prints,
                        AllGatherValue(*comm_, dataset_->Fingerprint()));
    for (size_t r = 1; r < prints.size(); ++r) {
      if (prints[r] != prints[0]) {
        agreed_failure_ = true;  // every rank knows: none needs the job aborted
        return FailedPreconditionError(
            "the ranks read different data: rank " + std::to_string(r) +
            "'s is not rank 0's (the same path names different files on the ranks' machines?; "
            "rank " +
            std::to_string(rank_) + " reads " + dataset_->Describe() +
            "): give every rank the same data");
      }
    }
    // Note [A checkpoint directory the ranks share] (checkpoint.cc) is checked at every save;
    // found only then, a run without one shared directory trained to its first save and lost
    // it all. Rank 0 holds its lock file in the checkpoint directory (made before the other
    // ranks looked: Train): every rank must see that very file.
    if (!out_.checkpoint_dir.empty()) {
      struct stat st {};
      const std::string lock_file = out_.checkpoint_dir + "/" + kLockFileName;
      const uint64_t seen =
          ::stat(lock_file.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
      TZ_ASSIGN_OR_RETURN(const std::vector<uint64_t> all, AllGatherValue(*comm_, seen));
      for (size_t r = 1; r < all.size(); ++r) {
        if (all[r] != all[0] || all[0] == 0) {
          agreed_failure_ = true;
          return FailedPreconditionError(
              "the checkpoint directory " + out_.checkpoint_dir +
              " is not one directory the ranks share: rank " + std::to_string(r) +
              " does not see the one rank 0 made (the same path on machines without a shared "
              "file system?); give --checkpoint a directory on a file system every rank "
              "mounts (nothing was trained)");
        }
      }
    }
  }
  int64_t resumed_step = 0;
  if (!out_.resume.empty()) {
    // The model checked before anything is built for it (Note [A checkpoint resumes its own
    // model]).
    StatusOr<CheckpointInfo> read = ReadCheckpointInfo(out_.resume);
    // A checkpoint no rank can read is a failure they all know: the lead says it (the others
    // each printed their own NotFound beside the lead's advice, then an abort; hunt 46).
    if (world_ > 1) {
      TZ_ASSIGN_OR_RETURN(const std::vector<uint64_t> read_ok,
                          AllGatherValue(*comm_, uint64_t{read.ok()}));
      if (std::all_of(read_ok.begin(), read_ok.end(), [](uint64_t r) { return r == 0; })) {
        agreed_failure_ = true;
        speaks_ = lead_;
      }
    }
    // A run stopped (killed) before its first save leaves its checkpoint directory without a
    // manifest: nothing to resume, and what to do is start it again.
    std::error_code ec;
    if (!read.ok() && read.status().code() == StatusCode::kNotFound && outputs_.in_place &&
        fs::is_directory(out_.resume, ec)) {
      const std::string run_dir = out_.run_dir.empty() ? "." : out_.run_dir;
      // A states file there without its manifest is a save that never committed, or whose
      // manifest was removed since: said as what is there, not as a run that saved nothing
      // (hunt 51), and --overwrite said to remove it too.
      std::string states;
      for (const auto& e : fs::directory_iterator(out_.resume, ec)) {
        const std::string n = e.path().filename().string();
        if (n.rfind("states-", 0) == 0 && n.size() > 4 && n.ends_with(".bin")) {
          states = n;
          break;
        }
      }
      return FailedPreconditionError(
          std::string(read.status().message()) + ": the run in " + run_dir +
          (states.empty()
               ? " stopped before it saved its first checkpoint, so there is nothing to resume"
               : " holds " + states +
                     " without the manifest.json that commits it (a save cut short, or its "
                     "manifest removed since), which no run can resume") +
          "; start it again in its place: tierzero train --config " +
          (fs::path(run_dir) / "config.json").string() + " --run-dir " + run_dir +
          " --overwrite (replaces that run's outputs" +
          (states.empty() ? "" : ", " + states + " among them") + ")");
    }
    TZ_ASSIGN_OR_RETURN(const CheckpointInfo info, std::move(read));
    TZ_RETURN_IF_ERROR(CheckSameModel(info.user_state, cfg_, out_.resume));
    // Resumed in place, a checkpoint at or past the last step has nothing left to train: refused
    // before the run's report, page and metrics are written over with those of no step (Note
    // [The loop's step, not the applied count], below, for which step). Into another run
    // directory it is a copy: re-saved there, on this run's ranks (resharding).
    const int64_t ckpt_step = resumed_step = CheckpointStep(info.user_state, info.step);
    if (outputs_.in_place && ckpt_step >= cfg_.train.steps) {
      return FailedPreconditionError(
          "the checkpoint " + out_.resume + " is at step " + std::to_string(ckpt_step) +
          ", and this run ends at step " + std::to_string(cfg_.train.steps) +
          " (train.steps, --steps): nothing is left to train. Give --steps above " +
          std::to_string(ckpt_step) + " to continue it (" +
          (cfg_.data.kind == "tokens"
               ? "tierzero eval --resume " + out_.resume + " --data PATH evaluates it; "
               : std::string()) +
          "--config " + out_.run_dir + "/config.json --resume " + out_.resume +
          " --run-dir DIR re-saves it elsewhere); nothing was written");
    }
  }
  if (Status s = CheckProfileStep(cfg_, resumed_step, lead_); !s.ok()) {
    agreed_failure_ = true;  // (every rank, from the config alike: Note [A step the report...])
    speaks_ = lead_;
    return s;
  }
  TZ_ASSIGN_OR_RETURN(engine_, Engine::Create(cfg_.engine, comm_));
  TZ_ASSIGN_OR_RETURN(model_, gpt::Gpt::Create(*engine_, cfg_.model));
  const auto init_t0 = std::chrono::steady_clock::now();
  TZ_RETURN_IF_ERROR(engine_->Finalize());
  const double init_s = SecondsSince(init_t0);
  // Before the step-0 evaluation: every rank plans the same run, and refuses it together.
  // (The ranks' machines may differ in memory: each checks its own, and all learn of a refusal.)
  Status fit = CheckPredictedFit(cfg_, world_, comm_->topology().local_size);
  if (world_ > 1) {
    TZ_ASSIGN_OR_RETURN(const std::vector<uint64_t> fit_ok,
                        AllGatherValue(*comm_, uint64_t{fit.ok()}));
    const auto first_refusing = std::find(fit_ok.begin(), fit_ok.end(), uint64_t{0});
    if (first_refusing != fit_ok.end()) {
      agreed_failure_ = true;
      speaks_ = first_refusing - fit_ok.begin() == rank_;  // one says it, not every rank alike
      if (fit.ok()) return FailedPreconditionError("another rank refused the run (it says why)");
    }
  }
  if (!fit.ok()) {
    speaks_ = speaks_ || world_ == 1;
    return fit;
  }
  if (!out_.init_from.empty()) {
    TZ_ASSIGN_OR_RETURN(init_note_, LoadInitFrom(*engine_, cfg_));
  }
  if (!out_.resume.empty()) {
    TZ_ASSIGN_OR_RETURN(const std::string user, engine_->LoadCheckpoint(out_.resume));
    resumed_user_ = user;
    // Note [The loop's step, not the applied count]: the engine counts the updates it applied
    // (Adam's bias correction needs that); a step skipped for a non-finite gradient is still a
    // step of the loop (its data, its learning rate, its metrics line). A checkpoint records the
    // loop's step in its user state, and a resume starts there, so 10 + 10 resumed steps are the
    // 20 uninterrupted ones.
    start_ = static_cast<int>(CheckpointStep(user, static_cast<int64_t>(engine_->step())));
    data_base_ = CheckpointMicroBatches(user, start_, world_, cfg_.engine.grad_accumulation);
    if (lead_)
      ReportRunChanges(user, out_.resume, cfg_, world_, start_, dataset_->Fingerprint(),
                       model_->ActivationsType());
    // Note [A resume that is a copy]
    // A resume into a run directory other than the checkpoint's own is a copy: the run goes on
    // here, its directory stays at the step resumed. That was said nowhere but the closing
    // lines' paths: `--config MY.json --resume C/checkpoint`, the first command again with
    // --resume, went on in the config's run directory (runs/default), C left at step 10 (hunt
    // 51). Said at the start, with the flag that continues it in place.
    if (lead_ && !outputs_.in_place) {
      fs::path ck = fs::path(out_.resume).lexically_normal();
      if (ck.has_parent_path() && ck.filename().empty()) ck = ck.parent_path();
      fs::path its = ck.parent_path();
      if (its.empty()) its = ".";
      std::error_code fec;
      if (fs::is_regular_file(its / "config.json", fec) && !fs::equivalent(its, out_.run_dir, fec))
        std::printf(
            "note: resuming %s (step %d) as a copy into %s: %s stays at step %d "
            "(--run-dir %s continues that run in place)\n",
            out_.resume.c_str(), start_, out_.run_dir.c_str(), its.c_str(), start_, its.c_str());
    }
    // Note [An evaluation a stop left undone]
    // A run stopped by a data error at its scheduled evaluation (or before it, by a metrics line
    // that could not be written) saved the step with its evaluation undone, and a resume starts
    // after it: the evaluation would be missing from the metrics for good. The checkpoint says
    // so ("eval_pending"), and the resumed run evaluates that step before it trains.
    const json u = json::parse(user, nullptr, /*allow_exceptions=*/false);
    // (A type other than a boolean, in an edited manifest, is not pending: value() would throw.)
    eval_at_start_ = u.is_object() && u.contains("eval_pending") && u["eval_pending"] == true;
  }
  TZ_RETURN_IF_ERROR(CheckPlanLayout());  // (train_plan.cc)
  // The set-up is good: only now is an earlier run's output removed (--overwrite) and the run's
  // config.json written. A config.json this run creates is removed again if the run fails before
  // its first step (a metrics FIFO with no reader): the directory then holds no trace of it, and
  // the corrected command is not refused as "another run's outputs".
  // (Also if it ends on a signal meanwhile: RemoveOnSignalExit.)
  // (Removed by name only while the name is still the file this run wrote.)
  struct UndoConfig {
    std::string path;
    bool armed = false;
    std::string stamp;
    void Arm() {
      armed = true;
      stamp = FileStamp(path);
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
      if (fd >= 0) {
        RemoveOnSignalExitIfSame(path, fd);
        ::close(fd);
      }
    }
    ~UndoConfig() {
      if (armed) {
        KeepOnSignalExit(path);
        if (FileStamp(path) == stamp) ::unlink(path.c_str());
      }
    }
  } undo_config{outputs_.config_path, false, {}};
  // Every rank past its set-up (a checkpoint loaded) before the lead replaces anything.
  if (world_ > 1) TZ_RETURN_IF_ERROR(comm_->Barrier());
  if (lead_) {
    // Another run writing the same metrics file is refused before anything is removed.
    TZ_RETURN_IF_ERROR(LockMetrics(-1));
    TZ_RETURN_IF_ERROR(RemoveStaleOutputs(outputs_));
  }
  // A run resumed in place continues the metrics of the checkpoint's step: lines of later steps
  // (written before a crash or a kill, after the checkpoint) and a torn last line are dropped
  // first, so the file never holds a step twice. Any other run starts its metrics file empty.
  if (lead_) {
    const bool append = start_ > 0 && outputs_.in_place;
    // Note [Metrics lines a stop left unwritten].
    std::vector<std::string> unwritten;
    bool appended = false;
    if (append) {
      const json u = json::parse(resumed_user_, nullptr, /*allow_exceptions=*/false);
      if (u.is_object() && u.contains("metrics_unwritten") && u["metrics_unwritten"].is_array()) {
        for (const json& l : u["metrics_unwritten"])
          if (l.is_object()) unwritten.push_back(l.dump());
      }
      TZ_RETURN_IF_ERROR(TrimMetrics(out_.metrics, start_, unwritten, &appended));
    }
    struct stat st {};
    const bool metrics_new = ::lstat(out_.metrics.c_str(), &st) != 0 && errno == ENOENT;
    // (This run took the file's lock above, LockMetrics(-1), when it was there: another run's
    // lock had been refused then.)
    TZ_ASSIGN_OR_RETURN(metrics_fd_, OpenOutputStream(out_.metrics, append, "the metrics file",
                                                      /*own_locked=*/true));
    TZ_RETURN_IF_ERROR(LockMetrics(metrics_fd_));
    // Into a stream, or a file made anew, the lines TrimMetrics had nowhere to add.
    if (!appended) {
      for (const std::string& l : unwritten) {
        TZ_RETURN_IF_ERROR(WriteMetrics(json::parse(l)));
        TZ_RETURN_IF_ERROR(pending_);
      }
    }
    // Made by this run, and locked: two runs started together may both have found no file, and
    // the one refused by the other's lock must not remove the file the other writes.
    if (metrics_new) {
      metrics_made_ = true;
      // Note [A run that trained nothing leaves nothing]; only while the name is this file.
      RemoveOnSignalExitIfSame(out_.metrics, metrics_fd_);
    }
  }
  // Note [A resume's config.json written last]: the run's config.json after every other step of
  // the set-up that can fail. A resume whose metrics could not be trimmed or appended to (a full
  // disk) had already written its new flags over its run's config.json, which the next plain
  // resume took (hunt 49: lr 0.5 for a run that never trained with it).
  if (lead_) {
    struct stat st {};
    const bool config_new = ::lstat(outputs_.config_path.c_str(), &st) != 0 && errno == ENOENT;
    TZ_RETURN_IF_ERROR(WriteRunConfigJson(outputs_));
    if (config_new) {
      undo_config.Arm();
      config_made_ = true;
      config_stamp_ = FileStamp(outputs_.config_path);
    }
  }
  // The destructor's undo ends here; a signal's stays until the first step (Note [A run that
  // trained nothing leaves nothing]).
  undo_config.armed = false;
  // A signal from here on stops the run after a step and saves (Note [Signals on one thread of
  // ours]); before, it ends the process (nothing trained yet, nothing to save).
  SetStopSaves(!out_.checkpoint_dir.empty(), start_ > 0);
  if (world_ > 1) SetStopsAtOnce(true);  // until StartKept
  if (lead_) RecordOutputs();
  EndSetUp();
  PrintHeader(init_s);
  progress_ = std::make_unique<Progress>(start_, cfg_.train.steps, cfg_.train.log_every, out_.quiet,
                                         lead_ && ::isatty(STDOUT_FILENO) == 1);
  return Status::OK();
}

// Note [A run that trained nothing leaves nothing]
// A run that fails after its set-up but before its first step ends (its step-0 evaluation runs
// out of memory, its metrics line cannot be written, a model setting is refused when the model
// first runs) has trained nothing and saved nothing, yet its config.json made the corrected
// command be refused as "another run's outputs", with advice to --resume a checkpoint that does
// not exist. So the config.json and the metrics file the run created stay registered for a
// signal's exit until its first step ends (TrainRun::StartKept), and a failure before then
// removes them (UndoStart), with the directories and lock files it made (train.cc's Train).
bool TrainRun::TrainedNothing() const { return model_step_ == start_ && saved_step_ < 0; }

void TrainRun::StartKept() {
  SetStopsAtOnce(false);
  if (config_made_) KeepOnSignalExit(outputs_.config_path);
  if (metrics_made_) KeepOnSignalExit(out_.metrics);
  config_made_ = metrics_made_ = false;
  if (on_started_) {
    on_started_();
    on_started_ = nullptr;
  }
}

void TrainRun::UndoStart() {
  // Each removed by name only while the name is still the file this run made: one put there
  // since is someone else's.
  bool metrics_same = false;
  if (metrics_fd_ >= 0) {
    struct stat mine {
    }, now{};
    metrics_same = ::fstat(metrics_fd_, &mine) == 0 && ::lstat(out_.metrics.c_str(), &now) == 0 &&
                   mine.st_dev == now.st_dev && mine.st_ino == now.st_ino;
    ::close(metrics_fd_);
  }
  metrics_fd_ = -1;
  if (metrics_made_ && metrics_same) ::unlink(out_.metrics.c_str());
  if (config_made_ && FileStamp(outputs_.config_path) == config_stamp_)
    ::unlink(outputs_.config_path.c_str());
  // (What StartKept lets go of, but a stop stays at once: the run is ending, its first step
  // never will, and a signal now (mpirun's, as another rank aborts) must not promise a save.)
  StartKept();
  if (world_ > 1) SetStopsAtOnce(true);
}

void TrainRun::PrintHeader(double init_s) const {
  // The model's states a parameter, as this run holds them (it said 16 bytes whatever the
  // compute type, accumulation or moments: figures hunt 47): the parameter in the compute type,
  // its gradient (fp32 when accumulated), the fp32 master, and the moments in their format
  // (int8: codes in blocks of 64, a float scale per block and moment).
  const EngineConfig& e = cfg_.engine;
  const double param = static_cast<double>(DTypeBytes(e.compute_dtype, 1));
  const double moments = e.optimizer_states == MomentFormat::kBF16   ? 4
                         : e.optimizer_states == MomentFormat::kInt8 ? 2 + 2 * 4.0 / 64
                                                                     : 8;
  const double states = static_cast<double>(model_->num_params()) *
                        (param + (e.grad_accumulation > 1 ? 4 : param) + 4 + moments);
  std::printf("tierzero train: %s %d layers x %d wide, %lld parameters (%s MiB of model states)\n",
              gpt::ModelName(cfg_.model), cfg_.model.n_layer, cfg_.model.d_model,
              static_cast<long long>(model_->num_params()),
              Mib(static_cast<uint64_t>(states)).c_str());
  if (!init_note_.empty()) std::printf("  init: %s\n", init_note_.c_str());
  std::printf("  compute: %s\n", model_->ComputeSummary().c_str());
  std::printf("  data: %s\n", dataset_->Describe().c_str());
  std::printf("  budgets: device %s MiB, host %s MiB, NVMe %s MiB under %s; %s compute\n",
              Mib(cfg_.engine.device_budget).c_str(), Mib(cfg_.engine.host_budget).c_str(),
              Mib(cfg_.engine.nvme_budget).c_str(), cfg_.engine.nvme_path.c_str(),
              std::string(DTypeName(cfg_.engine.compute_dtype)).c_str());
  // The summary's lines (the chunks, then a line per tier) indented under "placement:".
  std::string placement = engine_->PlacementSummary();
  for (size_t at = placement.find('\n'); at != std::string::npos;
       at = placement.find('\n', at + 1)) {
    placement.insert(at + 1, "    ");
  }
  const std::string chunks = placement.substr(0, placement.find('\n'));
  const std::string tiers =
      placement.find('\n') == std::string::npos ? "" : placement.substr(placement.find('\n'));
  std::printf("  placement: %s%s%s\n", chunks.c_str(),
              world_ > 1 ? (" (per rank, " + std::to_string(world_) + " ranks)").c_str() : "",
              tiers.c_str());
  std::printf("  initialised in %.1f s\n", init_s);
  if (start_ > 0) std::printf("  resumed from %s at step %d\n", out_.resume.c_str(), start_);
  std::fflush(stdout);
}

int Train(const std::vector<std::string>& given_args) {
  // Note [Every rank joins before it reads] (tierzero/communicator.h): under a launcher, before
  // any input is read (its --help too: a peer that printed only its help held the others in
  // MPI_Init). A failure is said where the run makes its communicator.
  g_joined = LaunchedRanks().size > 1 && Communicator::InitMpi().ok();
  for (const std::string& a : given_args) {
    if (a == "-h" || a == "--help") {
      std::fputs(TrainHelp(), stdout);
      return 0;
    }
  }
  // From here to the end, SIGINT and SIGTERM ask the run to stop after its current (or first)
  // step and save (Note [Signals on one thread of ours], signals.h).
  // Until the run's set-up ends (TrainRun::SetUp), a signal ends the process at once: a read
  // of a FIFO or a long initialisation is not waited for (nothing is trained or saved yet).
  GracefulInterrupts graceful(/*during_setup=*/true);
  ClearInterrupt();
  const StatusOr<std::vector<std::string>> with_config = WithResumedRunsConfig(given_args);
  if (!with_config.ok()) return Fail(with_config.status());
  const std::vector<std::string>& args = *with_config;
  std::string config_path;
  auto cfg = LoadRunConfig(args, &config_path);
  if (!cfg.ok()) return Fail(cfg.status());
  {
    auto comm = RunCommunicator(cfg->ranks);
    if (!comm.ok()) return Fail(comm.status());
    g_comm = *comm;
  }
  const int rank = g_comm->rank();
  if (Status s = ShareMachineBudgets(*g_comm, *cfg); !s.ok()) return Fail(s);
  if (Status s = AgreeOnRunConfig(*g_comm, *cfg); !s.ok()) {
    // Every rank knows: each fails on its own, rank 0 says why (Note [Ranks agree before they
    // compute]).
    if (rank == 0) std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  }
  if (rank != 0) {  // rank 0 prints
    std::fflush(stdout);
    if (std::freopen("/dev/null", "w", stdout) == nullptr) return Fail(IoError("silencing rank"));
  }
  // A set-up that fails on this rank alone ends the job (Fail): what this rank made for the run
  // (its directories, lock files, config.json) is removed first, as the scope below unwinds
  // (Note [A set-up ended by a signal leaves nothing], run_dir.h).
  Status failed;
  // Failed as every rank agreed (TrainRun::AgreeToGoOn), said here or not, this rank's own error.
  bool agreed = false, speaks = true, own = true;
  {
    // (Destroyed in reverse: the locks released, and the lock files this run made removed,
    // before the directories it made are, which then skip any another process holds.)
    MadeDirs made;    // removed again if the run is refused before it starts
    RunDirLock lock;  // held to the end of the run
    // The lead makes the shared directories (the run's, the checkpoint's) before the others
    // look: a rank that fails alone then removes only what is its own, never a directory the
    // lead is using (Note [A set-up ended by a signal leaves nothing], run_dir.h).
    if (rank != 0) {
      if (Status s = g_comm->Barrier(); !s.ok()) return Fail(s);
    }
    auto outputs = PrepareOutputs(*cfg, config_path, rank, g_comm->size(), lock, made);
    if (rank == 0 && g_comm->size() > 1 && outputs.ok()) {
      if (Status s = g_comm->Barrier(); !s.ok()) return Fail(s);
    }
    if (!outputs.ok()) {
      failed = outputs.status();
    } else {
      TrainRun run(std::move(*cfg), std::move(outputs).value(), g_comm);
      run.SetDirLock(&lock);
      run.OnStarted([&made, &lock] {
        made.KeepOnSignal();
        lock.KeepOnSignal();
      });
      if (Status s = CatchingExceptions([&] { return run.SetUp(); }); !s.ok()) {
        run.UndoStart();
        if (run.agreed_failure()) {
          if (run.speaks())
            std::fprintf(stderr, "rank %d of %d: error: %s\n", rank, g_comm->size(),
                         s.ToString().c_str());
          // Note [A refused start leaves no trace on any rank]: the lead's directories (the
          // run's, its nvme/) hold the others' (nvme/rankR), which go first; the lead's then go
          // as the scope unwinds. Each rank removing its own at once left RUN_DIR/nvme behind
          // about half the time (hunt 49).
          if (g_comm->size() > 1) {
            if (rank != 0) made.Undo();
            (void)g_comm->Barrier();
          }
          return 1;
        }
        failed = s;
      } else {
        Status ended = CatchingExceptions([&] { return run.Loop(); });
        if (!ended.ok() && run.TrainedNothing()) {
          // Note [A run that trained nothing leaves nothing]: what it made goes as the scope
          // unwinds, before Fail.
          run.UndoStart();
        } else {
          made.Keep();
          lock.Keep();
          if (ended.ok()) ended = CatchingExceptions([&] { return run.Finish(); });
          if (ended.ok()) return 0;
          // This rank's alone (the engine's, a collective's): the job ends at once, with the
          // engine as it is, not after its teardown waits out collectives in flight.
          if (!run.agreed_failure()) return Fail(ended);
        }
        failed = ended;
        agreed = run.agreed_failure();
        speaks = run.speaks();
        own = run.own_failure();
      }
    }
  }
  if (agreed) {
    // Every rank knows and ends on its own; the lead says why (Note [A checkpoint after a data
    // error], train_loop.cc).
    if (speaks && own && g_comm->size() > 1)
      std::fprintf(stderr, "rank %d of %d: error: %s\n", rank, g_comm->size(),
                   failed.ToString().c_str());
    else if (speaks)  // (one rank's; or another rank's, which the message names)
      std::fprintf(stderr, "error: %s\n", failed.ToString().c_str());
    return 1;
  }
  return Fail(failed);
}

}  // namespace tierzero::app
