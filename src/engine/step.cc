// Engine::Step: the iteration protocol's checks, the Updater's step (the global norm, clipping,
// AdamW over every optimizer group: src/update), dynamic loss scaling, and the profiled step's
// figures; Engine::PrepareStep.
#include <cmath>
#include <cstring>
#include <limits>

#include "core/check.h"
#include "core/logging.h"
#include "engine/engine_impl.h"

namespace tierzero {

namespace {
double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

// A non-finite gradient: the step is skipped, and with fp16 the loss scale halves.
Status Engine::Impl::SkipStep() {
  ++stats.skipped_steps;
  if (cfg.compute_dtype == DType::kF16) {
    loss_scale = std::max(1.0f, loss_scale / 2);
    good_steps = 0;
    TZ_LOG(kInfo, kEngine) << "non-finite gradient: step skipped, loss scale now " << loss_scale;
  } else {
    TZ_LOG(kWarn, kEngine) << "non-finite gradient: step skipped";
  }
  if (cfg.grad_accumulation > 1) RETURN_IF_ERROR(cm->ZeroGrads());
  return Status::OK();
}

Status Engine::Impl::CheckStep(const StepOptions& options) {
  if (iterations_since_step != cfg.grad_accumulation) {
    return FailedPreconditionError("Step after " + std::to_string(iterations_since_step) +
                                   " training iterations; grad_accumulation is " +
                                   std::to_string(cfg.grad_accumulation));
  }
  if (!(options.lr >= 0) || !std::isfinite(options.lr))
    return InvalidArgumentError("learning rate " + std::to_string(options.lr) + " is not >= 0");
  return Status::OK();
}

void Engine::Impl::NoteStepEnd() {
  const auto now = std::chrono::steady_clock::now();
  if (last_step_end != std::chrono::steady_clock::time_point{}) {
    const double dt = std::chrono::duration<double>(now - last_step_end).count();
    if (step_intervals.size() < kStepWindow) {
      step_intervals.push_back(dt);
    } else {
      step_intervals[step_interval_next] = dt;
      step_interval_next = (step_interval_next + 1) % kStepWindow;
    }
  }
  last_step_end = now;
}

StatusOr<StepResult> Engine::Step(const StepOptions& options) {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("Step before Finalize");
  RETURN_IF_ERROR(RefuseWithoutMoments("Step"));
  RETURN_IF_ERROR(im.cm->out_of_step());
  RETURN_IF_ERROR(im.updater->Await());
  if (im.in_iteration) {
    if (!im.iteration_train) return FailedPreconditionError("Step inside an evaluation iteration");
    RETURN_IF_ERROR(im.NoScopeOpen("Step"));
    RETURN_IF_ERROR(EndIteration());
  }
  RETURN_IF_ERROR(im.CheckStep(options));
  const auto t0 = std::chrono::steady_clock::now();
  const bool prof = im.profile_step;
  const double step_start_s = im.timeline.Now();
  // Note [The profiled step's NVMe]
  // The profiled step's NVMe optimizer traffic (the report's links.nvme_optimizer) is its states
  // read and written: the reads start in the last micro-batch's backward (the read-ahead), before
  // Step, so the counters are taken there; taken here, the read-ahead's reads were left out (5 of
  // 7 groups on NVMe counted 7 of 10 transfers: figures hunt 47). The link's rate stays the swap
  // pipeline's own: its bytes, from here, over its time.
  const OptimizerCounters in_step = im.optimizer().counters();
  const OptimizerCounters before = im.profile_optimizer_before.value_or(in_step);
  im.profile_optimizer_before.reset();
  const uint64_t param_writes_before = im.store->counters().nvme_write_bytes;
  im.iterations_since_step = 0;
  UpdateStepInputs in;
  in.step = im.step + 1;
  in.lr = options.lr;
  in.grad_scale = 1.0 / (static_cast<double>(im.loss_scale) * im.cfg.grad_accumulation);
  in.clip_grad_norm = im.cfg.clip_grad_norm;
  in.profiled = prof;
  ASSIGN_OR_RETURN(const UpdateStepOutcome u, im.updater->Step(in));
  StepResult r;
  r.grad_norm = u.grad_norm;
  if (!u.applied) {
    RETURN_IF_ERROR(im.SkipStep());
    r.applied = false;
    r.loss_scale = im.loss_scale;
    r.step = im.step;
    r.seconds = SecondsSince(t0);
    im.NoteStepEnd();
    return r;
  }
  ++im.step;
  ++im.stats.steps;
  if (im.cfg.compute_dtype == DType::kF16 && ++im.good_steps >= im.cfg.loss_scale_window) {
    im.loss_scale = std::min(im.loss_scale * 2, 16777216.0f);
    im.good_steps = 0;
  }
  r.applied = true;
  r.loss_scale = im.loss_scale;
  r.step = im.step;
  r.seconds = SecondsSince(t0);
  im.stats.optimizer_seconds += r.seconds;
  im.NoteStepEnd();
  if (prof) {
    const OptimizerCounters& after = im.optimizer().counters();
    im.timeline.Add({Track::kOptimizer, "optimizer step", step_start_s, r.seconds});
    im.profile_events = im.timeline.events();
    im.step_seconds = r.seconds;
    im.step_nvme_seconds = after.nvme_seconds - before.nvme_seconds;
    im.step_nvme_bytes = after.nvme_read_bytes + after.nvme_write_bytes - before.nvme_read_bytes -
                         before.nvme_write_bytes;
    im.step_nvme_pipeline_bytes = after.nvme_read_bytes + after.nvme_write_bytes -
                                  in_step.nvme_read_bytes - in_step.nvme_write_bytes;
    im.step_nvme_write_bytes = after.nvme_write_bytes - before.nvme_write_bytes +
                               im.store->counters().nvme_write_bytes - param_writes_before;
    im.profile_step = false;
  }
  return r;
}

Status Engine::PrepareStep(const StepOptions& options) {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("PrepareStep before Finalize");
  RETURN_IF_ERROR(RefuseWithoutMoments("PrepareStep"));
  if (im.in_iteration) return FailedPreconditionError("PrepareStep inside an iteration");
  if (!(options.lr >= 0) || !std::isfinite(options.lr))
    return InvalidArgumentError("learning rate " + std::to_string(options.lr) + " is not >= 0");
  im.updater->Prepare(options);
  return Status::OK();
}

}  // namespace tierzero
