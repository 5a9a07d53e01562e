// Planning a run before it starts (docs/plan.md): will the model fit the device, host and NVMe
// budgets, where will each byte live, how many bytes cross each link per step, where will the
// optimizer run, and how long will a step take.
//
//   auto engine = Engine::Create(config);           // the run's config
//   ... RegisterParam for every parameter ...       // as the run would (no memory is allocated)
//   PlanRequest req;
//   req.moments = trace.moments;                    // a warm-up trace (Engine::WarmupTrace of an
//   req.rates = rates;                              //   earlier run, or derived from the model)
//   auto plan = engine->Plan(req);                  // before Finalize
//
// The plan lays the parameters out and places them with the code Finalize runs, and plans the
// chunks' gathers with the code the warm-up iteration's plan runs; what it adds is a model of
// the device memory the run allocates and of the time its parts take, from rates measured on
// this machine (`tierzero plan --calibrate`) or given for another.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tierzero/status.h"
#include "tierzero/types.h"

namespace tierzero {

using ParamId = int;

// One Acquire of a training iteration, in order.
struct TraceMoment {
  std::vector<ParamId> params;    // as passed to Acquire
  bool backward = false;          // Phase::kBackward
  uint64_t activation_bytes = 0;  // activation bytes in use when the Acquire began
  uint64_t activation_peak = 0;   // the most in use until the next Acquire began
  double compute_seconds = 0;     // measured (a recorded trace), or predicted
  double flops = 0;               // the moment's arithmetic, when known (0: unknown)
  double memory_bytes = 0;        // bytes its kernels read and write, when known
};

// A training iteration's trace with the parameters it names (name and element count, in
// registration order), so a file holds everything a plan needs but the config.
struct WarmupTrace {
  struct Param {
    std::string name;
    std::vector<int64_t> shape;
    bool weight_decay = true;
  };
  std::vector<Param> params;
  std::vector<TraceMoment> moments;
  std::string source;  // what recorded or derived it, one line
};

// The trace as a JSON file (written atomically), and read back: NotFound for a missing file,
// InvalidArgument naming the field for a malformed one. A trace that would not read back (a
// NaN, a name that is not UTF-8, a moment without parameters...) is InvalidArgument, nothing
// written.
Status WriteWarmupTrace(const WarmupTrace& trace, const std::string& path);
StatusOr<WarmupTrace> ReadWarmupTrace(const std::string& path);

// The rates a plan's times come from: measured on this machine by a short calibration, or the
// numbers of another (a GPU node). 0 where unknown; a plan needs the ones its placement uses.
struct MachineRates {
  std::string name;                  // "this machine, calibrated 2026-11-24", "H100 node"
  double cpu_adam_params_per_s = 0;  // CPU Adam with every optimizer thread, memory-bound
  double device_adam_params_per_s = 0;
  double h2d_bytes_per_s = 0;  // pinned host to device
  double d2h_bytes_per_s = 0;
  double nvme_read_bytes_per_s = 0;  // the NVMe path's own, through io_uring
  double nvme_write_bytes_per_s = 0;
  double nvme_duplex_bytes_per_s = 0;  // read and write at once (0: in turn)
  // Host memory zeroed per second over every core: clearing a gradient shard for the next
  // accumulation window (0: not counted).
  double host_clear_bytes_per_s = 0;
  // Moments given by their work (TraceMoment::flops, memory_bytes) instead of their time: the
  // device's arithmetic and memory rates.
  double device_flops_per_s = 0;
  double device_memory_bytes_per_s = 0;
  // The ranks' collectives: bytes per second a rank receives (0: the host link's rate), and the
  // seconds each collective costs beyond its bytes (0: assumed 10 us). Measured by
  // `mpirun -np N tierzero plan --calibrate`.
  double comm_bytes_per_s = 0;
  double comm_latency_s = 0;
  // The device computes on the CPU's cores (the simulated device): device Adam and the model's
  // compute take time from CPU Adam's, and the ranks' collectives from the model's compute.
  bool device_shares_cpu = false;
};

// Rates as JSON (a calibration's cache file, or a config's description of another machine).
std::string MachineRatesToJson(const MachineRates& rates);
StatusOr<MachineRates> MachineRatesFromJson(const std::string& json_text);
// InvalidArgument naming the field when a rate is not finite, negative, or absurd (a non-zero rate
// below 1 or above 1e18 per second; a latency above an hour): such rates made step times of inf
// or NaN. MachineRatesFromJson and Engine::Plan check their rates with it.
Status ValidateMachineRates(const MachineRates& rates);

struct PlanRequest {
  std::vector<TraceMoment> moments;  // one training iteration (a micro-batch)
  MachineRates rates;
  int world_size = 0;      // ranks to plan for; 0: the communicator's
  int ranks_per_node = 0;  // 0: every rank on one node
  // A step's time beyond its moments and the update phase (the trainer's own work, the end of
  // each iteration, the gradient norm), when the caller measured it. Default: 0.
  double step_other_s = 0;
};

// Bytes of one tier: what the run will hold at its peak, and its budget.
struct TierPrediction {
  uint64_t peak = 0;
  uint64_t budget = 0;  // device: the device's capacity (budgets and margin); 0: unbounded
};

struct PlanPrediction {
  bool fits = false;
  // Why not, when it does not: the tier ("device", "host", "nvme") and the engine's own error.
  std::string failing_tier;
  std::string problem;

