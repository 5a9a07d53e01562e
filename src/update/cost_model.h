// The update phase's cost model (docs/optimizer.md): from rates measured on this machine, which
// optimizer groups (a chunk's shard each) update on the CPU and which on the device, and when the
// phase is predicted to end.
//
// A group updates in one of three ways:
//   kCpu             CpuAdam on the trainer's threads; states in host memory, or read from NVMe
//                    and written back through the swap pipeline.
//   kDeviceResident  states live in device memory (placed there by the device shard budget); the
//                    gradient goes up, the compute-dtype parameters come down.
//   kDeviceStreamed  states in host memory go up with the gradient for this phase only, into
//                    device memory that is idle while no chunk is gathered, and come back down.
// The device's work runs as three in-order streams (H2D, Adam, D2H) over `slots` buffers, while
// the CPU updates its groups: Simulate models exactly that order, so a prediction can be worked
// out by hand (tests/update/cost_model_test.cc does).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "tierzero/types.h"

namespace tierzero {

enum class UpdateWhere : uint8_t { kCpu, kDeviceResident, kDeviceStreamed };
std::string_view UpdateWhereName(UpdateWhere w);

// Measured rates (Updater::MeasureRates in update_phase.cc), all > 0 where used.
struct UpdateRates {
  double cpu_params_per_s = 0;  // CpuAdam with the optimizer's threads
  // CpuAdam while streamed groups' copies share host memory with it (0: cpu_params_per_s).
  // Measured on an H100 host: 3.4 G params/s against 4.8 alone.
  double cpu_params_per_s_streaming = 0;
  double device_params_per_s = 0;  // device Adam
  double h2d_bytes_per_s = 0;
  double d2h_bytes_per_s = 0;
  double nvme_read_bytes_per_s = 0;
  double nvme_write_bytes_per_s = 0;
  // Bytes read and written per second with a read and a write in flight at once, as the swap
  // pipeline keeps them (0: unknown, reads and writes then take their own rates in turn).
  double nvme_duplex_bytes_per_s = 0;
  // Bytes per second up and down together with an upload and a download in flight at once, as
  // a chain of streamed groups keeps them (0: unknown, each direction at its own rate). Where it
  // is under h2d + d2h, both directions slow by that share (measured on an H100: 0.66).
  double pcie_duplex_bytes_per_s = 0;
  // The device chain's copies take this many times longer while CPU Adam runs beside them (they
  // share host memory): sampled from phases, the device chain's measured end over its prediction
  // at the probe's rates (1: not slowed). Measured on an H100 host with 16 threads: about 1.3.
  double link_slowdown_beside_cpu = 1;
  // Seconds the NVMe groups' read-ahead has before the phase (backward's span, the median of
  // the last ones): the
  // reads of `read_ahead` groups beyond what the disk reads in that time stay in the phase
  // (< 0: unknown, every read-ahead done).
  double nvme_read_ahead_window_s = -1;
  // The device computes on the CPU's cores (the simulated device without a modelled rate): its
  // updates take CPU time from the CPU's own, so the phase is their sum.
  bool device_shares_cpu = false;
  // Bytes of host memory the CPU chain clears per second (a gradient shard zeroed over every
  // core for the next accumulation window: Note [Clearing gradient shards on the host's cores]);
  // 0: unknown, not counted.
  double host_clear_bytes_per_s = 0;
  // The CPU chain copies the next group's device gradient shard while this group's Adam runs
  // (Note [A CPU group's device gradient fetched ahead]; TZ_GRAD_FETCH_AHEAD).
  bool cpu_grad_fetch_ahead = true;
};

// One group as the model sees it.
struct UpdateGroup {
  uint64_t elems = 0;        // shard elements
  uint64_t state_bytes = 0;  // the group's master, m and v (0: fp32, 12 bytes an element)
  uint64_t grad_bytes = 0;   // the gradient shard, uploaded for a device update
  // The gradient shard is in device memory (Note [Gradient shards on the device]): nothing to
  // upload (its slot keeps the room all the same).
  bool grad_on_device = false;
  uint64_t out_bytes = 0;  // the compute-dtype parameters, downloaded (0: the shard is on the
                           // device, written in place)
  bool states_on_device = false;
  bool states_on_nvme = false;
  // The CPU's update also writes an NVMe parameter shard (a device update may not: kCpu only).
  bool param_on_nvme = false;
  // NVMe states only (Note [Optimizer I/O around the step]): read before the phase starts
  // (prefetched during backward), and written behind it (the phase does not wait for the write).
  bool read_ahead = false;
  bool write_behind = false;
  // Updated before the phase (the speculative start, from host memory): nothing left to do; it
  // stays kCpu at no cost.
  bool done_ahead = false;
  // Host bytes the CPU chain clears after this group's update (its fp32 accumulation shard, with
  // accumulation, when the chain clears it: Note [The accumulation clear in the model]).
  uint64_t clear_bytes = 0;
};

enum class UpdateMode : uint8_t { kAuto, kCpu, kFraction };

struct UpdateBudget {
  // Device memory the phase may use for its buffers, and how many streamed groups' buffers
  // (states, gradient and output) fit in it, at most kMaxSlots.
  uint64_t device_bytes = 0;
  UpdateMode mode = UpdateMode::kAuto;
  double device_fraction = 0;  // kFraction
  // > 0: the CPU's groups may finish behind the next forward, which takes this long (Note [The
  // update phase behind the next forward]). kAuto then minimises what the step and the forward
  // wait for, max(device chain + forward, CPU chain), rather than the phase.
  double behind_forward_s = 0;
};

inline constexpr int kMaxUpdateSlots = 3;

struct UpdateAssignment {
  std::vector<UpdateWhere> where;  // per group
  int slots = 0;                   // device buffers in turn
  uint64_t slot_bytes = 0;
  // Predicted seconds: per group, when its update ends (from the phase's start); the CPU's and
  // the device's chains; the phase.
  std::vector<double> group_end_s;
  double cpu_s = 0, device_s = 0, phase_s = 0;
  // What kAuto minimised: phase_s, or with behind_forward_s the time from the phase's start to
  // the end of the next forward less the forward's own time.
  double objective_s = 0;
  std::string reason;  // one line: why this assignment
};

// The groups as the model sees them, from each chunk's tiers (Engine::Impl::UpdateGroups and
// Engine::Plan build them so). The NVMe groups in the order the swap pipeline takes them: the
// first `read_ahead` were read during backward, and with `write_behind` the last two are
// written behind the phase (Note [Optimizer I/O around the step]); `done_ahead` (empty: none)
// marks groups the speculative start updated.
struct UpdateGroupTiers {
  bool param_on_device = false, param_on_nvme = false;
  bool states_on_device = false, states_on_nvme = false;
  bool grad_on_device = false;
};
std::vector<UpdateGroup> MakeUpdateGroups(const std::vector<UpdateGroupTiers>& tiers,
                                          uint64_t shard_elems, uint64_t grad_bytes,
                                          uint64_t shard_bytes, int read_ahead, bool write_behind,
                                          const std::vector<bool>& done_ahead,
                                          uint64_t state_bytes = 0);
// A group's state bytes (UpdateGroup::state_bytes, or 12 an element).
inline double StateBytes(const UpdateGroup& g) {
  return g.state_bytes > 0 ? static_cast<double>(g.state_bytes) : 12.0 * g.elems;
}

// The rate probe at the first step (Note [Measuring the update phase's rates]): the elements it
// updates (at least a group, at most 4M and an eighth of the host budget at 20 bytes each), and
// the device memory its device part uses for them (whole groups of states, gradient, output).
uint64_t RateProbeElems(uint64_t shard_elems, int num_chunks, uint64_t host_budget);
uint64_t RateProbeDeviceBytes(uint64_t shard_elems, int num_chunks, uint64_t host_budget,
                              DType grad_dtype, DType compute_dtype);

// The bytes one device buffer needs for a group updated `where` on the device.
uint64_t UpdateSlotBytes(const UpdateGroup& g, UpdateWhere where);

// Predicts the phase for a given assignment (where[i] for group i; kDeviceResident only for
// groups whose states are on the device). `slots` buffers of device memory (>= 1 when any group
// is on the device).
UpdateAssignment Simulate(const std::vector<UpdateGroup>& groups,
                          const std::vector<UpdateWhere>& where, const UpdateRates& rates,
                          int slots);

// Chooses the assignment. Groups whose states are on the device update there (unless their
// parameter shard is on NVMe, which the placement never does: then through the CPU); NVMe groups
// and those with an NVMe parameter shard on the CPU; of the rest, kAuto streams the number that
// ends the phase earliest (ties: fewer), kCpu none, kFraction round(fraction * groups) counting the
// resident ones, evenly spaced. Streaming needs a slot of memory: without one nothing streams.
UpdateAssignment AssignUpdates(const std::vector<UpdateGroup>& groups, const UpdateRates& rates,
                               const UpdateBudget& budget);

}  // namespace tierzero
