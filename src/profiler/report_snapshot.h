// ReportSnapshot: everything the memory placement report (docs/report.md) says, as plain values
// copied out of the engine at one moment, and BuildReportJson, which turns it into the report's
// JSON. The engine fills a snapshot (engine/report.cc); the profiler knows nothing of chunks,
// plans or tiers beyond these numbers and names, so the report's shape is defined here, once,
// and the renderings (tierzero/report.h) read only the JSON.
//
// Thread-safety: a snapshot is a value; BuildReportJson is reentrant.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "profiler/observer.h"
#include "tierzero/communicator.h"

namespace tierzero {

struct ReportSnapshot {
  struct Config {
    uint64_t device_budget = 0, device_shard_budget = 0, host_budget = 0, nvme_budget = 0;
    std::string compute_dtype;
    int grad_accumulation = 1;
    std::string device;  // the device's name
  } config;

  struct Chunk {
    std::vector<std::string> tensors;  // parameter names, in layout order
    uint64_t used_elems = 0;
    std::string param_tier, grad_tier;
    std::string optimizer_tier;  // of the chunk's optimizer group (its master weights, m, v)
  };
  struct Layout {
    uint64_t chunk_elems = 0, chunk_bytes = 0, shard_elems = 0;
    uint64_t optimizer_group_bytes = 0;  // one group's master, m and v (0: 12 an element)
    double waste_fraction = 0;
    std::vector<Chunk> chunks;
  } layout;

  // The recorded trace's moments, with the plan's decisions where there is a plan.
  struct Moment {
    std::vector<int> chunks;
    bool backward = false;
    uint64_t nonmodel_bytes = 0, nonmodel_peak = 0;
    double compute_seconds = 0;
    bool planned = false;  // gather and evict below are the plan's
    std::vector<int> gather, evict;
  };
  std::vector<Moment> moments;
  struct Plan {
    double predicted_stall_seconds = 0;
    std::string policy;
    bool planned = false;
  } plan;

  struct Tiers {
    uint64_t device_current = 0, device_peak = 0, device_capacity = 0, device_resident_shards = 0;
    uint64_t host_used = 0, host_budget = 0, host_model = 0, host_fixed = 0;
    uint64_t nvme_used = 0, nvme_budget = 0;
  } tiers;

  struct Ranks {
    int world_size = 1, rank = 0;
    std::string backend, collectives_on;
    int nodes = 1, node = 0, local_rank = 0, local_size = 1;
    uint64_t shard_bytes = 0, model_state_bytes = 0;
    uint64_t collectives = 0, comm_bytes = 0;
    double comm_seconds = 0;
    double train_comm_seconds = 0;  // of it, the training iterations' (evaluations' left out)
    // ZeRO++ (all off for plain ZeRO-3) and hpZ's secondary partition.
    bool qwz = false, hpz = false, qgz = false;
    int qwz_bits = 0, qgz_bits = 0, block_elems = 0;
    uint64_t hpz_bytes = 0;
    std::string hpz_tier;
    // Bytes per use of the collectives: forward gathers, later gathers, gradient reductions.
    WireBytes param_gather, param_regather, grad_reduce;
  } ranks;

  // The last step's update phase (docs/optimizer.md): where each group updated, when it was
  // predicted to end and when it did (seconds from the phase's start), the rates measured at
  // the first step, the phase's predicted and measured time.
  struct Update {
    bool available = false;
    std::string mode, reason;
    std::vector<std::string> where;  // per chunk: "cpu", "device", "device-streamed"
    std::vector<double> predicted_end_s, measured_end_s;
    double predicted_s = 0, predicted_cpu_s = 0, predicted_device_s = 0, measured_s = 0;
    double measured_median_s = 0;  // over every step so far
    int64_t phases = 0;
    int slots = 0;
    uint64_t slot_bytes = 0;
    double cpu_params_per_s = 0, device_params_per_s = 0, h2d_bytes_per_s = 0, d2h_bytes_per_s = 0,
           nvme_read_bytes_per_s = 0, nvme_write_bytes_per_s = 0, nvme_duplex_bytes_per_s = 0,
           cpu_params_per_s_streaming = 0, pcie_duplex_bytes_per_s = 0, host_clear_bytes_per_s = 0,
           link_slowdown_beside_cpu = 1;
    bool device_rate_modelled = false, device_shares_cpu = false;
    // The speculative start: its setting, steps that used it and that rolled it back.
    std::string speculative = "auto";
    std::string moments = "fp32";  // engine.optimizer_states
    uint64_t speculative_steps = 0, speculative_rollbacks = 0;
  } update;

  // The profiled iteration and the Step after it.
  struct ProfiledMoment {
    std::string residency;  // per chunk: 'D', 'H' or 'N' (ChunkManager::MomentProfile)
    std::vector<int> prefetch;
    uint64_t device_chunk_bytes = 0, nonmodel_bytes = 0;
    double stall_s = 0;
    bool backward = false;
    bool timed = false;  // the caller's times below were recorded
    double call_s = 0, ready_s = 0, release_s = -1;
  };
  struct Profile {
    bool available = false;
    int64_t iteration = -1;
    std::vector<ProfiledMoment> moments;
    std::vector<TimelineEvent> events;
    double step_seconds = 0, step_nvme_seconds = 0;
    uint64_t step_nvme_bytes = 0, step_nvme_write_bytes = 0;
    uint64_t step_nvme_pipeline_bytes = 0;  // of step_nvme_bytes, in Step's swap pipeline
    WireBytes collectives;  // the iteration's gathers and reductions (several ranks)
  } profile;

  struct Counters {
    uint64_t h2d_bytes = 0, d2h_bytes = 0, nvme_read_bytes = 0, nvme_write_bytes = 0;
    uint64_t hits = 0, misses = 0, prefetches = 0, evictions = 0, plans = 0, deviations = 0;
    double stall_seconds = 0, acquire_wait_seconds = 0, update_wait_seconds = 0,
           optimizer_seconds = 0, optimizer_nvme_seconds = 0;
    int64_t steps = 0, skipped_steps = 0;
    double step_seconds_median = 0;
  } counters;
};

// The report's JSON text (schema "tierzero-report", version 2).
std::string BuildReportJson(const ReportSnapshot& s);

}  // namespace tierzero
