// Engine::Step: the global gradient norm (the ranks' sums in rank order), the non-finite check
// and dynamic loss scaling, clipping, and AdamW over every optimizer group of the shard store,
// writing each group's new compute-dtype parameters back to its parameter shard.
#include <cmath>
#include <cstring>
#include <limits>

#include "comm/collective.h"
#include "core/check.h"
#include "core/logging.h"
#include "engine/engine_impl.h"

namespace tierzero {

namespace {
double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

// The sum of squares of every gradient over the tensors only (a shard's padding is not a
// gradient), over all ranks: a NaN or Inf makes it non-finite.
StatusOr<double> Engine::Impl::GradSumSquares() {
  const DType gt = store->grad_dtype();
  double sumsq = 0;
  for (int c = 0; c < layout.num_chunks(); ++c) {
    const auto* g = static_cast<const uint8_t*>(store->grad(c));
    for (const ShardSlice& sl : slices[static_cast<size_t>(c)]) {
      ASSIGN_OR_RETURN(double s,
                       adam_plain->SumSquares(g + DTypeBytes(gt, sl.shard_offset), gt, sl.numel));
      sumsq += s;
    }
  }
  if (world() > 1) {
    // The ranks' sums in rank order, so every rank gets the same norm bit for bit.
    ASSIGN_OR_RETURN(std::vector<double> all, AllGatherValue(*comm, sumsq));
    sumsq = 0;
    for (double x : all) sumsq += x;
  }
  return sumsq;
}

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

// AdamW on one optimizer group, and its new parameters written to the chunk's parameter shard.
Status Engine::Impl::AdamGroup(const OptimizerGroup& g, const AdamStepOptions& so, bool prof) {
  const int c = g.chunk;
  const double chunk_start_s = prof ? timeline.Now() : 0.0;
  AdamStepOptions chunk_so = so;
  if (prof) {
    chunk_so.observer = &timeline;
    chunk_so.chunk = c;
  }
  // Added when the chunk's update ends, on every path out of this function.
  struct SpanAtExit {
    Impl* im;
    bool on;
    double start;
    int chunk;
    ~SpanAtExit() {
      if (on) {
        im->timeline.Add({Track::kOptimizer, "Adam chunk " + std::to_string(chunk), start,
                          im->timeline.Now() - start, -1, chunk, im->layout.shard_elems() * 12});
      }
    }
  } span{this, prof, chunk_start_s, c};
  void* host = store->host_param(c);
  auto* out = static_cast<uint8_t*>(host != nullptr ? host : upload.data());
  if (host == nullptr) std::memset(out, 0, upload.bytes());  // zero padding
  RETURN_IF_ERROR(AdamInto(g, out, chunk_so));
  if (host == nullptr) RETURN_IF_ERROR(store->WriteParam(c, out));
  return Status::OK();
}

// AdamW on group g's states (wherever they are in host memory), its new compute-dtype
// parameters into `out` (the chunk's shard layout; padding left as it is).
Status Engine::Impl::AdamInto(const OptimizerGroup& g, uint8_t* out, const AdamStepOptions& so) {
  const DType gt = store->grad_dtype();
  const DType dt = cfg.compute_dtype;
  const auto* grad = static_cast<const uint8_t*>(store->grad(g.chunk));
  for (const ShardSlice& sl : slices[static_cast<size_t>(g.chunk)]) {
    AdamBuffers b;
    b.master = g.master + sl.shard_offset;
    b.m = g.m + sl.shard_offset;
    b.v = g.v + sl.shard_offset;
    b.grad = grad + DTypeBytes(gt, sl.shard_offset);
    b.grad_dtype = gt;
    b.n = sl.numel;
    if (dt != DType::kF32) {
      b.out = out + DTypeBytes(dt, sl.shard_offset);
      b.out_dtype = dt;
    }
    CpuAdam& adam = params[static_cast<size_t>(sl.tensor)].weight_decay ? *adam_decay : *adam_plain;
    ASSIGN_OR_RETURN(bool applied, adam.Step(b, so));
    TZ_CHECK(applied) << "Adam skipped a step that was checked finite";
    if (dt == DType::kF32) std::memcpy(out + sl.shard_offset * 4, b.master, sl.numel * 4);
  }
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
  RETURN_IF_ERROR(im.cm->out_of_step());
  RETURN_IF_ERROR(im.AwaitUpdate());
  if (im.in_iteration) {
    if (!im.iteration_train) return FailedPreconditionError("Step inside an evaluation iteration");
    RETURN_IF_ERROR(EndIteration());
  }
  RETURN_IF_ERROR(im.CheckStep(options));
  const auto t0 = std::chrono::steady_clock::now();
  const bool prof = im.profile_step;
  const double step_start_s = im.timeline.Now();
  const OptimizerCounters before = im.optimizer().counters();
  const uint64_t param_writes_before = im.store->counters().nvme_write_bytes;
  im.iterations_since_step = 0;
  ASSIGN_OR_RETURN(const double sumsq, im.GradSumSquares());
  const double inv = 1.0 / (static_cast<double>(im.loss_scale) * im.cfg.grad_accumulation);
  StepResult r;
  const bool finite = std::isfinite(sumsq);
  r.grad_norm = finite ? std::sqrt(sumsq) * inv : std::numeric_limits<double>::infinity();
  double clip = 1.0;
  if (finite && im.cfg.clip_grad_norm > 0 && r.grad_norm > im.cfg.clip_grad_norm)
    clip = im.cfg.clip_grad_norm / (r.grad_norm + 1e-6);
  // The speculative updates are this step's own only when nothing differs from what they
  // assumed (Note [The speculative start]).
  const bool same_options = im.spec.so.lr == options.lr;  // what the updates used
  ASSIGN_OR_RETURN(im.update.skip, im.CommitSpeculation(finite && clip == 1.0 && same_options));
  im.spec.last_clean = finite && clip == 1.0;
  if (!finite) {
    RETURN_IF_ERROR(im.SkipStep());
    r.applied = false;
    r.loss_scale = im.loss_scale;
    r.step = im.step;
    r.seconds = SecondsSince(t0);
    im.NoteStepEnd();
    return r;
  }
  AdamStepOptions so;
  so.step = im.step + 1;
  so.lr = options.lr;
  so.grad_scale = static_cast<float>(inv * clip);
  if (prof) {
    im.timeline.Add(
        {Track::kOptimizer, "gradient norm", step_start_s, im.timeline.Now() - step_start_s});
  }
  RETURN_IF_ERROR(im.RunUpdatePhase(so, prof));
  // (Behind the next forward, the gradient shards are cleared as their groups finish.)
  if (im.cfg.grad_accumulation > 1 && !im.tail.active) RETURN_IF_ERROR(im.cm->ZeroGrads());
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
    im.step_nvme_write_bytes = after.nvme_write_bytes - before.nvme_write_bytes +
                               im.store->counters().nvme_write_bytes - param_writes_before;
    im.profile_step = false;
  }
  return r;
}

}  // namespace tierzero
