// The engine behind include/tierzero/engine.h: its creation, the parameters a trainer registers,
// and the iteration protocol (BeginIteration, Acquire, Release, EndIteration, AbortIteration),
// which tells the chunk manager and the Updater of each event. Finalize is setup.cc, Step
// step.cc, parameter reads and writes param_io.cc, stats and the report report.cc.
#include "tierzero/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "chunk/chunk_manager.h"
#include "comm/collective.h"
#include "comm/device_collectives.h"
#include "comm/nccl.h"
#include "core/bytes.h"
#include "core/check.h"
#include "core/logging.h"
#include "core/mutex.h"
#include "engine/engine_impl.h"
#include "offload/cuda_device.h"
#include "offload/host_sim_device.h"
#include "tierzero/utf8.h"

namespace tierzero {

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
  if (!im.finalize_failed.empty())
    return FailedPreconditionError("RegisterParam after a failed Finalize (" + im.finalize_failed +
                                   "): create another Engine");
  if (spec.name.empty()) return InvalidArgumentError("a parameter needs a name");
  // A name goes into JSON (the manifest, the report, safetensors headers): UTF-8 only, and not
  // the safetensors header's own key.
  if (const int64_t bad = FirstInvalidUtf8(spec.name); bad >= 0)
    return InvalidArgumentError("a parameter name is not UTF-8 (an invalid byte at offset " +
                                std::to_string(bad) + ", after '" +
                                spec.name.substr(0, static_cast<size_t>(bad)) +
                                "'): names are written into JSON files");
  if (spec.name == "__metadata__")
    return InvalidArgumentError(
        "parameter name '__metadata__' is the safetensors header's own key: choose another");
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
// (A reference cannot carry an error: an id out of range is a programming error, said and ended
// here rather than read out of bounds.)
const ParamSpec& Engine::param(ParamId p) const {
  TZ_CHECK(p >= 0 && p < num_params())
      << "Engine::param(" << p << "): ids are 0.." << num_params() - 1;
  return impl_->params[static_cast<size_t>(p)];
}
int64_t Engine::numel(ParamId p) const {
  TZ_CHECK(p >= 0 && p < num_params())
      << "Engine::numel(" << p << "): ids are 0.." << num_params() - 1;
  return impl_->numel[static_cast<size_t>(p)];
}
int64_t Engine::step() const { return impl_->step; }

// ---- Iterations
// ---------------------------------------------------------------------------------

// Note [An engine that never steps]
// `optimizer_states: kNone` holds each chunk's fp32 master and no moments: 4 bytes a parameter
// of optimizer state where fp32 moments take 12 and 8-bit ones ~6.1; and no gradient shards
// (TierBudgets::grad_shards, ShardStoreOptions::grads): 2 bytes a parameter in bf16, 4 fp32. It is
// for what reads a model and never trains it (`tierzero eval` and `export`, which load a
// checkpoint: its moments are read and checked as any load's, then dropped; a parameter is its
// master rounded as in any run, so losses and exports are the same to the bit). Its groups are laid
// out, placed, tiered and swapped as any format's (no moments: GroupLayout's moment offsets
// coincide with the master's end). What would need the moments is refused by name: a training
// iteration, Step, PrepareStep, ReadGrad and SaveCheckpoint (a checkpoint without moments would
// restart Adam from zero when resumed, silently).
Status Engine::RefuseWithoutMoments(const char* what) const {
  if (impl_->cfg.optimizer_states != MomentFormat::kNone) return Status::OK();
  return FailedPreconditionError(std::string(what) +
                                 " in an engine without optimizer moments (optimizer_states "
                                 "kNone, for evaluating and exporting): it never steps or saves");
}

Status Engine::BeginIteration(bool train) {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("BeginIteration before Finalize");
  if (train) RETURN_IF_ERROR(RefuseWithoutMoments("a training iteration"));
  RETURN_IF_ERROR(im.NoScopeOpen("BeginIteration"));
  if (im.in_iteration) return FailedPreconditionError("BeginIteration inside an iteration");
  if (train && im.iterations_since_step >= im.cfg.grad_accumulation) {
    return FailedPreconditionError("a training iteration after " +
                                   std::to_string(im.iterations_since_step) +
                                   " micro-batches without Step (grad_accumulation is " +
                                   std::to_string(im.cfg.grad_accumulation) + ")");
  }
  im.OpenGate();
  im.iteration_comm0 = im.cm->counters().comm_seconds;
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
  // (Checked before an iteration begins: a refused Acquire changes nothing. A value outside the
  // enum was taken as a recompute: hunt 48.)
  for (ParamId p : params) {
    if (p < 0 || p >= num_params())
      return InvalidArgumentError("Acquire of unknown parameter id " + std::to_string(p));
  }
  if (phase != Phase::kForward && phase != Phase::kBackward && phase != Phase::kRecompute)
    return InvalidArgumentError("Acquire with phase " + std::to_string(static_cast<int>(phase)) +
                                ": no Phase (kForward, kBackward, kRecompute)");
  if (!im.in_iteration) RETURN_IF_ERROR(BeginIteration(true));
  if (im.abort_pending)
    return FailedPreconditionError(
        "Acquire in an aborted iteration: it ends when its open parameter scopes are released");
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
  if (phase == Phase::kBackward && im.LastMicroBatch()) im.PrefetchStates();
  if (im.host_compute) {
    RETURN_IF_ERROR(im.CloseGate(/*wait_entered=*/true));
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
  ++im.open_scopes;
  return ParamScope(this, im.alive, std::vector<ParamId>(params.begin(), params.end()), phase);
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
  --im.open_scopes;
  Status s = im.cm->Release(params, phase);
  if (im.abort_pending && im.open_scopes == 0) {
    im.abort_pending = false;
    Status a = AbortIteration();
    return s.ok() ? a : s;
  }
  RETURN_IF_ERROR(s);
  return im.CloseGate(/*wait_entered=*/false);
}

Status Engine::EndIteration() {
  Impl& im = *impl_;
  if (!im.in_iteration) return FailedPreconditionError("EndIteration outside an iteration");
  RETURN_IF_ERROR(im.NoScopeOpen("EndIteration"));
  im.OpenGate();
  im.in_iteration = false;
  if (Status u = im.updater->Await(); !u.ok()) {
    (void)im.cm->EndIteration();
    im.updater->EndIteration(/*keep=*/false);
    return u;
  }
  const bool profiled = im.cm->profiling();
  Status s = im.cm->EndIteration();
  if (im.iteration_train)  // (Note [The collectives of training])
    im.train_comm_seconds += im.cm->counters().comm_seconds - im.iteration_comm0;
  im.updater->EndIteration(/*keep=*/s.ok());
  if (!s.ok()) {
    // The micro-batch's gradients did not all arrive: it does not count, and with accumulation
    // the window's gradients are dropped as AbortIteration drops them.
    if (im.iteration_train) RETURN_IF_ERROR(im.DropAccumulated());
    return s;
  }
  if (im.iteration_train) {
    if (im.LastMicroBatch()) im.PrefetchStates();  // slots freed by the writes behind
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

// Note [An iteration aborted with scopes open]
// A trainer's natural error path aborts while a scope is still alive (`auto s = Acquire(...);
// if (bad) { engine.AbortIteration(); return; }`): the chunk manager cannot end an iteration
// whose tensors are acquired, and the failed end left the micro-batch's gradients to be added to
// the next window's. So an abort with scopes open only marks the iteration: nothing more is
// acquired in it, and the abort itself runs when the last scope is released (by its destructor
// as the trainer unwinds). EndIteration with scopes open is refused and changes nothing: the
// trainer releases them and ends (or aborts) the iteration again.
Status Engine::Impl::NoScopeOpen(const char* call) const {
  if (open_scopes == 0) return Status::OK();
  return FailedPreconditionError(
      std::string(call) + " with " + std::to_string(open_scopes) + " parameter scope" +
      (open_scopes == 1 ? " " : "s ") +
      (abort_pending ? "of the aborted iteration still open: it ends when they are released"
                     : "still open: release them (ParamScope::Release, or let them go out of "
                       "scope) first"));
}

Status Engine::AbortIteration() {
  Impl& im = *impl_;
  if (!im.in_iteration) return Status::OK();
  if (im.open_scopes > 0) {
    im.abort_pending = true;
    return Status::OK();
  }
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

}  // namespace tierzero
