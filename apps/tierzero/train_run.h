// One `tierzero train` run after its config (TrainRun): its set-up and header lines in
// train.cc, its step loop, evaluations, checkpoints and closing outputs in train_loop.cc.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "gpt/gpt.h"
#include "progress.h"
#include "run_dir.h"
#include "tierzero/engine.h"
#include "train.h"

namespace tierzero::app {

inline double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// `b` bytes in MiB, one decimal.
std::string Mib(uint64_t b);

// One `tierzero train` run after its config: the data, the engine and the model, the step loop
// with its evaluations and checkpoints, and what is written at the end.
class TrainRun {
 public:
  TrainRun(RunConfig cfg, OutputsPlan outputs, std::shared_ptr<Communicator> comm)
      : comm_(std::move(comm)),
        cfg_(std::move(cfg)),
        outputs_(std::move(outputs)),
        out_(cfg_.output),
        rank_(comm_->rank()),
        world_(comm_->size()),
        lead_(rank_ == 0) {}
  ~TrainRun() {
    if (metrics_fd_ >= 0) ::close(metrics_fd_);
    if (metrics_lock_fd_ >= 0) ::close(metrics_lock_fd_);
    for (const int fd : output_pins_) ::close(fd);
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
  // Note [A run that trained nothing leaves nothing] (train.cc): whether no step has ended and
  // nothing is saved; the config.json and metrics file this run created removed again.
  bool TrainedNothing() const;
  void UndoStart();
  // Called once when the first step ends (or a first save is committed): what the caller made
  // for the run stops being removed by a signal's exit.
  void OnStarted(std::function<void()> f) { on_started_ = std::move(f); }
  // The lead's locks of the run's directories (Note [A directory moved under the run]): each
  // save goes where the locked checkpoint directory is.
  void SetDirLock(RunDirLock* lock) { lock_ = lock; }

 private:
  // The validation loss at `step`, its metrics line written; cut short by an agreed stop (Note
  // [An evaluation a signal cuts short]): OK with eval_cut_ set and no line. Not `stoppable`:
  // made whole whatever is asked.
  Status Evaluate(int step, bool stoppable = true);

  // Note [A checkpoint after a data error]: what a resume needs after a data error `s`.
  std::string DataMended(const Status& s, bool validation) const;
  Status Save(int step);
  // Note [A checkpoint after a data error]: `s` with a checkpoint of model_step_ saved first,
  // where the error left the run between two steps.
  Status SaveAfterError(const Status& s);
  // Note [A checkpoint after a data error]: whether every rank can go on from here, between
  // steps: `mine` (a data error of this rank's) or the error deferred since the last agreement,
  // or any other rank's; every rank returns an error if any rank has one. With one rank, `mine`
  // or the deferred error.
  Status AgreeToGoOn(Status mine);
  // An error of the lead's that leaves the run between steps (a metrics line it could not
  // write) is kept for the next AgreeToGoOn, and OK returned: with several ranks the others are
  // on their way to the next step; with one, the run stops at the same point as with several.
  Status Defer(Status s);
  // One optimizer step: the micro-batches, the loss and the interrupt agreed over the ranks,
  // Step, the metrics line and the progress line.
  Status RunStep(int step);
  Status WriteReports(std::string& summary);
  // Note [A report kept aside] (train_loop.cc): the report in a new file of the run directory,
  // and what to say of it after the error that its own path could not be written.
  std::string KeepReportAside(const std::string& text);
  // Note [Outputs another run took] (train_loop.cc): config.json records `field` as `value`.
  void Disown(const char* field, const std::string& value);
  // The first step has ended: what the run created stays, whatever happens (UndoStart).
  void StartKept();
  // Note [An output another run wrote meanwhile] (train_loop.cc): each output file as it was
  // when the set-up ended, and each written only over that.
  void RecordOutputs();
  // "--resume CHECKPOINT_DIR" and, for a directory not the run directory's own, "--checkpoint"
  // too: the flags that continue this run in place.
  std::string ResumeFlags() const;
  Status WriteOutputIfUnchanged(const std::string& path, const std::string& text,
                                const char* what) const;
  // One line of the metrics file, whole, now (a crash keeps every finished step; a full disk
  // stops the run with a message instead of losing lines silently).
  Status WriteMetrics(const nlohmann::json& line);
  void PrintHeader(double init_s) const;
  void PrintDone(const std::string& summary) const;

  std::shared_ptr<Communicator> comm_;  // the run's ranks (one: Communicator::Single)
  RunConfig cfg_;
  const OutputsPlan outputs_;  // the lead rank's (run_dir.h)
  // config.json's text as last written (Note [Outputs another run took] rewrites it).
  std::string config_text_ = outputs_.config_text;
  const OutputOptions& out_;
  const int rank_, world_;
  const bool lead_;  // prints and writes the run's files
  std::unique_ptr<gpt::Dataset> dataset_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<gpt::Gpt> model_;
  std::unique_ptr<Progress> progress_;
  int metrics_fd_ = -1;       // the lead rank's
  std::string config_stamp_;  // FileStamp of the config.json this run made (UndoStart)
  // Metrics lines computed but not written (the write failed, or one before it did): the next
  // save records them and a resume in place writes them (Note [Metrics lines a stop left
  // unwritten], train.cc).
  std::vector<std::string> unwritten_metrics_;
  int metrics_lock_fd_ = -1;  // its lock (a regular file: MetricsLock)
  // Note [Run files removed under the run] (train_metrics.cc): the metrics file and config.json
  // named again where the run's directory lost them; said once each.
  void KeepRunFilesNamed();
  bool metrics_moved_said_ = false;
  bool relock_said_ = false;  // a run directory made again that another run holds: said once
  int start_ = 0, step_ = 0;
  // Note [The data continues where the checkpoint's run stopped] (train_loop.cc): the training
  // micro-batches taken before step start_, by this run's and the resumed checkpoint's runs.
  uint64_t data_base_ = 0;
  // The micro-batches taken before step `step` (what a checkpoint of it records).
  uint64_t MicroBatchesBefore(int step) const {
    return data_base_ + static_cast<uint64_t>(step - start_) * static_cast<uint64_t>(world_) *
                            static_cast<uint64_t>(cfg_.engine.grad_accumulation);
  }
  // Note [An evaluation a stop left undone] (train.cc): the step whose scheduled evaluation
  // failed (its checkpoint records it), and whether the resumed step's is to be made first.
  int eval_pending_step_ = -1;
  bool eval_at_start_ = false;
  bool interrupted_ = false;  // the agreed Ctrl-C (RunStep)
  bool eval_cut_ = false;     // the last Evaluate stopped by a signal before its end
  bool stop_agreed_ = false;  // at the last AgreeToGoOn, whether any rank was asked to stop
  // Note [A checkpoint after a data error]: what the model has trained to (start_, then each
  // step's end), and why the run may stop between steps with that saved: its data could not be
  // read, or its metrics not written (empty for any other error).
  int model_step_ = 0;
  bool trace_skipped_ = false;  // no profiled iteration to trace (WriteReports said so)
  // The config.json and metrics file this run created, until its first step ends (UndoStart).
  bool config_made_ = false, metrics_made_ = false;
  std::function<void()> on_started_;
  RunDirLock* lock_ = nullptr;
  // The checkpoint directory as the set-up locked it (out_.checkpoint_dir follows it if moved).
  std::string locked_checkpoint_dir_;
  std::optional<std::string> followed_;  // where the last save found it, when not at its path
  // Status of the directory a save goes to: OK, with out_.checkpoint_dir where the locked one is
  // now (one rank), or an error saying what became of it (Note [A directory moved under the run]).
  Status FollowCheckpointDir();
  // The plan (train_plan.cc): read and checked against the config before the engine is built,
  // against the engine's layout after; a resumed run's recorded one that is not this run's is
  // left out, said (Note [A plan the resumed run recorded, of another config]).
  bool RecordedPlan() const;
  Status ReadPlan();
  Status CheckPlanLayout();
  // RecordOutputs: the report's, page's and trace's identity ("" where there was no file).
  std::map<std::string, std::string> output_ids_;
  std::string report_aside_;  // where KeepReportAside kept the report ("" nowhere)
  // And a descriptor of each that was a file, held to the end (Note [An output another run
  // wrote meanwhile]).
  std::vector<int> output_pins_;

 public:
  // SetUp failed the same way on every rank (their data differs): each can end on its own, its
  // directories and locks cleaned up, instead of aborting the job (Note [A failing rank ends the
  // run]).
  bool agreed_failure() const { return agreed_failure_ || past_collectives_; }
  // Whether this rank says an agreed failure (AgreeToGoOn: the lead, and a failing rank whose
  // error is not the one the lead says).
  bool speaks() const { return speaks_; }
  // Whether the agreed failure is this rank's own (or another's, named in its message).
  bool own_failure() const { return own_failure_; }

 private:
  bool agreed_failure_ = false;
  // Finish's last collective (the save) is behind: a failure after it (the lead's report) is
  // this rank's alone, and ends it alone.
  bool past_collectives_ = false;
  bool speaks_ = true, own_failure_ = true;
  Status pending_;            // Defer's
  std::string pending_when_;  // and what a resume then needs
  std::string resume_when_;
  std::string resumed_user_;  // the resumed checkpoint's user state (Save, of its own step)
  int saved_step_ = -1;       // the last checkpoint's step
  double save_s_ = 0;         // the last checkpoint's
  std::string plan_text_;     // --plan's file
  std::string init_note_;     // what --init-from loaded
  double total_tokens_ = 0, total_compute_s_ = 0;
  // The engine's waits inside the steps (not in evaluations or saves between them), so their
  // shares of total_compute_s_ are shares of step time.
  double step_acquire_wait_s_ = 0, step_update_wait_s_ = 0;
  std::chrono::steady_clock::time_point run_t0_;
};

}  // namespace tierzero::app
