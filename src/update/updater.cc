// The Updater's life and its step (updater.h): CPU Adam made, the gradient norm over every rank,
// the speculative results committed or dropped, and the update phase run; what it did, for the
// engine's stats and report.
#include "update/updater.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "comm/collective.h"
#include "core/bytes.h"
#include "core/check.h"
#include "core/logging.h"

namespace tierzero {

Updater::Updater(UpdaterParts parts, UpdaterConfig config)
    : cfg_(config),
      device_(parts.device),
      store_(parts.store),
      cm_(parts.cm),
      layout_(*parts.layout),
      comm_(parts.comm),
      timeline_(*parts.timeline),
      out_(*parts.param_out),
      decays_(std::move(parts.weight_decay)) {}

StatusOr<std::unique_ptr<Updater>> Updater::Create(UpdaterParts parts, UpdaterConfig config) {
  if (parts.device == nullptr || parts.store == nullptr || parts.cm == nullptr ||
      parts.layout == nullptr || parts.comm == nullptr || parts.timeline == nullptr ||
      parts.param_out == nullptr || parts.param_out->bytes() < parts.layout->shard_bytes()) {
    return InvalidArgumentError("Updater::Create: a part is missing");
  }
  if (parts.weight_decay.size() != static_cast<size_t>(parts.layout->num_tensors())) {
    return InvalidArgumentError("Updater::Create: " + std::to_string(parts.weight_decay.size()) +
                                " weight-decay flags for " +
                                std::to_string(parts.layout->num_tensors()) + " tensors");
  }
  std::unique_ptr<Updater> u(new Updater(std::move(parts), config));
  RETURN_IF_ERROR(u->Init());
  return u;
}

// CPU AdamW with and without weight decay, the device's phase, and the chunk manager's fence.
Status Updater::Init() {
  for (int c = 0; c < layout_.num_chunks(); ++c)
    slices_.push_back(layout_.ShardSlices(c, comm_->rank()));
  AdamConfig ac = cfg_.adam;
  ac.weight_decay = 0;
  ac.adamw = true;
  CpuAdamOptions ao;
  ao.threads = cfg_.cpu_threads;
  ASSIGN_OR_RETURN(adam_plain_, CpuAdam::Create(ac, ao));
  ac.weight_decay = cfg_.weight_decay;
  ASSIGN_OR_RETURN(adam_decay_, CpuAdam::Create(ac, ao));
  if (adam_plain_->caller_cpus() > 0) {
    TZ_LOG(kInfo, kEngine) << "optimizer: CPU Adam on " << adam_plain_->threads()
                           << " threads (the calling thread is bound to "
                           << adam_plain_->caller_cpus()
                           << " CPUs, OMP_PROC_BIND or taskset: its workers run on every online "
                              "CPU; set engine.cpu_threads to choose)";
  } else {
    TZ_LOG(kInfo, kEngine) << "optimizer: CPU Adam on " << adam_plain_->threads() << " threads";
  }
  RETURN_IF_ERROR(CreatePhase());
  cm_->SetParamFence(&tail_);  // Note [The update phase behind the next forward]
  return Status::OK();
}

Updater::~Updater() { Shutdown(); }

void Updater::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  (void)Await();  // the worker joined before anything it uses goes
  cm_->SetParamFence(nullptr);
  Discard();  // the speculative worker joined before anything it reads goes
}

void Updater::NoteForward(double seconds) {
  AddSample(forward_spans_, std::max(seconds, 0.0), kSpanWindow);
}

void Updater::NoteLastBackward() {
  backward_open_ = true;
  backward_t0_ = std::chrono::steady_clock::now();
}

void Updater::EndIteration(bool keep) { EndSpeculation(keep); }

OptimizerCounters Updater::optimizer_counters() const {
  return tail_.active ? tail_.counters_at_launch : optimizer().counters();
}

// The sum of squares of every gradient over the tensors only (a shard's padding is not a
// gradient), over all ranks: a NaN or Inf makes it non-finite. Slices in chunk order, each
// slice's sum from CpuAdam's blocks, or for a gradient shard on the device from the device's
// fixed block sums (DeviceSliceSums): the same bits on every run.
// A host shard's slices may have been summed during the backward (Note [The gradient norm
// summed as the shards become final] in speculation.cc): the same sums, used once.
StatusOr<double> Updater::GradSumSquares() {
  ASSIGN_OR_RETURN(const std::vector<double> on_device, DeviceSliceSums());
  std::vector<bool> summed = std::move(spec_.summed);
  spec_.summed.clear();
  size_t k = 0;
  double sumsq = 0;
  last_summed_ahead_ = 0;
  std::vector<double> own;
  for (int c = 0; c < layout_.num_chunks(); ++c) {
    const size_t i = static_cast<size_t>(c);
    if (store_->grad_on_device(c)) {
      for (size_t j = 0; j < slices_[i].size(); ++j) sumsq += on_device[k++];
      continue;
    }
    const bool ahead = i < summed.size() && summed[i] && spec_.sums[i].size() == slices_[i].size();
    last_summed_ahead_ += ahead;
    if (!ahead) RETURN_IF_ERROR(HostSliceSums(c, own));
    for (double s : ahead ? spec_.sums[i] : own) sumsq += s;
  }
  if (world() > 1) {
    // The ranks' sums in rank order, so every rank gets the same norm bit for bit.
    ASSIGN_OR_RETURN(std::vector<double> all, AllGatherValue(*comm_, sumsq));
    sumsq = 0;
    for (double x : all) sumsq += x;
  }
  return sumsq;
}

