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
#include "comm/collective.h"
#include "comm/device_collectives.h"
#include "comm/nccl.h"
#include "core/bytes.h"
#include "core/check.h"
#include "core/convert.h"
#include "core/logging.h"
#include "core/mutex.h"
#include "cpu_adam/cpu_adam.h"
#include "engine/engine_impl.h"
#include "offload/cuda_device.h"
#include "offload/host_sim_device.h"
#include "offload/swapper.h"

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
    MutexLock lock(gate->mu);
    gate->opened = true;
  }
  gate->cv.NotifyAll();
  gate.reset();
}

Status Engine::Impl::PushGate(bool wait_entered) {
  if (!host_compute) return Status::OK();
  auto g = std::make_shared<Gate>();
  RETURN_IF_ERROR(device->LaunchHostFunc(compute.handle(), [g] {
    MutexLock lock(g->mu);
    g->entered = true;
    g->cv.NotifyAll();
    g->cv.Wait(lock, [&]() TZ_REQUIRES(g->mu) { return g->opened; });
  }));
  gate = g;
  if (wait_entered) {
    MutexLock lock(g->mu);
    g->cv.Wait(lock, [&]() TZ_REQUIRES(g->mu) { return g->entered; });
  }
  return Status::OK();
}

// ---- Engine
// -------------------------------------------------------------------------------------

Engine::Engine() : impl_(std::make_unique<Impl>()) {}

