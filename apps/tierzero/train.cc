#include "train.h"

#include <fcntl.h>
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
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>
#include <vector>

#include "progress.h"
#include "resume.h"
#include "run_dir.h"
#include "signals.h"
#include "tierzero/files.h"
#include "tierzero/report.h"

namespace tierzero::app {
namespace fs = std::filesystem;
using nlohmann::json;

StatusOr<std::string> ReadTextFile(const std::string& path, const std::string& what) {
  return ReadFileBounded(path, kMaxConfigBytes * 4, what);
}

StatusOr<std::shared_ptr<Communicator>> RunCommunicator(const RanksOptions& o) {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"}) {
    const char* v = std::getenv(var);
    if (v != nullptr && std::atoi(v) > 1) {
      auto comm = Communicator::Mpi(o.ranks_per_node);
      if (!comm.ok()) {
        return std::move(comm).status().WithContext(std::string(var) + " is " + v +
                                                    ": started as one of several ranks");
      }
      (*comm)->SetTimeout(o.collective_timeout_s);
      return comm;
    }
  }
  return Communicator::Single();
}

// train.h
double LearningRate(const TrainOptions& t, int step) {  // step: 0-based
  if (t.warmup_steps > 0 && step < t.warmup_steps)
    return t.lr * static_cast<double>(step + 1) / t.warmup_steps;
  const int decay = std::max(1, t.steps - t.warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - t.warmup_steps) / decay);
  return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + std::cos(3.14159265358979323846 * progress));
}

namespace {

std::string Mib(uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", static_cast<double>(b) / (1 << 20));
  return buf;
}

// The ranks of this run (mpirun) or one; Fail ends every rank when there are several.
std::shared_ptr<Communicator> g_comm;

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
  std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
  return 1;
}

constexpr const char* kTrainHelp = R"(usage: tierzero train [--config FILE] [options]

