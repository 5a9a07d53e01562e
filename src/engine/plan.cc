// Engine::Plan: a run predicted from its parameters, a training iteration's trace and a
// machine's rates, without allocating (tierzero/plan.h, docs/plan.md). The layout, the
// placement, the chunk plan and the update phase's assignment come from the functions the run
// itself calls (ChunkLayout::Build, PlaceRun, SlotsPerMoment and Simulate, AssignUpdates); the
// device memory and the time are the model written out in Note [What the plan predicts].
#include "chunk/plan.h"

#include <algorithm>
#include <set>

#include "core/bytes.h"
#include "engine/engine_impl.h"
#include "offload/cuda_device.h"
#include "zero/gather.h"
#include "zero/zeropp.h"

namespace tierzero {

// Note [What the plan predicts]
// Device memory is the most of three times in a run, each on top of the resident shards and
// states (and hpZ's secondary partition when the device holds it):
//   - the warm-up iteration, which records the trace on demand: at each moment, a buffer per
//     chunk it needs and per chunk whose gradients are still being written in place, the
//     separate gradient chunks being written, and the activation peak;
//   - a planned iteration: the slot region the plan reserves (as many slots as its schedule ever
//     holds, computed as ChunkManager::Replan does), the separate gradient chunks (from their
//     first backward moment to the one after their last: Note [A gradient chunk held one moment
//     past its reduction]) and the activation peak of each moment (each allocation rounded to
//     the device's alignment, as the device hands it out);
//   - the update phase: the idle slot region and the extra device buffers its assignment needs
//     beyond it.
// Host memory is the placement's host bytes and the fixed buffers (Note [Host memory
// accounting]); NVMe the placed shards and states, each extent rounded to the NVMe alignment.
// Time per step: grad_accumulation x (the moments' compute + the plan's simulated stall), plus
// the update phase as AssignUpdates predicts it. Compute is the trace's measured seconds, or, for a
// moment given by its work, flops / device_flops_per_s + memory_bytes / device_memory_bytes_per_s.
// Ranks that share a machine share its CPU and disk (RankShare). Collectives: Note [Collectives
// on the cores that compute].
// What the model leaves out (and bench/RESULTS.md measures): the warm-up iteration, the
// gradient norm's pass over the gradient shards, evaluations, and the CPU the link's copies take
// from compute on the simulated device.

// Note [Collectives on the cores that compute]
// A collective costs its latency plus the bytes a rank receives at the communicator's rate
// (MachineRates::comm_latency_s, comm_bytes_per_s; measured by `mpirun -np N tierzero plan
// --calibrate`). Per micro-batch a rank runs one all-gather per gather of a chunk the plan's
// schedule makes and one reduce-scatter per chunk. On a device with its own engines (NCCL, a
// GPU's copy engines) the all-gathers overlap compute: they are part of each gather's time and
// show as parameter waits only where the schedule cannot hide them. On the simulated device
// (device_shares_cpu) the collectives run on the cores that compute (MPI over shared memory
// copies with the CPU and polls while it waits), so a step pays every collective in full:
// comm_s, beside compute.

namespace {

// The chunks a moment needs, in the order the chunk manager takes them.
std::vector<int> ChunksOf(const ChunkLayout& layout, const std::vector<ParamId>& params) {
  std::vector<int> chunks;
  for (ParamId p : params) {
    const int c = layout.tensor(p).chunk;
    if (std::find(chunks.begin(), chunks.end(), c) == chunks.end()) chunks.push_back(c);
  }
  return chunks;
}

double MomentSeconds(const TraceMoment& m, const MachineRates& r) {
  if (m.compute_seconds > 0) return m.compute_seconds;
  double s = 0;
  if (m.flops > 0 && r.device_flops_per_s > 0) s += m.flops / r.device_flops_per_s;
  if (m.memory_bytes > 0 && r.device_memory_bytes_per_s > 0)
    s += m.memory_bytes / r.device_memory_bytes_per_s;
  return s;
}

// A rank's share of the machine's rates when `per_node` ranks share it: its cores (CPU Adam,
// and the simulated device's Adam) and its disk. A device's own link and arithmetic are the
// rank's (a device per rank).
MachineRates RankShare(MachineRates r, int per_node) {
  const double k = std::max(1, per_node);
  r.cpu_adam_params_per_s /= k;
  if (r.device_shares_cpu) r.device_adam_params_per_s /= k;
  r.nvme_read_bytes_per_s /= k;
  r.nvme_write_bytes_per_s /= k;
  r.nvme_duplex_bytes_per_s /= k;
  r.host_clear_bytes_per_s /= k;  // (memory bandwidth, shared)
  return r;
}

// Which budget an OutOfMemory from the placement names first.
std::string FailingTier(const Status& s, const EngineConfig& cfg) {
  const std::string msg = s.ToString();
  if (msg.find("fixed buffers") != std::string::npos ||
      msg.find("more than the host budget") != std::string::npos)
    return "host";
  return cfg.nvme_budget > 0 ? "nvme" : "host";
}

}  // namespace

StatusOr<PlanPrediction> Engine::Plan(const PlanRequest& req) const {
  const Impl& im = *impl_;
  if (im.finalized)
    return FailedPreconditionError(
        "Plan after Finalize: a plan predicts a run before it allocates");
  if (im.params.empty()) return FailedPreconditionError("Plan with no parameters registered");
  if (req.moments.empty())
    return InvalidArgumentError("Plan needs a training iteration's moments (a warm-up trace)");
  RETURN_IF_ERROR(ValidateMachineRates(req.rates));
  // The moments as Acquire would take them (a parameter once a moment, a backward only of what a
  // forward used), with times and counts a sum can hold: a NaN was counted as 0 and 1e308 made
  // the step infinite.
  auto bad_number = [](double v, double most) { return !(v >= 0 && v <= most); };
  std::vector<char> forwarded(static_cast<size_t>(num_params()), 0);
  for (size_t k = 0; k < req.moments.size(); ++k) {
    const TraceMoment& m = req.moments[k];
    const std::string which = "trace moment " + std::to_string(k);
    if (m.params.empty()) return InvalidArgumentError(which + " acquires no parameter");
    std::vector<char> here(forwarded.size(), 0);
    for (ParamId p : m.params) {
      if (p < 0 || p >= num_params())
        return InvalidArgumentError(which + " names parameter " + std::to_string(p) + " of " +
                                    std::to_string(num_params()));
      if (here[static_cast<size_t>(p)]++ != 0)
        return InvalidArgumentError(which + " names parameter " + std::to_string(p) +
                                    " twice (Acquire takes each once)");
      if (m.backward && !forwarded[static_cast<size_t>(p)])
        return InvalidArgumentError(which + " is a backward of parameter " + std::to_string(p) +
                                    ", which no forward moment before it acquired");
      if (!m.backward) forwarded[static_cast<size_t>(p)] = 1;
    }
    if (bad_number(m.compute_seconds, 1e6) || bad_number(m.flops, 1e30) ||
        bad_number(m.memory_bytes, 1e30))
      return InvalidArgumentError(which +
                                  " has a compute time, flop or byte count that is negative, "
                                  "not a number or beyond any run (at most 10^6 s, 10^30)");
  }
  if (bad_number(req.step_other_s, 1e6))
    return InvalidArgumentError("step_other_s must be 0 to 10^6 seconds");
  if (req.world_size < 0 || req.world_size > (1 << 16))
    return InvalidArgumentError("world_size " + std::to_string(req.world_size) +
                                "; accepted: 0 (the communicator's) .. 65536");
  const EngineConfig& cfg = im.cfg;
  const int world = req.world_size > 0 ? req.world_size : im.comm->size();
  int per_node = req.world_size > 0 ? world : im.comm->topology().local_size;
  if (req.ranks_per_node > 0) per_node = std::min(req.ranks_per_node, world);
  MachineRates rates = RankShare(req.rates, per_node);
  // Note [The simulated device's settings in a plan]
  // On the simulated device a run's copies run at engine.host_link_bandwidth and its device Adam
  // at engine.host_device_adam_rate when they are set (each rank's device its own); a plan
  // predicts them so, where it took the machine's calibrated rates (a throttled run's plan
  // predicted no wait for parameters, and its update phase 0.13 ms of 120: hunt 47). A GPU's
  // run ignores both, and so does its plan.
  const bool sim_device = cfg.device == DeviceChoice::kHost ||
                          (cfg.device == DeviceChoice::kAuto && CudaDeviceCount() == 0);
  if (sim_device && cfg.host_link_bandwidth > 0) {
    for (double* r : {&rates.h2d_bytes_per_s, &rates.d2h_bytes_per_s})
      *r = *r > 0 ? std::min(*r, cfg.host_link_bandwidth) : cfg.host_link_bandwidth;
  }

  PlanPrediction out;
  out.world_size = world;
  out.rates_name = rates.name;
  std::vector<TensorDesc> tensors;
  for (size_t i = 0; i < im.params.size(); ++i)
    tensors.push_back({im.params[i].name, static_cast<uint64_t>(im.numel[i])});
  LayoutOptions lo;
  lo.chunk_elems = cfg.chunk_elems;
  lo.world_size = world;
  lo.dtype = cfg.compute_dtype;
  auto built = ChunkLayout::Build(tensors, lo);
  if (!built.ok()) return std::move(built).status().WithContext("laying out the parameters");
  const ChunkLayout& layout = *built;
  const int n = layout.num_chunks();
  const uint64_t chunk = layout.chunk_bytes(), shard = layout.shard_bytes();
  out.chunk_elems = layout.chunk_elems();
  out.chunk_bytes = chunk;
  out.shard_bytes = shard;
  out.chunks = n;

  // The collective path as ChooseCollectivePath takes it when every rank can (the simulated
  // device's MPI progresses on its own; a GPU per rank loads NCCL).
  const bool on_device = world > 1 && cfg.collectives != CollectivePath::kHost;
  auto placed = PlaceRun(layout, cfg, on_device, per_node);
  if (!placed.ok()) {
    if (placed.status().code() != StatusCode::kOutOfMemory) return placed.status();
    out.failing_tier = FailingTier(placed.status(), cfg);
    out.problem = placed.status().ToString();
    return out;
  }
  const PlacedRun& pr = *placed;
  const Placement& pl = pr.placement;
  for (const ChunkPlacement& c : pl.chunks) {
    ++out.param_shards[static_cast<int>(c.param)];
    ++out.optimizer_groups[static_cast<int>(c.optimizer)];
  }
  for (int t = 0; t < kNumTiers; ++t) out.model_state_bytes[t] = pl.bytes[t];
  out.placement_summary = pl.Summary(pr.budgets);

  // The trace in chunks, and each tensor's uses (TensorStates counts the same).
  std::vector<int> fwd(im.params.size()), bwd(im.params.size());
  std::vector<Moment> moments;
  double compute = 0;
  for (const TraceMoment& t : req.moments) {
    Moment m;
    m.chunks = ChunksOf(layout, t.params);
    m.backward = t.backward;
    m.nonmodel_bytes = t.activation_bytes;
    m.nonmodel_peak = std::max(t.activation_peak, t.activation_bytes);
    m.compute_seconds = MomentSeconds(t, rates);
    compute += m.compute_seconds;
    for (ParamId p : t.params) ++(t.backward ? bwd : fwd)[static_cast<size_t>(p)];
    moments.push_back(std::move(m));
  }
  const int accum = cfg.grad_accumulation;
  const bool staged_all = world > 1 && !on_device;
  auto param_tier = [&](int c) { return pl.chunks[static_cast<size_t>(c)].param; };
  auto resident = [&](int c) { return world == 1 && param_tier(c) == Tier::kDevice; };
  PlanOptions po;
  po.device_capacity = cfg.device_budget;
  po.chunk_bytes = chunk;
  po.grads_in_place.resize(static_cast<size_t>(n));
  po.reduced_at_end.resize(static_cast<size_t>(n));
  po.always_resident.resize(static_cast<size_t>(n));
  po.staged.resize(static_cast<size_t>(n));
  bool nvme_params = false;
  for (int c = 0; c < n; ++c) {
    const size_t i = static_cast<size_t>(c);
    bool separate = accum > 1 || resident(c);
    for (int t : layout.chunk(c).tensors) {
      separate |= fwd[static_cast<size_t>(t)] > 1;
      if (bwd[static_cast<size_t>(t)] == 0) po.reduced_at_end[i] = true;
    }
    po.grads_in_place[i] = !separate;
    po.always_resident[i] = resident(c);
    po.staged[i] = staged_all || param_tier(c) == Tier::kNvme;
    nvme_params |= param_tier(c) == Tier::kNvme;
  }
  // Staging slots (internal::CreateStaging), within the NVMe queue (ChunkManager::PlanFrom).
  if (staged_all || nvme_params) {
    po.staging_slots =
        StagingSlotCount(staged_all ? HostGatherSlotBytes(shard, world) : shard, pr.staging_bytes);
    if (!staged_all) {
      // NvmeStore::TransfersInFlight with the store's default queue.
      const NvmeStoreOptions nvme;
      const uint64_t requests =
          std::max<uint64_t>(1, (shard + nvme.block_bytes - 1) / nvme.block_bytes);
      po.staging_slots = std::min(
          po.staging_slots,
          std::max(1, static_cast<int>(static_cast<uint64_t>(nvme.queue_depth) / requests)));
    }
  }
  // Gather seconds per tier: the local shard's read and copy, and the other ranks' part.
  // A rate the request leaves at 0 is assumed, and the prediction says which (AssignUpdates needs
  // every rate its groups use).
  auto rate_or = [&](double r, double assumed, const char* name) {
    if (r > 0) return r;
    if (std::find(out.assumed_rates.begin(), out.assumed_rates.end(), name) ==
        out.assumed_rates.end())
      out.assumed_rates.emplace_back(name);
    return assumed;
  };
  const double h2d = rate_or(rates.h2d_bytes_per_s, 1e10, "h2d_bytes_per_s");
  const double d2h = rate_or(rates.d2h_bytes_per_s, 1e10, "d2h_bytes_per_s");
  double comm = h2d, latency = 10e-6;
  if (world > 1) {
    comm = rate_or(rates.comm_bytes_per_s, h2d, "comm_bytes_per_s");
    latency =
        rates.comm_latency_s > 0 ? rates.comm_latency_s : rate_or(0, latency, "comm_latency_s");
  }
  // One collective's seconds (Note [Collectives on the cores that compute]).
  const double others = world > 1 ? static_cast<double>(chunk - shard) : 0.0;
  auto per_s = [](double bytes, double rate) { return rate > 0 ? bytes / rate : 0.0; };
  const double collective_s = world > 1 ? latency + per_s(others, comm) : 0.0;
  const bool comm_on_cpu = world > 1 && rates.device_shares_cpu;
  for (int c = 0; c < n; ++c) {
    const double local = static_cast<double>(world > 1 && on_device ? shard : chunk);
    double s = comm_on_cpu ? 0.0 : collective_s;
    switch (param_tier(c)) {
      case Tier::kDevice:
        if (resident(c)) s = 0;
        break;
      case Tier::kHost:
        s += per_s(local, h2d);
        break;
      case Tier::kNvme:
        s += per_s(local, h2d) +
             per_s(static_cast<double>(shard),
                   rate_or(rates.nvme_read_bytes_per_s, 1e9, "nvme_read_bytes_per_s"));
        break;
    }
    po.gather_seconds.push_back(s);
  }
  if (auto slots = SlotsPerMoment(moments, po); !slots.ok()) {
    out.failing_tier = "device";
    out.problem = slots.status().WithContext("planning after warm-up").ToString();
    return out;
  }
  auto simulated = Simulate(moments, po, CachePolicy::kPlan);
  if (!simulated.ok()) {
    if (simulated.status().code() != StatusCode::kOutOfMemory) return simulated.status();
    out.failing_tier = "device";
    out.problem = simulated.status().WithContext("planning after warm-up").ToString();
    return out;
  }
  const Schedule& sched = *simulated;
  // The slot region (ChunkManager::Replan).
  std::set<int> held;
  size_t most = 0;
  std::vector<int> gathers(static_cast<size_t>(n));
  for (const MomentDecision& d : sched.moments) {
    for (int c : d.evict) held.erase(c);
    for (int c : d.gather) {
      if (!resident(c)) held.insert(c);
      ++gathers[static_cast<size_t>(c)];
    }
    most = std::max(most, held.size());
  }
  out.slots = static_cast<int>(most);

  // Device memory (Note [What the plan predicts]).
  const size_t K = moments.size();
  std::vector<int> first_bwd(static_cast<size_t>(n), -1), last_bwd(static_cast<size_t>(n), -1);
  for (size_t k = 0; k < K; ++k) {
    if (!moments[k].backward) continue;
    for (int c : moments[k].chunks) {
      if (first_bwd[static_cast<size_t>(c)] < 0) first_bwd[static_cast<size_t>(c)] = int(k);
      last_bwd[static_cast<size_t>(c)] = int(k);
    }
  }
  uint64_t warm = 0, planned_rest = 0, grads_most = 0, act_most = 0;
  for (size_t k = 0; k < K; ++k) {
    const int at = static_cast<int>(k);
    std::set<int> cached;
    uint64_t grads = 0;
    for (int c : moments[k].chunks) {
      if (!resident(c)) cached.insert(c);
    }
    for (int c = 0; c < n; ++c) {
      const size_t i = static_cast<size_t>(c);
      if (first_bwd[i] < 0 || at < first_bwd[i]) continue;
      if (po.grads_in_place[i]) {
        if (at <= last_bwd[i] && !resident(c)) cached.insert(c);
        continue;
      }
      // A separate gradient chunk lives two moments past the Release that reduces it (Note [A
      // gradient chunk held past its reduction], src/chunk/chunk_manager.cc); one
      // with a tensor no backward uses is reduced at the iteration's end.
      if (po.reduced_at_end[i] || at <= last_bwd[i] + kGradChunkHeldMoments) grads += chunk;
    }
    const uint64_t act = moments[k].nonmodel_peak;
    warm = std::max(warm, act + grads + cached.size() * chunk);
    planned_rest = std::max(planned_rest, act + grads);
    grads_most = std::max(grads_most, grads);
    act_most = std::max(act_most, act);
  }
  const uint64_t hpz_device = pr.hpz_tier == Tier::kDevice ? pr.hpz_bytes : 0;
  // The optimizer states the device keeps are one allocation (OptimizerStates::Create), which
  // the device rounds up to its alignment: 8-bit moments' groups are 64-byte multiples, and the
  // plan was 128 bytes under the run's peak (hunt 51).
  uint64_t device_groups = 0;
  for (const ChunkPlacement& c : pl.chunks) device_groups += c.optimizer == Tier::kDevice ? 1 : 0;
  const uint64_t states_on_device = device_groups * pl.optim_shard_bytes;
  out.device_resident = pl.bytes[static_cast<int>(Tier::kDevice)] + hpz_device +
                        (AlignUp(states_on_device, kDeviceAlignment) - states_on_device);
  out.device_slots = most * chunk;
  out.device_activations = act_most;
  out.device_grads = grads_most;
  const uint64_t margin = 4 * chunk + (uint64_t{1} << 20);
  // (Rounded as the device rounds its capacity: CreateHostSimDevice, CreateCudaDevice.)
  out.device.budget =
      AlignUp(cfg.device_budget + cfg.device_shard_budget + margin, kDeviceAlignment);

  // The update phase (Updater::Groups, Updater::RunPhase).
  // Gradient shards: the compute dtype, fp32 with accumulation (ChunkManager::StoreOptions).
  const DType grad_dtype = accum > 1 ? DType::kF32 : cfg.compute_dtype;
  const uint64_t grad_bytes = DTypeBytes(grad_dtype, layout.shard_elems());
  std::vector<UpdateGroupTiers> tiers;
  int nvme_groups = 0;
  for (const ChunkPlacement& c : pl.chunks) {
    tiers.push_back({c.param == Tier::kDevice, c.param == Tier::kNvme, c.optimizer == Tier::kDevice,
                     c.optimizer == Tier::kNvme, c.grad == Tier::kDevice});
    nvme_groups += c.optimizer == Tier::kNvme;
  }
  // By the step the backward's prefetches fill every swap slot (PlaceRun counts three).
  constexpr int kSwapSlots = 3;
  const uint64_t group_bytes = OptimizerGroupLayout(layout, cfg.optimizer_states).bytes();
  std::vector<UpdateGroup> groups =
      MakeUpdateGroups(tiers, layout.shard_elems(), grad_bytes, shard, kSwapSlots,
                       OptimizerWritesBehind(), {}, group_bytes);
  // With accumulation every host gradient shard is cleared for the next window (Note [The
  // accumulation clear in the model], src/update/cost_model.cc): by the CPU's chain where it runs
  // behind the next forward (one rank, a GPU's compute or NVMe in the phase, as
  // Updater::RunPhase decides), else after the phase, in the step's rest.
  // (Updater::RunPhase's condition: the model computes on a GPU, not on the host's cores.)
  const bool host_compute = sim_device;
  bool in_chain = false;
  if (accum > 1) {
    bool io_bound = nvme_params;
    for (const UpdateGroup& g : groups) io_bound |= g.states_on_nvme;
    in_chain = world == 1 && (!host_compute || io_bound);
    for (UpdateGroup& g : groups)
      if (in_chain && !g.grad_on_device) g.clear_bytes = grad_bytes;
  }
  UpdateRates ur;
  ur.cpu_params_per_s = rate_or(rates.cpu_adam_params_per_s, 1e9, "cpu_adam_params_per_s");
  ur.device_params_per_s = rates.device_adam_params_per_s;
  ur.h2d_bytes_per_s = h2d;
  ur.d2h_bytes_per_s = d2h;
  if (nvme_groups > 0 || nvme_params) {
    ur.nvme_read_bytes_per_s = rate_or(rates.nvme_read_bytes_per_s, 1e9, "nvme_read_bytes_per_s");
    ur.nvme_write_bytes_per_s =
        rate_or(rates.nvme_write_bytes_per_s, 1e9, "nvme_write_bytes_per_s");
  } else {
    ur.nvme_read_bytes_per_s = ur.nvme_write_bytes_per_s = 1e9;  // unused: no NVMe state
  }
  ur.nvme_duplex_bytes_per_s = rates.nvme_duplex_bytes_per_s;
  ur.device_shares_cpu = rates.device_shares_cpu;
  if (sim_device && cfg.host_device_adam_rate > 0) {  // (a model: not the CPU's time)
    ur.device_params_per_s = cfg.host_device_adam_rate;
    ur.device_shares_cpu = false;
  }
  // (With accumulation the phase clears gradient shards: a rates file of an older tierzero has
  // no clearing rate, which is assumed and said, not taken as free.)
  ur.host_clear_bytes_per_s = cfg.grad_accumulation > 1 ? rate_or(rates.host_clear_bytes_per_s,
                                                                  1e10, "host_clear_bytes_per_s")
                                                        : rates.host_clear_bytes_per_s;
  UpdateBudget ub;
  // (As the run's phase sets it, UpdatePhase: compressed moments stream to the device as fp32
  // ones do, in their own bytes.)
  ub.mode = cfg.optimizer == OptimizerPlacement::kCpu        ? UpdateMode::kCpu
            : cfg.optimizer == OptimizerPlacement::kFraction ? UpdateMode::kFraction
                                                             : UpdateMode::kAuto;
  ub.device_fraction = cfg.optimizer_device_fraction;
  const uint64_t used_at_step = out.device_resident + out.device_slots;
  constexpr uint64_t kReserve = uint64_t{1} << 20;
  const uint64_t free_at_step =
      out.device.budget > used_at_step + kReserve ? out.device.budget - used_at_step - kReserve : 0;
  if (ur.device_params_per_s > 0) {
    ub.device_bytes = out.device_slots + free_at_step;
  } else {
    ur.device_params_per_s = 1;
  }
  const UpdateAssignment up = AssignUpdates(groups, ur, ub);
  // The clears the CPU's chain does not make: every host gradient shard after the phase, or,
  // behind the forward, those of the groups updated elsewhere (Updater::Await, on the step's
  // thread).
  uint64_t cleared_after_phase = 0;
  if (accum > 1) {
    for (size_t i = 0; i < groups.size(); ++i) {
      if (groups[i].grad_on_device || (in_chain && up.where[i] == UpdateWhere::kCpu)) continue;
      cleared_after_phase += grad_bytes;
    }
  }
  for (UpdateWhere w : up.where) {
    out.optimizer_cpu += w == UpdateWhere::kCpu;
    out.optimizer_resident += w == UpdateWhere::kDeviceResident;
    out.optimizer_streamed += w == UpdateWhere::kDeviceStreamed;
  }
  out.optimizer_reason = up.reason;
  if (up.slots > 0 && up.slot_bytes > 0) {
    const uint64_t sb = AlignUp(up.slot_bytes, kDeviceAlignment);
    const uint64_t in_idle = std::min<uint64_t>(static_cast<uint64_t>(up.slots), most * chunk / sb);
    out.device_update = (static_cast<uint64_t>(up.slots) - in_idle) * sb;
  }
  {
    // The first step's rate probe, in the idle slots or beside them: every run measures its
    // rates so, whatever rates the plan was given.
    const uint64_t want = RateProbeDeviceBytes(layout.shard_elems(), n, cfg.host_budget, grad_dtype,
                                               cfg.compute_dtype);
    if (out.device_slots < want)
      out.device_update = std::max(out.device_update, std::min(want, free_at_step));
  }
  out.device.peak = out.device_resident + std::max({warm, out.device_slots + planned_rest,
                                                    out.device_slots + out.device_update});

  // Host and NVMe.
  out.host.budget = cfg.host_budget;
  out.host.peak =
      pl.bytes[static_cast<int>(Tier::kHost)] + (cfg.host_budget - pr.budgets.host_bytes);
  out.nvme.budget = cfg.nvme_budget;
  out.nvme.peak =
      static_cast<uint64_t>(out.param_shards[2]) * AlignUp(shard, kNvmeAlignment) +
      static_cast<uint64_t>(out.optimizer_groups[2]) * AlignUp(group_bytes, kNvmeAlignment);

  // Bytes per step on each link.
  uint64_t h2d_iter = 0, d2h_iter = 0, nvme_iter = 0, comm_iter = 0;
  // Note [A secondary partition that is never stale] (zeropp_device.cc): with hpZ a chunk's
  // first gather of an iteration is a full one, which copies this rank's part of the node's
  // chunk out to the secondary partition; each later one copies the part back and all-gathers
  // the node's parts inside the node, reading no shard (the plan counted every gather as full:
  // hunt 51). Through the link both ways where the partition is in host memory.
  const bool hpz = pr.zeropp && on_device && cfg.zeropp.hpz;
  const uint64_t part = hpz ? chunk / static_cast<uint64_t>(std::max(1, per_node)) : 0;
  const uint64_t part_link = hpz && pr.hpz_tier == Tier::kHost ? part : 0;
  for (int c = 0; c < n; ++c) {
    const uint64_t g = static_cast<uint64_t>(gathers[static_cast<size_t>(c)]);
    if (resident(c) || g == 0) continue;
    const uint64_t local = world > 1 && on_device ? shard : chunk;
    const uint64_t full = hpz ? 1 : g, node = g - full;
    if (param_tier(c) != Tier::kDevice) h2d_iter += full * local;
    if (param_tier(c) == Tier::kNvme) nvme_iter += full * shard;
    if (world > 1) comm_iter += full * (chunk - shard) + node * (chunk - part);
    h2d_iter += node * part_link;
    d2h_iter += full * part_link;
  }
  // Each chunk's gradient once per micro-batch: reduced over the ranks, then its shard down
  // (not when the shard is on the device: Note [Gradient shards on the device]).
  for (const ChunkPlacement& p : pl.chunks) {
    if (p.grad != Tier::kDevice) d2h_iter += world > 1 && on_device ? shard : chunk;
  }
  if (world > 1) comm_iter += static_cast<uint64_t>(n) * (chunk - shard);
  out.iteration_h2d_bytes = h2d_iter;
  out.iteration_d2h_bytes = d2h_iter;
  out.iteration_nvme_read_bytes = nvme_iter;
  out.iteration_comm_bytes = comm_iter;
  out.h2d_bytes = accum * h2d_iter;
  out.d2h_bytes = accum * d2h_iter;
  out.nvme_read_bytes = accum * nvme_iter;
  out.comm_bytes = accum * comm_iter;
  for (int c = 0; c < n; ++c) {
    const ChunkPlacement& p = pl.chunks[static_cast<size_t>(c)];
    const UpdateWhere w = up.where[static_cast<size_t>(c)];
    if (p.optimizer == Tier::kNvme) {
      out.nvme_read_bytes += group_bytes;
      out.nvme_write_bytes += group_bytes;
    }
    if (p.param == Tier::kNvme) out.nvme_write_bytes += shard;
    if (p.param == Tier::kDevice && w == UpdateWhere::kCpu) out.h2d_bytes += shard;
    // A device gradient shard comes over for the CPU's Adam (Note [Accumulating on the device
    // for host updates]).
    if (p.grad == Tier::kDevice && w == UpdateWhere::kCpu) out.d2h_bytes += grad_bytes;
    if (w == UpdateWhere::kDeviceStreamed) {
      out.h2d_bytes += group_bytes + (p.grad == Tier::kDevice ? 0 : grad_bytes);
      out.d2h_bytes += group_bytes + (p.param == Tier::kDevice ? 0 : shard);
    } else if (w == UpdateWhere::kDeviceResident) {
      if (p.grad != Tier::kDevice) out.h2d_bytes += grad_bytes;
      out.d2h_bytes += p.param == Tier::kDevice ? 0 : shard;
    }
  }

  // Time per step.
  out.compute_s = accum * compute;
  out.param_wait_s = accum * sched.stall_s;
  out.transfer_s = accum * sched.transfer_s;
  out.optimizer_s = up.phase_s;
  double cpu_only = 0;
  for (size_t i = 0; i < groups.size(); ++i) {
    if (up.where[i] == UpdateWhere::kCpu)
      cpu_only += static_cast<double>(groups[i].elems) / ur.cpu_params_per_s;
  }
  out.optimizer_nvme_s = nvme_groups > 0 ? std::max(0.0, up.cpu_s - cpu_only) : 0.0;
  // (A rates file of an older tierzero has no clearing rate: assumed, and said, not left out.)
  out.other_s = req.step_other_s +
                (cleared_after_phase > 0
                     ? static_cast<double>(cleared_after_phase) /
                           rate_or(rates.host_clear_bytes_per_s, 1e10, "host_clear_bytes_per_s")
                     : 0.0);
  if (world > 1) {
    int per_iter = n;  // each chunk's gradients reduced once per micro-batch
    for (int c = 0; c < n; ++c) per_iter += gathers[static_cast<size_t>(c)];
    out.collectives = accum * per_iter;
    if (comm_on_cpu) out.comm_s = out.collectives * collective_s;
  }
  out.step_s = out.compute_s + out.param_wait_s + out.optimizer_s + out.comm_s + out.other_s;

  // Note [Room for the device allocator's fragmentation]
  // The peak is the run's, to the byte, but a run needs it in pieces of the sizes it asks for:
  // the device's best-fit allocator, between chunks (of one size, freed out of order) and
  // activations (of every size), can hold enough bytes and no range large enough. At the
  // smallest budget whose peak fitted the capacity exactly, a GPT at accumulation 2 failed for a
  // 1 MiB gradient buffer with 1.1 MiB free in three pieces; 576 KiB more ran (hunt 39;
  // tests/gpt/plan_fit_test.cc). So a plan fits when the peak and two chunks do, and the budgets
  // it advises leave that room. It is a margin measured on that case, not a bound: the allocator
  // does not model its own fragmentation, and a run can still want more in one piece. The bytes
  // it predicts stay the run's (the report compares them).
  out.device_fragmentation_allowance = 2 * chunk;
  out.fits = true;
  if (out.device.peak + out.device_fragmentation_allowance > out.device.budget) {
    out.fits = false;
    out.failing_tier = "device";
    out.problem =
        "the device would need " + FormatBytes(out.device.peak) + " of " +
        FormatBytes(out.device.budget) +
        (out.device.peak <= out.device.budget
             ? ", leaving less than the " + FormatBytes(out.device_fragmentation_allowance) +
                   " (two chunks) a plan keeps free against fragmentation"
             : "") +
        "; raise device_budget";
  }
  return out;
}

StatusOr<WarmupTrace> Engine::RecordedTrace() const {
  const Impl& im = *impl_;
  if (!im.finalized || !im.cm->has_plan() || im.traced_acquires.empty())
    return FailedPreconditionError(
        "no recorded trace yet: the first training iteration records it (call after it ends)");
  const std::vector<Moment>& moments = im.cm->trace();
  if (moments.size() != im.traced_acquires.size())
    return InternalError("the recorded trace has " + std::to_string(moments.size()) +
                         " moments and the engine saw " +
                         std::to_string(im.traced_acquires.size()) + " Acquires");
  WarmupTrace t;
  for (size_t i = 0; i < im.params.size(); ++i)
    t.params.push_back({im.params[i].name, im.params[i].shape, im.params[i].weight_decay});
  for (size_t k = 0; k < moments.size(); ++k) {
    TraceMoment m;
    m.params = im.traced_acquires[k].params;
    m.backward = im.traced_acquires[k].backward;
    m.activation_bytes = moments[k].nonmodel_bytes;
    m.activation_peak = moments[k].nonmodel_peak;
    m.compute_seconds = moments[k].compute_seconds;
    t.moments.push_back(std::move(m));
  }
  t.source = "recorded by the engine on " + im.device->info().name;
  return t;
}

}  // namespace tierzero