Engine::~Engine() {
  if (impl_ && impl_->device) {
    impl_->OpenGate();
    if (impl_->updater) impl_->updater->Shutdown();  // its workers joined before what they use goes
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
  // Budgets beyond any machine are refused rather than summed into a wrapped 64-bit figure (a
  // device budget of 2^64 - 1 became a 1 MiB device): 1 EiB leaves every sum of them room.
  constexpr uint64_t kMostBudget = uint64_t{1} << 60;
  for (const auto& [field, value] :
       {std::pair<std::string_view, uint64_t>{"device_budget", c.device_budget},
        {"device_shard_budget", c.device_shard_budget},
        {"host_budget", c.host_budget},
        {"nvme_budget", c.nvme_budget}}) {
    if (value > kMostBudget)
      return bad(field, std::to_string(value) + " bytes", "at most 2^60 bytes (1 EiB)");
  }
  // A chunk's states (16 bytes an element and more) must not wrap either: 2^36 elements is a
  // chunk of 256 GiB of fp32, larger than any device.
  if (c.chunk_elems > (uint64_t{1} << 36))
    return bad("chunk_elems", std::to_string(c.chunk_elems), "0 (automatic) up to 2^36");
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
  if (!(c.optimizer_device_fraction >= 0 && c.optimizer_device_fraction <= 1))
    return bad("optimizer_device_fraction", std::to_string(c.optimizer_device_fraction), "[0, 1]");
  if (!(c.host_device_adam_rate >= 0) || !std::isfinite(c.host_device_adam_rate))
    return bad("host_device_adam_rate", std::to_string(c.host_device_adam_rate),
               "parameters/s >= 0 (0: off)");
  if (!(c.host_link_bandwidth >= 0))
    return bad("host_link_bandwidth", std::to_string(c.host_link_bandwidth),
               "0 (unthrottled) or more");
  if (c.zeropp.qwz_bits != 4 && c.zeropp.qwz_bits != 8)
    return bad("zeropp.qwz_bits", std::to_string(c.zeropp.qwz_bits), "4 or 8");
  if (c.zeropp.qgz_bits != 4 && c.zeropp.qgz_bits != 8)
    return bad("zeropp.qgz_bits", std::to_string(c.zeropp.qgz_bits), "4 or 8");
  if (c.zeropp.block_elems < 64 || c.zeropp.block_elems > 4096)
    return bad("zeropp.block_elems", std::to_string(c.zeropp.block_elems), "64..4096");
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
  // With several ranks every log line names its rank (core/logging.h).
  if (comm->size() > 1) SetLogRank(comm->rank());
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
bool Engine::host_compute() const {
  const Impl& im = *impl_;
  if (im.finalized) return im.host_compute;
  if (im.device != nullptr) return im.device->info().caps.host_compute;
  // Before Finalize (a plan's derived trace): the device Finalize will open, decided as it does.
  return !(im.cfg.device == DeviceChoice::kCuda ||
           (im.cfg.device == DeviceChoice::kAuto && CudaDeviceCount() > 0));
}
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
  return AgreeOnStatus(*comm, read);
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
  im.forward_open = train;
  im.forward_t0 = std::chrono::steady_clock::now();
  im.forward_wait0 = im.updater->wait_seconds();
  im.iteration_acquires.clear();
  if (train)
    RETURN_IF_ERROR(im.updater->BeginTraining(im.LastMicroBatch(), im.step, im.loss_scale));
  ++im.iterations;
  if (im.cm->profiling()) {
    im.moment_times.clear();
    im.profile_wire_start = im.cm->counters().AllWire();
    // Note [Compute spans on the device's clock]: the origin on an idle stream, so its time is
    // the host's now.
    im.device_timed = !im.host_compute && im.device->info().caps.event_timing;
    if (im.device_timed) {
      if (im.profile_origin.handle().impl == nullptr) {
        ASSIGN_OR_RETURN(im.profile_origin, Event::Create(*im.device));
      }
      RETURN_IF_ERROR(im.device->SynchronizeStream(im.compute.handle()));
      RETURN_IF_ERROR(im.profile_origin.Record(im.compute));
      im.profile_origin_s = im.timeline.Now();
    }
  }
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
  const double update_wait0 = im.updater->wait_seconds();
  const double call_s = im.timeline.Now();
  bool backward_starts = false;
  if (phase == Phase::kBackward && im.forward_open) {
    im.forward_open = false;
    im.updater->NoteForward(std::chrono::duration<double>(t0 - im.forward_t0).count() -
                            (im.updater->wait_seconds() - im.forward_wait0));
    // The NVMe read-ahead's window opens (after the wait for the last chain, below).
    backward_starts = im.LastMicroBatch();
  }
  // Backward writes gradient shards the update phase may still read (Note [The update phase
  // behind the next forward]); forward's gathers wait per chunk.
  if (phase == Phase::kBackward) RETURN_IF_ERROR(im.updater->Await());
  // The NVMe read-ahead starts below (PrefetchStates), after the wait for the last chain.
  if (backward_starts) im.updater->NoteLastBackward();
  RETURN_IF_ERROR(im.cm->Acquire(params, phase));
  if (im.iteration_train) {
    im.iteration_acquires.push_back(
        {std::vector<ParamId>(params.begin(), params.end()), phase == Phase::kBackward});
  }
  if (phase == Phase::kBackward && im.LastMicroBatch()) im.updater->PrefetchStates();
  if (im.host_compute) {
    RETURN_IF_ERROR(im.PushGate(/*wait_entered=*/true));
  }
  im.stats.acquire_wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() -
      (im.updater->wait_seconds() - update_wait0);
  if (im.cm->profiling()) {
    const int k = static_cast<int>(im.moment_times.size());
    const double ready_s = im.timeline.Now();
    Impl::MomentTimes m;
    m.call_s = call_s;
    m.ready_s = ready_s;
    m.backward = phase == Phase::kBackward;
    if (im.device_timed) {
      ASSIGN_OR_RETURN(m.ready_ev, Event::Create(*im.device));
      RETURN_IF_ERROR(m.ready_ev.Record(im.compute));
    }
    im.moment_times.push_back(std::move(m));
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
      if (im.device_timed) {  // placed when the iteration ends (PlaceDeviceSpans)
        auto ev = Event::Create(*im.device);
        if (ev.ok() && ev->Record(im.compute).ok()) m.release_ev = std::move(*ev);
        break;
      }
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
  if (Status u = im.updater->Await(); !u.ok()) {
    (void)im.cm->EndIteration();
    im.updater->EndIteration(/*keep=*/false);
    return u;
  }
  const bool profiled = im.cm->profiling();
  Status s = im.cm->EndIteration();
  im.updater->EndIteration(/*keep=*/s.ok());
  if (!s.ok()) {
    // The micro-batch's gradients did not all arrive: it does not count, and with accumulation
    // the window's gradients are dropped as AbortIteration drops them.
    if (im.iteration_train) RETURN_IF_ERROR(im.DropAccumulated());
    return s;
  }
  if (im.iteration_train) {
    if (im.LastMicroBatch()) im.updater->PrefetchStates();  // slots freed by the writes behind
    ++im.iterations_since_step;
    if (im.cm->counters().plans != im.traced_plans) {
      // This iteration's trace made the plan: its Acquires are the warm-up trace's moments.
      im.traced_plans = im.cm->counters().plans;
      im.traced_acquires = im.iteration_acquires;
    }
  }
  if (profiled) {
    im.PlaceDeviceSpans();
    im.profile = im.cm->moment_profiles();
    im.profile_events = im.timeline.events();
    im.profile_wire = im.cm->counters().AllWire() - im.profile_wire_start;
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
  Status u = im.updater->Await();
  Status s = im.cm->EndIteration();
  if (s.ok()) s = u;
  im.updater->Discard();
  if (im.iteration_train) RETURN_IF_ERROR(im.DropAccumulated());
  return s;
}

// With accumulation, a micro-batch that failed spoils the window: its gradients are cleared and
// the micro-batches counted so far dropped (the step then needs grad_accumulation new ones).
Status Engine::Impl::DropAccumulated() {
  if (cfg.grad_accumulation == 1) return Status::OK();
  if (iterations_since_step > 0) {
    TZ_LOG(kWarn, kEngine) << "failed micro-batch: dropping the " << iterations_since_step
                           << " accumulated micro-batches of this step";
  }
  iterations_since_step = 0;
  return cm->ZeroGrads();
}

// ---- Parameters
// ---------------------------------------------------------------------------------

// The checks of every parameter accessor: after Finalize, between iterations unless `anytime`,
// a known id, and a buffer of the parameter's size (`into`: "into" or "with").
Status Engine::Impl::CheckAccess(std::string_view what, ParamId p, size_t n, std::string_view into,
                                 bool anytime) const {
  if (!finalized) return FailedPreconditionError(std::string(what) + " before Finalize");
  if (!anytime && in_iteration) {
    return FailedPreconditionError(std::string(what) + " inside an iteration");
  }
  if (p < 0 || p >= static_cast<ParamId>(params.size())) {
    return InvalidArgumentError("unknown parameter id");
  }
  const int64_t have = numel[static_cast<size_t>(p)];
  if (static_cast<int64_t>(n) != have) {
    return InvalidArgumentError(std::string(what) + " of '" + params[static_cast<size_t>(p)].name +
                                "' " + std::string(into) + " " + std::to_string(n) +
                                " elements; it has " + std::to_string(have));
  }
  return Status::OK();
}

Status Engine::ReadParam(ParamId p, std::span<float> out) {
  Impl& im = *impl_;
  RETURN_IF_ERROR(im.CheckAccess("ReadParam", p, out.size(), "into", /*anytime=*/true));
  RETURN_IF_ERROR(im.updater->Await());
  const TensorLoc& loc = im.layout.tensor(p);
  std::vector<float> full;
  RETURN_IF_ERROR(im.GatherChunkMaster(loc.chunk, full));
  std::memcpy(out.data(), full.data() + loc.offset, loc.numel * 4);
  return Status::OK();
}

Status Engine::ReadGrad(ParamId p, std::span<float> out) {
  Impl& im = *impl_;
  RETURN_IF_ERROR(im.CheckAccess("ReadGrad", p, out.size(), "into", /*anytime=*/false));
  RETURN_IF_ERROR(im.updater->Await());
  const DType gt = im.store->grad_dtype();
  const TensorLoc& loc = im.layout.tensor(p);
  // The chunk's gradient from every rank's shard.
  std::vector<uint8_t> full(DTypeBytes(gt, im.layout.chunk_elems()));
  ASSIGN_OR_RETURN(
      std::unique_ptr<CommRequest> req,
      im.comm->AllGather(im.store->grad(loc.chunk), full.data(), im.layout.shard_elems(), gt));
  RETURN_IF_ERROR(req->Wait());
  return Convert(full.data() + DTypeBytes(gt, loc.offset), gt, out.data(), DType::kF32, out.size());
}

Status Engine::WriteParam(ParamId p, std::span<const float> values) {
  Impl& im = *impl_;
  RETURN_IF_ERROR(im.CheckAccess("WriteParam", p, values.size(), "with", /*anytime=*/false));
  RETURN_IF_ERROR(im.updater->Await());
  im.updater->Discard();  // it started from the values replaced here
  const int c = im.layout.tensor(p).chunk;
  return im.WithChunkState(c, /*write_back=*/true, [&](float* master, float*, float*) -> Status {
    for (const ShardSlice& sl : im.slices[static_cast<size_t>(c)]) {
      if (sl.tensor != p) continue;
      std::memcpy(master + sl.shard_offset, values.data() + sl.tensor_begin, sl.numel * 4);
    }
    return im.UploadChunk(c, master);
  });
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
  s.h2d_bytes = c.h2d_bytes;
  s.d2h_bytes = c.d2h_bytes;
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
