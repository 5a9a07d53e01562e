// The engine behind include/tierzero/engine.h: parameters registered by the trainer, chunked and
// placed (src/chunk), optimizer states in host memory or on NVMe, CPU AdamW (src/cpu_adam), and
// checkpoints (checkpoint.cc).
#include "tierzero/engine.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>

#include "chunk/chunk_manager.h"
#include "core/bytes.h"
#include "core/check.h"
#include "core/convert.h"
#include "core/logging.h"
#include "cpu_adam/cpu_adam.h"
#include "engine/engine_impl.h"
#include "offload/cuda_device.h"
#include "offload/host_sim_device.h"
#include "offload/swapper.h"
#include "zero/collective.h"
#include "zero/device_collectives.h"
#include "zero/nccl.h"

namespace tierzero {

// ---- Initializers
// ------------------------------------------------------------------

namespace {
uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
double Unit(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53; }
}  // namespace

Initializer InitNormal(float stddev, uint64_t seed) {
  return [stddev, seed](std::span<float> values) {
    // Box-Muller on pairs: elements 2j and 2j+1 share the uniform pair of counter j. Pairs are
    // independent, so fixed blocks of them run in parallel (a 2B-parameter model draws 2B
    // values at initialisation).
    const uint64_t key = SplitMix64(seed);
    const size_t n = values.size(), pairs = (n + 1) / 2;
    constexpr size_t kPairsPerBlock = size_t{1} << 15;
    tbb::parallel_for(size_t{0}, (pairs + kPairsPerBlock - 1) / kPairsPerBlock, [&](size_t blk) {
      const size_t end = std::min(pairs, (blk + 1) * kPairsPerBlock);
      for (size_t j = blk * kPairsPerBlock; j < end; ++j) {
        const double u1 = Unit(SplitMix64(key ^ (2 * j)));
        const double u2 = Unit(SplitMix64(key ^ (2 * j + 1) ^ 0xA5A5A5A5A5A5A5A5ull));
        const double r = std::sqrt(-2.0 * std::log(u1));
        const double angle = 2.0 * 3.14159265358979323846 * u2;
        values[2 * j] = static_cast<float>(stddev * r * std::cos(angle));
        if (2 * j + 1 < n) values[2 * j + 1] = static_cast<float>(stddev * r * std::sin(angle));
      }
    });
  };
}

Status CastElements(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  return Convert(src, src_type, dst, dst_type, n);
}

Initializer InitConstant(float value) {
  return [value](std::span<float> values) { std::fill(values.begin(), values.end(), value); };
}

// ---- Activation buffers
// -------------------------------------------------------------------------

ActivationBuffer::ActivationBuffer(ActivationBuffer&& o) noexcept
    : owner_(o.owner_), data_(o.data_), bytes_(o.bytes_) {
  o.owner_ = nullptr;
  o.data_ = nullptr;
  o.bytes_ = 0;
}

ActivationBuffer& ActivationBuffer::operator=(ActivationBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    owner_ = o.owner_;
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.owner_ = nullptr;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

ActivationBuffer::~ActivationBuffer() { Reset(); }

void ActivationBuffer::Reset() {
  if (owner_ != nullptr && data_ != nullptr) owner_->FreeActivation(data_, bytes_);
  owner_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

// ---- Scopes
// -------------------------------------------------------------------------------------

ParamScope::ParamScope(ParamScope&& o) noexcept
    : engine_(o.engine_), params_(std::move(o.params_)), phase_(o.phase_) {
  o.engine_ = nullptr;
}

ParamScope::~ParamScope() {
  Status s = Release();
  if (!s.ok()) TZ_LOG(kError, kEngine) << "releasing a parameter scope: " << s.ToString();
}

void* ParamScope::data(ParamId p) const {
  if (engine_ == nullptr || std::find(params_.begin(), params_.end(), p) == params_.end())
    return nullptr;
  return engine_->ScopeData(p);
}

void* ParamScope::grad(ParamId p) const {
  if (engine_ == nullptr || phase_ != Phase::kBackward ||
      std::find(params_.begin(), params_.end(), p) == params_.end())
    return nullptr;
  return engine_->ScopeGrad(p);
}

Status ParamScope::Release() {
  if (engine_ == nullptr) return Status::OK();
  Engine* e = engine_;
  engine_ = nullptr;
  return e->ScopeRelease(params_, phase_);
}

// ---- Host compute gate
// --------------------------------------------------------------------------

// Note [Host compute on the simulated device]
// On HostSim the trainer computes on the CPU, on its own thread, so the compute stream has
// nothing queued and its events would say every moment took no time: the plan would be made
// blind, and stalls measured on the stream would be the gathers' whole duration. Instead, after
// each Acquire and Release the engine queues a gate on the compute stream, a host function that
// blocks until the trainer's next call into the engine. The stream then is busy exactly while
// the trainer computes, so the chunk manager's events time each moment's compute and each
// moment's wait as they would on a GPU, and prefetches are issued against real compute times.
// Acquire returns once the stream has reached its gate, i.e. once its gathers are complete. The
// gate is opened before every call into the chunk manager (which may synchronise on the stream).
void Engine::Impl::OpenGate() {
  if (!gate) return;
  {
    std::lock_guard<std::mutex> lock(gate->mu);
    gate->opened = true;
  }
  gate->cv.notify_all();
  gate.reset();
}

Status Engine::Impl::PushGate(bool wait_entered) {
  if (!host_compute) return Status::OK();
  auto g = std::make_shared<Gate>();
  RETURN_IF_ERROR(device->LaunchHostFunc(compute.handle(), [g] {
    std::unique_lock<std::mutex> lock(g->mu);
    g->entered = true;
    g->cv.notify_all();
    g->cv.wait(lock, [&] { return g->opened; });
  }));
  gate = g;
  if (wait_entered) {
    std::unique_lock<std::mutex> lock(g->mu);
    g->cv.wait(lock, [&] { return g->entered; });
  }
  return Status::OK();
}

// ---- Engine
// -------------------------------------------------------------------------------------

Engine::Engine() : impl_(std::make_unique<Impl>()) {}

Engine::~Engine() {
  if (impl_ && impl_->device) {
    impl_->OpenGate();
    // Collectives first: Drain ends them by the deadline (NCCL's would spin forever on a
    // peer that died), so the device's streams can finish.
    if (impl_->device_comm) (void)impl_->device_comm->Drain();
    (void)impl_->device->Synchronize();
  }
}

Status ValidateEngineConfig(const EngineConfig& c) {
  auto bad = [](std::string_view field, const std::string& value, std::string_view range) {
    return InvalidArgumentError("config field '" + std::string(field) + "' is " + value +
                                "; accepted: " + std::string(range));
  };
  if (c.device_budget < (uint64_t{1} << 20))
    return bad("device_budget", FormatBytes(c.device_budget), "at least 1 MiB");
  if (c.host_budget < (uint64_t{1} << 20))
    return bad("host_budget", FormatBytes(c.host_budget), "at least 1 MiB");
  if (c.nvme_budget > 0 && c.nvme_path.empty())
    return bad("nvme_path", "empty", "a directory for the swap files when nvme_budget > 0");
  if (!IsFloatType(c.compute_dtype))
    return bad("compute_dtype", std::string(DTypeName(c.compute_dtype)), "bf16, fp16 or fp32");
  if (!(c.beta1 >= 0 && c.beta1 < 1)) return bad("beta1", std::to_string(c.beta1), "[0, 1)");
  if (!(c.beta2 >= 0 && c.beta2 < 1)) return bad("beta2", std::to_string(c.beta2), "[0, 1)");
  if (!(c.eps > 0 && std::isfinite(c.eps))) return bad("eps", std::to_string(c.eps), "(0, inf)");
  if (!(c.weight_decay >= 0 && std::isfinite(c.weight_decay)))
    return bad("weight_decay", std::to_string(c.weight_decay), "[0, inf)");
  if (!(c.clip_grad_norm >= 0 && std::isfinite(c.clip_grad_norm)))
    return bad("clip_grad_norm", std::to_string(c.clip_grad_norm), "0 (off) or a positive norm");
  if (c.grad_accumulation < 1 || c.grad_accumulation > 4096)
    return bad("grad_accumulation", std::to_string(c.grad_accumulation), "1..4096");
  if (!(c.initial_loss_scale >= 1 && std::isfinite(c.initial_loss_scale)))
    return bad("initial_loss_scale", std::to_string(c.initial_loss_scale), "[1, inf)");
  if (c.loss_scale_window < 1)
    return bad("loss_scale_window", std::to_string(c.loss_scale_window), "at least 1");
  if (c.cpu_threads < 0)
    return bad("cpu_threads", std::to_string(c.cpu_threads), "0 (all) or more");
  if (!(c.host_link_bandwidth >= 0))
    return bad("host_link_bandwidth", std::to_string(c.host_link_bandwidth),
               "0 (unthrottled) or more");
  return Status::OK();
}

StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineConfig& config,
                                                 std::shared_ptr<Communicator> comm) {
  RETURN_IF_ERROR(ValidateEngineConfig(config));
  if (!comm) comm = Communicator::Single();
  if (config.device == DeviceChoice::kCuda && CudaDeviceCount() == 0) {
    return UnavailableError(
        "device 'cuda' was asked for but no usable GPU was found; use device 'host' (or 'auto') "
        "to train on the simulated device");
  }
  std::unique_ptr<Engine> e(new Engine());
  e->impl_->cfg = config;
  e->impl_->comm = std::move(comm);
  e->impl_->loss_scale = config.compute_dtype == DType::kF16 ? config.initial_loss_scale : 1.0f;
  return e;
}

StatusOr<ParamId> Engine::RegisterParam(ParamSpec spec) {
  Impl& im = *impl_;
  if (im.finalized) return FailedPreconditionError("RegisterParam after Finalize");
  if (spec.name.empty()) return InvalidArgumentError("a parameter needs a name");
  if (im.by_name.count(spec.name) > 0)
    return InvalidArgumentError("parameter '" + spec.name + "' is registered twice");
  if (spec.shape.empty())
    return InvalidArgumentError("parameter '" + spec.name + "' has an empty shape");
  int64_t n = 1;
  for (int64_t d : spec.shape) {
    if (d < 1)
      return InvalidArgumentError("parameter '" + spec.name + "' has a dimension " +
                                  std::to_string(d) + " (every dimension must be >= 1)");
    if (n > (int64_t{1} << 40) / d)
      return InvalidArgumentError("parameter '" + spec.name + "' is too large");
    n *= d;
  }
  const ParamId id = static_cast<ParamId>(im.params.size());
  im.by_name[spec.name] = id;
  im.params.push_back(std::move(spec));
  im.numel.push_back(n);
  return id;
}

StatusOr<ActivationBuffer> Engine::AllocateActivation(uint64_t bytes) {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("activations are allocated after Finalize");
  if (bytes == 0) return ActivationBuffer();
  auto p = im.device->Allocate(bytes);
  if (!p.ok()) {
    return std::move(p).status().WithContext(
        "allocating " + FormatBytes(bytes) + " of activations with " + FormatBytes(im.act_current) +
        " already in use; lower the batch size or sequence length, turn on activation "
        "checkpointing, or raise device_budget");
  }
  im.act_current += bytes;
  im.act_peak = std::max(im.act_peak, im.act_current);
  im.cm->OnNonModelBytes(im.act_current);
  return ActivationBuffer(&im, *p, bytes);
}

void Engine::Impl::FreeActivation(void* p, uint64_t bytes) {
  device->Free(p);
  act_current -= bytes;
  if (cm) cm->OnNonModelBytes(act_current);
}

uint64_t Engine::activation_bytes() const { return impl_->act_current; }
bool Engine::host_compute() const { return impl_->host_compute; }
void* Engine::compute_stream() const {
  return impl_->host_compute ? nullptr : impl_->compute.handle().impl;
}
DType Engine::compute_dtype() const { return impl_->cfg.compute_dtype; }
float Engine::loss_scale() const { return impl_->loss_scale; }
const EngineConfig& Engine::config() const { return impl_->cfg; }
int Engine::num_params() const { return static_cast<int>(impl_->params.size()); }
const ParamSpec& Engine::param(ParamId p) const { return impl_->params[static_cast<size_t>(p)]; }
int64_t Engine::numel(ParamId p) const { return impl_->numel[static_cast<size_t>(p)]; }
int64_t Engine::step() const { return impl_->step; }

// ---- Finalize
// -----------------------------------------------------------------------------------

Status Engine::Finalize() {
  Impl& im = *impl_;
  if (im.finalized) return FailedPreconditionError("Finalize called twice");
  if (im.params.empty()) return FailedPreconditionError("Finalize with no parameters registered");
  const EngineConfig& cfg = im.cfg;

  std::vector<TensorDesc> tensors;
  for (size_t i = 0; i < im.params.size(); ++i)
    tensors.push_back({im.params[i].name, static_cast<uint64_t>(im.numel[i])});
  LayoutOptions lo;
  lo.chunk_elems = cfg.chunk_elems;
  lo.world_size = im.comm->size();
  lo.dtype = cfg.compute_dtype;
  auto layout = ChunkLayout::Build(tensors, lo);
  if (!layout.ok()) return std::move(layout).status().WithContext("laying out the parameters");
  im.layout = std::move(layout).value();
  for (int c = 0; c < im.layout.num_chunks(); ++c)
    im.slices.push_back(im.layout.ShardSlices(c, im.comm->rank()));
  const uint64_t chunk_bytes = im.layout.chunk_bytes();
  const uint64_t shard_bytes = im.layout.shard_bytes();
  const uint64_t shard_elems = im.layout.shard_elems();
  const uint64_t optim_bytes = shard_elems * 12;
  const bool cuda = cfg.device == DeviceChoice::kCuda ||
                    (cfg.device == DeviceChoice::kAuto && CudaDeviceCount() > 0);

  // Where the ranks' collectives run. Every rank must take the same path (the device path
  // duplicates the communicator, a collective call), so they agree on it.
  bool on_device = false;
  if (im.world() > 1) {
    // NCCL wants a GPU per rank of a node.
    // The simulated device's stream runs MPI on its own thread: the communicator must progress
    // on its own (asynchronous()).
    const bool nccl =
        cuda && NcclLoadable().ok() && CudaDeviceCount() >= im.comm->topology().local_size;
    on_device =
        cfg.collectives == CollectivePath::kDevice ||
        (cfg.collectives == CollectivePath::kAuto && (cuda ? nccl : im.comm->asynchronous()));
    ASSIGN_OR_RETURN(std::vector<int32_t> all,
                     zero::AllGatherValue(*im.comm, static_cast<int32_t>(on_device)));
    const bool everywhere = std::all_of(all.begin(), all.end(), [](int32_t v) { return v != 0; });
    if (on_device && !everywhere) {
      TZ_LOG(kWarn, kEngine) << "NCCL cannot load, or a node has fewer GPUs than ranks: gathers "
                                "and reductions go through host buffers (ranks.collectives: "
                                "host)";
    }
    on_device = everywhere;
  }

  // Fixed host overheads (Note [Host memory accounting] in docs/config.md): NVMe staging for
  // parameter reads, the optimizer's swap buffers, and one upload buffer.
  // (With W > 1 staging slots hold a whole gathered chunk.)
  im.staging_bytes =
      std::max<uint64_t>(2 * chunk_bytes, std::min<uint64_t>(8 * chunk_bytes, 64u << 20));
  im.swap_slot_bytes = AlignUp(optim_bytes, kNvmeAlignment);
  const uint64_t fixed =
      im.staging_bytes + 3 * im.swap_slot_bytes + AlignUp(shard_bytes, kNvmeAlignment) +
      (im.world() > 1 && !on_device ? 4 * AlignUp(chunk_bytes + shard_bytes, kNvmeAlignment) : 0);
  if (cfg.host_budget <= fixed) {
    return OutOfMemoryError("host_budget " + FormatBytes(cfg.host_budget) +
                            " does not cover the fixed buffers for chunks of " +
                            FormatBytes(chunk_bytes) + " (" + FormatBytes(fixed) +
                            "); raise host_budget or lower chunk_elems");
  }
  TierBudgets budgets{cfg.device_shard_budget, cfg.host_budget - fixed, cfg.nvme_budget};
  auto placement = PlaceShards(im.layout, budgets);
  if (!placement.ok()) return std::move(placement).status().WithContext("placing the shards");
  im.placement = std::move(placement).value();
  im.budgets = budgets;

  // The device, its compute stream and the NVMe tier. With several ranks they agree on the
  // outcome: what follows starts collectives (MPI_Comm_dup, NCCL's setup) that a rank which
  // failed here would never join.
  Status local = [&]() -> Status {
    const uint64_t margin = 4 * chunk_bytes + (uint64_t{1} << 20);
    if (cuda) {
      CudaDeviceOptions o;
      // A GPU per rank of a node (NCCL refuses two ranks on one device).
      o.ordinal = im.comm->topology().local_rank % std::max(1, CudaDeviceCount());
      o.capacity_bytes = cfg.device_budget + cfg.device_shard_budget + margin;
      ASSIGN_OR_RETURN(im.device, CreateCudaDevice(o));
    } else {
      HostSimOptions o;
      o.capacity_bytes = cfg.device_budget + cfg.device_shard_budget + margin;
      o.h2d_bytes_per_second = cfg.host_link_bandwidth;
      o.d2h_bytes_per_second = cfg.host_link_bandwidth;
      ASSIGN_OR_RETURN(im.device, CreateHostSimDevice(o));
      im.host_compute = true;
    }
    ASSIGN_OR_RETURN(im.compute, Stream::Create(*im.device, "compute"));

    if (im.placement.bytes[static_cast<int>(Tier::kNvme)] > 0) {
      NvmeStoreOptions no;
      no.paths = {cfg.nvme_path};
      no.bytes_per_path = cfg.nvme_budget;
      auto store = NvmeStore::Open(no);
      if (!store.ok()) {
        return std::move(store).status().WithContext(
            "opening the NVMe tier under '" + cfg.nvme_path +
            "' (check the directory exists, is writable and has nvme_budget free)");
      }
      im.nvme = std::move(store).value();
    }
    return Status::OK();
  }();
  if (im.world() > 1) local = zero::AgreeOnStatus(*im.comm, local);
  RETURN_IF_ERROR(local);

  ChunkManagerOptions co;
  co.device_budget_bytes = cfg.device_budget;
  co.grad_accumulation = cfg.grad_accumulation > 1;
  co.staging_bytes = im.staging_bytes;
  if (im.world() > 1) co.comm = im.comm.get();
  if (on_device) {
    auto dc = CreateDeviceCollectives(*im.device, im.comm);
    if (!dc.ok()) {
      return std::move(dc).status().WithContext(
          "starting the collectives on the device (ranks.collectives: host avoids them)");
    }
    im.device_comm = std::move(dc).value();
    co.device_comm = im.device_comm.get();
  }
  if (cfg.host_link_bandwidth > 0) co.h2d_bytes_per_second = cfg.host_link_bandwidth;
  auto cm = ChunkManager::Create(*im.device, im.compute.handle(), im.nvme.get(), im.layout,
                                 im.placement, co);
  if (!cm.ok()) return std::move(cm).status().WithContext("creating the chunk manager");
  im.cm = std::move(cm).value();
  im.cm->ProfileNextIteration(&im.timeline);  // the first planned iteration

  // Optimizer states and the buffers of the step.
  AdamConfig ac;
  ac.beta1 = cfg.beta1;
  ac.beta2 = cfg.beta2;
  ac.eps = cfg.eps;
  ac.adamw = true;
  CpuAdamOptions ao;
  ao.threads = cfg.cpu_threads;
  ASSIGN_OR_RETURN(im.adam_plain, CpuAdam::Create(ac, ao));
  ac.weight_decay = cfg.weight_decay;
  ASSIGN_OR_RETURN(im.adam_decay, CpuAdam::Create(ac, ao));

  const int nc = im.layout.num_chunks();
  im.optim.resize(static_cast<size_t>(nc));
  int host_optim = 0;
  for (int c = 0; c < nc; ++c)
    host_optim += im.placement.chunks[static_cast<size_t>(c)].optimizer != Tier::kNvme;
  if (host_optim > 0) {
    im.optim_host = AlignedBuffer::Allocate(static_cast<uint64_t>(host_optim) * optim_bytes);
    if (im.optim_host.data() == nullptr)
      return OutOfMemoryError("optimizer states: " + FormatBytes(host_optim * optim_bytes));
  }
  bool any_nvme_optim = false;
  int h = 0;
  for (int c = 0; c < nc; ++c) {
    Impl::OptimShard& o = im.optim[static_cast<size_t>(c)];
    if (im.placement.chunks[static_cast<size_t>(c)].optimizer == Tier::kNvme) {
      ASSIGN_OR_RETURN(o.extent, im.nvme->Allocate(optim_bytes));
      o.on_nvme = true;
      any_nvme_optim = true;
    } else {
      o.host = reinterpret_cast<float*>(im.optim_host.data()) +
               static_cast<uint64_t>(h++) * 3 * shard_elems;
    }
  }
  if (any_nvme_optim) {
    ASSIGN_OR_RETURN(im.swap_arena, PinnedArena::Create(nullptr, im.swap_slot_bytes, 3));
    Status reg = im.nvme->RegisterBuffers({{im.swap_arena->base(), im.swap_arena->total_bytes()}});
    if (!reg.ok())
      TZ_LOG(kWarn, kEngine) << "optimizer swap buffers not registered: " << reg.ToString();
  }
  im.upload = AlignedBuffer::Allocate(AlignUp(shard_bytes, kNvmeAlignment));
  std::memset(im.upload.data(), 0, im.upload.bytes());  // padding stays zero
  im.finalized = true;

  // Initial values, chunk by chunk (NVMe-resident state is never held whole in memory).
  return im.InitOptimChunks([&](int c, float* master, float* m, float* v) -> Status {
    std::memset(master, 0, shard_elems * 4);
    std::memset(m, 0, shard_elems * 4);
    std::memset(v, 0, shard_elems * 4);
    std::vector<float> whole;
    for (const ShardSlice& sl : im.slices[static_cast<size_t>(c)]) {
      const ParamSpec& ps = im.params[static_cast<size_t>(sl.tensor)];
      if (!ps.init) continue;
      const uint64_t numel = im.layout.tensor(sl.tensor).numel;
      if (sl.numel == numel) {
        ps.init(std::span<float>(master + sl.shard_offset, sl.numel));
        continue;
      }
      // A tensor split between ranks: its initial values are a function of the whole tensor.
      whole.resize(numel);
      ps.init(whole);
      std::memcpy(master + sl.shard_offset, whole.data() + sl.tensor_begin, sl.numel * 4);
    }
    return im.UploadChunk(c, master);
  });
}

// Like ForEachOptimChunk, without reading first (the states have no contents yet).
Status Engine::Impl::InitOptimChunks(const std::function<Status(int, float*, float*, float*)>& fn) {
  const uint64_t n = layout.shard_elems();
  // NVMe chunks are written behind: while one slot's write is in flight the next chunk is
  // filled in another (a 2B-parameter model writes 24 GB here). Every write is waited for before
  // returning, also on error (Ticket's destructor blocks until its I/O is done).
  struct InFlight {
    PinnedSlot slot;
    NvmeStore::Ticket ticket;
  };
  std::deque<InFlight> writes;
  auto retire_oldest = [&]() -> Status {
    Status s = writes.front().ticket.Wait();
    writes.pop_front();
    return s;
  };
  // (No swap arena without NVMe chunks.)
  const size_t max_in_flight = swap_arena ? std::max<size_t>(1, swap_arena->num_slots() - 1) : 1;
  for (int c = 0; c < layout.num_chunks(); ++c) {
    OptimShard& o = optim[static_cast<size_t>(c)];
    if (!o.on_nvme) {
      RETURN_IF_ERROR(fn(c, o.host, o.host + n, o.host + 2 * n));
      continue;
    }
    if (writes.size() >= max_in_flight) RETURN_IF_ERROR(retire_oldest());
    ASSIGN_OR_RETURN(PinnedSlot slot, swap_arena->Acquire(std::chrono::seconds(60)));
    auto* f = static_cast<float*>(slot.data());
    RETURN_IF_ERROR(fn(c, f, f + n, f + 2 * n));
    ASSIGN_OR_RETURN(NvmeStore::Ticket ticket, nvme->SubmitWrite(o.extent, slot.data()));
    writes.push_back({std::move(slot), std::move(ticket)});
    stats.nvme_write_bytes += n * 12;
  }
  while (!writes.empty()) RETURN_IF_ERROR(retire_oldest());
  TZ_LOG(kInfo, kEngine) << params.size() << " parameters initialised";
  return Status::OK();
}

// Runs fn(chunk, master, m, v) over every chunk's optimizer state wherever it lives; NVMe
// chunks stream through the swap pipeline (written back when write_back).
Status Engine::Impl::ForEachOptimChunk(const std::function<Status(int, float*, float*, float*)>& fn,
                                       bool write_back) {
  const uint64_t n = layout.shard_elems();
  std::vector<int> on_nvme;
  std::vector<NvmeExtent> extents;
  for (int c = 0; c < layout.num_chunks(); ++c) {
    OptimShard& o = optim[static_cast<size_t>(c)];
    if (o.on_nvme) {
      on_nvme.push_back(c);
      extents.push_back(o.extent);
      continue;
    }
    RETURN_IF_ERROR(fn(c, o.host, o.host + n, o.host + 2 * n));
  }
  if (on_nvme.empty()) return Status::OK();
  SwapOptions so;
  so.write_back = write_back;
  const auto t0 = std::chrono::steady_clock::now();
  Status s = RunSwapPipeline(
      *nvme, extents, *swap_arena,
      [&](size_t i, void* data) -> Status {
        auto* f = static_cast<float*>(data);
        return fn(on_nvme[i], f, f + n, f + 2 * n);
      },
      so);
  stats.optimizer_nvme_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const uint64_t bytes = extents.size() * n * 12;
  stats.nvme_read_bytes += bytes;
  if (write_back) stats.nvme_write_bytes += bytes;
  return s;
}

// Writes the compute-dtype copy of a chunk's master weights into its parameter shard.
Status Engine::Impl::UploadChunk(int c, const float* master) {
  const DType dt = cfg.compute_dtype;
  void* host = cm->HostParamShard(c);
  void* dst = host;
  if (dst == nullptr) {
    dst = upload.data();
    std::memset(dst, 0, upload.bytes());  // the padding of the shard stays zero
  }
  for (const ShardSlice& sl : slices[static_cast<size_t>(c)]) {
    RETURN_IF_ERROR(Convert(master + sl.shard_offset, DType::kF32,
                            static_cast<uint8_t*>(dst) + DTypeBytes(dt, sl.shard_offset), dt,
                            sl.numel));
  }
  if (host == nullptr) RETURN_IF_ERROR(cm->WriteParamShard(c, dst));
  return Status::OK();
}

Status Engine::Impl::GatherChunkMaster(int c, std::vector<float>& full) {
  const uint64_t n = layout.shard_elems();
  full.assign(layout.chunk_elems(), 0.0f);
  std::vector<float> mine(n, 0.0f);
  // A rank that cannot read its shard still joins the all_gather (with zeros), and the ranks
  // agree on the outcome, so none waits for it or keeps a chunk with zeros in it
  // (Note [Agreeing on an outcome]).
  Status read = WithChunkState(c, /*write_back=*/false, [&](float* master, float*, float*) {
    std::memcpy(mine.data(), master, n * 4);
    return Status::OK();
  });
  ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req,
                   comm->AllGather(mine.data(), full.data(), n, DType::kF32));
  RETURN_IF_ERROR(req->Wait());
  return zero::AgreeOnStatus(*comm, read);
}

// ---- Iterations
// ---------------------------------------------------------------------------------

Status Engine::BeginIteration(bool train) {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("BeginIteration before Finalize");
  if (im.in_iteration) return FailedPreconditionError("BeginIteration inside an iteration");
  if (train && im.iterations_since_step >= im.cfg.grad_accumulation) {
    return FailedPreconditionError("a training iteration after " +
                                   std::to_string(im.iterations_since_step) +
                                   " micro-batches without Step (grad_accumulation is " +
                                   std::to_string(im.cfg.grad_accumulation) + ")");
  }
  im.OpenGate();
  RETURN_IF_ERROR(im.cm->BeginIteration(/*inference=*/!train));
  im.in_iteration = true;
  im.iteration_train = train;
  ++im.iterations;
  if (im.cm->profiling()) im.moment_times.clear();
  return Status::OK();
}

StatusOr<ParamScope> Engine::Acquire(std::span<const ParamId> params, Phase phase) {
  Impl& im = *impl_;
  if (!im.in_iteration) RETURN_IF_ERROR(BeginIteration(true));
  for (ParamId p : params) {
    if (p < 0 || p >= num_params())
      return InvalidArgumentError("Acquire of unknown parameter id " + std::to_string(p));
  }
  im.OpenGate();
  const auto t0 = std::chrono::steady_clock::now();
  const double call_s = im.timeline.Now();
  RETURN_IF_ERROR(im.cm->Acquire(params, phase));
  if (im.host_compute) {
    RETURN_IF_ERROR(im.PushGate(/*wait_entered=*/true));
  }
  im.stats.acquire_wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (im.cm->profiling()) {
    const int k = static_cast<int>(im.moment_times.size());
    const double ready_s = im.timeline.Now();
    im.moment_times.push_back({call_s, ready_s, -1, phase == Phase::kBackward});
    im.timeline.Add({Track::kCompute, "acquire " + std::to_string(k), call_s, ready_s - call_s, k});
  }
  return ParamScope(this, std::vector<ParamId>(params.begin(), params.end()), phase);
}

void* Engine::ScopeData(ParamId p) const { return impl_->cm->DevicePtr(p); }
void* Engine::ScopeGrad(ParamId p) const { return impl_->cm->GradPtr(p); }

Status Engine::ScopeRelease(std::span<const ParamId> params, Phase phase) {
  Impl& im = *impl_;
  im.OpenGate();
  if (im.cm->profiling()) {
    // Scopes nest: a release ends the latest moment still open.
    for (size_t k = im.moment_times.size(); k-- > 0;) {
      Impl::MomentTimes& m = im.moment_times[k];
      if (m.release_s >= 0) continue;
      m.release_s = im.timeline.Now();
      im.timeline.Add({Track::kCompute, (m.backward ? "backward " : "forward ") + std::to_string(k),
                       m.ready_s, m.release_s - m.ready_s, static_cast<int>(k)});
      break;
    }
  }
  RETURN_IF_ERROR(im.cm->Release(params, phase));
  return im.PushGate(/*wait_entered=*/false);
}

Status Engine::EndIteration() {
  Impl& im = *impl_;
  if (!im.in_iteration) return FailedPreconditionError("EndIteration outside an iteration");
  im.OpenGate();
  im.in_iteration = false;
  const bool profiled = im.cm->profiling();
  Status s = im.cm->EndIteration();
  if (im.iteration_train) ++im.iterations_since_step;
  if (profiled && s.ok()) {
    im.profile = im.cm->moment_profiles();
    im.profile_events = im.timeline.events();
    im.profile_iteration = im.iterations - 1;
    im.profile_step = true;
  }
  return s;
}

Status Engine::AbortIteration() {
  Impl& im = *impl_;
  if (!im.in_iteration) return Status::OK();
  im.OpenGate();
  im.in_iteration = false;
  Status s = im.cm->EndIteration();
  if (im.iteration_train && im.cfg.grad_accumulation > 1) {
    if (im.iterations_since_step > 0) {
      TZ_LOG(kWarn, kEngine) << "aborted micro-batch: dropping the " << im.iterations_since_step
                             << " accumulated micro-batches of this step";
    }
    im.iterations_since_step = 0;
    RETURN_IF_ERROR(im.cm->ZeroGrads());
  }
  return s;
}

// ---- Step
// ---------------------------------------------------------------------------------------

StatusOr<StepResult> Engine::Step(const StepOptions& options) {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("Step before Finalize");
  RETURN_IF_ERROR(im.cm->out_of_step());
  if (im.in_iteration) {
    if (!im.iteration_train) return FailedPreconditionError("Step inside an evaluation iteration");
    RETURN_IF_ERROR(EndIteration());
  }
  if (im.iterations_since_step != im.cfg.grad_accumulation) {
    return FailedPreconditionError("Step after " + std::to_string(im.iterations_since_step) +
                                   " training iterations; grad_accumulation is " +
                                   std::to_string(im.cfg.grad_accumulation));
  }
  if (!(options.lr >= 0) || !std::isfinite(options.lr))
    return InvalidArgumentError("learning rate " + std::to_string(options.lr) + " is not >= 0");
  const auto t0 = std::chrono::steady_clock::now();
  const bool prof = im.profile_step && im.iterations_since_step == im.cfg.grad_accumulation;
  const double step_start_s = im.timeline.Now();
  const double nvme_before = im.stats.optimizer_nvme_seconds;
  const uint64_t nvme_bytes_before = im.stats.nvme_read_bytes + im.stats.nvme_write_bytes;
  const uint64_t nvme_writes_before =
      im.stats.nvme_write_bytes + im.cm->counters().nvme_write_bytes;
  im.iterations_since_step = 0;
  const int nc = im.layout.num_chunks();
  const DType gt = im.cm->GradDType();

  // Global norm (and the non-finite check: a NaN or Inf makes the sum non-finite), over the
  // tensors only: a shard's padding is not a gradient.
  double sumsq = 0;
  for (int c = 0; c < nc; ++c) {
    const auto* g = static_cast<const uint8_t*>(im.cm->GradShard(c));
    for (const ShardSlice& sl : im.slices[static_cast<size_t>(c)]) {
      ASSIGN_OR_RETURN(
          double s, im.adam_plain->SumSquares(g + DTypeBytes(gt, sl.shard_offset), gt, sl.numel));
      sumsq += s;
    }
  }
  if (im.world() > 1) {
    // The ranks' sums in rank order, so every rank gets the same norm bit for bit.
    ASSIGN_OR_RETURN(std::vector<double> all, zero::AllGatherValue(*im.comm, sumsq));
    sumsq = 0;
    for (double x : all) sumsq += x;
  }
  const double inv = 1.0 / (static_cast<double>(im.loss_scale) * im.cfg.grad_accumulation);
  StepResult r;
  const bool finite = std::isfinite(sumsq);
  r.grad_norm = finite ? std::sqrt(sumsq) * inv : std::numeric_limits<double>::infinity();
  if (!finite) {
    ++im.stats.skipped_steps;
    if (im.cfg.compute_dtype == DType::kF16) {
      im.loss_scale = std::max(1.0f, im.loss_scale / 2);
      im.good_steps = 0;
      TZ_LOG(kInfo, kEngine) << "non-finite gradient: step skipped, loss scale now "
                             << im.loss_scale;
    } else {
      TZ_LOG(kWarn, kEngine) << "non-finite gradient: step skipped";
    }
    if (im.cfg.grad_accumulation > 1) RETURN_IF_ERROR(im.cm->ZeroGrads());
    r.applied = false;
    r.loss_scale = im.loss_scale;
    r.step = im.step;
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }
  double clip = 1.0;
  if (im.cfg.clip_grad_norm > 0 && r.grad_norm > im.cfg.clip_grad_norm)
    clip = im.cfg.clip_grad_norm / (r.grad_norm + 1e-6);
  AdamStepOptions so;
  so.step = im.step + 1;
  so.lr = options.lr;
  so.grad_scale = static_cast<float>(inv * clip);
  const DType dt = im.cfg.compute_dtype;
  if (prof) {
    im.timeline.Add(
        {Track::kOptimizer, "gradient norm", step_start_s, im.timeline.Now() - step_start_s});
  }
  RETURN_IF_ERROR(im.ForEachOptimChunk(
      [&](int c, float* master, float* m, float* v) -> Status {
        const double chunk_start_s = prof ? im.timeline.Now() : 0.0;
        AdamStepOptions chunk_so = so;
        if (prof) {
          chunk_so.timeline = &im.timeline;
          chunk_so.chunk = c;
        }
        // Added when the chunk's update ends, on every path out of this function.
        struct SpanAtExit {
          Impl* im;
          bool on;
          double start;
          int chunk;
          ~SpanAtExit() {
            if (on) {
              im->timeline.Add({Track::kOptimizer, "Adam chunk " + std::to_string(chunk), start,
                                im->timeline.Now() - start, -1, chunk,
                                im->layout.shard_elems() * 12});
            }
          }
        } span{&im, prof, chunk_start_s, c};
        const auto* grad = static_cast<const uint8_t*>(im.cm->GradShard(c));
        void* host = im.cm->HostParamShard(c);
        auto* out = static_cast<uint8_t*>(host != nullptr ? host : im.upload.data());
        if (host == nullptr) std::memset(out, 0, im.upload.bytes());  // zero padding
        for (const ShardSlice& sl : im.slices[static_cast<size_t>(c)]) {
          AdamBuffers b;
          b.master = master + sl.shard_offset;
          b.m = m + sl.shard_offset;
          b.v = v + sl.shard_offset;
          b.grad = grad + DTypeBytes(gt, sl.shard_offset);
          b.grad_dtype = gt;
          b.n = sl.numel;
          if (dt != DType::kF32) {
            b.out = out + DTypeBytes(dt, sl.shard_offset);
            b.out_dtype = dt;
          }
          CpuAdam& adam = im.params[static_cast<size_t>(sl.tensor)].weight_decay ? *im.adam_decay
                                                                                 : *im.adam_plain;
          ASSIGN_OR_RETURN(bool applied, adam.Step(b, chunk_so));
          TZ_CHECK(applied) << "Adam skipped a step that was checked finite";
          if (dt == DType::kF32) std::memcpy(out + sl.shard_offset * 4, b.master, sl.numel * 4);
        }
        if (host == nullptr) RETURN_IF_ERROR(im.cm->WriteParamShard(c, out));
        return Status::OK();
      },
      /*write_back=*/true));
  if (im.cfg.grad_accumulation > 1) RETURN_IF_ERROR(im.cm->ZeroGrads());
  ++im.step;
  ++im.stats.steps;
  if (im.cfg.compute_dtype == DType::kF16 && ++im.good_steps >= im.cfg.loss_scale_window) {
    im.loss_scale = std::min(im.loss_scale * 2, 16777216.0f);
    im.good_steps = 0;
  }
  r.applied = true;
  r.loss_scale = im.loss_scale;
  r.step = im.step;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  im.stats.optimizer_seconds += r.seconds;
  if (prof) {
    im.timeline.Add({Track::kOptimizer, "optimizer step", step_start_s, r.seconds});
    im.profile_events = im.timeline.events();
    im.step_seconds = r.seconds;
    im.step_nvme_seconds = im.stats.optimizer_nvme_seconds - nvme_before;
    im.step_nvme_bytes = im.stats.nvme_read_bytes + im.stats.nvme_write_bytes - nvme_bytes_before;
    im.step_nvme_write_bytes =
        im.stats.nvme_write_bytes + im.cm->counters().nvme_write_bytes - nvme_writes_before;
    im.profile_step = false;
  }
  return r;
}

// ---- Parameters
// ---------------------------------------------------------------------------------

Status Engine::ReadParam(ParamId p, std::span<float> out) {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("ReadParam before Finalize");
  if (p < 0 || p >= num_params()) return InvalidArgumentError("unknown parameter id");
  if (static_cast<int64_t>(out.size()) != numel(p))
    return InvalidArgumentError("ReadParam of '" + param(p).name + "' into " +
                                std::to_string(out.size()) + " elements; it has " +
                                std::to_string(numel(p)));
  const TensorLoc& loc = im.layout.tensor(p);
  std::vector<float> full;
  RETURN_IF_ERROR(im.GatherChunkMaster(loc.chunk, full));
  std::memcpy(out.data(), full.data() + loc.offset, loc.numel * 4);
  return Status::OK();
}

Status Engine::ReadGrad(ParamId p, std::span<float> out) {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("ReadGrad before Finalize");
  if (im.in_iteration) return FailedPreconditionError("ReadGrad inside an iteration");
  if (p < 0 || p >= num_params()) return InvalidArgumentError("unknown parameter id");
  if (static_cast<int64_t>(out.size()) != numel(p))
    return InvalidArgumentError("ReadGrad of '" + param(p).name + "' into " +
                                std::to_string(out.size()) + " elements; it has " +
                                std::to_string(numel(p)));
  const DType gt = im.cm->GradDType();
  const TensorLoc& loc = im.layout.tensor(p);
  // The chunk's gradient from every rank's shard.
  std::vector<uint8_t> full(DTypeBytes(gt, im.layout.chunk_elems()));
  ASSIGN_OR_RETURN(
      std::unique_ptr<CommRequest> req,
      im.comm->AllGather(im.cm->GradShard(loc.chunk), full.data(), im.layout.shard_elems(), gt));
  RETURN_IF_ERROR(req->Wait());
  return Convert(full.data() + DTypeBytes(gt, loc.offset), gt, out.data(), DType::kF32, out.size());
}

Status Engine::WriteParam(ParamId p, std::span<const float> values) {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("WriteParam before Finalize");
  if (im.in_iteration) return FailedPreconditionError("WriteParam inside an iteration");
  if (p < 0 || p >= num_params()) return InvalidArgumentError("unknown parameter id");
  if (static_cast<int64_t>(values.size()) != numel(p))
    return InvalidArgumentError("WriteParam of '" + param(p).name + "' with " +
                                std::to_string(values.size()) + " elements; it has " +
                                std::to_string(numel(p)));
  const int c = im.layout.tensor(p).chunk;
  return im.WithChunkState(c, /*write_back=*/true, [&](float* master, float*, float*) -> Status {
    for (const ShardSlice& sl : im.slices[static_cast<size_t>(c)]) {
      if (sl.tensor != p) continue;
      std::memcpy(master + sl.shard_offset, values.data() + sl.tensor_begin, sl.numel * 4);
    }
    return im.UploadChunk(c, master);
  });
}

// Runs fn on one chunk's optimizer state (read from NVMe into a swap slot and, with write_back,
// written back).
Status Engine::Impl::WithChunkState(int c, bool write_back,
                                    const std::function<Status(float*, float*, float*)>& fn) {
  const uint64_t n = layout.shard_elems();
  OptimShard& o = optim[static_cast<size_t>(c)];
  if (!o.on_nvme) return fn(o.host, o.host + n, o.host + 2 * n);
  ASSIGN_OR_RETURN(PinnedSlot slot, swap_arena->Acquire(std::chrono::seconds(60)));
  RETURN_IF_ERROR(nvme->Read(o.extent, slot.data()));
  auto* f = static_cast<float*>(slot.data());
  RETURN_IF_ERROR(fn(f, f + n, f + 2 * n));
  if (write_back) RETURN_IF_ERROR(nvme->Write(o.extent, slot.data()));
  return Status::OK();
}

// ---- Usage, stats
// -------------------------------------------------------------------------------

void Engine::ProfileNextIteration() {
  if (impl_->cm) impl_->cm->ProfileNextIteration(&impl_->timeline);
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
  u.host = im.placement.bytes[static_cast<int>(Tier::kHost)] + fixed;
  u.nvme = im.nvme ? im.nvme->stats().space.current : 0;
  return u;
}

EngineStats Engine::stats() const {
  const Impl& im = *impl_;
  EngineStats s = im.stats;
  if (!im.cm) return s;
  const ChunkCounters& c = im.cm->counters();
  s.h2d_bytes = c.h2d_bytes;
  s.d2h_bytes = c.d2h_bytes;
  s.nvme_read_bytes += c.nvme_read_bytes;
  s.nvme_write_bytes += c.nvme_write_bytes;
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
  }
  return s;
}

std::string Engine::PlacementSummary() const {
  const Impl& im = *impl_;
  if (!im.finalized) return "not finalized";
  char waste[32];
  std::snprintf(waste, sizeof waste, "%.1f%%", 100.0 * im.layout.waste_fraction());
  return std::to_string(im.layout.num_chunks()) + " chunks of " +
         FormatBytes(im.layout.chunk_bytes()) + " (" + waste + " padding); " +
         im.placement.Summary(im.budgets);
}

}  // namespace tierzero
