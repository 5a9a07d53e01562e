#include "update/cost_model.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "offload/device.h"

namespace tierzero {

std::string_view UpdateWhereName(UpdateWhere w) {
  switch (w) {
    case UpdateWhere::kCpu:
      return "cpu";
    case UpdateWhere::kDeviceResident:
      return "device";
    case UpdateWhere::kDeviceStreamed:
      return "device-streamed";
  }
  return "?";
}

std::vector<UpdateGroup> MakeUpdateGroups(const std::vector<UpdateGroupTiers>& tiers,
                                          uint64_t shard_elems, uint64_t grad_bytes,
                                          uint64_t shard_bytes, int read_ahead, bool write_behind,
                                          const std::vector<bool>& done_ahead,
                                          uint64_t state_bytes) {
  constexpr int kBehind = 2;
  int nvme_total = 0;
  for (const UpdateGroupTiers& t : tiers) nvme_total += t.states_on_nvme;
  int nvme_seen = 0;
  std::vector<UpdateGroup> out;
  for (size_t c = 0; c < tiers.size(); ++c) {
    const UpdateGroupTiers& t = tiers[c];
    UpdateGroup g;
    g.elems = shard_elems;
    g.state_bytes = state_bytes;
    g.grad_bytes = grad_bytes;
    g.out_bytes = t.param_on_device ? 0 : shard_bytes;
    g.grad_on_device = t.grad_on_device;
    g.states_on_device = t.states_on_device;
    g.states_on_nvme = t.states_on_nvme;
    g.param_on_nvme = t.param_on_nvme;
    g.done_ahead = c < done_ahead.size() && done_ahead[c];
    if (g.states_on_nvme) {
      g.read_ahead = nvme_seen < read_ahead;
      g.write_behind = write_behind && nvme_seen >= nvme_total - kBehind;
      ++nvme_seen;
    }
    out.push_back(g);
  }
  return out;
}

uint64_t RateProbeElems(uint64_t shard_elems, int num_chunks, uint64_t host_budget) {
  return std::max<uint64_t>(
      shard_elems, std::min({uint64_t{4} << 20, shard_elems * static_cast<uint64_t>(num_chunks),
                             host_budget / 8 / 20}));
}

uint64_t RateProbeDeviceBytes(uint64_t shard_elems, int num_chunks, uint64_t host_budget,
                              DType grad_dtype, DType compute_dtype) {
  const uint64_t n = std::max<uint64_t>(1, shard_elems);
  const uint64_t calls = (RateProbeElems(n, num_chunks, host_budget) + n - 1) / n;
  return calls * (n * (12 + DTypeBytes(grad_dtype, 1) + DTypeBytes(compute_dtype, 1)) +
                  3 * kDeviceAlignment);
}

uint64_t UpdateSlotBytes(const UpdateGroup& g, UpdateWhere where) {
  switch (where) {
    case UpdateWhere::kCpu:
      return 0;
    case UpdateWhere::kDeviceResident:
      return g.grad_bytes + g.out_bytes;
    case UpdateWhere::kDeviceStreamed:
      return static_cast<uint64_t>(StateBytes(g)) + g.grad_bytes + g.out_bytes;
  }
  return 0;
}

namespace {

double Div(double bytes, double rate) { return bytes > 0 ? bytes / rate : 0.0; }

// A group's states copied between the device and the host (a device group updated by the CPU
// through OptimizerStates' bounce buffer).
double BounceSeconds(const UpdateGroup& g, const UpdateRates& r) {
  return Div(StateBytes(g), r.d2h_bytes_per_s) + Div(StateBytes(g), r.h2d_bytes_per_s);
}

// Note [The accumulation clear in the model]
// With accumulation each CPU group's fp32 gradient shard in host memory is zeroed for the next
// window right after its update, on the chain's own thread (the update behind the next forward,
// Updater::RunCpuChain; otherwise all of them after the phase, which the step pays all the
// same). At 4 bytes an element against CPU Adam's ~30 it is about an eighth more of the chain;
// on one thread it was two thirds of an H100 host's phase (bench/RESULTS.md, session 30), and
// the model that left it out predicted 201 ms for 552. Timed by the rate probe (a parallel
// clear of its own buffer).
double ClearSeconds(const UpdateGroup& g, const UpdateRates& r) {
  return r.host_clear_bytes_per_s > 0
             ? Div(static_cast<double>(g.clear_bytes), r.host_clear_bytes_per_s)
             : 0.0;
}

}  // namespace

// Note [The update phase's model]
// The executor (update_phase.cc) runs two chains at once. The device chain is three in-order
// streams over `slots` buffers taken in turn: a group's upload (gradient, and the states when
// streamed) waits for the H2D stream and for its buffer's previous download; its Adam waits for
// the Adam stream and its upload; its download waits for the D2H stream and its Adam. The CPU
// chain updates host groups one after another at the CPU rate, then the NVMe groups through the
// swap pipeline, which is bound by the disk (reads and writes share it, at the rate measured
// with one of each in flight) or by Adam, plus the first read and the last write that nothing
// overlaps. The phase ends when both chains have.
// On a device that computes on the CPU's cores the chains do not overlap: the phase is their sum.
UpdateAssignment Simulate(const std::vector<UpdateGroup>& groups,
                          const std::vector<UpdateWhere>& where, const UpdateRates& r, int slots) {
  UpdateAssignment p;
  p.where = where;
  p.slots = slots;
  p.group_end_s.assign(groups.size(), 0.0);
  for (size_t i = 0; i < groups.size(); ++i)
    p.slot_bytes = std::max(p.slot_bytes, UpdateSlotBytes(groups[i], where[i]));
  // Device chain. Beside CPU Adam the copies slow down as measured; both directions busy at once
  // share the link's duplex rate.
  double h2d_rate = r.h2d_bytes_per_s, d2h_rate = r.d2h_bytes_per_s;
  bool up = false, down = false, cpu_beside = false, streams = false;
  int device_groups = 0;
  for (size_t i = 0; i < groups.size(); ++i) {
    if (where[i] == UpdateWhere::kCpu) {
      cpu_beside |= !groups[i].done_ahead;
      continue;
    }
    ++device_groups;
    const bool streamed = where[i] == UpdateWhere::kDeviceStreamed;
    streams |= streamed;
    up |= (groups[i].grad_bytes > 0 && !groups[i].grad_on_device) || streamed;
    down |= groups[i].out_bytes > 0 || streamed;
  }
  // An upload and a download overlap only with two groups or more in two slots or more.
  if (up && down && device_groups >= 2 && slots >= 2 && r.pcie_duplex_bytes_per_s > 0 &&
      h2d_rate > 0 && d2h_rate > 0) {
    const double share = r.pcie_duplex_bytes_per_s / (h2d_rate + d2h_rate);
    if (share < 1) {
      h2d_rate *= share;
      d2h_rate *= share;
    }
  }
  // The slowdown was sampled against predictions that had the duplex share: it applies after.
  if (cpu_beside && r.link_slowdown_beside_cpu > 1) {
    h2d_rate /= r.link_slowdown_beside_cpu;
    d2h_rate /= r.link_slowdown_beside_cpu;
  }
  double h2d_free = 0, adam_free = 0, d2h_free = 0;
  std::vector<double> slot_free(static_cast<size_t>(std::max(slots, 1)), 0.0);
  size_t k = 0;
  for (size_t i = 0; i < groups.size(); ++i) {
    if (where[i] == UpdateWhere::kCpu) continue;
    const UpdateGroup& g = groups[i];
    const bool streamed = where[i] == UpdateWhere::kDeviceStreamed;
    const double grad_up = g.grad_on_device ? 0.0 : static_cast<double>(g.grad_bytes);
    const double up_s = Div(grad_up + (streamed ? StateBytes(g) : 0.0), h2d_rate);
    const double adam = Div(static_cast<double>(g.elems), r.device_params_per_s);
    const double down_s =
        Div(static_cast<double>(g.out_bytes) + (streamed ? StateBytes(g) : 0.0), d2h_rate);
    double& slot = slot_free[k++ % slot_free.size()];
    h2d_free = std::max(h2d_free, slot) + up_s;
    adam_free = std::max(adam_free, h2d_free) + adam;
    d2h_free = std::max(d2h_free, adam_free) + down_s;
    slot = d2h_free;
    p.group_end_s[i] = d2h_free;
  }
  p.device_s = d2h_free;
  // CPU chain: host groups (and device groups through the bounce buffer), then NVMe groups, at
  // the rate CPU Adam has beside a streamed chain's copies when there is one.
  const double cpu_rate = streams && r.cpu_params_per_s_streaming > 0 ? r.cpu_params_per_s_streaming
                                                                      : r.cpu_params_per_s;
  double t = 0;
  // Fetched ahead (Note [A CPU group's device gradient fetched ahead]): a group's copy is issued
  // when the group before it starts (the first at the chain's start), after the copy before it.
  double copy_end = 0, next_issue = 0;
  std::vector<size_t> nvme;
  for (size_t i = 0; i < groups.size(); ++i) {
    if (where[i] != UpdateWhere::kCpu) continue;
    const UpdateGroup& g = groups[i];
    if (g.done_ahead) {
      p.group_end_s[i] = 0;
      continue;
    }
    if (g.states_on_nvme) {
      nvme.push_back(i);
      continue;
    }
    // A gradient shard on the device comes over before the CPU's Adam reads it; with
    // accumulation the host's shard is cleared after (Note [The accumulation clear in the model]).
    double start = t;
    if (g.grad_on_device) {
      const double copy = Div(static_cast<double>(g.grad_bytes), r.d2h_bytes_per_s);
      if (r.cpu_grad_fetch_ahead) {
        copy_end = std::max(copy_end, next_issue) + copy;
        next_issue = t;
        start = std::max(t, copy_end);
      } else {
        start = t + copy;
      }
    }
    t = start + Div(static_cast<double>(g.elems), cpu_rate) + ClearSeconds(g, r) +
        (g.states_on_device ? BounceSeconds(g, r) : 0.0) +
        (g.param_on_nvme ? Div(static_cast<double>(g.out_bytes), r.nvme_write_bytes_per_s) : 0);
    p.group_end_s[i] = t;
  }
  if (!nvme.empty()) {
    // The disk's work inside the phase: the reads not done ahead of it and the writes not left
    // behind it.
    double io = 0, adam = 0, first_read = 0, last_write = 0, last_adam = 0;
    bool first = true;
    // What the disk reads ahead during backward, in the groups' order.
    double ahead = r.nvme_read_ahead_window_s < 0
                       ? 1e300
                       : r.nvme_read_ahead_window_s * r.nvme_read_bytes_per_s;
    for (size_t i : nvme) {
      const UpdateGroup& g = groups[i];
      double read_bytes = StateBytes(g);
      if (g.read_ahead) {
        const double done = std::min(read_bytes, ahead);
        ahead -= done;
        read_bytes -= done;
      }
      const double write_bytes =
          g.write_behind
              ? 0.0
              : StateBytes(g) + (g.param_on_nvme ? static_cast<double>(g.out_bytes) : 0.0);
      const double rd = Div(read_bytes, r.nvme_read_bytes_per_s);
      const double wr = Div(write_bytes, r.nvme_write_bytes_per_s);
      const double a = Div(static_cast<double>(g.elems), cpu_rate) + ClearSeconds(g, r);
      if (first) first_read = rd;
      first = false;
      last_write = wr;
      last_adam = a;
      // In the pipeline's steady state a read and a write are in flight together.
      io += r.nvme_duplex_bytes_per_s > 0 ? Div(read_bytes + write_bytes, r.nvme_duplex_bytes_per_s)
                                          : rd + wr;
      adam += a;
    }
    const double start = t;
    t += std::max(io + last_adam, first_read + adam + last_write);
    // Evenly over the pipeline's span, for the report's per-group estimate.
    for (size_t k2 = 0; k2 < nvme.size(); ++k2)
      p.group_end_s[nvme[k2]] = start + (t - start) * static_cast<double>(k2 + 1) / nvme.size();
  }
  p.cpu_s = t;
  p.phase_s = r.device_shares_cpu ? p.cpu_s + p.device_s : std::max(p.cpu_s, p.device_s);
  p.objective_s = p.phase_s;
  return p;
}

UpdateAssignment AssignUpdates(const std::vector<UpdateGroup>& groups, const UpdateRates& rates,
                               const UpdateBudget& budget) {
  const size_t n = groups.size();
  std::vector<UpdateWhere> base(n, UpdateWhere::kCpu);
  std::vector<size_t> candidates;  // may stream: states in host memory, parameters not on NVMe
  uint64_t resident_slot = 0, stream_slot = 0;
  int resident = 0;
  for (size_t i = 0; i < n; ++i) {
    const UpdateGroup& g = groups[i];
    if (g.done_ahead) continue;  // kCpu, nothing to do
    if (g.states_on_device && !g.param_on_nvme) {
      base[i] = UpdateWhere::kDeviceResident;
      resident_slot = std::max(resident_slot, UpdateSlotBytes(g, base[i]));
      ++resident;
    } else if (!g.states_on_nvme && !g.param_on_nvme) {
      candidates.push_back(i);
      stream_slot = std::max(stream_slot, UpdateSlotBytes(g, UpdateWhere::kDeviceStreamed));
    }
  }
  std::ostringstream why;
  auto slots_for = [&](uint64_t bytes) {
    if (bytes == 0) return 0;
    return static_cast<int>(std::min<uint64_t>(kMaxUpdateSlots, budget.device_bytes / bytes));
  };
  // Resident groups need a buffer for their gradient; without one they go through the CPU.
  const int resident_slots = slots_for(std::max(resident_slot, uint64_t{1}));
  if (resident > 0 && resident_slots == 0) {
    for (auto& w : base) {
      if (w == UpdateWhere::kDeviceResident) w = UpdateWhere::kCpu;
    }
    why << "no device memory for a gradient buffer: resident groups update on the CPU; ";
    resident = 0;
  }
  const int stream_slots = std::max(slots_for(std::max(stream_slot, resident_slot)), 0);
  // The assignment streaming `s` of the candidates, evenly spaced.
  auto with = [&](size_t s) {
    std::vector<UpdateWhere> w = base;
    for (size_t j = 0; j < s; ++j) {
      w[candidates[(j * candidates.size()) / s]] = UpdateWhere::kDeviceStreamed;
    }
    return w;
  };
  // Behind the next forward (budget.behind_forward_s > 0), the step waits for the device chain,
  // the forward for the CPU's groups: the forward ends at max(device + forward, CPU) after the
  // phase's start (the forward's own waits for CPU groups cover the rest).
  const double fwd = rates.device_shares_cpu ? 0.0 : std::max(budget.behind_forward_s, 0.0);
  auto sim = [&](size_t s) {
    UpdateAssignment p = Simulate(groups, with(s), rates, s > 0 ? stream_slots : resident_slots);
    if (fwd > 0) p.objective_s = std::max(p.device_s + fwd, p.cpu_s) - fwd;
    return p;
  };
  size_t max_stream = stream_slots > 0 ? candidates.size() : 0;
  // Note [Auto streams nothing to a device on the CPU's cores]
  // A device whose Adam is this machine's CPU (the simulated device, unmodelled) runs each
  // streamed group's Adam on one of the cores CPU Adam runs on: streaming moves the work between
  // the cores, never off them, and adds the copies. Its rate as measured can still come out
  // above CPU Adam's when the probe of CPU Adam shared the cores (two ranks probing at once, a
  // loaded machine): auto then streamed every group, and the phase took 2-4x its prediction
  // (hunt 48: 6.1 ms against 1.9 ms at 2 ranks with int8 moments). So auto streams nothing
  // there, as docs/optimizer.md says; a fraction asked for still streams (a modelled device
  // Adam, engine.host_device_adam_rate, is not on the CPU's cores).
  const bool on_cpu_cores = rates.device_shares_cpu && budget.mode == UpdateMode::kAuto;
  if (on_cpu_cores) max_stream = 0;
  if (budget.mode == UpdateMode::kCpu || n == 0) {
    UpdateAssignment p = Simulate(groups, base, rates, resident_slots);
    p.reason = why.str() + "engine.optimizer is cpu";
    return p;
  }
  if (budget.mode == UpdateMode::kFraction) {
    const size_t want = static_cast<size_t>(std::llround(budget.device_fraction * n));
    size_t s = want > static_cast<size_t>(resident) ? want - resident : 0;
    why << "engine.optimizer is a device fraction of " << budget.device_fraction << " (" << want
        << " of " << n << " groups, " << resident << " resident)";
    if (s > max_stream) {
      why << "; only " << max_stream << " can stream ("
          << (stream_slots == 0 ? "no device memory for one group's buffer"
                                : "the others' states or parameters are on NVMe")
          << ")";
      s = max_stream;
    }
    UpdateAssignment p = sim(s);
    p.reason = why.str();
    return p;
  }
  UpdateAssignment best = sim(0);
  size_t best_s = 0;
  for (size_t s = 1; s <= max_stream; ++s) {
    UpdateAssignment p = sim(s);
    if (p.objective_s < best.objective_s * (1 - 1e-9)) {
      best = std::move(p);
      best_s = s;
    }
  }
  why << "auto: " << resident << " resident, " << best_s << " of " << candidates.size()
      << " streamable groups streamed";
  if (candidates.size() > 0 && on_cpu_cores)
    why << " (the device's Adam runs on this machine's CPU cores: streaming moves the work "
           "between them)";
  else if (candidates.size() > 0 && max_stream == 0)
    why << " (no device memory for one group's buffer)";
  bool cpu_groups = false;
  for (UpdateWhere w : best.where) cpu_groups |= w == UpdateWhere::kCpu;
  if (fwd > 0 && max_stream > 0 && cpu_groups) {
    why << "; the CPU's groups finish behind the next forward (" << fwd * 1e3 << " ms)";
  }
  best.reason = why.str();
  return best;
}

}  // namespace tierzero
