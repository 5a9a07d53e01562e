// TrainRun's saves (train_run.h): where a checkpoint goes (Note [A directory moved under the
// run]), what it records, and what a failed save leaves and says.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "resume.h"
#include "signals.h"
#include "tierzero/files.h"
#include "train_run.h"

namespace tierzero::app {
using nlohmann::json;

std::string TrainRun::ResumeFlags() const {
  // A checkpoint directory other than the run directory's own is resumed with the run's config,
  // which names both (and the run's other paths: its NVMe directory): `--resume CK --checkpoint
  // CK` alone took the default run directory and was refused there (hunt 42).
  std::error_code ec;
  const bool own =
      std::filesystem::equivalent(out_.checkpoint_dir, out_.run_dir + "/checkpoint", ec);
  return own ? "--resume " + out_.checkpoint_dir
             : "--config " + out_.run_dir + "/config.json --resume " + out_.checkpoint_dir;
}

// Note [A directory moved under the run] (dir_lock.cc): the save goes where the directory the
// set-up locked is now. Moved (aside, or with its run directory), it follows it, and says so:
// what the old path names now is not this run's (another run's, behind a symbolic link).
// Removed, the path is made again and saved into, unless something else is there now. With
// several ranks, each writing its own file into the directory by its path, any change stops the
// save on every rank: a rank that followed would write where the others do not.
Status TrainRun::FollowCheckpointDir() {
  if (lock_ == nullptr || !lead_ || out_.checkpoint_dir.empty()) return Status::OK();
  if (locked_checkpoint_dir_.empty()) locked_checkpoint_dir_ = out_.checkpoint_dir;
  std::string key = locked_checkpoint_dir_;
  std::optional<std::string> where = lock_->Where(key);
  if (!where) {  // (the checkpoint directory is the run directory: locked as that)
    key = out_.run_dir;
    where = lock_->Where(key);
  }
  // (Unchanged since the set-up, or since the last save followed it.)
  if (!where || *where == followed_.value_or(key)) return Status::OK();
  std::error_code ec;
  const bool taken = std::filesystem::exists(locked_checkpoint_dir_, ec) || ec;
  std::string target = where->empty() ? locked_checkpoint_dir_ : *where;
  if (*where == key) target = locked_checkpoint_dir_;  // back where it was
  const std::string said = where->empty() ? "was removed while the run trained"
                                          : "was moved to " + *where + " while the run trained";
  if (where->empty() && taken)
    return FailedPreconditionError(
        "the checkpoint directory " + locked_checkpoint_dir_ + " " + said + ", and " +
        locked_checkpoint_dir_ +
        " now names another (a symbolic link, or another run's?): nothing is saved there, "
        "where this run's checkpoint would replace what is not its own. Remove what is there "
        "now and resume from the last checkpoint this run saved, if one is left");
  if (world_ > 1)
    return FailedPreconditionError(
        "the checkpoint directory " + locked_checkpoint_dir_ + " " + said +
        ": with several ranks, each writing its file there by its path, nothing is saved. Put it "
        "back and resume from its last checkpoint");
  if (*where != key)
    progress_->Line("note: the checkpoint directory " + locked_checkpoint_dir_ + " " + said +
                    (where->empty()
                         ? ": it is made again, and saved into"
                         : ": saved there (" + locked_checkpoint_dir_ +
                               (taken ? " names another now, not this run's)" : " is no more)")));
  cfg_.output.checkpoint_dir = target;  // (out_ names it)
  followed_ = *where;
  if (where->empty()) {
    // Note [A directory made again is locked again]: made here, and locked before the save.
    std::filesystem::create_directories(target, ec);
    if (ec) return IoError("making the checkpoint directory " + target + " again: " + ec.message());
    TZ_RETURN_IF_ERROR(
        lock_->Relock(key, key == out_.run_dir ? "run directory" : "checkpoint directory"));
    followed_.reset();  // (its path names the lock held again)
  }
  return Status::OK();
}

Status TrainRun::Save(int step) {
  // The loop's step (Note [The loop's step, not the applied count]), the model (Note [A
  // checkpoint resumes its own model]), and what a resumed run compares with its own
  // (ReportRunChanges).
  json user = {{"step", step},
               {"micro_batches", MicroBatchesBefore(step)},
               {"data_seed", cfg_.data.seed},
               {"batch_size", cfg_.train.batch_size},
               {"grad_accumulation", cfg_.engine.grad_accumulation},
               {"ranks", world_},
               {"model", ModelJson(cfg_)},
               {"schedule", ScheduleJson(cfg_.train)},
               {"data", DataJson(cfg_.data)},
               {"compute_dtype", std::string(DTypeName(cfg_.engine.compute_dtype))},
               {"data_fingerprint", FingerprintText(dataset_->Fingerprint())},
               {"optimizer_states", MomentFormatText(cfg_.engine.optimizer_states)},
               {"adamw", AdamWJson(cfg_)},
               {"zeropp", ZeroPPJson(cfg_)},
               {"chunk_elems", cfg_.engine.chunk_elems},
               {"activations_ran", std::string(DTypeName(model_->ActivationsType()))}};
  // A re-save of the step resumed (a copy into another run directory, nothing trained): its
  // states were trained as the checkpoint's run trained them, which it keeps recording (a later
  // resume compares its own settings with those).
  if (step == start_ && !resumed_user_.empty()) {
    const json was = json::parse(resumed_user_, nullptr, /*allow_exceptions=*/false);
    for (const char* key : {"schedule", "data", "data_seed", "batch_size", "grad_accumulation",
                            "ranks", "compute_dtype", "data_fingerprint", "eval_pending", "adamw",
                            "zeropp", "chunk_elems", "activations_ran"}) {
      // (An evaluation left undone stays so only until the resume has made it.)
      const bool done = std::string(key) == "eval_pending" && !eval_at_start_;
      if (was.is_object() && was.contains(key) && !done) {
        user[key] = was[key];
      } else {
        user.erase(key);
      }
    }
  }
  // Note [An evaluation a stop left undone]
  if (step == eval_pending_step_) user["eval_pending"] = true;
  // Note [Metrics lines a stop left unwritten] (train.cc): those of this step and before.
  if (!unwritten_metrics_.empty()) {
    json lines = json::array();
    for (const std::string& l : unwritten_metrics_) {
      const json m = json::parse(l, nullptr, /*allow_exceptions=*/false);
      if (m.is_object() && m.contains("step") && m["step"].is_number_integer() &&
          m["step"].get<int64_t>() <= step)
        lines.push_back(m);
    }
    if (!lines.empty()) user["metrics_unwritten"] = lines;
  }
  KeepRunFilesNamed();  // Note [Run files removed under the run] (train_metrics.cc)
  if (out_.checkpoint_dir.empty()) return Status::OK();  // --checkpoint none
  // Note [The metrics on disk before the checkpoint that follows them]
  // A checkpoint is durable when its manifest is committed (fsynced); the metrics lines up to its
  // step were only written. After a power cut (or a file system shut down or gone read-only)
  // the checkpoint of step 10 resumed bit for bit and metrics.jsonl was empty: lines 0-10 gone for
  // good, since a resume writes only the lines after its step (hunt 42). So the lines go to disk
  // first. Its failure is said, not fatal: the checkpoint is the run's, the lines its record.
  if (metrics_fd_ >= 0) {
    struct stat mst {};
    if (::fstat(metrics_fd_, &mst) == 0 && S_ISREG(mst.st_mode) && ::fdatasync(metrics_fd_) != 0)
      std::fprintf(stderr,
                   "warning: the metrics file %s could not be written to disk before the "
                   "checkpoint of step %d: %s\n",
                   out_.metrics.c_str(), step, std::strerror(errno));
  }
  // Note [A directory moved under the run] (dir_lock.cc): every rank the same answer.
  Status followed = FollowCheckpointDir();
  if (world_ > 1) followed = AgreeOnStatus(*comm_, followed);
  TZ_RETURN_IF_ERROR(followed);
  const auto t0 = std::chrono::steady_clock::now();
  Status s = engine_->SaveCheckpoint(out_.checkpoint_dir, user.dump());
  save_s_ = SecondsSince(t0);
  // Every rank has the outcome (Note [Agreeing on an outcome]): a failure ends each rank on its
  // own, the lead saying it, not by an abort. Unless the save's own agreement was given up (a
  // rank stopped mid-save: the others timed out in it): then no rank knows the others', and the
  // job is aborted, each rank saying its error. Treated as agreed, the ranks left waited in
  // MPI_Finalize for the stopped one, forever (hunt 46).
  if (!s.ok() && world_ > 1 && !comm_->gave_up()) {
    agreed_failure_ = true;
    speaks_ = lead_;
  }
  if (s.ok()) {
    saved_step_ = step;
    SetStopSaves(true, true);
    StartKept();  // (a re-save of the step resumed trains no step first)
    return s;
  }
  // What the failure leaves (the manifest is the commit point: Note [Checkpoint format]): the
  // last checkpoint in the directory, this run's or the one it resumed in place, stays whole.
  // (Or any checkpoint that is there: the one this run resumed from another run directory, when
  // --checkpoint names it.)
  int64_t kept = saved_step_ >= 0 ? saved_step_ : outputs_.in_place ? start_ : -1;
  // Said only of what is there now: the directory may have been removed or replaced meanwhile.
  // A manifest that cannot be read now (the disk failing, the file system gone read-only or shut
  // down: hunt 42) says nothing either way, and is said as such: a checkpoint called gone would be
  // deleted, and it was intact once the disk was back.
  const std::string what = "saving the checkpoint of step " + std::to_string(step) + " in " +
                           out_.checkpoint_dir + " failed";
  auto there = ReadCheckpointInfo(out_.checkpoint_dir);
  if (there.ok()) {
    const int64_t at = CheckpointStep(there->user_state, there->step);
    if (kept < 0 || at != kept) kept = at;
  } else if (kept >= 0 && (there.status().code() == StatusCode::kIoError ||
                           there.status().code() == StatusCode::kUnavailable)) {
    return std::move(s).WithContext(
        what + " (and its last checkpoint, of step " + std::to_string(kept) +
        ", cannot be read now: " + std::string(there.status().message()) +
        "; it may well be intact: once the disk reads again, " + ResumeFlags() +
        " continues from it" +
        (kept < step ? "; steps " + std::to_string(kept + 1) + " to " + std::to_string(step) +
                           " are not saved)"
                     : ")"));
  } else {
    kept = -1;
  }
  if (kept >= 0)
    return std::move(s).WithContext(what + " (the checkpoint of step " + std::to_string(kept) +
                                    " there is intact: " + ResumeFlags() +
                                    " continues from it once the save can succeed" +
                                    (kept < step ? "; steps " + std::to_string(kept + 1) + " to " +
                                                       std::to_string(step) + " are not saved)"
                                                 : ")"));
  return std::move(s).WithContext(
      what + " (no checkpoint of this run is there" +
      (saved_step_ >= 0 || (outputs_.in_place && start_ > 0)
           ? " any more (removed or replaced meanwhile)"
           : "") +
      ": its " + std::to_string(step - start_) + " steps are not saved" +
      (s.code() != StatusCode::kIoError ? ")"
       : s.message().find("(ulimit -") != std::string::npos
           ? "; raise the limit the error names, or for a file system's own cap give "
             "--checkpoint a directory on another)"
       : s.message().find("longer than this system allows") != std::string::npos
           ? "; give --checkpoint a shorter path)"
       : s.message().find("free space there") != std::string::npos
           ? "; the path on another disk is --checkpoint DIR)"
       : s.message().find("Not a directory") != std::string::npos ||
               s.message().find("File exists") != std::string::npos
           ? "; a file is where a directory of that path goes: move it away, or give "
             "--checkpoint another directory)"
           : "; free space there, or give --checkpoint a directory on another disk)") +
      (saved_step_ < 0 && !(outputs_.in_place && start_ > 0)
           ? ". Its run directory keeps its config and metrics: run it again with --overwrite"
           : ""));
}

}  // namespace tierzero::app
