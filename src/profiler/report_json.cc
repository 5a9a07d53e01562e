// The report's JSON from a snapshot (report_snapshot.h; the fields are documented in
// docs/report.md).
#include <algorithm>
#include <nlohmann/json.hpp>
#include <utility>

#include "profiler/report_snapshot.h"

namespace tierzero {
namespace {

using json = nlohmann::json;

uint64_t FreeUnder(uint64_t budget, uint64_t used) { return budget > used ? budget - used : 0; }

double Rate(uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds : 0.0;
}

// The profiled moments: memory per tier, residency, and the caller's times.
struct MomentTotals {
  double forward = 0, backward = 0, wait = 0, stall = 0;
  // Note [The compute stream's idle time]: the gaps between the moments' compute spans.
  double idle = 0, largest_idle = 0, span = 0;  // span: the first moment's start to the last end
  int64_t largest_idle_before = -1;             // the moment that began after the largest gap
};

// Note [The compute stream's idle time]
// Issue 44 asks that the all-resident iteration never leave the compute stream waiting for the
// host, and that the report say where it still does. Each moment's compute span runs from
// Acquire's return to its Release; on a GPU both ends are events on the compute stream (Note
// [Compute spans on the device's clock]), so a gap between one moment's end and the next one's
// start is time the stream ran nothing of the model: waiting for a gather (the moment's
// `stall_seconds`, measured apart) or for the host to enqueue (a host round trip, a launch-bound
// stretch, the caller's own work between scopes). Scopes nest, so the spans are merged before the
// gaps are summed; the iteration's window is the first span's start to the last one's end (the
// optimizer step after it is reported on its own). On the CPU the spans are the host's, and the
// gaps are its time in Acquire and between scopes.
void ComputeIdle(const std::vector<ReportSnapshot::ProfiledMoment>& moments, MomentTotals& totals) {
  struct Span {
    double start, end;
    int64_t moment;
  };
  std::vector<Span> spans;
  for (size_t k = 0; k < moments.size(); ++k) {
    const ReportSnapshot::ProfiledMoment& p = moments[k];
    if (p.timed && p.release_s >= p.ready_s)
      spans.push_back({p.ready_s, p.release_s, static_cast<int64_t>(k)});
  }
  std::stable_sort(spans.begin(), spans.end(),
                   [](const Span& a, const Span& b) { return a.start < b.start; });
  for (size_t i = 1, end_i = 0; i < spans.size(); ++i) {
    const double end = spans[end_i].end;
    if (spans[i].start > end) {
      const double gap = spans[i].start - end;
      totals.idle += gap;
      if (gap > totals.largest_idle) {
        totals.largest_idle = gap;
        totals.largest_idle_before = spans[i].moment;
      }
    }
    if (spans[i].end > end) end_i = i;
  }
  if (!spans.empty()) {
    double last = spans[0].end;
    for (const Span& sp : spans) last = std::max(last, sp.end);
    totals.span = last - spans[0].start;
  }
}

json Wire(const WireBytes& w) {
  return {{"collectives", w.collectives},
          {"bytes_before_quantization", w.bytes_unquantized},
          {"bytes_on_wire", w.bytes_sent},
          {"bytes_cross_node", w.bytes_cross_node},
          {"bytes_intra_node", w.bytes_sent - w.bytes_cross_node}};
}

json ProfiledMoments(const ReportSnapshot& s, MomentTotals& totals) {
  const ReportSnapshot::Tiers& t = s.tiers;
  const uint64_t capacity = s.config.device_budget;
  json moments = json::array();
  for (size_t k = 0; k < s.profile.moments.size(); ++k) {
    const ReportSnapshot::ProfiledMoment& p = s.profile.moments[k];
    const double compute = p.timed && p.release_s >= 0 ? p.release_s - p.ready_s : 0;
    const double wait = p.timed ? p.ready_s - p.call_s : 0;
    (p.backward ? totals.backward : totals.forward) += compute;
    totals.wait += wait;
    totals.stall += p.stall_s;
    const uint64_t used = p.device_chunk_bytes + p.nonmodel_bytes;
    moments.push_back(
        {{"index", k},
         {"backward", p.backward},
         {"residency", p.residency},
         {"prefetch", p.prefetch},
         {"device",
          {{"chunk_bytes", p.device_chunk_bytes},
           {"nonmodel_bytes", p.nonmodel_bytes},
           {"free_bytes", FreeUnder(capacity, used)},
           {"budget", capacity}}},
         // Host and NVMe allocations do not change within an iteration.
         {"host",
          {{"model_bytes", t.host_model},
           {"fixed_bytes", t.host_fixed},
           {"free_bytes", FreeUnder(s.config.host_budget, t.host_model + t.host_fixed)},
           {"budget", s.config.host_budget}}},
         {"nvme",
          {{"model_bytes", t.nvme_used},
           {"free_bytes", FreeUnder(s.config.nvme_budget, t.nvme_used)},
           {"budget", s.config.nvme_budget}}},
         {"stall_seconds", p.stall_s},
         {"wait_seconds", wait},
         {"compute_seconds", compute}});
  }
  ComputeIdle(s.profile.moments, totals);
  return moments;
}

// A link's bytes in the profiled iteration's transfers, and the time it was busy: the union of
// their spans (NVMe reads overlap each other).
struct Link {
  uint64_t bytes = 0;
  std::vector<std::pair<double, double>> spans;