// The sum of squares of each slice of chunk c's host gradient shard, in slice order.
Status Updater::HostSliceSums(int c, std::vector<double>& out) const {
  const DType gt = store_->grad_dtype();
  const auto* g = static_cast<const uint8_t*>(store_->grad(c));
  out.clear();
  for (const ShardSlice& sl : slices_[static_cast<size_t>(c)]) {
    ASSIGN_OR_RETURN(double s,
                     adam_plain_->SumSquares(g + DTypeBytes(gt, sl.shard_offset), gt, sl.numel));
    out.push_back(s);
  }
  return Status::OK();
}

// The sum of squares of each slice of the gradient shards kept on the device (Note [Gradient
// shards on the device] in chunk/placement.cc), in chunk and slice order: the device's block
// sums, brought over once and added in order. Their memory is the chunk cache's idle slot
// region when it is large enough (as the update phase's), else a buffer held for the call.
StatusOr<std::vector<double>> Updater::DeviceSliceSums() {
  std::vector<double> sums;
  if (!store_->any_grad_on_device()) return sums;
  constexpr int kParts = DeviceAdam::kSumParts;
  size_t n = 0;
  for (int c = 0; c < layout_.num_chunks(); ++c) {
    if (store_->grad_on_device(c)) n += slices_[static_cast<size_t>(c)].size();
  }
  const uint64_t bytes = n * kParts * sizeof(double);
  DeviceBuffer own;
  auto* parts = static_cast<double*>(cm_->idle_slot_memory());
  if (parts == nullptr || cm_->idle_slot_bytes() < bytes) {
    ASSIGN_OR_RETURN(own, DeviceBuffer::Allocate(*device_, bytes));
    parts = static_cast<double*>(own.data());
  }
  const DType gt = store_->grad_dtype();
  const StreamHandle stream = phase_.adam.handle();
  size_t k = 0;
  for (int c = 0; c < layout_.num_chunks(); ++c) {
    if (!store_->grad_on_device(c)) continue;
    const auto* g = static_cast<const uint8_t*>(store_->grad(c));
    for (const ShardSlice& sl : slices_[static_cast<size_t>(c)]) {
      RETURN_IF_ERROR(phase_.plain->SumSquaresAsync(g + DTypeBytes(gt, sl.shard_offset), gt,
                                                    sl.numel, parts + k * kParts, stream));
      ++k;
    }
  }
  std::vector<double> host(n * kParts);
  RETURN_IF_ERROR(device_->CopyAsync(host.data(), parts, bytes, CopyKind::kDeviceToHost, stream));
  RETURN_IF_ERROR(phase_.adam.Synchronize());
  RETURN_IF_ERROR(phase_.plain->TakeError());
  sums.assign(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    for (int j = 0; j < kParts; ++j) sums[i] += host[i * kParts + static_cast<size_t>(j)];
  }
  return sums;
}

StatusOr<UpdateStepOutcome> Updater::Step(const UpdateStepInputs& in) {
  RETURN_IF_ERROR(Await());
  const double start_s = in.profiled ? timeline_.Now() : 0.0;
  ASSIGN_OR_RETURN(const double sumsq, GradSumSquares());
  UpdateStepOutcome r;
  const bool finite = std::isfinite(sumsq);
  r.grad_norm = finite ? std::sqrt(sumsq) * in.grad_scale : std::numeric_limits<double>::infinity();
  double clip = 1.0;
  if (finite && in.clip_grad_norm > 0 && r.grad_norm > in.clip_grad_norm)
    clip = in.clip_grad_norm / (r.grad_norm + 1e-6);
  // The speculative updates are this step's own only when nothing differs from what they
  // assumed (Note [The speculative start]).
  const bool same_options = spec_.so.lr == in.lr;  // what the updates used
  ASSIGN_OR_RETURN(phase_.skip, CommitSpeculation(finite && clip == 1.0 && same_options));
  spec_.last_clean = finite && clip == 1.0;
  if (!finite) return r;
  AdamStepOptions so;
  so.step = in.step;
  so.lr = in.lr;
  so.grad_scale = static_cast<float>(in.grad_scale * clip);
  if (in.profiled) {
    timeline_.Add({Track::kOptimizer, "gradient norm", start_s, timeline_.Now() - start_s});
  }
  RETURN_IF_ERROR(RunPhase(so, in.profiled));
  // (Behind the next forward, the gradient shards are cleared as their groups finish.)
  if (cfg_.grad_accumulation > 1 && !tail_.active) RETURN_IF_ERROR(cm_->ZeroGrads());
  r.applied = true;
  return r;
}

