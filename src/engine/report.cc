// The engine's memory placement report (engine.h, docs/report.md): a snapshot of its layout,
// placement, plan, profile and counters, which src/profiler turns into the report's JSON; the
// engine's usage, stats and placement summary.
#include <algorithm>
#include <cstdio>

#include "core/bytes.h"
#include "core/file_io.h"
#include "engine/engine_impl.h"
#include "profiler/report_snapshot.h"

namespace tierzero {

void Engine::Impl::SnapshotLayout(ReportSnapshot& s) const {
  const Impl& im = *this;
  s.layout.chunk_elems = im.layout.chunk_elems();
  s.layout.chunk_bytes = im.layout.chunk_bytes();
  s.layout.shard_elems = im.layout.shard_elems();
  s.layout.optimizer_group_bytes = im.optimizer().group_bytes();
  s.layout.waste_fraction = im.layout.waste_fraction();
  for (int k = 0; k < im.layout.num_chunks(); ++k) {
    const ChunkPlacement& p = im.placement.chunks[static_cast<size_t>(k)];
    ReportSnapshot::Chunk& c = s.layout.chunks.emplace_back();
    for (int t : im.layout.chunk(k).tensors)
      c.tensors.push_back(im.params[static_cast<size_t>(t)].name);
    c.used_elems = im.layout.chunk(k).used_elems;
    c.param_tier = TierName(p.param);
    c.optimizer_tier = TierName(p.optimizer);
    // (An engine that never steps holds no gradient shards: Note [An engine that never steps].)
    c.grad_tier = im.placement.grad_shard_bytes > 0 ? TierName(p.grad) : "none";
  }
}

void Engine::Impl::SnapshotPlan(ReportSnapshot& s) const {
  const Impl& im = *this;
  const std::vector<Moment>& trace = im.cm->trace();
  const Schedule& sched = im.cm->schedule();
  for (size_t k = 0; k < trace.size(); ++k) {
    ReportSnapshot::Moment& m = s.moments.emplace_back();
    m.chunks = trace[k].chunks;
    m.backward = trace[k].backward;
    m.nonmodel_bytes = trace[k].nonmodel_bytes;
    m.nonmodel_peak = trace[k].nonmodel_peak;
    m.compute_seconds = trace[k].compute_seconds;
    if (k < sched.moments.size()) {
      m.planned = true;
      m.gather = sched.moments[k].gather;
      m.evict = sched.moments[k].evict;
    }
  }
  s.plan.predicted_stall_seconds = sched.stall_s;
  s.plan.policy = CachePolicyName(sched.policy);
  s.plan.planned = im.cm->has_plan();
}

void Engine::Impl::SnapshotProfile(ReportSnapshot& s) const {
  const Impl& im = *this;
  ReportSnapshot::Profile& p = s.profile;
  p.available = im.profile_iteration >= 0;
  if (!p.available) return;
  p.iteration = im.profile_iteration;
  const std::vector<Moment>& trace = im.cm->trace();
  for (size_t k = 0; k < im.profile.size(); ++k) {
    const ChunkManager::MomentProfile& from = im.profile[k];
    ReportSnapshot::ProfiledMoment& m = p.moments.emplace_back();
    m.residency = from.residency;
    m.prefetch = from.prefetch;
    m.device_chunk_bytes = from.device_chunk_bytes;
    m.nonmodel_bytes = from.nonmodel_bytes;
    m.stall_s = from.stall_s;
    m.backward = k < trace.size() && trace[k].backward;
    if (k < im.moment_times.size()) {
      m.timed = true;
      m.call_s = im.moment_times[k].call_s;
      m.ready_s = im.moment_times[k].ready_s;
      m.release_s = im.moment_times[k].release_s;
    }
  }
  p.events = im.profile_events;
  p.collectives = im.profile_wire;
  p.step_seconds = im.step_seconds;
  p.step_nvme_seconds = im.step_nvme_seconds;
  p.step_nvme_bytes = im.step_nvme_bytes;
  p.step_nvme_pipeline_bytes = im.step_nvme_pipeline_bytes;
  p.step_nvme_write_bytes = im.step_nvme_write_bytes;
}

void Engine::Impl::SnapshotRanks(ReportSnapshot& s) const {
  const Impl& im = *this;
  const CommStats cs = im.comm_stats();
  const Topology topo = im.comm->topology();
  ReportSnapshot::Ranks& r = s.ranks;
  r.world_size = im.comm->size();
  r.rank = im.comm->rank();
  r.backend = im.comm->backend();
  r.collectives_on = im.device_comm ? "device (" + im.device_comm->backend() + ")" : "host";
  r.nodes = topo.nodes;
  r.node = topo.node;
  r.local_rank = topo.local_rank;
  r.local_size = topo.local_size;
  r.shard_bytes = im.layout.shard_bytes();
  for (int t = 0; t < kNumTiers; ++t) r.model_state_bytes += im.placement.bytes[t];
  r.collectives = cs.collectives;
  r.comm_bytes = cs.bytes_sent;
  r.comm_seconds = im.cm->counters().comm_seconds;
  r.train_comm_seconds = im.train_comm_seconds;
  if (im.zeropp) {
    const ZeroPPConfig& z = im.cfg.zeropp;
    r.qwz = z.qwz;
    r.hpz = z.hpz;
    r.qgz = z.qgz;
    r.qwz_bits = z.qwz_bits;
    r.qgz_bits = z.qgz_bits;
    r.block_elems = z.block_elems;
    r.hpz_bytes = im.hpz_bytes;
    r.hpz_tier = im.hpz_tier == Tier::kDevice ? "device" : "host (pinned)";
  }
  const ChunkCounters c = im.cm->counters();
  r.param_gather = c.param_gather;
  r.param_regather = c.param_regather;
  r.grad_reduce = c.grad_reduce;
}

StatusOr<std::string> Engine::ReportJson() const {
  const Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("the report before Finalize");
  // The last phase's figures are complete once its CPU chain is; a failed one is reported by
  // the calls that need its shards, not here.
  (void)impl_->updater->Await();
  ReportSnapshot s;
  const EngineConfig& c = im.cfg;
  s.config = {.device_budget = c.device_budget,
              .device_shard_budget = c.device_shard_budget,
              .host_budget = c.host_budget,
              .nvme_budget = c.nvme_budget,
              .compute_dtype = std::string(DTypeName(c.compute_dtype)),
              .grad_accumulation = c.grad_accumulation,
              .device = im.device->info().name};
  im.SnapshotLayout(s);
  im.SnapshotPlan(s);
  const TierUsage u = usage();
  s.tiers = {.device_current = u.device,
             .device_peak = u.device_peak,
             .device_capacity = u.device_capacity,
             .device_resident_shards = im.placement.bytes[static_cast<int>(Tier::kDevice)],
             .host_used = u.host,
             .host_budget = u.host_budget,
             .host_model = im.placement.bytes[static_cast<int>(Tier::kHost)],
             .host_fixed = c.host_budget - im.budgets.host_bytes,
             .nvme_used = u.nvme,
             .nvme_budget = u.nvme_budget};
  im.SnapshotRanks(s);
  im.SnapshotProfile(s);
  im.updater->Snapshot(s.update);
  const EngineStats st = stats();
  s.counters = {.h2d_bytes = st.h2d_bytes,
                .d2h_bytes = st.d2h_bytes,
                .nvme_read_bytes = st.nvme_read_bytes,
                .nvme_write_bytes = st.nvme_write_bytes,
                .hits = st.hits,
                .misses = st.misses,
                .prefetches = st.prefetches,
                .evictions = st.evictions,
                .plans = st.plans,
                .deviations = st.deviations,
                .stall_seconds = im.cm->counters().stall_seconds,
                .acquire_wait_seconds = st.acquire_wait_seconds,
                .update_wait_seconds = st.update_wait_seconds,
                .optimizer_seconds = st.optimizer_seconds,
                .optimizer_nvme_seconds = st.optimizer_nvme_seconds,
                .steps = st.steps,
                .skipped_steps = st.skipped_steps,
                .step_seconds_median = st.step_seconds_median};
  return BuildReportJson(s);
}

Status Engine::WriteReport(const std::string& path) const {
  ASSIGN_OR_RETURN(std::string text, ReportJson());
  return WriteFileAtomically(path, text);
}

// Note [Compute spans on the device's clock] (engine_impl.h).
void Engine::Impl::PlaceDeviceSpans() {
  if (!device_timed) return;
  device_timed = false;
  // The iteration's work is done (EndIteration waited for every stream).
  double forward_begin_s = -1, forward_end_s = -1;
  for (size_t k = 0; k < moment_times.size(); ++k) {
    MomentTimes& m = moment_times[k];
    if (m.ready_ev.handle().impl == nullptr || m.release_ev.handle().impl == nullptr) continue;
    auto ready = device->ElapsedSeconds(profile_origin.handle(), m.ready_ev.handle());
    auto release = device->ElapsedSeconds(profile_origin.handle(), m.release_ev.handle());
    if (!ready.ok() || !release.ok()) continue;
    const double host_wait = m.ready_s - m.call_s;  // the host's time in Acquire stays its own
    m.ready_s = profile_origin_s + std::max(0.0, *ready);
    m.call_s = m.ready_s - host_wait;
    m.release_s = std::max(m.ready_s, profile_origin_s + *release);
    timeline.Add({Track::kCompute, (m.backward ? "backward " : "forward ") + std::to_string(k),
                  m.ready_s, m.release_s - m.ready_s, static_cast<int>(k)});
    if (!m.backward) {
      if (forward_begin_s < 0) forward_begin_s = m.ready_s;
      forward_end_s = m.release_s;
    }
  }
  // The training forward on the device's clock: the time the update's CPU chain can hide
  // behind (Note [The forward's time on the device], update_phase.cc).
  if (iteration_train && forward_begin_s >= 0 && updater)
    updater->NoteDeviceForward(forward_end_s - forward_begin_s);
}

// ---- Usage, stats
// -------------------------------------------------------------------------------

void Engine::ProfileNextIteration() {
  Impl& im = *impl_;
  // The profiled iteration's stalls are the plan's own, not waits for the last update.
  if (im.updater) (void)im.updater->Await();
  if (im.cm) im.cm->ProfileNextIteration(&im.timeline, [&im] { im.timeline.Begin(); });
}

TierUsage Engine::usage() const {
  const Impl& im = *impl_;
  TierUsage u;
  u.host_budget = im.cfg.host_budget;
  u.nvme_budget = im.cfg.nvme_budget;
  if (!im.finalized) return u;
  const MemoryStat d = im.device->memory_stat();
  u.device = d.current;
  u.device_peak = d.peak;
  u.device_capacity = im.device->info().capacity_bytes;
  const uint64_t fixed = im.cfg.host_budget - im.budgets.host_bytes;
  u.host =
      im.placement.bytes[static_cast<int>(Tier::kHost)] + fixed + im.updater->side_buffer_bytes();
  u.nvme = im.nvme ? im.nvme->stats().space.current : 0;
  return u;
}

EngineStats Engine::stats() const {
  const Impl& im = *impl_;
  EngineStats s = im.stats;
  if (im.updater) {
    const UpdaterStats& u = im.updater->stats();
    s.update_wait_seconds = im.updater->wait_seconds();
    s.optimizer_cpu_groups = u.optimizer_cpu_groups;
    s.optimizer_resident_groups = u.optimizer_resident_groups;
    s.optimizer_streamed_groups = u.optimizer_streamed_groups;
    s.optimizer_predicted_seconds = u.optimizer_predicted_seconds;
    s.optimizer_phase_seconds = u.optimizer_phase_seconds;
    s.speculative_groups = u.speculative_groups;
    s.speculative_steps = u.speculative_steps;
    s.speculative_rollbacks = u.speculative_rollbacks;
  }
  if (!im.step_intervals.empty()) {
    std::vector<double> v = im.step_intervals;
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    s.step_seconds_median = v[v.size() / 2];
  }
  if (!im.cm) return s;
  const ChunkCounters c = im.cm->counters();
  s.h2d_bytes = c.h2d_bytes + (im.updater ? im.updater->moved_h2d_bytes() : 0);
  s.d2h_bytes = c.d2h_bytes + (im.updater ? im.updater->moved_d2h_bytes() : 0);
  // While the update phase's CPU chain runs behind the forward its counters are the worker's.
  const OptimizerCounters o = im.updater->optimizer_counters();
  s.nvme_read_bytes = o.nvme_read_bytes + c.nvme_read_bytes;
  s.nvme_write_bytes = o.nvme_write_bytes + c.nvme_write_bytes;
  s.optimizer_nvme_seconds = o.nvme_seconds;
  s.hits = c.hits;
  s.misses = c.misses;
  s.prefetches = c.prefetches;
  s.evictions = c.evictions;
  s.plans = c.plans;
  s.deviations = c.deviations;
  if (im.comm->size() > 1) {
    const CommStats cs = im.comm_stats();
    s.collectives = cs.collectives;
    s.comm_bytes = cs.bytes_sent;
    s.comm_seconds = c.comm_seconds;
    s.param_gather = c.param_gather;
    s.param_regather = c.param_regather;
    s.grad_reduce = c.grad_reduce;
  }
  return s;
}

std::string Engine::PlacementSummary() const {
  const Impl& im = *impl_;
  if (!im.finalized) return "not finalized";
  char waste[32];
  std::snprintf(waste, sizeof waste, "%.1f%%", 100.0 * im.layout.waste_fraction());
  std::string tiers = im.placement.Summary(im.budgets);
  while (!tiers.empty() && tiers.back() == '\n') tiers.pop_back();
  return std::to_string(im.layout.num_chunks()) + " chunks of " +
         FormatBytes(im.layout.chunk_bytes()) + " (" + waste + " padding)\n" + tiers;
}

}  // namespace tierzero
