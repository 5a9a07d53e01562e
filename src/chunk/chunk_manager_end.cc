// ChunkManager: the end of an iteration (reductions finished, streams drained, gathered copies
// dropped, the ranks' outcome agreed) and, after a recording iteration, the plan.
#include <algorithm>
#include <set>

#include "chunk/chunk_manager.h"
#include "chunk/chunk_manager_impl.h"
#include "core/logging.h"

namespace tierzero {

Status ChunkManager::EndIteration() {
  Impl& im = *impl_;
  RETURN_IF_ERROR(im.ranks.OutOfStep());  // no teardown: the manager takes no more work
  im.pending_prefetch.clear();            // nothing left to use them
  if (layout_.world_size() > 1) {
    bool unused = false;
    RETURN_IF_ERROR(im.ranks.AgreeOnMoment(im.ctx.moment, 0, /*end=*/true, im.inference, &unused,
                                           &im.ctx.counters.comm_seconds));
  }
  RETURN_IF_ERROR(states_->FinishBackward());
  const Impl::Mode mode = im.mode;
  RETURN_IF_ERROR(FinishTransfers());
  MeasureStalls();
  RETURN_IF_ERROR(ReleaseChunks());
  if (layout_.world_size() > 1) {
    // A failure inside a stream (an NVMe read, a collective on the device) reaches only its
    // rank, but what it left in a gathered chunk reached every rank: all of them fail, out of
    // step (Note [Agreeing on an outcome]).
    Status agreed = im.ranks.AgreeOnOutcome();
    if (!agreed.ok()) {
      im.ctx.moment = 0;
      return agreed;
    }
  }
  ++counters_.iterations;
  if (im.profiling) {
    im.profiling = false;
    im.observer = nullptr;
    im.on_profile_begin = nullptr;
    im.ctx.spans.Observe(nullptr);
  }
  if (im.inference) {
    im.inference = false;
    im.ctx.moment = 0;
    // A failure inside a stream (an NVMe read cut short or failing its checksum) left garbage
    // in a gathered chunk: the forward's loss is of that. Said, not returned as the loss (one
    // rank's evaluation printed a wrong loss, exit 0: hunt 50).
    return im.ranks.TakeAsyncError();
  }
  if (mode == Impl::Mode::kReplay && im.ctx.moment != static_cast<int>(trace_.size())) {
    ++counters_.deviations;
    im.record_next = true;  // fewer moments than the trace
  }
  im.ctx.moment = 0;
  RETURN_IF_ERROR(im.ranks.TakeAsyncError());
  if (mode != Impl::Mode::kRecord) return Status::OK();

  // Plan from the recorded iteration, with the gather times it measured.
  im.ctx.timer.Finish(device_, im.measured_seconds);
  TZ_LOG(kInfo, kChunk) << "measured gathers: host " << im.measured_seconds[1] * 1e3 << " ms, nvme "
                        << im.measured_seconds[2] * 1e3 << " ms per chunk";
  tracer_.Finish();
  std::vector<Moment> moments = tracer_.moments();
  for (size_t k = 0; k < moments.size(); ++k) {
    EventHandle end =
        k + 1 < moments.size() ? im.moment_begin[k + 1].handle() : im.iteration_end.handle();
    auto t = device_.ElapsedSeconds(im.moment_start[k].handle(), end);
    moments[k].compute_seconds = t.ok() ? std::max(0.0, *t) : 0.0;
  }
  return Replan(std::move(moments));
}

// Completes the reductions (W > 1) and waits for every stream. Failures of reductions and device
// collectives become the iteration's asynchronous error.
Status ChunkManager::FinishTransfers() {
  Impl& im = *impl_;
  if (layout_.world_size() > 1) {
    Status s = im.reduce->Finish(/*wait_all=*/true, /*wait_oldest=*/false);
    if (!s.ok()) im.ranks.SetAsyncError(std::move(s));
    if (options_.device_comm != nullptr) {
      s = options_.device_comm->Drain();
      if (!s.ok()) im.ranks.SetAsyncError(im.ranks.LoseStep(std::move(s)));
    }
  }
  if (im.mode == Impl::Mode::kRecord) {
    RETURN_IF_ERROR(device_.RecordEvent(im.iteration_end.handle(), compute_));
  }
  return device_.Synchronize();
}

// Compute-stream stall: per moment, from reaching its Acquire to passing the waits.
void ChunkManager::MeasureStalls() {
  Impl& im = *impl_;
  if (im.moments_timed == 0) return;
  double stall = 0;
  for (int k = 0; k < im.moments_timed; ++k) {
    auto t = device_.ElapsedSeconds(im.moment_begin[static_cast<size_t>(k)].handle(),
                                    im.moment_start[static_cast<size_t>(k)].handle());
    if (t.ok()) stall += std::max(0.0, *t);
    if (t.ok() && im.profiling && static_cast<size_t>(k) < im.profile.size())
      im.profile[static_cast<size_t>(k)].stall_s = std::max(0.0, *t);
  }
  counters_.last_stall_seconds = stall;
  counters_.stall_seconds += stall;
  im.moments_timed = 0;
}

// Gathered copies do not outlive the iteration: the optimizer changes the shards.
void* ChunkManager::idle_slot_memory() const { return impl_->slots.region(); }
uint64_t ChunkManager::idle_slot_bytes() const { return impl_->slots.region_bytes(); }

Status ChunkManager::ReleaseChunks() {
  Impl& im = *impl_;
  for (int c = 0; c < layout_.num_chunks(); ++c) RETURN_IF_ERROR(Evict(c));
  RETURN_IF_ERROR(device_.Synchronize());
  for (auto& rt : im.chunks) rt.grad_buf.Reset();  // also after a failed reduction: no stale data
  im.deferred_free.clear();
  im.slots.ForgetCopies();
  return Status::OK();
}

// W > 1: the plan's inputs become the maximum over the ranks, so that every rank computes the
// same plan (and issues the same gathers).
namespace {
Status AgreeOnPlanInputs(RankAgreement& ranks, std::vector<Moment>& moments,
                         double measured[kNumTiers]) {
  std::vector<double> v;
  for (const Moment& m : moments) {
    v.push_back(m.compute_seconds);
    v.push_back(static_cast<double>(m.nonmodel_bytes));
    v.push_back(static_cast<double>(m.nonmodel_peak));
  }
  for (int t = 0; t < kNumTiers; ++t) v.push_back(measured[t]);
  RETURN_IF_ERROR(ranks.AgreeOnMaximum(v));
  for (size_t k = 0; k < moments.size(); ++k) {
    moments[k].compute_seconds = v[3 * k];
    moments[k].nonmodel_bytes = static_cast<uint64_t>(v[3 * k + 1]);
    moments[k].nonmodel_peak = static_cast<uint64_t>(v[3 * k + 2]);
  }
  for (int t = 0; t < kNumTiers; ++t) measured[t] = v[3 * moments.size() + t];
  return Status::OK();
}
}  // namespace

StatusOr<Schedule> ChunkManager::PlanFrom(const std::vector<Moment>& moments) {
  Impl& im = *impl_;
  PlanOptions po;
  po.device_capacity = options_.device_budget_bytes;
  po.chunk_bytes = layout_.chunk_bytes();
  po.gather_seconds = GatherSeconds();
  const size_t nc = static_cast<size_t>(layout_.num_chunks());
  po.grads_in_place.resize(nc);
  po.reduced_at_end.resize(nc);
  po.always_resident.resize(nc);
  po.staged.resize(nc);
  // Note [Prefetches within the staging slots] (plan.cc).
  const bool staged_all = im.gather->StagesEveryChunk();
  po.staging_slots = im.gather->staging_slots();
  NvmeStore* nvme = store_.nvme();
  if (nvme != nullptr && po.staging_slots > 0 && !staged_all) {
    // Asynchronous reads beyond the NVMe queue would hold up the caller in the same way (the
    // host path reads synchronously, one at a time).
    po.staging_slots = std::min(po.staging_slots, nvme->TransfersInFlight(layout_.shard_bytes()));
  }
  for (int c = 0; c < layout_.num_chunks(); ++c) {
    const size_t i = static_cast<size_t>(c);
    po.grads_in_place[i] = !SeparateGrads(c);
    po.always_resident[i] = ShardIsGathered(c);
    po.staged[i] = staged_all || store_.param_tier(c) == Tier::kNvme;
    for (int t : layout_.chunk(c).tensors) {
      if (states_->backward_uses(t) == 0) po.reduced_at_end[i] = true;
    }
  }
  auto schedule = Simulate(moments, po, options_.policy);
  if (!schedule.ok()) return std::move(schedule).status().WithContext("planning after warm-up");
  return schedule;
}

Status ChunkManager::Replan(std::vector<Moment> moments) {
  Impl& im = *impl_;
  if (layout_.world_size() > 1) {
    RETURN_IF_ERROR(AgreeOnPlanInputs(im.ranks, moments, im.measured_seconds));
  }
  ASSIGN_OR_RETURN(Schedule schedule, PlanFrom(moments));
  // The slot region: as many slots as the schedule ever holds (device-resident chunks need none).
  std::set<int> resident;
  size_t most = 0;
  for (const MomentDecision& d : schedule.moments) {
    for (int c : d.evict) resident.erase(c);
    for (int c : d.gather) {
      if (!ShardIsGathered(c)) resident.insert(c);
    }
    most = std::max(most, resident.size());
  }
  RETURN_IF_ERROR(im.slots.Reserve(device_, static_cast<int>(most), layout_.chunk_bytes()));
  trace_ = std::move(moments);
  schedule_ = std::move(schedule);
  has_plan_ = true;
  im.record_next = false;
  ++counters_.plans;
  TZ_LOG(kInfo, kChunk) << "plan (" << CachePolicyName(options_.policy) << "): " << trace_.size()
                        << " moments, " << most << " slots, predicted stall " << schedule_.stall_s
                        << " s";
  return Status::OK();
}

}  // namespace tierzero