// AdamW on one optimizer group, and its new parameters written to the chunk's parameter shard.
Status Updater::AdamGroup(const OptimizerGroup& g, const AdamStepOptions& so, bool prof) {
  const int c = g.chunk;
  const double chunk_start_s = prof ? timeline_.Now() : 0.0;
  AdamStepOptions chunk_so = so;
  if (prof) {
    chunk_so.observer = &timeline_;
    chunk_so.chunk = c;
  }
  // Added when the chunk's update ends, on every path out of this function.
  struct SpanAtExit {
    Updater* u;
    bool on;
    double start;
    int chunk;
    ~SpanAtExit() {
      if (on) {
        u->timeline_.Add({Track::kOptimizer, "Adam chunk " + std::to_string(chunk), start,
                          u->timeline_.Now() - start, -1, chunk, u->optimizer().group_bytes()});
      }
    }
  } span{this, prof, chunk_start_s, c};
  void* host = store_->host_param(c);
  auto* out = static_cast<uint8_t*>(host != nullptr ? host : out_.data());
  if (host == nullptr) std::memset(out, 0, out_.bytes());  // zero padding
  RETURN_IF_ERROR(AdamInto(g, out, chunk_so));
  if (host == nullptr) RETURN_IF_ERROR(store_->WriteParam(c, out));
  if (store_->param_tier(c) == Tier::kDevice) moved_h2d_ += layout_.shard_bytes();
  return Status::OK();
}

// Note [8-bit blocks per slice]
// CpuAdam runs once per slice (a tensor's part of the shard: its weight decay is its own), and an
// 8-bit block's scale is computed from the block's own new moments, so a block must not straddle
// two slices: each slice's blocks start at its own first element. Slice s of a chunk (in offset
// order) takes the scales from floor(offset / 64) + s on: its ceil(numel / 64) blocks end before
// the next slice's first, since floor(offset / 64) + ceil(numel / 64) <= floor((offset + numel)
// / 64) + 1. A group therefore holds ceil(shard_elems / 64) + (the most slices a chunk has)
// scales per moment (OptimizerGroupLayout). The stochastic rounding's key is the element's place
// among every rank's parameters (chunk, rank, offset), the same on a resumed run.
AdamBuffers Updater::SliceBuffers(const OptimizerGroup& g, size_t s, const uint8_t* grad,
                                  uint8_t* out) const {
  const DType gt = store_->grad_dtype();
  const DType dt = cfg_.compute_dtype;
  const ShardSlice& sl = slices_[static_cast<size_t>(g.chunk)][s];
  AdamBuffers b;
  b.master = g.master + sl.shard_offset;
  b.states = g.format;
  if (g.format == StateFormat::kF32) {
    b.m = g.m + sl.shard_offset;
    b.v = g.v + sl.shard_offset;
  } else {
    const uint64_t w = MomentWidth(g.format);
    b.m_state = static_cast<uint8_t*>(g.m_state) + w * sl.shard_offset;
    b.v_state = static_cast<uint8_t*>(g.v_state) + w * sl.shard_offset;
    if (g.format == StateFormat::kInt8) {
      const uint64_t first = sl.shard_offset / kStateBlockElems + s;
      b.m_scale = g.m_scale + first;
      b.v_scale = g.v_scale + first;
    }
    const uint64_t key0 = static_cast<uint64_t>(g.chunk) * layout_.chunk_elems() +
                          static_cast<uint64_t>(comm_->rank()) * layout_.shard_elems();
    b.rounding_key = static_cast<uint32_t>(key0 + sl.shard_offset);
  }
  b.grad = grad + DTypeBytes(gt, sl.shard_offset);
  b.grad_dtype = gt;
  b.n = sl.numel;
  if (dt != DType::kF32) {
    b.out = out + DTypeBytes(dt, sl.shard_offset);
    b.out_dtype = dt;
  }
  return b;
}

