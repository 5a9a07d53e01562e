// TrainRun's step loop (train_run.h): the steps, their evaluations and checkpoints (the saves
// themselves: train_save.cc), the saves after an error, and what the lead rank writes and prints
// at the end.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "resume.h"
#include "signals.h"
#include "tierzero/files.h"
#include "tierzero/report.h"
#include "train_run.h"

namespace tierzero::app {
using nlohmann::json;

namespace {

// This rank's bytes to other nodes in its gathers and reductions so far.
uint64_t CrossNodeBytes(const EngineStats& s) {
  return s.param_gather.bytes_cross_node + s.param_regather.bytes_cross_node +
         s.grad_reduce.bytes_cross_node;
}

uint64_t WireBytesSent(const EngineStats& s) {
  return s.param_gather.bytes_sent + s.param_regather.bytes_sent + s.grad_reduce.bytes_sent;
}

}  // namespace

std::string TrainRun::DataMended(const Status& s, bool validation) const {
  // (An id outside the vocabulary is read again at the same step: a resume keeps its model's.)
  if (s.code() == StatusCode::kInvalidArgument)
    return std::string("the ") + (validation ? "validation " : "") +
           "token files hold only ids below the model's vocabulary of " +
           std::to_string(cfg_.model.vocab) + " (a resume keeps its model's vocabulary)";
  return validation ? "the validation data is readable" : "the data is readable";
}

// Note [An evaluation a signal cuts short]
// A signal was read once per step, and an evaluation is up to 100000 batches: one SIGTERM in a
// long step-0 evaluation was acted on only after it and a step (minutes; a scheduler's SIGKILL
// comes first), and a second one ended the run unsaved (hunt 50). So an evaluation asks before
// each batch whether a stop was asked for (the ranks agree, as on a step's), and stops there,
// writing no line: an evaluation changes no weight, so the model is the step's. (The ranks'
// stop rides on the agreement each batch's read makes: AgreeToGoOn's stop_agreed_.) The step's
// checkpoint records its evaluation as undone and the resumed run makes it first (Note [An
// evaluation a stop left undone], train.cc), as after a data error. The last evaluation, after
// the last step, has no resume to make it: a stop asked during that step lets it run whole (as
// before); one asked during it cuts it short, and the run says how to make it (tierzero eval, for
// token files).
Status TrainRun::Evaluate(int step, bool stoppable) {
  double loss = 0, acc = 0;
  eval_cut_ = false;
  // What a signal now says it cuts (signals.h), until the evaluation returns.
  SetInEvaluation(stoppable, step >= cfg_.train.steps);
  struct Restore {
    ~Restore() { SetInEvaluation(false, false); }
  } restore;
  // Each batch is read before it is computed, and the ranks agree that it could be (Note [A
  // checkpoint after a data error]: an evaluation changes no weight, so the model is whole at
  // every batch; one batch is held at a time).
  for (int b = 0; b < cfg_.train.eval_batches; ++b) {
    auto fetched = dataset_->Fetch(true, static_cast<uint64_t>(b), cfg_.train.batch_size);
    Status read;
    if (!fetched.ok()) {
      resume_when_ = DataMended(fetched.status(), /*validation=*/true);
      read = fetched.status();
    }
    TZ_RETURN_IF_ERROR(AgreeToGoOn(std::move(read)));
    if (stoppable && stop_agreed_) {  // (the ranks agreed on it with the batch's read)
      eval_cut_ = interrupted_ = true;
      return Status::OK();
    }
    const gpt::Batch batch = std::move(fetched).value();
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

// Note [A checkpoint after a data error]
// Some errors leave the run between two steps with every rank's model whole: a step's data could
// not be read (its micro-batches are fetched before any is computed), an evaluation's could not
// (likewise), or a metrics line could not be written (after its step was applied; a full disk, a
// closed pipe). The run then saves what it trained so far, as a Ctrl-C would, before it reports
// the error, so a run of hours is not lost to a file it reads or writes. On a resume in place the
// metrics file is trimmed to the checkpoint's step (a torn last line goes too); a line that could
// not be written stays missing. Any other error (the engine's, a collective's) may have left the
// model half updated and saves nothing. (The warm-up trace, an aid to the next plan, stops
// nothing: the run says it could not be written and goes on.)
//
// With several ranks a checkpoint is a collective, and one rank's data error used to abort the
// job unsaved. So the ranks agree between steps (AgreeToGoOn): before a step's or an evaluation's
// first computation, and once more before the last save, each shares whether its data was read
// and whether a metrics line it wrote since the last agreement failed (Defer keeps that error
// until then: the other ranks are on their way to the next step already; one rank does the
// same, so it stops where several would). Any rank's error stops every rank there, together:
// all save, the lead says why (the lowest failing rank's error, whole; another failing rank says
// its own, if it differs), and each rank ends on its own, not by an abort. A run stopped before
// its last step resumes once the cause is mended; one that trained its last step is saved,
// evaluated and reported, and says so. Cost: a gather of 16 bytes per rank per step.
Status TrainRun::AgreeToGoOn(Status mine) {
  if (!pending_.ok()) {
    // A metrics line that failed since the last agreement (and, maybe, this data error too).
    if (mine.ok()) {
      mine = pending_;
      resume_when_ = pending_when_;
    } else {
      mine = Status(mine.code(),
                    std::string(mine.message()) + "; and " + std::string(pending_.message()));
      resume_when_ += " and " + pending_when_;
    }
    pending_ = Status::OK();
  }
  stop_agreed_ = InterruptRequested();
  if (world_ == 1) return mine;
  // Which ranks failed (a few bytes a step), and whether any was asked to stop (Note [An
  // evaluation a signal cuts short]); then, only then, what each said, whole.
  struct Outcome {
    int32_t code = 0;
    uint32_t message_bytes = 0, when_bytes = 0, stop = 0;
  } o;
  o.stop = stop_agreed_ ? 1 : 0;
  const std::string message(mine.message()), when = mine.ok() ? "" : resume_when_;
  if (!mine.ok()) {
    o.code = static_cast<int32_t>(mine.code());
    o.message_bytes = static_cast<uint32_t>(message.size());
    o.when_bytes = static_cast<uint32_t>(when.size());
  }
  auto all = AllGatherValue(*comm_, o);
  if (!all.ok()) {
    resume_when_.clear();  // (no collective save after a collective that failed)
    return mine.ok() ? all.status() : mine;
  }
  int first = -1;
  size_t longest = 1;
  for (int r = world_ - 1; r >= 0; --r) {
    const Outcome& x = (*all)[static_cast<size_t>(r)];
    stop_agreed_ = stop_agreed_ || x.stop != 0;
    if (x.code != 0) first = r;
    longest = std::max<size_t>(longest, size_t{x.message_bytes} + x.when_bytes);
  }
  if (first < 0) return Status::OK();
  agreed_failure_ = true;
  std::string text = message + when;
  text.resize(longest);
  auto texts = AllGatherBytes(*comm_, text.data(), longest);
  if (!texts.ok()) {
    resume_when_.clear();
    return mine.ok() ? texts.status() : mine;
  }
  const Outcome& f = (*all)[static_cast<size_t>(first)];
  const char* at =
      reinterpret_cast<const char*>(texts->data()) + static_cast<size_t>(first) * longest;
  const std::string said(at, f.message_bytes);
  if (!mine.ok()) {
    speaks_ = lead_ || (first != rank_ && said != message);
    return mine;
  }
  speaks_ = lead_;
  own_failure_ = false;
  resume_when_.assign(at + f.message_bytes, f.when_bytes);
  return Status(static_cast<StatusCode>(f.code),
                "rank " + std::to_string(first) + " of " + std::to_string(world_) + ": " + said);
}

Status TrainRun::SaveAfterError(const Status& s) {
  // (With several ranks only an error they agreed on: every rank saves, or none does.)
  if (resume_when_.empty() || (world_ > 1 && !agreed_failure_) || out_.checkpoint_dir.empty() ||
      model_step_ == start_)
    return s;
  const Status saved = saved_step_ == model_step_ ? Status::OK() : Save(model_step_);
  const std::string at = std::to_string(model_step_);
  return Status(s.code(), std::string(s.message()) +
                              (saved.ok() ? ". A checkpoint of step " + at + " is saved in " +
                                                out_.checkpoint_dir + ": " + ResumeFlags() +
                                                " continues the run once " + resume_when_
                                          : ". Saving a checkpoint of step " + at +
                                                " failed too: " + saved.ToString()));
}

Status TrainRun::Loop() {
  run_t0_ = std::chrono::steady_clock::now();
  step_ = start_;
  model_step_ = start_;
  if ((start_ == 0 || eval_at_start_) && cfg_.train.steps > 0) {
    if (Status s = Evaluate(start_); !s.ok()) {
      if (start_ > 0) eval_pending_step_ = start_;  // (still undone: the resume keeps saying so)
      return SaveAfterError(s);
    }
    if (eval_cut_ && out_.checkpoint_dir.empty() && start_ == 0)
      // (Nothing trained, nothing to save: Note [A run that trained nothing leaves nothing].)
      return Status(StatusCode::kCancelled,
                    "interrupted in the evaluation of step 0 (--checkpoint none): "
                    "nothing was trained or saved, and the run leaves nothing");
    if (eval_cut_) {  // Note [An evaluation a signal cuts short]: saved untrained (Finish)
      eval_pending_step_ = start_;
      progress_->Line(out_.checkpoint_dir.empty()
                          ? "interrupted in the evaluation of step " + std::to_string(start_) +
                                " (--checkpoint none: nothing is saved)"
                          : "interrupted in the evaluation of step " + std::to_string(start_) +
                                ": saving a checkpoint at step " + std::to_string(start_) +
                                " (the resumed run makes the evaluation first)");
      return Status::OK();
    }
    eval_at_start_ = false;
  }
  for (; step_ < cfg_.train.steps; ++step_) {
    if (cfg_.train.profile_step > 0 && step_ + 1 == cfg_.train.profile_step)
      engine_->ProfileNextIteration();
    if (Status s = RunStep(step_); !s.ok()) return SaveAfterError(s);
    // A step on the evaluation schedule is evaluated before an interrupt's save too, or, cut
    // short by the stop (Note [An evaluation a signal cuts short]), recorded undone for the
    // resumed run to make first: it starts after the step, so the evaluation would be missing
    // from the metrics for good.
    if (cfg_.train.eval_every > 0 && (step_ + 1) % cfg_.train.eval_every == 0 &&
        step_ + 1 < cfg_.train.steps) {
      if (Status s = Evaluate(step_ + 1); !s.ok()) {
        eval_pending_step_ = step_ + 1;  // Note [An evaluation a stop left undone]
        return SaveAfterError(s);
      }
      if (eval_cut_) eval_pending_step_ = step_ + 1;  // Note [An evaluation a signal cuts short]
    }
    if (interrupted_) {
      ++step_;
      const std::string cut = eval_pending_step_ == step_
                                  ? " (its evaluation cut short: the resumed run makes it first)"
                                  : "";
      progress_->Line(out_.checkpoint_dir.empty() ? "interrupted at step " + std::to_string(step_) +
                                                        " (--checkpoint none: nothing is saved)"
                                                  : "interrupted: saving a checkpoint at step " +
                                                        std::to_string(step_) + cut);
      break;
    }
    if (cfg_.train.checkpoint_every > 0 && (step_ + 1) % cfg_.train.checkpoint_every == 0)
      TZ_RETURN_IF_ERROR(Save(step_ + 1));
  }
  return Status::OK();
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
  Status read;
  for (int micro = 0; micro < accum && read.ok(); ++micro) {
    // Data parallel: a step takes world * accum micro-batches, rank r the r-th run of accum,
    // so the same global batch whatever the split between ranks and accumulation; after those
    // a resumed checkpoint's run took (Note [The data continues where the checkpoint's run
    // stopped]).
    const uint64_t index = data_base_ +
                           (static_cast<uint64_t>(step - start_) * static_cast<uint64_t>(world_) +
                            static_cast<uint64_t>(rank_)) *
                               static_cast<uint64_t>(accum) +
                           static_cast<uint64_t>(micro);
    auto batch = dataset_->Fetch(false, index, cfg_.train.batch_size);
    if (!batch.ok()) {
      resume_when_ = DataMended(batch.status(), /*validation=*/false);
      read = batch.status();
    } else {
      batches.push_back(std::move(batch).value());
    }
  }
  TZ_RETURN_IF_ERROR(AgreeToGoOn(std::move(read)));
  const auto compute_t0 = std::chrono::steady_clock::now();
  for (const gpt::Batch& batch : batches) {
    TZ_ASSIGN_OR_RETURN(const double l, model_->ForwardBackward(batch));
    loss += l / accum;
  }
  const double compute_s = SecondsSince(compute_t0);
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
    TZ_ASSIGN_OR_RETURN(const auto all, AllGatherValue(*comm_, mine));
    loss = 0;
    for (const auto& r : all) {
      loss += r.loss / world_;
      if (r.interrupted != 0) interrupted_ = true;
    }
  }
  const auto step_call_t0 = std::chrono::steady_clock::now();
  TZ_ASSIGN_OR_RETURN(const StepResult r, engine_->Step({static_cast<float>(lr)}));
  const double step_call_s = SecondsSince(step_call_t0);
  model_step_ = step + 1;
  StartKept();
  const double dt = SecondsSince(t0);
  if (lead_ && step == start_) {
    // The warm-up iteration's trace, for `tierzero plan --trace` (docs/plan.md).
    // (Not the run's record, an aid to plan the next: one that cannot be written stops nothing.)
    if (auto trace = engine_->RecordedTrace(); trace.ok()) {
      const std::string path = out_.run_dir + "/warmup_trace.json";
      if (Status s = WriteWarmupTrace(*trace, path); !s.ok())
        progress_->Line("(the warm-up trace " + path + " could not be written: " + s.ToString() +
                        "; the run goes on without it: only `tierzero plan --trace` reads it)");
    }
  }
  total_tokens_ += tokens_per_step;
  total_compute_s_ += dt;
  const EngineStats now = engine_->stats();
  const double acquire_wait_s = now.acquire_wait_seconds - before.acquire_wait_seconds;
  const double update_wait_s = now.update_wait_seconds - before.update_wait_seconds;
  step_acquire_wait_s_ += acquire_wait_s;
  step_update_wait_s_ += update_wait_s;
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
            {"nvme_bytes", u.nvme},
            // Where the step's time went, on the host's clock (docs/config.md, "metrics").
            {"forward_backward_s", compute_s},
            {"engine_step_s", step_call_s},
            {"parameter_wait_s", acquire_wait_s},
            {"update_wait_s", update_wait_s}};
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
  if ((!interrupted_ || step_ >= cfg_.train.steps) && step_ > start_) {
    // A stop asked during the last step saves it first: the evaluation may take long, and a
    // second signal then (a scheduler's SIGKILL) would lose the step (review 50).
    if (interrupted_ && saved_step_ != step_) TZ_RETURN_IF_ERROR(Save(step_));
    final_eval = Evaluate(step_, /*stoppable=*/!interrupted_);
    if (final_eval.ok() && eval_cut_) {  // Note [An evaluation a signal cuts short]
      std::string how;
      if (cfg_.data.kind == "tokens" && !out_.checkpoint_dir.empty())
        how = " (tierzero eval --resume " + out_.checkpoint_dir +
              " --data FILES scores the model on token files of your choice)";
      progress_->Line("interrupted in the last evaluation: it is not made" + how);
    }
  }
  // A metrics line the lead could not write since the last agreement. A run stopped before its
  // last step (a Ctrl-C in the same step) is saved and resumes, as after a step's data error.
  if (final_eval.ok()) {
    final_eval = AgreeToGoOn(Status::OK());
    if (!final_eval.ok() && !resume_when_.empty() && step_ < cfg_.train.steps)
      return SaveAfterError(final_eval);
  }
  // Note [A checkpoint after a data error]: an evaluation that could not read its data or write
  // its line leaves the run whole, trained to its end: it is saved and reported all the same,
  // and the error says how to evaluate it. Any other failure stops here, as before.
  if (!final_eval.ok() && resume_when_.empty()) return final_eval;
  // (A checkpoint of this very step is there already when checkpoint_every saved it.)
  if (saved_step_ != step_) TZ_RETURN_IF_ERROR(Save(step_));
  past_collectives_ = true;
  if (!lead_) return final_eval;
  KeepRunFilesNamed();  // (also with --checkpoint none, which saves nothing)
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

// Note [An output another run wrote meanwhile]
// The run's outputs are checked against another run's when it starts (run_dir.cc), but the
// report, its page and its trace are written only at its end, hours later. Two runs started
// together naming one --report outside their run directories both passed the check, and the one
// that ended last replaced the other's report silently (the metrics file is locked for this:
// LockMetrics). So each of these files is recorded as it was when the set-up ended, and is
// written only if it is still that file (or still absent); one written meanwhile by another
// process is kept, and the run says so (its checkpoint is saved first). The check and the
// replace are one step (Note [A replace that checks what it replaces], src/core/file_io.cc).
void TrainRun::RecordOutputs() {
  for (const std::string* f : {&out_.report, &out_.html, &out_.trace}) {
    if (f->empty()) continue;
    // Held open to the end, a file keeps its inode number: FAT numbers an inode anew each time
    // it is read back into memory, so a resume in place of a run on a FAT disk found its own
    // report "written by another process" once memory pressure had dropped it (hunt 42). Held
    // first, then stamped. (Only a regular file: a FIFO named as an output is not opened.)
    struct stat st {};
    if (::stat(f->c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      const int fd = ::open(f->c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
      if (fd >= 0) output_pins_.push_back(fd);
    }
    output_ids_[*f] = FileStamp(*f);
  }
}

Status TrainRun::WriteOutputIfUnchanged(const std::string& path, const std::string& text,
                                        const char* what) const {
  auto it = output_ids_.find(path);
  Status s = WriteFileAtomicallyIfUnchanged(path, text,
                                            it == output_ids_.end() ? FileStamp(path) : it->second);
  if (s.code() != StatusCode::kFailedPrecondition ||
      s.message().find("written by another process") == std::string_view::npos)
    return s;
  return FailedPreconditionError(
      "the " + std::string(what) + " " + path +
      " was written by another process while this run trained (two runs naming one output?); "
      "it is kept, not replaced: give each run its own (--report, --html, --trace)");
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
                    {"batch_size", cfg_.train.batch_size},
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
  // (A status with more said after its message.)
  auto more = [](const Status& s, const std::string& after) {
    return Status(s.code(), std::string(s.message()) + after);
  };
  // (Another process's now: Note [Outputs another run took].)
  auto taken = [](const Status& s) {
    return s.code() == StatusCode::kFailedPrecondition &&
           s.message().find("was written by another process") != std::string_view::npos;
  };
  Status wrote = WriteOutputIfUnchanged(out_.report, text, "report");
  if (!wrote.ok()) {
    const std::string aside = KeepReportAside(text);
    if (taken(wrote)) {
      Disown("report", report_aside_);
      if (!out_.html.empty()) Disown("html", "none");
      if (!out_.trace.empty()) Disown("trace", "none");
    }
    return more(std::move(wrote).WithContext(where("report", out_.report)), aside);
  }
  TZ_ASSIGN_OR_RETURN(summary, ReportSummary(text));
  // (The report is written: it renders its page and trace again.)
  auto again = [&](const char* flag, const std::string& path) {
    return "; tierzero report " + out_.report + " " + flag + " " + path + " renders it again";
  };
  // The page and the trace each tried, whatever became of the other (a page that could not be
  // written left the trace unwritten and unmentioned: hunt 42); the first failure is returned.
  Status first;
  if (!out_.html.empty()) {
    StatusOr<std::string> page = RenderHtmlReport(text);
    Status s =
        page.ok() ? WriteOutputIfUnchanged(out_.html, *page, "report's page") : page.status();
    if (taken(s)) Disown("html", "none");
    if (!s.ok())
      first = more(std::move(s).WithContext(where("report's page", out_.html)),
                   again("-o", "PAGE.html"));
  }
  if (!out_.trace.empty()) {
    StatusOr<std::string> trace = RenderChromeTrace(text);
    Status s = trace.status();
    if (s.ok()) s = WriteOutputIfUnchanged(out_.trace, *trace, "trace");
    if (taken(s)) Disown("trace", "none");
    if (trace.status().code() == StatusCode::kFailedPrecondition) {
      std::printf("  (no trace: %s)\n", std::string(trace.status().message()).c_str());
      trace_skipped_ = true;
    } else if (!s.ok()) {
      Status t = more(std::move(s).WithContext(where("trace", out_.trace)),
                      again("--trace", "TRACE.json"));
      first = first.ok() ? std::move(t)
                         : more(first, "; the trace could not be written either: " + t.ToString());
    }
  }
  return first;
}

// Note [A report kept aside]
// The report is the run's record of where its memory went and how long each phase took; it is
// written at the end, and cannot be made again from the checkpoint. When its own path cannot be
// written (a full disk, a directory removed, another run's report there), it is kept in a new
// file in the run directory instead, never over any file: report.json there if --report named
// another path, else report-step<N>.json (then -2, -3, ...). `tierzero report FILE` renders its
// summary, page and trace from it.
std::string TrainRun::KeepReportAside(const std::string& text) {
  std::vector<std::string> names;
  const std::string dir = out_.run_dir + "/";
  if (out_.report != dir + "report.json") names.push_back(dir + "report.json");
  const std::string stem = dir + "report-step" + std::to_string(step_);
  names.push_back(stem + ".json");
  for (int i = 2; i <= 9; ++i) names.push_back(stem + "-" + std::to_string(i) + ".json");
  Status last;
  for (const std::string& name : names) {
    last = WriteNewFile(name, text);
    if (last.ok()) {
      report_aside_ = name;
      return "; the report is kept in " + name + " instead (tierzero report " + name +
             " summarises it; -o PAGE.html and --trace TRACE.json render it)";
    }
    if (last.code() != StatusCode::kAlreadyExists) break;
  }
  return "; keeping it in the run directory failed too (" + last.ToString() + ")";
}

// Note [Outputs another run took]
// A report, page or trace path another run wrote meanwhile (two runs naming one --report) is
// that run's: this one keeps the file (Note [A report kept aside]). Its config.json still
// recorded the path as its own, so a resume in place replaced the other run's report unasked
// (hunt 51). It now records where its report went (the file kept aside, or none), and the path
// is checked as any other's at the resume.
void TrainRun::Disown(const char* field, const std::string& value) {
  if (outputs_.config_path.empty() || config_text_.empty()) return;
  json c = json::parse(config_text_, nullptr, /*allow_exceptions=*/false);
  if (!c.is_object() || !c.contains("output") || !c["output"].is_object()) return;
  const std::string was = c["output"].value(field, std::string());
  const std::string now = value.empty() ? "none" : value;
  if (was == now) return;
  c["output"][field] = now;
  const std::string text = c.dump(2) + "\n";
  if (!WriteFileAtomically(outputs_.config_path, text).ok()) return;
  config_text_ = text;
  progress_->Line("note: " + outputs_.config_path + " now records output." + field + " " + now +
                  " (" + was + " is another run's): a resume writes " +
                  (now == "none" ? std::string("no ") + field : std::string("there")));
}

void TrainRun::PrintDone(const std::string& summary) const {
  const EngineStats st = engine_->stats();
  const double wall = SecondsSince(run_t0_);
  const double c = total_compute_s_;
  std::printf(
      "done: %d steps in %.1f s | %.0f tok/s, %.2f GFLOP/s | moved%s H2D %s MiB, D2H %s MiB, "
      "NVMe read %s MiB, write %s MiB | waits for parameters %.1f%%, for the optimizer's update "
      "behind the forward %.1f%% of step time\n",
      step_ - start_, wall, c > 0 ? total_tokens_ / c : 0,
      c > 0 ? total_tokens_ * model_->flops_per_token() / c / 1e9 : 0,
      // (Tokens and FLOP/s are the job's; the bytes this rank's: figures hunt 47.)
      world_ > 1 ? " (rank 0)" : "", Mib(st.h2d_bytes).c_str(), Mib(st.d2h_bytes).c_str(),
      Mib(st.nvme_read_bytes).c_str(), Mib(st.nvme_write_bytes).c_str(),
      c > 0 ? 100 * step_acquire_wait_s_ / c : 0, c > 0 ? 100 * step_update_wait_s_ / c : 0);
  // How it computed, now that it has (which attention ran: Note [Which attention runs]).
  std::printf("  compute: %s\n", model_->ComputeSummary().c_str());
  if (world_ > 1) std::printf("  (the report below is rank 0's: its memory, bytes and waits)\n");
  std::fputs(summary.c_str(), stdout);
  if (out_.checkpoint_dir.empty())
    std::printf("  checkpoint: none\n");
  else
    std::printf("  checkpoint: %s (saved in %.1f s)\n", out_.checkpoint_dir.c_str(), save_s_);
  std::printf("  metrics: %s\n  report: %s\n", out_.metrics.c_str(), out_.report.c_str());
  if (!out_.html.empty()) std::printf("  html: %s\n", out_.html.c_str());
  if (!out_.trace.empty() && !trace_skipped_) std::printf("  trace: %s\n", out_.trace.c_str());
}

}  // namespace tierzero::app