Trains the built-in GPT (default: 2-digit addition, zero-padded, 1600 steps of 32 rows, with a
model whose states are 2.9x the device budget and larger than the host budget, so device, host
and NVMe are all used). Every config field is documented in docs/config.md; these options
override the config:

  --config FILE          JSON config (sections model, data, train, engine, output)
  --steps N              optimizer steps               --batch-size N   rows per micro-batch
  --lr X                 peak learning rate            --eval-every N   steps between evaluations
  --device auto|cuda|host                              --dtype bf16|fp16|fp32
  --device-budget SIZE   --host-budget SIZE            --nvme-budget SIZE   --nvme-path DIR
  --grad-accumulation N  --layers N  --width N  --heads N  --checkpoint-activations
  --activations auto|fp32|bf16   the type activations are stored in (model.activations)
  --arch gpt2|llama      the architecture (model.arch; docs/models.md)   --kv-heads N
  --optimizer-states fp32|bf16|int8   how Adam's m and v are stored (engine.optimizer_states)
  --text FILE            train on a UTF-8 text file (byte-level) instead of addition
  --data PATH            train on token files: llm.c shards or raw uint16 .bin (a file or a
                         glob of shards; set model.vocab to the tokenizer's, docs/data.md)
  --seq-len T            context length (model.seq_len)
  --vocab N              vocabulary size (model.vocab; a tokenizer's, for --data)
  --seed N               data seed
  --run-dir DIR          outputs (default runs/default)
  --metrics FILE         JSON lines, one per step and per evaluation (default RUN_DIR/metrics.jsonl)
  --report FILE          memory placement report (default RUN_DIR/report.json)
  --profile-step N       profile step N for the report (default: the first planned iteration)
  --html FILE            the report as an HTML page, charts that open offline
                         (default RUN_DIR/report.html; none: not written)
  --trace FILE           the profiled iteration as a Chrome trace for Perfetto
                         (default RUN_DIR/trace.json; none: not written)
  --checkpoint DIR       where checkpoints go (default RUN_DIR/checkpoint; none: no checkpoint)
  --resume DIR           continue from a checkpoint
  --init-from FILE       start from a safetensors file's parameters
  --plan FILE            this run's `tierzero plan --json` file: the report (summary, page)
                         shows the prediction beside what the run measured
  --overwrite            replace another run's outputs in RUN_DIR (refused without it)
  --log-every N          without a terminal, a step line every N steps (default: ~20 lines)
  --quiet                no per-step lines

A run directory holding another run is refused: --resume RUN_DIR/checkpoint continues it,
--overwrite replaces it (docs/outputs.md). One process writes a run directory at a time.
Ctrl-C (SIGINT) or SIGTERM finishes the current step, saves a checkpoint and exits 0 (during the
run's set-up, before its first line, it ends the process at once: nothing is saved yet).
)";

}  // namespace

namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One `tierzero train` run after its config: the data, the engine and the model, the step loop
// with its evaluations and checkpoints, and what is written at the end.
class TrainRun {
 public:
  TrainRun(RunConfig cfg, OutputsPlan outputs, int rank, int world)
      : cfg_(std::move(cfg)),
        outputs_(std::move(outputs)),
        out_(cfg_.output),
        rank_(rank),
        world_(world),
        lead_(rank == 0) {}
  ~TrainRun() {
    if (metrics_fd_ >= 0) ::close(metrics_fd_);
    if (metrics_lock_fd_ >= 0) ::close(metrics_lock_fd_);
  }

  // The dataset, engine and model; the starting point (--init-from, --resume); the header lines;
  // the metrics file.
  Status SetUp();
  // The steps, with evaluations and checkpoints on their schedules, until the last step or an
  // agreed interrupt.
  Status Loop();
  Status LockMetrics(int fd);
  // The last evaluation and checkpoint; on the lead rank the report, its renderings and the
  // closing lines.
  Status Finish();

 private:
  Status Evaluate(int step);
  Status Save(int step);
  // Note [A checkpoint after a data error]: `s` with a checkpoint of model_step_ saved first,
  // where the error left the run between two steps.
  Status SaveAfterError(const Status& s);
  // One optimizer step: the micro-batches, the loss and the interrupt agreed over the ranks,
  // Step, the metrics line and the progress line.
  Status RunStep(int step);
  Status WriteReports(std::string& summary);
  // One line of the metrics file, whole, now (a crash keeps every finished step; a full disk
  // stops the run with a message instead of losing lines silently).
  Status WriteMetrics(const json& line);
  void PrintHeader(double init_s) const;
  void PrintDone(const std::string& summary) const;

  RunConfig cfg_;
  const OutputsPlan outputs_;  // the lead rank's (run_dir.h)
  const OutputOptions& out_;
  const int rank_, world_;
  const bool lead_;  // prints and writes the run's files
  std::unique_ptr<gpt::Dataset> dataset_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<gpt::Gpt> model_;
  std::unique_ptr<Progress> progress_;
  int metrics_fd_ = -1;       // the lead rank's
  int metrics_lock_fd_ = -1;  // its lock (a regular file: MetricsLock)
  int start_ = 0, step_ = 0;
  bool interrupted_ = false;  // the agreed Ctrl-C (RunStep)
  // Note [A checkpoint after a data error]: what the model has trained to (start_, then each
  // step's end), and why the run may stop between steps with that saved: its data could not be
  // read, or its metrics not written (empty for any other error).
  int model_step_ = 0;
  bool trace_skipped_ = false;  // no profiled iteration to trace (WriteReports said so)
 public:
  // SetUp failed the same way on every rank (their data differs): each can end on its own, its
  // directories and locks cleaned up, instead of aborting the job (Note [A failing rank ends the
  // run]).
  bool agreed_failure() const { return agreed_failure_; }

 private:
  bool agreed_failure_ = false;
  std::string resume_when_;
  int saved_step_ = -1;    // the last checkpoint's step
  double save_s_ = 0;      // the last checkpoint's
  std::string plan_text_;  // --plan's file
  std::string init_note_;  // what --init-from loaded
  double total_tokens_ = 0, total_compute_s_ = 0;
  // The engine's waits inside the steps (not in evaluations or saves between them), so their
  // shares of total_compute_s_ are shares of step time.
  double step_acquire_wait_s_ = 0, step_update_wait_s_ = 0;
  std::chrono::steady_clock::time_point run_t0_;
};

Status TrainRun::SetUp() {
  TZ_ASSIGN_OR_RETURN(dataset_,
                      gpt::Dataset::Create(cfg_.data, cfg_.model.seq_len, cfg_.model.vocab));
  if (world_ > 1) {
    // Note [Ranks agree before they compute] (agree.cc) compares the configs, whose data is a
    // path: the same path on two machines can name different files.
    TZ_ASSIGN_OR_RETURN(const std::vector<uint64_t> prints,
                        AllGatherValue(*g_comm, dataset_->Fingerprint()));
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
  }
  if (!out_.resume.empty()) {
    // The model checked before anything is built for it (Note [A checkpoint resumes its own
    // model]).
    TZ_ASSIGN_OR_RETURN(const CheckpointInfo info, ReadCheckpointInfo(out_.resume));
    TZ_RETURN_IF_ERROR(CheckSameModel(info.user_state, cfg_, out_.resume));
    // Resumed in place, a checkpoint at or past the last step has nothing left to train: refused
    // before the run's report, page and metrics are written over with those of no step (Note
    // [The loop's step, not the applied count], below, for which step). Into another run
    // directory it is a copy: re-saved there, on this run's ranks (resharding).
    const int64_t ckpt_step = CheckpointStep(info.user_state, info.step);
    if (outputs_.in_place && ckpt_step >= cfg_.train.steps) {
      return FailedPreconditionError(
          "the checkpoint " + out_.resume + " is at step " + std::to_string(ckpt_step) +
          ", and this run ends at step " + std::to_string(cfg_.train.steps) +
          " (train.steps, --steps): nothing is left to train. Give --steps above " +
          std::to_string(ckpt_step) +
          " to continue it (tierzero eval --resume evaluates it; --run-dir DIR re-saves it "
          "elsewhere); nothing was written");
    }
  }
  TZ_ASSIGN_OR_RETURN(engine_, Engine::Create(cfg_.engine, g_comm));
  TZ_ASSIGN_OR_RETURN(model_, gpt::Gpt::Create(*engine_, cfg_.model));
  const auto init_t0 = std::chrono::steady_clock::now();
  TZ_RETURN_IF_ERROR(engine_->Finalize());
  const double init_s = SecondsSince(init_t0);
  if (!out_.init_from.empty()) {
    TZ_ASSIGN_OR_RETURN(init_note_, LoadInitFrom(*engine_, cfg_));
  }
  if (!out_.resume.empty()) {
    TZ_ASSIGN_OR_RETURN(const std::string user, engine_->LoadCheckpoint(out_.resume));
    // Note [The loop's step, not the applied count]: the engine counts the updates it applied
    // (Adam's bias correction needs that); a step skipped for a non-finite gradient is still a
    // step of the loop (its data, its learning rate, its metrics line). A checkpoint records the
    // loop's step in its user state, and a resume starts there, so 10 + 10 resumed steps are the
    // 20 uninterrupted ones.
    start_ = static_cast<int>(CheckpointStep(user, static_cast<int64_t>(engine_->step())));
    if (lead_) ReportRunChanges(user, cfg_, world_, start_);
  }
  if (!out_.plan.empty() && lead_) {
    // Refused now, not after the run: a plan file that is unreadable or of another config.
    TZ_ASSIGN_OR_RETURN(plan_text_, ReadTextFile(out_.plan, "plan file"));
    TZ_ASSIGN_OR_RETURN(const std::string report, engine_->ReportJson());
    if (auto s = WithPrediction(report, plan_text_); !s.ok())
      return s.status().WithContext("--plan " + out_.plan);
  }
  // The set-up is good: only now is an earlier run's output removed (--overwrite) and the run's
  // config.json written. A config.json this run creates is removed again if the run fails before
  // its first step (a metrics FIFO with no reader): the directory then holds no trace of it, and
  // the corrected command is not refused as "another run's outputs".
  // (Also if it ends on a signal meanwhile: RemoveOnSignalExit.)
  struct UndoConfig {
    std::string path;
    bool armed = false;
    void Arm() {
      armed = true;
      RemoveOnSignalExit(path);
    }
    void Disarm() {
      if (armed) KeepOnSignalExit(path);
      armed = false;
    }
    ~UndoConfig() {
      if (armed) {
        KeepOnSignalExit(path);
        ::unlink(path.c_str());
      }
    }
  } undo_config{outputs_.config_path, false};
  // Every rank past its set-up (a checkpoint loaded) before the lead replaces anything.
  if (world_ > 1) TZ_RETURN_IF_ERROR(g_comm->Barrier());
  if (lead_) {
    // Another run writing the same metrics file is refused before anything is removed.
    TZ_RETURN_IF_ERROR(LockMetrics(-1));
    struct stat st {};
    const bool config_new = ::lstat(outputs_.config_path.c_str(), &st) != 0 && errno == ENOENT;
    TZ_RETURN_IF_ERROR(ApplyOutputs(outputs_));
    if (config_new) undo_config.Arm();
  }
  // A run resumed in place continues the metrics of the checkpoint's step: lines of later steps
  // (written before a crash or a kill, after the checkpoint) and a torn last line are dropped
  // first, so the file never holds a step twice. Any other run starts its metrics file empty.
  if (lead_) {
    const bool append = start_ > 0 && outputs_.in_place;
    if (append) TZ_RETURN_IF_ERROR(TrimMetrics(out_.metrics, start_));
    TZ_ASSIGN_OR_RETURN(metrics_fd_, OpenOutputStream(out_.metrics, append, "the metrics file"));
    TZ_RETURN_IF_ERROR(LockMetrics(metrics_fd_));
  }
  undo_config.Disarm();
  // A signal from here on stops the run after a step and saves (Note [Signals on one thread of
  // ours]); before, it ends the process (nothing trained yet, nothing to save).
  EndSetUp();
  PrintHeader(init_s);
  progress_ = std::make_unique<Progress>(start_, cfg_.train.steps, cfg_.train.log_every, out_.quiet,
                                         lead_ && ::isatty(STDOUT_FILENO) == 1);
  return Status::OK();
}

// A metrics file is appended to line by line for the whole run: two runs naming the same file
// (outside their run directories, which are locked) interleaved their lines and tore some. It is
// locked (flock, exclusive, held to the end): `fd` -1, the file as it exists before the run's
// outputs are replaced (a second run is refused before it removes anything), nothing created;
// then the descriptor the run writes (the file may have been replaced or made since), the first
// lock let go. Regular files only (a FIFO or a device streams). A file system without locks: the
// run goes on unlocked.
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
    if (::flock(early, LOCK_EX | LOCK_NB) != 0) {
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
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) return refuse();
  return Status::OK();
}