  double Busy() {
    std::sort(spans.begin(), spans.end());
    double busy = 0, end = -1;
    for (const auto& [a, b] : spans) {
      if (a > end) {
        busy += b - a;
        end = b;
      } else if (b > end) {
        busy += b - end;
        end = b;
      }
    }
    return busy;
  }
  json ToJson() {
    const double busy = Busy();
    return {{"bytes", bytes}, {"busy_seconds", busy}, {"bytes_per_second", Rate(bytes, busy)}};
  }
};

json Profile(const ReportSnapshot& s) {
  const ReportSnapshot::Profile& p = s.profile;
  if (!p.available) return json{{"available", false}};
  MomentTotals totals;
  json moments = ProfiledMoments(s, totals);
  Link links[kNumTracks];
  json events = json::array();
  double adam = 0, norm = 0, probe = 0;
  for (const TimelineEvent& e : p.events) {
    Link& l = links[static_cast<int>(e.track)];
    if (e.lane == 0) {
      l.bytes += e.bytes;
      l.spans.emplace_back(e.start_s, e.start_s + e.dur_s);
    }
    if (e.track == Track::kOptimizer && e.chunk >= 0 && e.lane == 0) adam += e.dur_s;
    if (e.track == Track::kOptimizer && e.name == "gradient norm") norm = e.dur_s;
    if (e.track == Track::kOptimizer && e.name == kRateProbeSpan) probe += e.dur_s;
    events.push_back({{"track", TrackName(e.track)},
                      {"name", e.name},
                      {"start", e.start_s},
                      {"dur", e.dur_s},
                      {"moment", e.moment},
                      {"chunk", e.chunk},
                      {"bytes", e.bytes},
                      {"lane", e.lane}});
  }
  auto link = [&](Track t) { return links[static_cast<int>(t)].ToJson(); };
  json profile = {
      {"available", true},
      {"iteration", p.iteration},
      {"moments", moments},
      {"breakdown",
       {{"forward_seconds", totals.forward},
        {"backward_seconds", totals.backward},
        {"parameter_wait_seconds", totals.wait},
        {"stall_seconds", totals.stall},
        {"compute_idle_seconds", totals.idle},
        {"compute_span_seconds", totals.span},
        {"largest_compute_idle_seconds", totals.largest_idle},
        {"optimizer_seconds", p.step_seconds},
        {"optimizer_compute_seconds", adam},
        // The first step measures the update phase's rates (a one-time probe).
        {"optimizer_rate_probe_seconds", probe},
        // The step's time in neither the norm, Adam nor the probe: waiting for NVMe states.
        {"optimizer_io_wait_seconds", std::max(0.0, p.step_seconds - norm - adam - probe)}}},
      {"links",
       {{"h2d", link(Track::kH2D)},
        {"d2h", link(Track::kD2H)},
        {"nvme_read", link(Track::kNvmeRead)},
        {"nvme_optimizer",
         {{"bytes", p.step_nvme_bytes},
          {"busy_seconds", p.step_nvme_seconds},
          // (The pipeline's own rate: the read-ahead's reads ran before it, in the backward.)
          {"bytes_per_second", Rate(p.step_nvme_pipeline_bytes, p.step_nvme_seconds)}}},
        // The step's NVMe writes (states and parameter shards), during its swap pipeline.
        {"nvme_write",
         {{"bytes", p.step_nvme_write_bytes},
          {"busy_seconds", p.step_nvme_seconds},
          {"bytes_per_second", Rate(p.step_nvme_write_bytes, p.step_nvme_seconds)}}},
        // The iteration's gathers and reductions (none with one rank): their values'
        // bytes, what was sent (less with ZeRO++'s quantization), what crossed nodes.
        {"collective", Wire(p.collectives)}}},
      {"events", events}};
  if (totals.largest_idle_before >= 0)
    profile["breakdown"]["largest_compute_idle_moment"] = totals.largest_idle_before;
  return profile;
}

json Layout(const ReportSnapshot& s) {
  json chunks = json::array();
  for (const ReportSnapshot::Chunk& c : s.layout.chunks) {
    chunks.push_back({{"tensors", c.tensors},
                      {"used_elems", c.used_elems},
                      {"param_tier", c.param_tier},
                      {"optimizer_tier", c.optimizer_tier},
                      {"grad_tier", c.grad_tier}});
  }
  return {{"chunk_elems", s.layout.chunk_elems},
          {"chunk_bytes", s.layout.chunk_bytes},
          {"waste_fraction", s.layout.waste_fraction},
          {"chunks", chunks}};
}

json Moments(const ReportSnapshot& s) {
  json moments = json::array();
  for (const ReportSnapshot::Moment& m : s.moments) {
    json j = {{"chunks", m.chunks},
              {"backward", m.backward},
              {"nonmodel_bytes", m.nonmodel_bytes},
              {"nonmodel_peak", m.nonmodel_peak},
              {"compute_seconds", m.compute_seconds}};
    if (m.planned) {
      j["gather"] = m.gather;
      j["evict"] = m.evict;
    }
    moments.push_back(std::move(j));
  }
  return moments;
}

json Tiers(const ReportSnapshot::Tiers& t) {
  return {{"device",
           {{"current", t.device_current},
            {"peak", t.device_peak},
            {"capacity", t.device_capacity},
            {"resident_shard_bytes", t.device_resident_shards}}},
          {"host",
           {{"used", t.host_used},
            {"budget", t.host_budget},
            {"model_bytes", t.host_model},
            {"fixed_bytes", t.host_fixed}}},
          {"nvme", {{"used", t.nvme_used}, {"budget", t.nvme_budget}}}};
}

json Ranks(const ReportSnapshot::Ranks& r) {
  json zeropp = {{"qwz", r.qwz}, {"hpz", r.hpz}, {"qgz", r.qgz}};
  if (r.qwz) zeropp["qwz_bits"] = r.qwz_bits;
  if (r.qgz) zeropp["qgz_bits"] = r.qgz_bits;
  if (r.qwz || r.qgz) zeropp["block_elems"] = r.block_elems;
  if (r.hpz) zeropp["hpz_secondary"] = {{"bytes", r.hpz_bytes}, {"tier", r.hpz_tier}};
  return {{"world_size", r.world_size},
          {"rank", r.rank},
          {"backend", r.backend},
          {"collectives_on", r.collectives_on},
          {"nodes", r.nodes},
          {"node", r.node},
          {"local_rank", r.local_rank},
          {"local_size", r.local_size},
          {"shard_bytes", r.shard_bytes},
          {"model_state_bytes", r.model_state_bytes},
          {"collectives", r.collectives},
          {"comm_bytes", r.comm_bytes},
          {"comm_seconds", r.comm_seconds},
          {"train_comm_seconds", r.train_comm_seconds},
          {"zeropp", zeropp},
          {"bytes_by_use",
           {{"param_gather", Wire(r.param_gather)},
            {"param_regather", Wire(r.param_regather)},
            {"grad_reduce", Wire(r.grad_reduce)}}}};
}

json Counters(const ReportSnapshot::Counters& c) {
  return {{"h2d_bytes", c.h2d_bytes},
          {"d2h_bytes", c.d2h_bytes},
          {"nvme_read_bytes", c.nvme_read_bytes},
          {"nvme_write_bytes", c.nvme_write_bytes},
          {"hits", c.hits},
          {"misses", c.misses},
          {"prefetches", c.prefetches},
          {"evictions", c.evictions},
          {"plans", c.plans},
          {"deviations", c.deviations},
          {"stall_seconds", c.stall_seconds},
          {"acquire_wait_seconds", c.acquire_wait_seconds},
          {"update_wait_seconds", c.update_wait_seconds},
          {"optimizer_seconds", c.optimizer_seconds},
          {"optimizer_nvme_seconds", c.optimizer_nvme_seconds},
          {"steps", c.steps},
          {"skipped_steps", c.skipped_steps},
          {"step_seconds_median", c.step_seconds_median}};
}

}  // namespace

std::string BuildReportJson(const ReportSnapshot& s) {
  const ReportSnapshot::Config& c = s.config;
  json report;
  report["schema"] = "tierzero-report";
  report["version"] = 2;
  report["config"] = {{"device_budget", c.device_budget},
                      {"device_shard_budget", c.device_shard_budget},
                      {"host_budget", c.host_budget},
                      {"nvme_budget", c.nvme_budget},
                      {"compute_dtype", c.compute_dtype},
                      {"grad_accumulation", c.grad_accumulation},
                      {"device", c.device}};
  report["layout"] = Layout(s);
  report["moments"] = Moments(s);
  report["plan"] = {{"predicted_stall_seconds", s.plan.predicted_stall_seconds},
                    {"policy", s.plan.policy},
                    {"planned", s.plan.planned}};
  report["tiers"] = Tiers(s.tiers);
  const ReportSnapshot::Update& u = s.update;
  json groups = json::array();
  for (size_t k = 0; k < s.layout.chunks.size(); ++k) {
    json g = {{"chunk", k},
              {"tier", s.layout.chunks[k].optimizer_tier},
              {"bytes", s.layout.optimizer_group_bytes > 0 ? s.layout.optimizer_group_bytes
                                                           : s.layout.shard_elems * 12}};
    if (u.available && k < u.where.size()) {
      g["update"] = u.where[k];
      g["predicted_end_seconds"] = u.predicted_end_s[k];
      g["measured_end_seconds"] = u.measured_end_s[k];
    }
    groups.push_back(std::move(g));
  }
  report["optimizer"] = {{"sub_groups", groups}};
  if (u.available) {
    report["optimizer"]["update_phase"] = {
        {"mode", u.mode},
        {"moments", u.moments},
        {"reason", u.reason},
        {"predicted_seconds", u.predicted_s},
        {"predicted_cpu_seconds", u.predicted_cpu_s},
        {"predicted_device_seconds", u.predicted_device_s},
        {"measured_seconds", u.measured_s},
        {"measured_median_seconds", u.measured_median_s},
        {"phases", u.phases},
        {"slots", u.slots},
        {"slot_bytes", u.slot_bytes},
        {"speculative_start",
         {{"setting", u.speculative},
          {"steps", u.speculative_steps},
          {"rollbacks", u.speculative_rollbacks}}},
        {"rates",
         {{"cpu_adam_params_per_second", u.cpu_params_per_s},
          {"cpu_adam_params_per_second_beside_streaming", u.cpu_params_per_s_streaming},
          {"h2d_d2h_at_once_bytes_per_second", u.pcie_duplex_bytes_per_s},
          {"copies_slowdown_beside_cpu_adam", u.link_slowdown_beside_cpu},
          {"device_adam_params_per_second", u.device_params_per_s},
          {"device_adam_modelled", u.device_rate_modelled},
          {"device_shares_cpu", u.device_shares_cpu},
          {"h2d_bytes_per_second", u.h2d_bytes_per_s},
          {"d2h_bytes_per_second", u.d2h_bytes_per_s},
          {"nvme_read_bytes_per_second", u.nvme_read_bytes_per_s},
          {"nvme_write_bytes_per_second", u.nvme_write_bytes_per_s},
          {"nvme_duplex_bytes_per_second", u.nvme_duplex_bytes_per_s},
          {"host_clear_bytes_per_second", u.host_clear_bytes_per_s}}}};
  }
  report["ranks"] = Ranks(s.ranks);
  report["profile"] = Profile(s);
  report["counters"] = Counters(s.counters);
  return report.dump(1, ' ', false, json::error_handler_t::replace);
}

}  // namespace tierzero
