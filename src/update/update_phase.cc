// The optimizer's update phase (docs/optimizer.md): every group updated where the plan says,
// the device's groups on three streams (upload, Adam, download) over buffers carved from device
// memory idle between iterations, while the trainer's threads update the CPU's groups; the rates
// the plan is made from, measured at the first step.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>

#include "core/bytes.h"
#include "core/check.h"
#include "core/convert.h"
#include "core/logging.h"
#include "core/tunable.h"
#include "update/updater.h"

namespace tierzero {

TZ_TUNABLE_CHOICE(kUpdateBehindForward, "TZ_UPDATE_BEHIND_FORWARD", "auto",
                  "the update phase's CPU groups finish behind the next forward, each chunk's "
                  "gather waiting for its own update: auto (on a GPU; on the simulated device when "
                  "the CPU's groups wait for NVMe), on, off",
                  "auto", "on", "off", "1", "0", "true", "false");

namespace {

// For measuring what each overlap buys (bench/train_bench.sh overlap): both are on by default.
TZ_TUNABLE(bool, kPrefetchStates, "TZ_OPTIMIZER_PREFETCH", true,
           "read NVMe optimizer states during the last micro-batch's backward");
TZ_TUNABLE(bool, kWriteBehind, "TZ_OPTIMIZER_WRITE_BEHIND", true,
           "leave the update phase's last NVMe optimizer-state writes to finish behind the next "
           "forward");

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

uint64_t Aligned(uint64_t bytes) { return AlignUp(bytes, kDeviceAlignment); }

}  // namespace

double AddSample(std::vector<double>& window, double x, size_t keep) {
  window.push_back(x);
  if (window.size() > keep) window.erase(window.begin());
  return Median(window);
}

namespace {

// Where a slot's parts lie: [states (streamed only)] [gradient] [output].
struct SlotParts {
  uint8_t* states;
  uint8_t* grad;
  uint8_t* out;
};
SlotParts PartsOf(uint8_t* mem, bool streamed, uint64_t group_bytes, uint64_t grad_bytes) {
  uint8_t* grad = mem + (streamed ? Aligned(group_bytes) : 0);
  return {mem, grad, grad + Aligned(grad_bytes)};
}

}  // namespace

// Device Adam with and without weight decay, the phase's streams and their events.
Status Updater::CreatePhase() {
  AdamConfig ac = adam_plain_->config();
  DeviceAdamOptions o;
  o.model_params_per_second = cfg_.host_device_adam_rate;
  auto plain = DeviceAdam::Create(*device_, ac, o);
  if (!plain.ok()) return std::move(plain).status().WithContext("device Adam");
  phase_.plain = std::move(plain).value();
  ASSIGN_OR_RETURN(phase_.decay, DeviceAdam::Create(*device_, adam_decay_->config(), o));
  ASSIGN_OR_RETURN(phase_.h2d, Stream::Create(*device_, "optimizer-h2d"));
  ASSIGN_OR_RETURN(phase_.adam, Stream::Create(*device_, "optimizer-adam"));
  ASSIGN_OR_RETURN(phase_.d2h, Stream::Create(*device_, "optimizer-d2h"));
  for (int k = 0; k < kMaxUpdateSlots; ++k) {
    for (auto* v : {&phase_.up_done, &phase_.adam_done, &phase_.slot_free}) {
      ASSIGN_OR_RETURN(Event e, Event::Create(*device_));
      v->push_back(std::move(e));
    }
  }
  return Status::OK();
}

std::vector<UpdateGroup> Updater::Groups() const {
  std::vector<UpdateGroupTiers> tiers;
  for (int c = 0; c < layout_.num_chunks(); ++c) {
    tiers.push_back({store_->param_tier(c) == Tier::kDevice, store_->param_tier(c) == Tier::kNvme,
                     optimizer().tier(c) == Tier::kDevice, optimizer().tier(c) == Tier::kNvme,
                     store_->grad_on_device(c)});
  }
  return MakeUpdateGroups(tiers, layout_.shard_elems(), store_->grad_bytes(), layout_.shard_bytes(),
                          optimizer().staged(), kWriteBehind.Get(), phase_.skip,
                          optimizer().group_bytes());
}

bool OptimizerWritesBehind() { return kWriteBehind.Get(); }

// Note [Measuring the update phase's rates]
// Each rate is first timed as the phase will see it: group-sized calls (so a call's own overhead
// counts) over as many elements of distinct memory as the model's groups hold, up to 4M (112 MB
// of streams, beyond this machine's 32 MiB L3: the caches then hold as little of the probe as
// of the groups a step walks) and an eighth of the host budget, several rounds, the median: CPU
// Adam with the optimizer's threads on host buffers; the link by copying the states up and down on
// the phase's own streams; device Adam on them; the disk by reading the first NVMe group and
// writing it back unchanged. They are measured once, at the first step, on the memory the phase
// will use. The probe can still flatter CPU Adam: under a small host budget it is one group,
// which its second and third rounds find in the L3 cache (measured: 9.8 G params/s on the default
// run, ten times the memory-bound rate), while the phase's states come cold from memory or
// straight from the disk. So every later phase times its own CPU groups' Adam calls, and the
// median of the last 15 phases' rates replaces the probe's (not a phase whose device work ran
// on the CPU's own cores, which slows the CPU's groups).
StatusOr<UpdateRates> Updater::MeasureRates(void* scratch, uint64_t scratch_bytes) {
  constexpr int kRounds = 3;
  const uint64_t probe_elems =
      RateProbeElems(layout_.shard_elems(), layout_.num_chunks(), cfg_.host_budget);
  UpdateRates r;
  r.device_shares_cpu = cfg_.host_compute && cfg_.host_device_adam_rate == 0;
  const DType gt = store_->grad_dtype();
  const DType dt = cfg_.compute_dtype;
  const uint64_t n = layout_.shard_elems();
  const uint64_t calls = std::max<uint64_t>(1, (probe_elems + n - 1) / n);
  const uint64_t total = calls * n;
  // Host: [master | m | v] for all calls, then the gradients, then the outputs.
  AlignedBuffer host = AlignedBuffer::Allocate(Aligned(total * 12) + 2 * Aligned(total * 4));
  if (host.data() == nullptr) return OutOfMemoryError("the optimizer's rate probe");
  // Page-locked like the memory the phase copies from (the host groups' states, the gradient
  // shards): pageable memory crosses PCIe at a fraction of the rate (measured on an H100: 7.2
  // GB/s against 54), and the model then predicted a resident phase 7x too long and streamed
  // too few groups.
  struct Pinned {
    Device* device = nullptr;
    void* ptr = nullptr;
    ~Pinned() {
      if (ptr != nullptr) (void)device->UnregisterHostMemory(ptr);
    }
  } pinned;
  if (device_->RegisterHostMemory(host.data(), host.bytes()).ok()) {
    pinned.device = device_;
    pinned.ptr = host.data();
  }
  auto* f = reinterpret_cast<float*>(host.data());
  for (uint64_t i = 0; i < 3 * total; ++i) f[i] = i < total ? 0.01f : 0.0f;
  uint8_t* hgrad = static_cast<uint8_t*>(host.data()) + Aligned(total * 12);
  uint8_t* hout = hgrad + Aligned(total * 4);
  {
    std::vector<float> small(total, 1e-3f);
    RETURN_IF_ERROR(Convert(small.data(), DType::kF32, hgrad, gt, total));
  }
  AdamStepOptions so;
  so.lr = 0;  // the probe's values do not matter; its time does
  auto buffers = [&](float* st, uint64_t count, uint8_t* grad, uint8_t* out, uint64_t k) {
    // Call k of `count` elements' groups laid out as [master | m | v] for all of them.
    return AdamBuffers{st + k * n,
                       st + count + k * n,
                       st + 2 * count + k * n,
                       grad + DTypeBytes(gt, k * n),
                       gt,
                       dt == DType::kF32 ? nullptr : out + DTypeBytes(dt, k * n),
                       dt,
                       n};
  };
  // CPU Adam in the run's moment format (compressed moments beside the fp32 ones' master).
  const GroupLayout& gl = optimizer().layout();
  AlignedBuffer moments;
  if (gl.format != StateFormat::kF32) {
    moments = AlignedBuffer::Allocate(2 * (AlignUp(MomentWidth(gl.format) * total, 64) +
                                           AlignUp(4 * calls * StateScaleCount(n), 64)));
    if (moments.data() == nullptr) return OutOfMemoryError("the optimizer's rate probe");
    std::memset(moments.data(), 0, moments.bytes());
  }
  auto cpu_buffers = [&](uint64_t k) {
    AdamBuffers b = buffers(f, total, hgrad, hout, k);
    if (gl.format == StateFormat::kF32) return b;
    auto* base = static_cast<uint8_t*>(moments.data());
    const uint64_t w = MomentWidth(gl.format);
    const uint64_t codes = AlignUp(w * total, 64);
    const uint64_t half = codes + AlignUp(4 * calls * StateScaleCount(n), 64);
    b.states = gl.format;
    b.m_state = base + w * k * n;
    b.v_state = base + half + w * k * n;
    // Each moment's scales after its codes, StateScaleCount(n) a call.
    b.m_scale = reinterpret_cast<float*>(base + codes) + k * StateScaleCount(n);
    b.v_scale = reinterpret_cast<float*>(base + half + codes) + k * StateScaleCount(n);
    return b;
  };
  std::vector<double> t;
  for (int round = 0; round < kRounds; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (uint64_t k = 0; k < calls; ++k)
      RETURN_IF_ERROR(adam_plain_->Step(cpu_buffers(k), so).status());
    t.push_back(Since(t0));
  }
  r.cpu_params_per_s = static_cast<double>(total) / std::max(Median(t), 1e-9);
  // Clearing host memory as the chain clears gradient shards with accumulation (Note [The
  // accumulation clear in the model]): the probe's whole buffer, 20 bytes an element (its values
  // do not matter to the device's probe below either).
  {
    const uint64_t bytes = host.bytes();
    std::vector<double> z;
    for (int round = 0; round < kRounds; ++round) {
      const auto t0 = std::chrono::steady_clock::now();
      ZeroHostParallel(host.data(), bytes);
      z.push_back(Since(t0));
    }
    r.host_clear_bytes_per_s = static_cast<double>(bytes) / std::max(Median(z), 1e-9);
  }
  // The device: as many whole groups as the scratch holds.
  const uint64_t per_elem = 12 + DTypeBytes(gt, 1) + DTypeBytes(dt, 1);
  const uint64_t dcalls =
      std::min<uint64_t>(calls, scratch_bytes / (n * per_elem + 3 * kDeviceAlignment));
  if (dcalls > 0 && scratch != nullptr) {
    const uint64_t dn = dcalls * n;
    auto* ds = static_cast<uint8_t*>(scratch);
    auto* dstates = reinterpret_cast<float*>(ds);
    uint8_t* dgrad = ds + Aligned(dn * 12);
    uint8_t* dout = dgrad + Aligned(DTypeBytes(gt, dn));
    std::vector<double> up, down, adam, both;
    for (int round = 0; round < kRounds; ++round) {
      // The same states as the host's first dn elements' (the layout differs; the time does not).
      auto t0 = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(
          device_->CopyAsync(dstates, f, dn * 12, CopyKind::kHostToDevice, phase_.h2d.handle()));
      RETURN_IF_ERROR(device_->CopyAsync(dgrad, hgrad, DTypeBytes(gt, dn), CopyKind::kHostToDevice,
                                         phase_.h2d.handle()));
      RETURN_IF_ERROR(phase_.h2d.Synchronize());
      up.push_back(Since(t0));
      t0 = std::chrono::steady_clock::now();
      for (uint64_t k = 0; k < dcalls; ++k) {
        RETURN_IF_ERROR(phase_.plain->StepAsync(buffers(dstates, dn, dgrad, dout, k), so,
                                                phase_.adam.handle()));
      }
      RETURN_IF_ERROR(phase_.adam.Synchronize());
      RETURN_IF_ERROR(phase_.plain->TakeError());
      adam.push_back(Since(t0));
      t0 = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(
          device_->CopyAsync(f, dstates, dn * 12, CopyKind::kDeviceToHost, phase_.d2h.handle()));
      RETURN_IF_ERROR(phase_.d2h.Synchronize());
      down.push_back(Since(t0));
      // Both directions at once, as a chain of streamed groups keeps them: half the states up
      // while the other half comes down (disjoint memory on both sides).
      const uint64_t half = dn * 6;
      t0 = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(
          device_->CopyAsync(dstates, f, half, CopyKind::kHostToDevice, phase_.h2d.handle()));
      RETURN_IF_ERROR(device_->CopyAsync(reinterpret_cast<uint8_t*>(f) + half, ds + half, half,
                                         CopyKind::kDeviceToHost, phase_.d2h.handle()));
      RETURN_IF_ERROR(phase_.h2d.Synchronize());
      RETURN_IF_ERROR(phase_.d2h.Synchronize());
      both.push_back(Since(t0));
    }
    r.pcie_duplex_bytes_per_s = static_cast<double>(dn * 12) / std::max(Median(both), 1e-9);
    r.h2d_bytes_per_s =
        static_cast<double>(dn * 12 + DTypeBytes(gt, dn)) / std::max(Median(up), 1e-9);
    r.d2h_bytes_per_s = static_cast<double>(dn * 12) / std::max(Median(down), 1e-9);
    r.device_params_per_s = static_cast<double>(dn) / std::max(Median(adam), 1e-9);
  }
  ASSIGN_OR_RETURN(const OptimizerStates::NvmeRates disk, optimizer().MeasureNvmeRates(3));
  r.nvme_read_bytes_per_s = disk.read;
  r.nvme_write_bytes_per_s = disk.write;
  r.nvme_duplex_bytes_per_s = disk.duplex;
  return r;
}

// While the last micro-batch's backward computes (the engine calls it then): the NVMe groups'
// states start coming in (Note [Optimizer I/O around the step]). Never waits.
void Updater::PrefetchStates() {
  if (!kPrefetchStates.Get()) return;
  // Best effort: a failure here (a lost write behind, a read that cannot be submitted) must
  // not fail the backward step it rides on; the states keep it, and the Step reports it.
  auto staged = optimizer().Prefetch();
  if (!staged.ok() && !prefetch_warned_) {
    TZ_LOG(kWarn, kEngine) << "prefetching optimizer states: " << staged.status().ToString();
    prefetch_warned_ = true;
  }
}

// One device group's upload, Adam and download, queued on the phase's streams in slot `k`.
Status Updater::EnqueueDeviceGroup(int c, UpdateWhere where, int k, uint8_t* mem,
                                   const AdamStepOptions& so) {
  const size_t ks = static_cast<size_t>(k);
  const bool streamed = where == UpdateWhere::kDeviceStreamed;
  const uint64_t group_bytes = optimizer().group_bytes();
  const uint64_t shard_bytes = layout_.shard_bytes();
  const DType dt = cfg_.compute_dtype;
  const OptimizerGroup g = optimizer().Resident(c);
  const SlotParts p = PartsOf(mem, streamed, group_bytes, store_->grad_bytes());
  auto* stamp = &phase_.measured_end_s[static_cast<size_t>(c)];
  // Upload: the gradient, and a streamed group's states.
  StreamHandle h2d = phase_.h2d.handle(), adam = phase_.adam.handle(), d2h = phase_.d2h.handle();
  RETURN_IF_ERROR(device_->StreamWaitEvent(h2d, phase_.slot_free[ks].handle()));
  // A gradient shard on the device is read where it is (Note [Gradient shards on the device]).
  const bool grad_here = store_->grad_on_device(c);
  uint8_t* grad = grad_here ? static_cast<uint8_t*>(store_->grad(c)) : p.grad;
  if (!grad_here) {
    RETURN_IF_ERROR(device_->CopyAsync(p.grad, store_->grad(c), store_->grad_bytes(),
                                       CopyKind::kHostToDevice, h2d));
    moved_h2d_ += store_->grad_bytes();
  }
  if (streamed) {
    RETURN_IF_ERROR(
        device_->CopyAsync(p.states, g.master, group_bytes, CopyKind::kHostToDevice, h2d));
    moved_h2d_ += group_bytes;
  }
  RETURN_IF_ERROR(device_->RecordEvent(phase_.up_done[ks].handle(), h2d));
  // Adam, slice by slice, its compute-dtype output into a device shard or the slot.
  RETURN_IF_ERROR(device_->StreamWaitEvent(adam, phase_.up_done[ks].handle()));
  const OptimizerGroup on_device = streamed ? optimizer().layout().At(c, p.states) : g;
  float* master = on_device.master;
  auto* param_dev = static_cast<uint8_t*>(store_->device_param(c));
  uint8_t* out = param_dev != nullptr ? param_dev : p.out;
  if (dt != DType::kF32 && param_dev == nullptr) {
    RETURN_IF_ERROR(device_->MemsetAsync(p.out, 0, shard_bytes, adam));  // padding stays zero
  }
  for (size_t s = 0; s < slices_[static_cast<size_t>(c)].size(); ++s) {
    const AdamBuffers b = SliceBuffers(on_device, s, grad, out);
    const ShardSlice& sl = slices_[static_cast<size_t>(c)][s];
    DeviceAdam& da = decays_[static_cast<size_t>(sl.tensor)] ? *phase_.decay : *phase_.plain;
    RETURN_IF_ERROR(da.StepAsync(b, so, adam));
  }
  if (dt == DType::kF32 && param_dev != nullptr) {
    RETURN_IF_ERROR(
        device_->CopyAsync(param_dev, master, shard_bytes, CopyKind::kDeviceToDevice, adam));
  }
  RETURN_IF_ERROR(device_->RecordEvent(phase_.adam_done[ks].handle(), adam));
  // Download: the parameters to a host shard, and a streamed group's states.
  RETURN_IF_ERROR(device_->StreamWaitEvent(d2h, phase_.adam_done[ks].handle()));
  if (param_dev == nullptr) {
    void* host = store_->host_param(c);
    TZ_CHECK(host != nullptr) << "a device update of chunk " << c << " whose shard is on NVMe";
    const void* src = dt == DType::kF32 ? static_cast<const void*>(master) : p.out;
    RETURN_IF_ERROR(device_->CopyAsync(host, src, shard_bytes, CopyKind::kDeviceToHost, d2h));
    moved_d2h_ += shard_bytes;
  }
  if (streamed) {
    RETURN_IF_ERROR(
        device_->CopyAsync(g.master, p.states, group_bytes, CopyKind::kDeviceToHost, d2h));
    moved_d2h_ += group_bytes;
  }
  RETURN_IF_ERROR(device_->RecordEvent(phase_.slot_free[ks].handle(), d2h));
  return device_->LaunchHostFunc(d2h, [stamp, t0 = phase_.t0] {
    *stamp = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
}

// Note [Device memory for the update phase]
// While no iteration runs, no chunk is gathered: the plan's slot region is idle (Deep Optimizer
// States' observation that device memory is mostly free during the update). The phase carves
// its buffers from it first, and from what the device has free beyond a reserve, held only
// until the phase ends: the next iteration finds its memory as it left it, and nothing here can
// take memory an iteration needs. Every exit of the phase, errors included, first drains the
// phase's streams, so no copy or kernel still uses the borrowed memory.
Status Updater::RunPhase(const AdamStepOptions& so, bool prof) {
  constexpr uint64_t kReserve = uint64_t{1} << 20;
  auto* idle = static_cast<uint8_t*>(cm_->idle_slot_memory());
  const uint64_t idle_bytes = idle != nullptr ? cm_->idle_slot_bytes() : 0;
  const uint64_t free_block = device_->largest_free_block();
  const uint64_t extra_bytes = free_block > kReserve ? free_block - kReserve : 0;
  // The read-ahead's window ends here (before the first step's probe, which is no backward).
  if (backward_open_) {
    backward_open_ = false;
    AddSample(backward_spans_, Since(backward_t0_), kSpanWindow);
  }
  if (!phase_.measured) {
    // The probe's device memory: the idle region, or a free block.
    // (No more than the probe uses: a run's device peak is what its iterations and phases
    // need, and Engine::Plan predicts it.)
    DeviceBuffer probe;
    void* scratch = idle;
    uint64_t scratch_bytes = idle_bytes;
    const uint64_t want =
        RateProbeDeviceBytes(layout_.shard_elems(), layout_.num_chunks(), cfg_.host_budget,
                             store_->grad_dtype(), cfg_.compute_dtype);
    if (scratch_bytes < want && extra_bytes > 0) {
      const uint64_t bytes = std::min(want, extra_bytes);
      auto b = DeviceBuffer::Allocate(*device_, bytes);
      if (b.ok()) {
        probe = std::move(b).value();
        scratch = probe.data();
        scratch_bytes = bytes;
      }
    }
    // A span of its own in a profiled step: not a wait for NVMe, not Adam (the report's
    // `optimizer_rate_probe_seconds`).
    const double probe_start_s = prof ? timeline_.Now() : 0.0;
    ASSIGN_OR_RETURN(phase_.rates, MeasureRates(scratch, scratch_bytes));
    if (prof) {
      timeline_.Add({Track::kOptimizer, std::string(kRateProbeSpan), probe_start_s,
                     timeline_.Now() - probe_start_s});
    }
    phase_.measured = true;
    const UpdateRates& r = phase_.rates;
    TZ_LOG(kInfo, kEngine) << "update rates: CPU Adam " << r.cpu_params_per_s / 1e6
                           << " Mparams/s (" << adam_plain_->threads() << " threads), device Adam "
                           << r.device_params_per_s / 1e6 << " Mparams/s"
                           << (cfg_.host_device_adam_rate > 0 ? " (a model)" : "") << ", H2D "
                           << r.h2d_bytes_per_s / 1e9 << " GB/s, D2H " << r.d2h_bytes_per_s / 1e9
                           << " GB/s, both at once " << r.pcie_duplex_bytes_per_s / 1e9
                           << " GB/s, NVMe read " << r.nvme_read_bytes_per_s / 1e9
                           << " GB/s, write " << r.nvme_write_bytes_per_s / 1e9
                           << " GB/s, both at once " << r.nvme_duplex_bytes_per_s / 1e9 << " GB/s";
  }
  std::vector<UpdateGroup> groups = Groups();
  UpdateBudget budget;
  budget.mode = cfg_.placement == OptimizerPlacement::kCpu        ? UpdateMode::kCpu
                : cfg_.placement == OptimizerPlacement::kFraction ? UpdateMode::kFraction
                                                                  : UpdateMode::kAuto;
  budget.device_fraction = cfg_.device_fraction;
  // Whether the CPU's groups may finish behind the next forward (the conditions below, less
  // those of this step alone): the plan then credits the forward they hide behind. NVMe groups
  // always update on the CPU, so io_bound does not depend on the plan.
  const std::string behind_mode = kUpdateBehindForward.Get();
  const bool behind_off = behind_mode == "off" || behind_mode == "0" || behind_mode == "false";
  const bool behind_on = behind_mode == "on" || behind_mode == "1" || behind_mode == "true";
  bool io_bound = false;
  for (const UpdateGroup& g : groups) io_bound |= g.states_on_nvme || g.param_on_nvme;
  if (!behind_off && world() == 1 && (behind_on || !cfg_.host_compute || io_bound) &&
      !forward_spans_.empty()) {
    // Note [The forward's time on the device]
    // The host's span of a forward on a GPU is its enqueueing (6.7 ms of the 1.21B GPT's 30 ms
    // forward on an H100, session 37): the CPU chain can hide behind as long as the device
    // computes. The profiled iteration times its compute spans with events on the compute
    // stream (Note [Compute spans on the device's clock]), and its phase ran inside Step, so
    // its forward waited for no update: that span is the credit, or the host's if longer.
    budget.behind_forward_s = std::max(Median(forward_spans_), device_forward_s_);
    // The chain behind the forward clears each of its groups' host gradient shards as it goes
    // (Note [The accumulation clear in the model]); not in a profiled step, whose chain runs
    // inside Step and clears after the phase.
    if (cfg_.grad_accumulation > 1 && !prof && !cm_->profile_pending()) {
      for (UpdateGroup& g : groups)
        if (!g.grad_on_device) g.clear_bytes = store_->grad_bytes();
    }
  }
  UpdateRates rates = phase_.rates;
  rates.cpu_grad_fetch_ahead = kGradFetchAhead.Get();
  if (!backward_spans_.empty()) rates.nvme_read_ahead_window_s = Median(backward_spans_);
  if (rates.device_params_per_s <= 0) {
    // No device memory for the probe: nothing can update there but resident groups, which
    // then go through the CPU.
    budget.device_bytes = 0;
    rates.device_params_per_s = 1;
  }
  // Slots come from two regions: as many as fit in each.
  auto carve = [&](uint64_t slot_bytes) -> int {
    if (slot_bytes == 0) return 0;
    const uint64_t sb = Aligned(slot_bytes);
    return static_cast<int>(std::min<uint64_t>(idle_bytes / sb + extra_bytes / sb, 1u << 30));
  };
  if (phase_.rates.device_params_per_s > 0) budget.device_bytes = idle_bytes + extra_bytes;
  // An assignment with every group on the CPU needs no slot (its slots had no bytes, were read
  // as "no device memory for one group's buffer", and the report gave that reason).
  auto assign = [&] {
    UpdateAssignment a = AssignUpdates(groups, rates, budget);
    if (std::all_of(a.where.begin(), a.where.end(),
                    [](UpdateWhere w) { return w == UpdateWhere::kCpu; }))
      a.slots = 0;
    return a;
  };
  UpdateAssignment plan = assign();
  if (plan.slots > 0 && carve(plan.slot_bytes) < plan.slots) {
    // The two regions hold fewer than their sum suggests.
    budget.device_bytes = static_cast<uint64_t>(carve(plan.slot_bytes)) * plan.slot_bytes;
    plan = assign();
  }
  phase_.assigned_groups = groups;
  phase_.assigned_rates = rates;
  const bool changed = plan.where != phase_.assignment.where;
  phase_.assignment = plan;
  if (changed) {
    int cpu = 0, res = 0, str = 0;
    for (UpdateWhere w : plan.where) {
      cpu += w == UpdateWhere::kCpu;
      res += w == UpdateWhere::kDeviceResident;
      str += w == UpdateWhere::kDeviceStreamed;
    }
    TZ_LOG(kInfo, kEngine) << "update plan: " << cpu << " groups on the CPU, " << res
                           << " on the device (resident), " << str
                           << " streamed to the device; predicted " << plan.phase_s * 1e3
                           << " ms (CPU " << plan.cpu_s * 1e3 << ", device " << plan.device_s * 1e3
                           << ") — " << plan.reason << "; device memory for its buffers "
                           << FormatBytes(budget.device_bytes) << " (idle slots "
                           << FormatBytes(idle_bytes) << ", free " << FormatBytes(extra_bytes)
                           << ")";
  }
  // The slots' memory.
  std::vector<uint8_t*> slot_mem;
  // (A slot of no bytes still takes an aligned address: no division by zero below.)
  const uint64_t sb = std::max<uint64_t>(Aligned(plan.slot_bytes), kDeviceAlignment);
  if (plan.slots > 0) {
    const int in_idle = static_cast<int>(std::min<uint64_t>(plan.slots, idle_bytes / sb));
    for (int k = 0; k < in_idle; ++k) slot_mem.push_back(idle + k * sb);
    if (in_idle < plan.slots) {
      ASSIGN_OR_RETURN(phase_.extra, DeviceBuffer::Allocate(*device_, (plan.slots - in_idle) * sb));
      for (int k = in_idle; k < plan.slots; ++k) {
        slot_mem.push_back(static_cast<uint8_t*>(phase_.extra.data()) + (k - in_idle) * sb);
      }
    }
  }
  phase_.measured_end_s.assign(groups.size(), 0.0);
  // Drains the device's chain on every way out, then gives the extra memory back.
  struct Drain {
    Updater* im;
    ~Drain() {
      (void)im->phase_.h2d.Synchronize();
      (void)im->phase_.adam.Synchronize();
      (void)im->phase_.d2h.Synchronize();
      im->phase_.extra.Reset();
    }
  } drain{this};
  phase_.t0 = std::chrono::steady_clock::now();
  const double phase_start_s = prof ? timeline_.Now() : 0.0;
  int k = 0;
  for (int c = 0; c < layout_.num_chunks(); ++c) {
    const UpdateWhere w = plan.where[static_cast<size_t>(c)];
    if (w == UpdateWhere::kCpu) continue;
    RETURN_IF_ERROR(EnqueueDeviceGroup(c, w, k, slot_mem[static_cast<size_t>(k)], so));
    k = (k + 1) % plan.slots;
  }
  // The CPU's groups meanwhile: on the trainer's threads, or behind the next forward (Note [The
  // update phase behind the next forward]); not in the profiled step, whose timeline shows the
  // phase as one span, nor before a profiled iteration, whose stalls are the plan's.
  int counts[3] = {0, 0, 0};
  for (UpdateWhere w : plan.where) ++counts[static_cast<int>(w)];
  stats_.optimizer_cpu_groups = counts[0];
  stats_.optimizer_resident_groups = counts[1];
  stats_.optimizer_streamed_groups = counts[2];
  stats_.optimizer_predicted_seconds = plan.phase_s;
  // On the simulated device the forward computes on the cores CPU Adam would use: only a chain
  // with disk waits to hide gains from going behind it (measured: bench/train_bench.sh behind).
  // One rank only: on several, a failure behind one rank's forward would first have to be agreed
  // on by every rank before each collective that follows.
  bool behind = false;
  if (!behind_off && !prof && !cm_->profile_pending() && counts[0] > 0 && world() == 1 &&
      (behind_on || !cfg_.host_compute || io_bound)) {
    ASSIGN_OR_RETURN(behind, LaunchBehind(so));
  }
  // The device's groups end before Step returns either way: their slots are the next
  // iteration's memory.
  auto device_chain_done = [&]() -> Status {
    RETURN_IF_ERROR(phase_.h2d.Synchronize());
    RETURN_IF_ERROR(phase_.adam.Synchronize());
    RETURN_IF_ERROR(phase_.d2h.Synchronize());
    RETURN_IF_ERROR(phase_.plain->TakeError());
    return phase_.decay->TakeError();
  };
  if (behind) {
    RETURN_IF_ERROR(device_chain_done());
    tail_.device_end_s = Since(phase_.t0);
    return Status::OK();
  }
  double adam_s = 0;
  uint64_t adam_elems = 0;
  RETURN_IF_ERROR(RunCpuChain(so, prof, /*mark=*/false, adam_s, adam_elems));
  RETURN_IF_ERROR(device_chain_done());
  if (prof) {
    for (int c = 0; c < layout_.num_chunks(); ++c) {
      const UpdateWhere w = plan.where[static_cast<size_t>(c)];
      if (w == UpdateWhere::kCpu) continue;
      // The device's groups as spans ending when their download did.
      timeline_.Add(
          {Track::kOptimizer,
           "device Adam chunk " + std::to_string(c) + " (" + std::string(UpdateWhereName(w)) + ")",
           phase_start_s, phase_.measured_end_s[static_cast<size_t>(c)], -1, c,
           layout_.shard_elems() * 12, 0});
    }
  }
  FinishPhase(Since(phase_.t0), adam_s, adam_elems, /*rate_sample=*/true);
  return Status::OK();
}

// The CPU's groups, each timed for the CPU Adam rate (Note [Measuring the update phase's
// rates]); not those whose NVMe parameter write counts. With `mark`, each chunk is current
// for the chunk manager's fence as soon as its parameters are written (and, with accumulation,
// its gradient shard cleared for the next window).
Status Updater::RunCpuChain(const AdamStepOptions& so, bool prof, bool mark, double& adam_s,
                            uint64_t& adam_elems) {
  const auto takes = [&](int c) { return CpuChainTakes(c); };
  struct End {  // drains the fetches on every way out, a failed FetchBegin's too
    Updater* u;
    ~End() { u->FetchEnd(); }
  } end{this};
  RETURN_IF_ERROR(FetchBegin(takes));
  return optimizer().ForEach(
      [&](const OptimizerGroup& g) {
        RETURN_IF_ERROR(FetchNext(g.chunk));
        const auto a0 = std::chrono::steady_clock::now();
        RETURN_IF_ERROR(AdamGroup(g, so, prof));
        if (store_->param_tier(g.chunk) != Tier::kNvme) {
          adam_s += Since(a0);
          adam_elems += layout_.shard_elems();
        }
        phase_.measured_end_s[static_cast<size_t>(g.chunk)] = Since(phase_.t0);
        if (mark) {
          if (cfg_.grad_accumulation > 1) {
            const auto z0 = std::chrono::steady_clock::now();
            RETURN_IF_ERROR(store_->ZeroGrad(g.chunk));
            if (!store_->grad_on_device(g.chunk)) {
              tail_.clear_s += Since(z0);
              tail_.clear_bytes += store_->grad_bytes();
            }
          }
          tail_.MarkDone(g.chunk);
        }
        return Status::OK();
      },
      /*write_back=*/true, takes, /*write_behind=*/kWriteBehind.Get());
}

bool Updater::CpuChainTakes(int c) const {
  const size_t i = static_cast<size_t>(c);
  return phase_.assignment.where[i] == UpdateWhere::kCpu &&
         !(i < phase_.skip.size() && phase_.skip[i]);
}

void Updater::FinishPhase(double measured_s, double adam_s, uint64_t adam_elems, bool rate_sample) {
  phase_.measured_s = measured_s;
  phase_.phase_s.push_back(measured_s);
  // Device work on the CPU's own cores slows the CPU's groups: such a phase is no sample; nor
  // one behind the forward, whose Adam calls shared the cores with it.
  const bool cpu_shared =
      phase_.rates.device_shares_cpu && stats_.optimizer_cpu_groups < layout_.num_chunks();
  if (rate_sample && adam_elems > 0 && adam_s > 0 && !cpu_shared) {
    // Kept apart for phases with streamed groups, whose copies slow CPU Adam down.
    const bool streamed = stats_.optimizer_streamed_groups > 0;
    (streamed ? phase_.rates.cpu_params_per_s_streaming : phase_.rates.cpu_params_per_s) =
        AddSample(streamed ? phase_.cpu_rate_samples_streaming : phase_.cpu_rate_samples,
                  static_cast<double>(adam_elems) / adam_s);
  }
  // The device chain beside CPU Adam: its copies share host memory with the CPU's groups, so
  // its measured end over its prediction at the probe's link rates is sampled (not where the
  // device computes on the CPU's cores: no copies cross a link there).
  if (!phase_.rates.device_shares_cpu &&
      phase_.assignment.where.size() == phase_.assigned_groups.size()) {
    double dev_end = 0;
    bool dev = false, cpu = false;
    for (size_t i = 0; i < phase_.assignment.where.size(); ++i) {
      if (phase_.assignment.where[i] != UpdateWhere::kCpu) {
        dev = true;
        dev_end = std::max(dev_end, phase_.measured_end_s[i]);
      } else {
        cpu |= CpuChainTakes(static_cast<int>(i));
      }
    }
    if (dev && cpu && dev_end > 0) {
      UpdateRates at_probe = phase_.assigned_rates;
      at_probe.link_slowdown_beside_cpu = 1;
      const double predicted = Simulate(phase_.assigned_groups, phase_.assignment.where, at_probe,
                                        phase_.assignment.slots)
                                   .device_s;
      if (predicted > 0) {
        phase_.rates.link_slowdown_beside_cpu =
            AddSample(phase_.link_samples, std::clamp(dev_end / predicted, 1.0, 4.0));
      }
    }
  }
  stats_.optimizer_phase_seconds = measured_s;
}

}  // namespace tierzero