Status TrainRun::WriteMetrics(const json& line) {
  if (metrics_fd_ < 0) return Status::OK();  // ranks other than 0 write their metrics nowhere
  const std::string text = line.dump() + "\n";
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t w = ::write(metrics_fd_, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      const int err = errno;
      // Note [A checkpoint after a data error]: a failed write leaves the run between steps.
      resume_when_ = "the metrics file " + out_.metrics + " can be written";
      return ErrnoError(
          "writing the metrics file " + out_.metrics + (err == ENOSPC ? " (disk full)" : ""), err);
    }
    done += static_cast<size_t>(w);
  }
  return Status::OK();
}

void TrainRun::PrintHeader(double init_s) const {
  const double states = static_cast<double>(model_->num_params()) * 16;
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

Status TrainRun::Evaluate(int step) {
  double loss = 0, acc = 0;
  for (int b = 0; b < cfg_.train.eval_batches; ++b) {
    auto fetched = dataset_->Fetch(true, static_cast<uint64_t>(b), cfg_.train.batch_size);
    if (!fetched.ok()) {
      resume_when_ = "its validation data is readable";
      return fetched.status();
    }
    gpt::Batch batch = std::move(fetched).value();
    std::vector<int32_t> pred;
    TZ_ASSIGN_OR_RETURN(double l, model_->Evaluate(batch, &pred));
    loss += l;
    acc += dataset_->Accuracy(batch, pred);
  }
  loss /= cfg_.train.eval_batches;
  acc /= cfg_.train.eval_batches;
  json m = {{"step", step}, {"val_loss", loss}};
  if (dataset_->has_accuracy()) m["val_accuracy"] = acc;
  TZ_RETURN_IF_ERROR(WriteMetrics(m));
  char line[160];
  if (dataset_->has_accuracy()) {
    std::snprintf(line, sizeof line, "eval  step %5d | val loss %.4f | exact-match accuracy %.1f%%",
                  step, loss, 100 * acc);
  } else {
    std::snprintf(line, sizeof line, "eval  step %5d | val loss %.4f", step, loss);
  }
  progress_->Line(line);
  return Status::OK();
}

Status TrainRun::Save(int step) {
  // The loop's step (Note [The loop's step, not the applied count]), the model (Note [A
  // checkpoint resumes its own model]), and what a resumed run compares with its own
  // (ReportRunChanges).
  json user = {{"step", step},
               {"data_seed", cfg_.data.seed},
               {"batch_size", cfg_.train.batch_size},
               {"grad_accumulation", cfg_.engine.grad_accumulation},
               {"ranks", world_},
               {"model", ModelJson(cfg_)},
               {"schedule", ScheduleJson(cfg_.train)},
               {"data", DataJson(cfg_.data)},
               {"compute_dtype", std::string(DTypeName(cfg_.engine.compute_dtype))}};
  if (out_.checkpoint_dir.empty()) return Status::OK();  // --checkpoint none
  const auto t0 = std::chrono::steady_clock::now();
  Status s = engine_->SaveCheckpoint(out_.checkpoint_dir, user.dump());
  save_s_ = SecondsSince(t0);
  if (s.ok()) {
    saved_step_ = step;
    return s;
  }
  // What the failure leaves (the manifest is the commit point: Note [Checkpoint format]): the
  // last checkpoint in the directory, this run's or the one it resumed in place, stays whole.
  const int kept = saved_step_ >= 0 ? saved_step_ : outputs_.in_place ? start_ : -1;
  const std::string what = "saving the checkpoint of step " + std::to_string(step) + " in " +
                           out_.checkpoint_dir + " failed";
  if (kept >= 0)
    return std::move(s).WithContext(what + " (the checkpoint of step " + std::to_string(kept) +
                                    " there is intact: --resume " + out_.checkpoint_dir +
                                    " continues from it; steps " + std::to_string(kept + 1) +
                                    " to " + std::to_string(step) + " are not saved)");
  return std::move(s).WithContext(
      what + " (no checkpoint of this run exists: its " + std::to_string(step - start_) +
      " steps are not saved" +
      (s.code() == StatusCode::kIoError
           ? "; free space there, or give --checkpoint a directory on another disk)"
           : ")"));
}

// Note [A checkpoint after a data error]
// Some errors leave the run between two steps with every rank's model whole: a step's data could
// not be read (its micro-batches are fetched before any is computed), an evaluation's could not,
// or a metrics line could not be written (after its step was applied; a full disk, a closed
// pipe). One rank (whose failure no other rank waits on) then saves what it trained so far, as
// a Ctrl-C would, before it reports the error, so a run of hours is not lost to a file it
// reads or writes. On a resume in place the metrics file is trimmed to the checkpoint's step (a
// torn last line goes too); a line that could not be written stays missing. Any other error
// (the engine's, a collective's) may have left the model half updated and saves nothing.
Status TrainRun::SaveAfterError(const Status& s) {
  if (resume_when_.empty() || world_ != 1 || out_.checkpoint_dir.empty() || model_step_ == start_)
    return s;
  const Status saved = saved_step_ == model_step_ ? Status::OK() : Save(model_step_);
  const std::string at = std::to_string(model_step_);
  return Status(
      s.code(),
      std::string(s.message()) +
          (saved.ok()
               ? ". A checkpoint of step " + at + " is saved in " + out_.checkpoint_dir +
                     ": --resume " + out_.checkpoint_dir + " continues the run once " + resume_when_
               : ". Saving a checkpoint of step " + at + " failed too: " + saved.ToString()));
}

Status TrainRun::Loop() {
  run_t0_ = std::chrono::steady_clock::now();
  step_ = start_;
  model_step_ = start_;
  if (start_ == 0 && cfg_.train.steps > 0) TZ_RETURN_IF_ERROR(Evaluate(0));
  for (; step_ < cfg_.train.steps; ++step_) {
    if (cfg_.train.profile_step > 0 && step_ + 1 == cfg_.train.profile_step)
      engine_->ProfileNextIteration();
    if (Status s = RunStep(step_); !s.ok()) return SaveAfterError(s);
    // A step on the evaluation schedule is evaluated before an interrupt's save too: a resumed
    // run starts after it, so its evaluation would be missing from the metrics for good.
    if (cfg_.train.eval_every > 0 && (step_ + 1) % cfg_.train.eval_every == 0 &&
        step_ + 1 < cfg_.train.steps) {
      if (Status s = Evaluate(step_ + 1); !s.ok()) return SaveAfterError(s);
    }
    if (interrupted_) {
      ++step_;
      progress_->Line("interrupted: saving a checkpoint at step " + std::to_string(step_));
      break;
    }
    if (cfg_.train.checkpoint_every > 0 && (step_ + 1) % cfg_.train.checkpoint_every == 0)
      TZ_RETURN_IF_ERROR(Save(step_ + 1));
  }
  return Status::OK();
}

// This rank's bytes to other nodes in its gathers and reductions so far.
uint64_t CrossNodeBytes(const EngineStats& s) {
  return s.param_gather.bytes_cross_node + s.param_regather.bytes_cross_node +
         s.grad_reduce.bytes_cross_node;
}

uint64_t WireBytesSent(const EngineStats& s) {
  return s.param_gather.bytes_sent + s.param_regather.bytes_sent + s.grad_reduce.bytes_sent;
}

Status TrainRun::RunStep(int step) {
  const auto t0 = std::chrono::steady_clock::now();
  const EngineStats before = engine_->stats();
  const int accum = cfg_.engine.grad_accumulation;
  const double tokens_per_step =
      static_cast<double>(cfg_.train.batch_size) * cfg_.model.seq_len * accum * world_;
  double loss = 0;
  const double lr = LearningRate(cfg_.train, step);
  // Lets the last micro-batch's backward start the CPU's updates (engine.speculative_step).
  TZ_RETURN_IF_ERROR(engine_->PrepareStep({static_cast<float>(lr)}));
  // The step's micro-batches are read before any is computed: a data error (a token file
  // truncated or changed under the run) then stops the run between two steps, where the last
  // one can still be saved (Loop, Note [A checkpoint after a data error]).
  std::vector<gpt::Batch> batches;
  for (int micro = 0; micro < accum; ++micro) {
    // Data parallel: a step takes world * accum micro-batches, rank r the r-th run of accum,
    // so the same global batch whatever the split between ranks and accumulation.
    const uint64_t index = (static_cast<uint64_t>(step) * static_cast<uint64_t>(world_) +
                            static_cast<uint64_t>(rank_)) *
                               static_cast<uint64_t>(accum) +
                           static_cast<uint64_t>(micro);
    auto batch = dataset_->Fetch(false, index, cfg_.train.batch_size);
    if (!batch.ok()) {
      resume_when_ = "its data is readable";
      return batch.status();
    }
    batches.push_back(std::move(batch).value());
  }
  for (const gpt::Batch& batch : batches) {
    TZ_ASSIGN_OR_RETURN(const double l, model_->ForwardBackward(batch));
    loss += l / accum;
  }
  // Ctrl-C is read once per step; with several ranks the ranks agree on it below, and only
  // the agreed value is used, so every rank stops after the same step.
  interrupted_ = InterruptRequested();
  if (world_ > 1) {
    // The step's loss over every rank's micro-batches, summed in rank order.
    // (And whether any rank was interrupted: they all stop at the same step.)
    struct {
      double loss;
      int64_t interrupted;
    } mine{loss, interrupted_ ? 1 : 0};
    TZ_ASSIGN_OR_RETURN(const auto all, AllGatherValue(*g_comm, mine));
    loss = 0;
    for (const auto& r : all) {
      loss += r.loss / world_;
      if (r.interrupted != 0) interrupted_ = true;
    }
  }
  TZ_ASSIGN_OR_RETURN(const StepResult r, engine_->Step({static_cast<float>(lr)}));
  model_step_ = step + 1;
  const double dt = SecondsSince(t0);
  if (lead_ && step == start_) {
    // The warm-up iteration's trace, for `tierzero plan --trace` (docs/plan.md).
    if (auto trace = engine_->RecordedTrace(); trace.ok()) {
      TZ_RETURN_IF_ERROR(WriteWarmupTrace(*trace, out_.run_dir + "/warmup_trace.json"));
    }
  }
  total_tokens_ += tokens_per_step;
  total_compute_s_ += dt;
  {
    const EngineStats now = engine_->stats();
    step_acquire_wait_s_ += now.acquire_wait_seconds - before.acquire_wait_seconds;
    step_update_wait_s_ += now.update_wait_seconds - before.update_wait_seconds;
  }
  const TierUsage u = engine_->usage();
  json m = {{"step", step + 1},
            {"loss", loss},
            {"lr", lr},
            {"grad_norm", r.grad_norm},
            {"applied", r.applied},
            {"loss_scale", r.loss_scale},
            {"step_s", dt},
            {"tokens_per_s", tokens_per_step / dt},
            {"device_bytes", u.device},
            {"device_peak_bytes", u.device_peak},
            {"host_bytes", u.host},
            {"nvme_bytes", u.nvme}};
  if (world_ > 1) {
    // This rank's bytes in the step's gathers and reductions (docs/zero.md, "Bytes on the wire").
    const EngineStats after = engine_->stats();
    m["comm_bytes"] = WireBytesSent(after) - WireBytesSent(before);
    m["comm_cross_node_bytes"] = CrossNodeBytes(after) - CrossNodeBytes(before);
  }
  TZ_RETURN_IF_ERROR(WriteMetrics(m));
  StepLine line;
  line.step = step + 1;
  line.loss = loss;
  line.lr = lr;
  line.tokens_per_s = tokens_per_step / dt;
  line.step_s = dt;
  line.skipped = !r.applied;
  line.memory = "dev " + Mib(u.device_peak) + "/" + Mib(u.device_capacity) + " MiB host " +
                Mib(u.host) + " MiB nvme " + Mib(u.nvme) + " MiB";
  progress_->Step(line);
  return Status::OK();
}

Status TrainRun::Finish() {
  // The last evaluation, also after a stop during the last step (its resume would have nothing
  // to train, so the evaluation would be lost for good).
  Status final_eval = Status::OK();
  if ((!interrupted_ || step_ >= cfg_.train.steps) && step_ > start_) final_eval = Evaluate(step_);
  // Note [A checkpoint after a data error]: an evaluation that could not read its data or write
  // its line leaves the run whole, trained to its end: it is saved and reported all the same,
  // and the error says how to evaluate it. Any other failure stops here, as before.
  if (!final_eval.ok() && resume_when_.empty()) return final_eval;
  // (A checkpoint of this very step is there already when checkpoint_every saved it.)
  if (saved_step_ != step_) TZ_RETURN_IF_ERROR(Save(step_));
  if (!lead_) return final_eval;
  progress_->Finish();
  std::string summary;
  const Status reports = WriteReports(summary);
  if (reports.ok()) PrintDone(summary);
  if (final_eval.ok()) return reports;
  std::string advice = ". The run's " + std::to_string(step_) + " steps are trained";
  if (!out_.checkpoint_dir.empty()) {
    advice += " and saved in " + out_.checkpoint_dir;
    if (cfg_.data.kind == "tokens")
      advice += " (tierzero eval --resume " + out_.checkpoint_dir + " --data ... evaluates it)";
  }
  if (!reports.ok()) advice += "; its report could not be written either: " + reports.ToString();
  return Status(final_eval.code(), std::string(final_eval.message()) + advice);
}

// The report, its summary and the renderings asked for, from one rendering of the JSON.
Status TrainRun::WriteReports(std::string& summary) {
  TZ_ASSIGN_OR_RETURN(std::string text, engine_->ReportJson());
  if (!plan_text_.empty()) {
    auto with = WithPrediction(text, plan_text_);
    if (!with.ok()) return with.status().WithContext("--plan " + out_.plan);
    text = std::move(with).value();
  }
  {
    // The model the report is of, and how it computed (which backend, which attention).
    json r = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (r.is_object()) {
      r["model"] = {{"name", gpt::ModelName(cfg_.model)},
                    {"parameters", model_->num_params()},
                    {"config", ModelJson(cfg_)},
                    {"compute", model_->ComputeSummary()}};
      text = r.dump(1);
    }
  }
  // The outputs after the checkpoint (Finish saves first): a failure here loses no training.
  auto where = [&](const char* what, const std::string& path) {
    return "writing the " + std::string(what) + " " + path +
           (saved_step_ >= 0 ? " (the checkpoint of step " + std::to_string(saved_step_) +
                                   " is saved in " + out_.checkpoint_dir + ")"
                             : std::string());
  };
  if (Status s = WriteTextFile(out_.report, text); !s.ok())
    return std::move(s).WithContext(where("report", out_.report));
  TZ_ASSIGN_OR_RETURN(summary, ReportSummary(text));
  if (!out_.html.empty()) {
    if (Status s = WriteHtmlReport(text, out_.html); !s.ok())
      return std::move(s).WithContext(where("report's page", out_.html));
  }
  if (!out_.trace.empty()) {
    Status s = WriteChromeTrace(text, out_.trace);
    if (s.code() == StatusCode::kFailedPrecondition) {
      std::printf("  (no trace: %s)\n", std::string(s.message()).c_str());
      trace_skipped_ = true;
    } else if (!s.ok()) {
      return std::move(s).WithContext(where("trace", out_.trace));
    }
  }
  return Status::OK();
}

void TrainRun::PrintDone(const std::string& summary) const {
  const EngineStats st = engine_->stats();
  const double wall = SecondsSince(run_t0_);
  const double c = total_compute_s_;
  std::printf(
      "done: %d steps in %.1f s | %.0f tok/s, %.2f GFLOP/s | moved H2D %s MiB, D2H %s MiB, "
      "NVMe read %s MiB, write %s MiB | waits for parameters %.1f%%, for the optimizer's update "
      "behind the forward %.1f%% of step time\n",
      step_ - start_, wall, c > 0 ? total_tokens_ / c : 0,
      c > 0 ? total_tokens_ * model_->flops_per_token() / c / 1e9 : 0, Mib(st.h2d_bytes).c_str(),
      Mib(st.d2h_bytes).c_str(), Mib(st.nvme_read_bytes).c_str(), Mib(st.nvme_write_bytes).c_str(),
      c > 0 ? 100 * step_acquire_wait_s_ / c : 0, c > 0 ? 100 * step_update_wait_s_ / c : 0);
  // How it computed, now that it has (which attention ran: Note [Which attention runs]).
  std::printf("  compute: %s\n", model_->ComputeSummary().c_str());
  std::fputs(summary.c_str(), stdout);
  if (out_.checkpoint_dir.empty())
    std::printf("  checkpoint: none\n");
  else
    std::printf("  checkpoint: %s (saved in %.1f s)\n", out_.checkpoint_dir.c_str(), save_s_);
  std::printf("  metrics: %s\n  report: %s\n", out_.metrics.c_str(), out_.report.c_str());
  if (!out_.html.empty()) std::printf("  html: %s\n", out_.html.c_str());
  if (!out_.trace.empty() && !trace_skipped_) std::printf("  trace: %s\n", out_.trace.c_str());
}

}  // namespace