  // The layout and placement (per rank).
  int world_size = 1;
  uint64_t chunk_elems = 0, chunk_bytes = 0, shard_bytes = 0;
  int chunks = 0;
  int param_shards[3] = {0, 0, 0};  // per tier: device, host, NVMe
  int optimizer_groups[3] = {0, 0, 0};
  uint64_t model_state_bytes[3] = {0, 0, 0};
  std::string placement_summary;

  // Memory per tier at the run's peak (per rank), and the device's parts: resident shards and
  // states, the slot region the plan reserves, the activation peak, gradient chunks, the update
  // phase's buffers.
  TierPrediction device, host, nvme;
  uint64_t device_resident = 0, device_slots = 0, device_activations = 0, device_grads = 0,
           device_update = 0;
  // What `fits` keeps free beyond the device's peak: the allocator may not find the last bytes in
  // one piece (Note [Room for the device allocator's fragmentation], src/engine/plan.cc).
  uint64_t device_fragmentation_allowance = 0;
  int slots = 0;

  // Bytes per optimizer step on each link (per rank), and of them one iteration's (a micro-batch's
  // forward and backward: what the report's profiled iteration measures).
  uint64_t h2d_bytes = 0, d2h_bytes = 0, nvme_read_bytes = 0, nvme_write_bytes = 0, comm_bytes = 0;
  uint64_t iteration_h2d_bytes = 0, iteration_d2h_bytes = 0, iteration_nvme_read_bytes = 0,
           iteration_comm_bytes = 0;

  // The optimizer's placement: groups on the CPU, resident on the device, streamed to it.
  int optimizer_cpu = 0, optimizer_resident = 0, optimizer_streamed = 0;
  std::string optimizer_reason;

  // Seconds per optimizer step and its breakdown: compute (every micro-batch), waits for
  // parameters (the plan's stall), the update phase, and of it the NVMe time the phase cannot
  // hide; the iteration's gathers' link time (overlapped with compute where the plan can); the
  // collectives when they run on the cores that compute (device_shares_cpu), else 0 (they are
  // then in the gathers' time).
  double step_s = 0, compute_s = 0, param_wait_s = 0, optimizer_s = 0, optimizer_nvme_s = 0,
         transfer_s = 0, comm_s = 0, other_s = 0;
  int collectives = 0;         // per step (per rank): the gathers and reductions of chunks
  double tokens_per_step = 0;  // set by the caller that knows them (0: not shown)
  std::string rates_name;
  // Rates the request left at 0 that the times needed, assumed (1 G params/s, 10 GB/s link,
  // 1 GB/s NVMe): the times are then a sketch, and the table says so.
  std::vector<std::string> assumed_rates;
};

// A table for the terminal, and JSON in the report's schema ("prediction", docs/report.md).
std::string PlanTable(const PlanPrediction& plan);
std::string PlanJson(const PlanPrediction& plan);

}  // namespace tierzero