Status Updater::AdamInto(const OptimizerGroup& g, uint8_t* out, const AdamStepOptions& so) {
  const auto* grad = static_cast<const uint8_t*>(store_->grad(g.chunk));
  const int fetched = fetch_.held[0] == g.chunk ? 0 : fetch_.held[1] == g.chunk ? 1 : -1;
  if (fetched >= 0 && store_->grad_on_device(g.chunk)) {
    // Fetched ahead (Note [A CPU group's device gradient fetched ahead]).
    RETURN_IF_ERROR(fetch_.done[static_cast<size_t>(fetched)].Synchronize());
    grad = static_cast<const uint8_t*>(fetch_.slots[static_cast<size_t>(fetched)].data());
    ++fetch_.groups;
  } else if (store_->grad_on_device(g.chunk)) {
    // A device group updated on the CPU (its states come through OptimizerStates' bounce
    // buffer): its gradient shard comes over too, never read where it is.
    if (!grad_bounce_) {
      ASSIGN_OR_RETURN(grad_bounce_arena_, PinnedArena::Create(device_, store_->grad_bytes(), 1,
                                                               PinnedArena::Pinning::kBestEffort));
      std::optional<PinnedSlot> slot = grad_bounce_arena_->TryAcquire();
      if (!slot) return InternalError("the gradient bounce buffer's one slot is taken");
      grad_bounce_.emplace(std::move(*slot));
    }
    RETURN_IF_ERROR(store_->ReadGradShard(g.chunk, grad_bounce_->data()));
    moved_d2h_ += store_->grad_bytes();
    grad = static_cast<const uint8_t*>(grad_bounce_->data());
  }
  const std::vector<ShardSlice>& slices = slices_[static_cast<size_t>(g.chunk)];
  for (size_t s = 0; s < slices.size(); ++s) {
    const AdamBuffers b = SliceBuffers(g, s, grad, out);
    const ShardSlice& sl = slices[s];
    CpuAdam& adam = decays_[static_cast<size_t>(sl.tensor)] ? *adam_decay_ : *adam_plain_;
    ASSIGN_OR_RETURN(bool applied, adam.Step(b, so));
    TZ_CHECK(applied) << "Adam skipped a step that was checked finite";
    if (cfg_.compute_dtype == DType::kF32)
      std::memcpy(out + sl.shard_offset * 4, b.master, sl.numel * 4);
  }
  return Status::OK();
}

void Updater::Snapshot(ReportSnapshot::Update& u) const {
  const UpdateAssignment& p = phase_.assignment;
  if (!phase_.measured || p.where.size() != static_cast<size_t>(layout_.num_chunks())) return;
  u.available = true;
  u.mode = cfg_.placement == OptimizerPlacement::kCpu        ? "cpu"
           : cfg_.placement == OptimizerPlacement::kFraction ? "device fraction"
                                                             : "auto";
  u.reason = p.reason;
  for (UpdateWhere w : p.where) u.where.emplace_back(UpdateWhereName(w));
  u.predicted_end_s = p.group_end_s;
  u.measured_end_s = phase_.measured_end_s;
  u.predicted_s = p.phase_s;
  u.predicted_cpu_s = p.cpu_s;
  u.predicted_device_s = p.device_s;
  u.measured_s = phase_.measured_s;
  std::vector<double> all = phase_.phase_s;
  std::sort(all.begin(), all.end());
  u.phases = static_cast<int64_t>(all.size());
  u.measured_median_s = all.empty() ? 0.0 : all[all.size() / 2];
  u.slots = p.slots;
  u.slot_bytes = p.slot_bytes;
  const UpdateRates& r = phase_.rates;
  u.cpu_params_per_s = r.cpu_params_per_s;
  u.device_params_per_s = r.device_params_per_s;
  u.h2d_bytes_per_s = r.h2d_bytes_per_s;
  u.d2h_bytes_per_s = r.d2h_bytes_per_s;
  u.nvme_read_bytes_per_s = r.nvme_read_bytes_per_s;
  u.nvme_write_bytes_per_s = r.nvme_write_bytes_per_s;
  u.nvme_duplex_bytes_per_s = r.nvme_duplex_bytes_per_s;
  u.cpu_params_per_s_streaming = r.cpu_params_per_s_streaming;
  u.host_clear_bytes_per_s = r.host_clear_bytes_per_s;
  u.pcie_duplex_bytes_per_s = r.pcie_duplex_bytes_per_s;
  u.link_slowdown_beside_cpu = r.link_slowdown_beside_cpu;
  u.device_rate_modelled = cfg_.host_device_adam_rate > 0;
  u.moments = std::string(StateFormatName(cfg_.states));
  u.speculative = cfg_.speculative_step == SpeculativeStep::kAuto ? "auto"
                  : cfg_.speculative_step == SpeculativeStep::kOn ? "on"
                                                                  : "off";
  u.speculative_steps = stats_.speculative_steps;
  u.speculative_rollbacks = stats_.speculative_rollbacks;
  u.device_shares_cpu = r.device_shares_cpu;
}

}  // namespace tierzero