int Train(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "-h" || a == "--help") {
      std::fputs(kTrainHelp, stdout);
      return 0;
    }
  }
  // From here to the end, SIGINT and SIGTERM ask the run to stop after its current (or first)
  // step and save (Note [Signals on one thread of ours], signals.h).
  // Until the run's set-up ends (TrainRun::SetUp), a signal ends the process at once: a read
  // of a FIFO or a long initialisation is not waited for (nothing is trained or saved yet).
  GracefulInterrupts graceful(/*during_setup=*/true);
  ClearInterrupt();
  std::string config_path;
  auto cfg = LoadRunConfig(args, &config_path);
  if (!cfg.ok()) return Fail(cfg.status());
  {
    auto comm = RunCommunicator(cfg->ranks);
    if (!comm.ok()) return Fail(comm.status());
    g_comm = *comm;
  }
  const int rank = g_comm->rank();
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
  RunDirLock lock;  // held to the end of the run
  MadeDirs made;    // removed again if the run is refused before it starts
  auto outputs = PrepareOutputs(*cfg, config_path, rank, g_comm->size(), lock, made);
  if (!outputs.ok()) return Fail(outputs.status());
  TrainRun run(std::move(*cfg), std::move(outputs).value(), rank, g_comm->size());
  if (Status s = run.SetUp(); !s.ok()) {
    if (!run.agreed_failure()) return Fail(s);
    std::fprintf(stderr, "rank %d of %d: error: %s\n", rank, g_comm->size(), s.ToString().c_str());
    return 1;
  }
  made.Keep();
  lock.Keep();
  if (Status s = run.Loop(); !s.ok()) return Fail(s);
  if (Status s = run.Finish(); !s.ok()) return Fail(s);
  return 0;
}

}  // namespace tierzero::app
