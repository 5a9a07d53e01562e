// ChunkManager: creation, shard contents, and the moment loop (Acquire/Release). Gathers,
// evictions and reductions are in chunk_gather.cc, the end of an iteration and the plan in
// chunk_manager_end.cc.
#include "chunk/chunk_manager.h"

#include <algorithm>
#include <cstring>

#include "chunk/chunk_manager_impl.h"
#include "core/bytes.h"
#include "core/check.h"
#include "core/logging.h"

namespace tierzero {

ChunkManager::ChunkManager(Device& device, StreamHandle compute, ShardStore& store,
                           const ChunkLayout& layout, const Placement& placement,
                           const ChunkManagerOptions& options)
    : device_(device),
      compute_(compute),
      store_(store),
      layout_(layout),
      placement_(placement),
      options_(options),
      impl_(std::make_unique<Impl>(device, compute, store,
                                   layout.world_size() > 1 ? options.comm : nullptr)) {}

ChunkManager::~ChunkManager() {
  if (impl_) {
    if (layout_.world_size() > 1 && options_.device_comm != nullptr) {
      (void)options_.device_comm->Drain();  // bounded by the deadline
    }
    (void)device_.Synchronize();
  }
}

ShardStoreOptions ChunkManager::StoreOptions(const ChunkLayout& layout, const Placement& placement,
                                             const ChunkManagerOptions& options) {
  ShardStoreOptions so;
  so.geometry.num_chunks = layout.num_chunks();
  so.geometry.world_size = layout.world_size();
  so.geometry.rank = options.comm != nullptr ? options.comm->rank() : 0;
  so.geometry.shard_elems = layout.shard_elems();
  so.geometry.dtype = layout.dtype();
  for (const ChunkPlacement& p : placement.chunks) so.param_tier.push_back(p.param);
  so.fp32_grads = options.grad_accumulation;
  for (const ChunkPlacement& p : placement.chunks) so.grad_tier.push_back(p.grad);
  so.grads = placement.grad_shard_bytes > 0;  // none in an engine that never steps
  // With W > 1 over host buffers a host shard has room for its gather tag after it.
  if (layout.world_size() > 1 && options.device_comm == nullptr) {
    so.host_param_tail_bytes = kGatherTagBytes;
  }
  return so;
}

StatusOr<std::unique_ptr<ChunkManager>> ChunkManager::Create(
    Device& device, StreamHandle compute_stream, ShardStore& store, const ChunkLayout& layout,
    const Placement& placement, const ChunkManagerOptions& options) {
  if (layout.world_size() > 1) {
    if (options.comm == nullptr || options.comm->size() != layout.world_size()) {
      return InvalidArgumentError("a layout for " + std::to_string(layout.world_size()) +
                                  " ranks needs a communicator of that size");
    }
    if (options.comm->backend() == "nccl") {
      return UnsupportedError(
          "the chunk manager gathers and reduces through host buffers; give it the MPI "
          "communicator (the NCCL one takes device buffers)");
    }
    for (const ChunkPlacement& p : placement.chunks) {
      if (p.param == Tier::kDevice && options.device_comm == nullptr) {
        return UnsupportedError(
            "device-resident parameter shards with several ranks and host collectives; set "
            "ranks.collectives to device, or device_shard_budget to 0");
      }
    }
  }
  if (static_cast<int>(placement.chunks.size()) != layout.num_chunks()) {
    return InvalidArgumentError("placement covers " + std::to_string(placement.chunks.size()) +
                                " chunks, the layout has " + std::to_string(layout.num_chunks()));
  }
  const ShardGeometry& g = store.geometry();
  if (g.num_chunks != layout.num_chunks() || g.world_size != layout.world_size() ||
      g.shard_elems != layout.shard_elems() || g.dtype != layout.dtype() ||
      g.rank != (options.comm != nullptr ? options.comm->rank() : 0)) {
    return InvalidArgumentError(
        "the shard store was not made for this layout and rank "
        "(ChunkManager::StoreOptions)");
  }
  for (int c = 0; c < layout.num_chunks(); ++c) {
    if (store.param_tier(c) != placement.chunks[static_cast<size_t>(c)].param) {
      return InvalidArgumentError("the shard store places chunk " + std::to_string(c) +
                                  " elsewhere than the placement");
    }
  }
  if (options.device_budget_bytes < layout.chunk_bytes()) {
    return InvalidArgumentError("device budget " + FormatBytes(options.device_budget_bytes) +
                                " cannot hold one chunk of " + FormatBytes(layout.chunk_bytes()));
  }
  std::unique_ptr<ChunkManager> m(
      new ChunkManager(device, compute_stream, store, layout, placement, options));
  RETURN_IF_ERROR(m->Init());
  return m;
}

// The gather and reduce paths, chosen once: one rank, W ranks over host buffers, or W ranks
// with device collectives (zero/gather.h).
Status ChunkManager::Init() {
  Impl& im = *impl_;
  TransferContext& ctx = im.ctx;
  RETURN_IF_ERROR(ctx.Init());
  if (options_.comm != nullptr) ctx.topology = options_.comm->topology();
  GatherOptions go;
  go.staging_bytes = options_.staging_bytes;
  ReduceOptions ro;
  ro.accumulate = options_.grad_accumulation;
  if (layout_.world_size() == 1) {
    ASSIGN_OR_RETURN(im.gather, CreateLocalGather(ctx, go));
    ASSIGN_OR_RETURN(im.reduce, CreateLocalReduce(ctx, ro));
  } else {
    // ZeRO++'s strategies where a part of it is on, the plain ones for the rest; on the device
    // collectives' stream, or through host buffers.
    DeviceCollectives* dc = options_.device_comm;
    Communicator& comm = *options_.comm;
    ZeroPPOptions zo = options_.zeropp;
    zo.shard_runs.clear();
    if (zo.any()) {
      for (int c = 0; c < layout_.num_chunks(); ++c) zo.shard_runs.push_back(layout_.ShardRuns(c));
    }
    if (zo.qwz || zo.hpz) {
      ASSIGN_OR_RETURN(im.gather, dc != nullptr ? CreateZeroPPDeviceGather(ctx, *dc, go, zo)
                                                : CreateZeroPPHostGather(ctx, comm, go, zo));
    } else {
      ASSIGN_OR_RETURN(im.gather, dc != nullptr ? CreateDeviceGather(ctx, *dc, go)
                                                : CreateHostGather(ctx, comm, go));
    }
    if (zo.qgz) {
      ASSIGN_OR_RETURN(im.reduce, dc != nullptr ? CreateZeroPPDeviceReduce(ctx, *dc, ro, zo)
                                                : CreateZeroPPHostReduce(ctx, comm, ro, zo));
    } else {
      ASSIGN_OR_RETURN(im.reduce, dc != nullptr ? CreateDeviceReduce(ctx, *dc, ro)
                                                : CreateHostReduce(ctx, comm, ro));
    }
  }
  im.chunks.resize(static_cast<size_t>(layout_.num_chunks()));
  for (Impl::ChunkRt& rt : im.chunks) {
    ASSIGN_OR_RETURN(rt.ready, Event::Create(device_));
  }
  ASSIGN_OR_RETURN(im.iteration_end, Event::Create(device_));
  states_ = std::make_unique<StateTracker>(layout_, [this](int c) {
    if (impl_->inference) return;  // evaluation: the gradient shards keep what they hold
    Status s = ReduceChunk(c);
    if (!s.ok()) impl_->ranks.SetAsyncError(std::move(s));
  });
  states_->MarkAllocated();
  TZ_LOG(kInfo, kChunk) << layout_.num_chunks() << " chunks of "
                        << FormatBytes(layout_.chunk_bytes()) << " (shards of "
                        << FormatBytes(layout_.shard_bytes()) << " on " << layout_.world_size()
                        << " ranks); " << placement_.Summary({0, 0, 0});
  return Status::OK();
}

std::vector<double> ChunkManager::GatherSeconds() const {
  std::vector<double> s(static_cast<size_t>(layout_.num_chunks()));
  const double bytes = static_cast<double>(layout_.chunk_bytes());
  const double* measured = impl_->measured_seconds;
  // (W > 1: the defaults leave out the all_gather; a recording iteration measures it.)
  for (size_t c = 0; c < s.size(); ++c) {
    switch (store_.param_tier(static_cast<int>(c))) {
      case Tier::kDevice:
        s[c] = ShardIsGathered(static_cast<int>(c)) ? 0 : measured[0];
        break;
      case Tier::kHost:
        s[c] = measured[1] > 0 ? measured[1] : bytes / options_.h2d_bytes_per_second;
        break;
      case Tier::kNvme:
        s[c] = measured[2] > 0 ? measured[2]
                               : bytes / options_.h2d_bytes_per_second +
                                     bytes / options_.nvme_read_bytes_per_second;
        break;
    }
  }
  return s;
}

ChunkCounters ChunkManager::counters() const {
  ChunkCounters c = counters_;
  const TransferCounters& t = impl_->ctx.counters;
  c.h2d_bytes = t.h2d_bytes;
  c.d2h_bytes = t.d2h_bytes;
  c.nvme_read_bytes = t.nvme_read_bytes + store_.counters().nvme_read_bytes;
  c.nvme_write_bytes = store_.counters().nvme_write_bytes;
  c.comm_seconds = t.comm_seconds;
  c.all_gathers = t.all_gathers;
  c.reduce_scatters = t.reduce_scatters;
  c.param_gather = t.param_gather;
  c.param_regather = t.param_regather;
  c.grad_reduce = t.grad_reduce;
  return c;
}

// ---- Shard contents
// ------------------------------------------------------------------------------

namespace {
Status NotBetweenIterations(bool in_iteration) {
  if (in_iteration) {
    return FailedPreconditionError("shard contents can change only between iterations");
  }
  return Status::OK();
}
}  // namespace

Status ChunkManager::ZeroGrads() {
  RETURN_IF_ERROR(NotBetweenIterations(impl_->ctx.moment > 0));
  RETURN_IF_ERROR(store_.ZeroGrads());
  return Status::OK();
}

// ---- Iterations
// ----------------------------------------------------------------------------------

Status ChunkManager::out_of_step() const { return impl_->ranks.OutOfStep(); }
void ChunkManager::MarkOutOfStep(Status why) { (void)impl_->ranks.LoseStep(std::move(why)); }

void ChunkManager::SetGradFinalCallback(std::function<void(int)> fn) {
  impl_->grad_final = std::move(fn);
}

Status ChunkManager::BeginIteration(bool inference) {
  Impl& im = *impl_;
  RETURN_IF_ERROR(im.ranks.OutOfStep());
  RETURN_IF_ERROR(states_->BeginIteration());
  im.ctx.moment = 0;
  im.ctx.gathered.assign(static_cast<size_t>(layout_.num_chunks()), 0);
  im.gather->BeginIteration();
  im.inference = inference;
  im.profiling = false;  // (an iteration that failed while profiling is profiled again)
  im.ctx.spans.Observe(nullptr);
  if (inference) {
    im.mode = Impl::Mode::kOnDemand;
    im.ctx.timer.set_recording(false);
    return Status::OK();
  }
  im.mode = (im.record_next || !has_plan_) ? Impl::Mode::kRecord : Impl::Mode::kReplay;
  im.ctx.timer.set_recording(im.mode == Impl::Mode::kRecord);
  if (im.mode == Impl::Mode::kReplay && im.observer != nullptr) {
    im.profiling = true;
    im.profile.clear();
    if (im.on_profile_begin) im.on_profile_begin();
    im.ctx.spans.Observe(im.observer);
  }
  if (im.mode == Impl::Mode::kRecord) {
    tracer_.Begin(tracer_.current_nonmodel());
    // Recording gathers into per-chunk allocations; the old plan's slot region would only take
    // memory from them (and from the activations).
    im.slots.Clear();
  }
  return Status::OK();
}

Status ChunkManager::Acquire(std::span<const int> tensors, Phase phase) {
  Impl& im = *impl_;
  RETURN_IF_ERROR(im.ranks.OutOfStep());
  if (im.inference && phase != Phase::kForward) {
    return FailedPreconditionError("an inference iteration acquires for forward only, not " +
                                   std::string(PhaseName(phase)));
  }
  RETURN_IF_ERROR(states_->Acquire(tensors, phase));
  // The moment's chunks, in order of first appearance.
  std::vector<int> needed;
  for (int t : tensors) {
    const int c = layout_.tensor(t).chunk;
    if (std::find(needed.begin(), needed.end(), c) == needed.end()) needed.push_back(c);
  }
  const int k = im.ctx.moment++;
  ++im.acquires;
  const size_t traced = tracer_.moments().size();
  Status st = AcquireChunks(k, needed, tensors, phase);
  if (!st.ok()) {
    // Leave everything as it was before the call: states, use counts, trace, moment count.
    states_->Unacquire(tensors, phase);
    if (tracer_.moments().size() > traced) tracer_.PopMoment();
    --im.ctx.moment;
  }
  return st;
}

StatusOr<bool> ChunkManager::OffTrace(int k, const std::vector<int>& needed,
                                      std::span<const int> tensors, Phase phase) {
  Impl& im = *impl_;
  bool off_trace =
      im.mode == Impl::Mode::kReplay &&
      (k >= static_cast<int>(trace_.size()) || trace_[static_cast<size_t>(k)].chunks != needed ||
       trace_[static_cast<size_t>(k)].backward != (phase == Phase::kBackward));
  if (layout_.world_size() == 1) return off_trace;
  // (With W > 1 the evictions' check in ReplayMoment is made here, so all ranks leave the plan
  // together.)
  if (im.mode == Impl::Mode::kReplay && !off_trace) {
    for (int c : schedule_.moments[static_cast<size_t>(k)].evict) off_trace |= !Evictable(c);
  }
  RETURN_IF_ERROR(im.reduce->Finish(/*wait_all=*/false, /*wait_oldest=*/false));
  if (options_.device_comm != nullptr) {
    Status s = options_.device_comm->Check();
    if (!s.ok()) return im.ranks.LoseStep(std::move(s));
  }
  RETURN_IF_ERROR(im.ranks.AgreeOnMoment(k, MomentHash(tensors, phase == Phase::kBackward),
                                         /*end=*/false, im.inference, &off_trace,
                                         &im.ctx.counters.comm_seconds));
  return off_trace;
}

// Off the trace (or the plan would drop a chunk in use): on demand for the rest of the
// iteration, record and plan again next time.
void ChunkManager::LeavePlan(int k, const std::string& why) {
  ++counters_.deviations;
  impl_->mode = Impl::Mode::kOnDemand;
  impl_->record_next = true;
  TZ_LOG(kInfo, kChunk) << "moment " << k << why;
}

void ChunkManager::TraceMoment(const std::vector<int>& needed, Phase phase) {
  tracer_.BeginMoment(needed, phase == Phase::kBackward);
  std::vector<int> held;  // chunks outer scopes still hold
  for (int c = 0; c < layout_.num_chunks(); ++c) {
    if (!states_->ChunkEvictable(c) && std::find(needed.begin(), needed.end(), c) == needed.end()) {
      held.push_back(c);
    }
  }
  if (!held.empty()) tracer_.SetHeld(std::move(held));
}

Status ChunkManager::AcquireChunks(int k, const std::vector<int>& needed,
                                   std::span<const int> tensors, Phase phase) {
  Impl& im = *impl_;
  RETURN_IF_ERROR(FreeDeferred(k - kGradChunkHeldMoments));
  RETURN_IF_ERROR(FlushPrefetches());
  ASSIGN_OR_RETURN(bool off_trace, OffTrace(k, needed, tensors, phase));
  if (im.mode == Impl::Mode::kReplay && off_trace) {
    LeavePlan(k,
              " differs from the trace; on-demand until the iteration ends, then recording "
              "and planning again");
  }
  const bool timed = im.mode == Impl::Mode::kRecord || options_.measure_stalls || im.profiling;
  if (im.mode == Impl::Mode::kRecord) TraceMoment(needed, phase);
  // The moment's event, recorded when first needed: the gathers wait for it, evicted slots are
  // free after it, and timed moments measure from it (Note [One wait per moment]).
  while (im.moment_begin.size() <= static_cast<size_t>(k)) {
    Event b, s;
    ASSIGN_OR_RETURN(b, Event::Create(device_));
    ASSIGN_OR_RETURN(s, Event::Create(device_));
    im.moment_begin.push_back(std::move(b));
    im.moment_start.push_back(std::move(s));
  }
  if (timed) {
    RETURN_IF_ERROR(MomentEvent(k).status());
    im.moments_timed = k + 1;
  }
  for (int c : needed) {
    if (im.chunks[static_cast<size_t>(c)].cached) ++counters_.hits;
  }
  if (im.mode == Impl::Mode::kReplay) {
    for (int c : schedule_.moments[static_cast<size_t>(k)].evict) {
      if (Evictable(c)) continue;
      // The plan would drop a chunk still in use (a scope or unreduced gradients): the program
      // is not the one traced. Stay safe: on demand for the rest of the iteration.
      LeavePlan(k, ": the plan evicts chunk " + std::to_string(c) +
                       ", which is still in use; on-demand for this iteration");
      break;
    }
  }
  if (im.mode == Impl::Mode::kReplay) {
    RETURN_IF_ERROR(ReplayMoment(k, needed));
  } else {
    RETURN_IF_ERROR(OnDemandMoment(k, needed));
  }
  RETURN_IF_ERROR(WaitForNeeded(k, needed, phase));
  if (timed) {
    RETURN_IF_ERROR(
        device_.RecordEvent(im.moment_start[static_cast<size_t>(k)].handle(), compute_));
  }
  if (im.profiling) ProfileMoment(k);
  return Status::OK();
}

// The plan's decisions at moment k: its evictions, its misses now, its prefetches once the
// caller has queued the moment's compute (Note [Prefetches after the moment's compute is
// queued]).
Status ChunkManager::ReplayMoment(int k, const std::vector<int>& needed) {
  Impl& im = *impl_;
  const MomentDecision& d = schedule_.moments[static_cast<size_t>(k)];
  for (int c : d.evict) RETURN_IF_ERROR(Evict(c, k));
  for (int c : needed) {
    // Device-resident shards are never in the plan's gathers: they are the gathered copy.
    if (!im.chunks[static_cast<size_t>(c)].cached && ShardIsGathered(c)) {
      RETURN_IF_ERROR(Gather(c));
    }
  }
  if (!d.gather.empty()) RETURN_IF_ERROR(GathersStartNow(k));
  for (int c : d.gather) {
    if (im.chunks[static_cast<size_t>(c)].cached) continue;
    if (std::find(needed.begin(), needed.end(), c) != needed.end()) {
      ++counters_.misses;
      RETURN_IF_ERROR(Gather(c));
    } else {
      im.pending_prefetch.push_back(c);
    }
  }
  // Whatever a dropped prefetch left out is gathered now.
  return GatherMissing(k, needed, /*started=*/!d.gather.empty());
}

// Recording and on-demand moments gather what they need when they need it; on demand keeps
// only what this moment needs plus chunks still in use by live scopes.
Status ChunkManager::OnDemandMoment(int k, const std::vector<int>& needed) {
  Impl& im = *impl_;
  if (im.mode == Impl::Mode::kOnDemand) {
    for (int c = 0; c < layout_.num_chunks(); ++c) {
      const bool want = std::find(needed.begin(), needed.end(), c) != needed.end();
      if (!want && im.chunks[static_cast<size_t>(c)].cached && Evictable(c)) {
        RETURN_IF_ERROR(Evict(c, k));
      }
    }
  }
  return GatherMissing(k, needed, /*started=*/false);
}

// Gathers the needed chunks not on the device (misses), tying them to moment k first unless
// `started` says gathers of this moment were already issued.
Status ChunkManager::GatherMissing(int k, const std::vector<int>& needed, bool started) {
  Impl& im = *impl_;
  for (int c : needed) {
    if (im.chunks[static_cast<size_t>(c)].cached) continue;
    if (!started) RETURN_IF_ERROR(GathersStartNow(k));
    started = true;
    ++counters_.misses;
    RETURN_IF_ERROR(Gather(c));
  }
  return Status::OK();
}

Status ChunkManager::WaitForNeeded(int k, const std::vector<int>& needed, Phase phase) {
  Impl& im = *impl_;
  const Impl::ChunkRt* latest = nullptr;  // the needed gather recorded last, if not done
  for (int c : needed) {
    Impl::ChunkRt& rt = im.chunks[static_cast<size_t>(c)];
    TZ_CHECK(rt.cached) << "chunk " << c << " not gathered at moment " << k;
    if (!rt.ready_known_done) {
      ASSIGN_OR_RETURN(bool done, device_.EventDone(rt.ready.handle()));
      if (done) {
        rt.ready_known_done = true;
      } else if (latest == nullptr || rt.ready_seq > latest->ready_seq) {
        latest = &rt;
      }
    }
    if (phase == Phase::kBackward && SeparateGrads(c) && rt.grad_buf.data() == nullptr) {
      ASSIGN_OR_RETURN(rt.grad_buf, DeviceBuffer::Allocate(device_, layout_.chunk_bytes()));
      RETURN_IF_ERROR(device_.MemsetAsync(rt.grad_buf.data(), 0, layout_.chunk_bytes(), compute_));
    }
  }
  if (latest != nullptr) RETURN_IF_ERROR(device_.StreamWaitEvent(compute_, latest->ready.handle()));
  return Status::OK();
}

void ChunkManager::ProfileMoment(int) {
  Impl& im = *impl_;
  MomentProfile p;
  p.residency.resize(static_cast<size_t>(layout_.num_chunks()));
  for (int c = 0; c < layout_.num_chunks(); ++c) {
    const Impl::ChunkRt& rt = im.chunks[static_cast<size_t>(c)];
    const Tier tier = store_.param_tier(c);
    p.residency[static_cast<size_t>(c)] =
        rt.cached || tier == Tier::kDevice ? 'D' : (tier == Tier::kHost ? 'H' : 'N');
    if (rt.cached && !ShardIsGathered(c)) p.device_chunk_bytes += layout_.chunk_bytes();
    if (rt.grad_buf.data() != nullptr) p.device_chunk_bytes += layout_.chunk_bytes();
  }
  // Gradient chunks reduced but held (Note [A gradient chunk held past its reduction]).
  p.device_chunk_bytes += im.deferred_free.size() * layout_.chunk_bytes();
  p.nonmodel_bytes = tracer_.current_nonmodel();
  p.prefetch = im.pending_prefetch;
  im.profile.push_back(std::move(p));
}

// Note [A gradient chunk held past its reduction]
// A separate gradient chunk (accumulation, a device-resident shard, a tensor used twice in
// forward) is reduced at the Release of its last backward moment, by a copy queued on the D2H
// stream; its memory can go only once that copy has read it. Freed when the copy was seen done,
// the chunk lived a timing-dependent number of moments: `tierzero plan`, which counted it to its
// last backward moment, said a run fitted that then ran out of device memory in the next moment
// (hunt 39, P1). So the time is fixed: a chunk released at moment r is held through moments
// r + 1 .. r + kGradChunkHeldMoments, even when its copy is done, and freed at the Acquire after
// them, waiting for its copy there if it is not done. Two moments, not one: when the host waits
// there, the compute stream still has the two moments before queued (on a GPU the host runs
// ahead of it; one queued moment would leave it idle while the host enqueues the next, if the
// copy, a host-side accumulation or a collective behind it runs late). The plan counts the chunk
// over the same moments (Note [What the plan predicts], src/engine/plan.cc), so the device peak
// it predicts is the run's. The end of an iteration frees every one (ReleaseChunks). A model
// that holds a scope across moments (none here: the GPT releases each moment's scope before the
// next) reduces a chunk later than its last use, and holds it longer than the plan counts.
Status ChunkManager::FreeDeferred(int before) {
  auto& v = impl_->deferred_free;
  size_t keep = 0;
  Status first;
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i].released_at < before) {
      Status s = device_.SynchronizeEvent(v[i].done.handle());
      if (s.ok()) continue;  // its copy is done: freed when the vector shrinks
      if (first.ok()) first = std::move(s);
    }
    if (keep != i) v[keep] = std::move(v[i]);
    ++keep;
  }
  v.resize(keep);
  return first;
}

// Note [Prefetches after the moment's compute is queued]
// A gather is a handful of queue operations (and an io_uring submission for NVMe), cheap but
// not free: issuing the prefetches of a moment before returning from its Acquire delays the
// moment's compute by all of them (0.9 ms for the 26 chunks the plan fetches at the first moment
// of chunk_bench). They are issued at the next Release or Acquire instead, after the caller has
// queued the moment's compute. Their timing on the device does not change: the H2D stream
// already waits for the moment to begin (Note [Gathers start when their moment begins]), and
// nothing else is queued on it in between.
Status ChunkManager::FlushPrefetches() {
  Impl& im = *impl_;
  std::vector<int> later;  // shards the optimizer has not updated yet (one rank): next time
  for (int c : im.pending_prefetch) {
    if (im.chunks[static_cast<size_t>(c)].cached) continue;
    if (fence_ != nullptr && layout_.world_size() == 1 && !fence_->Ready(c)) {
      later.push_back(c);
      continue;
    }
    ++counters_.prefetches;
    // A prefetch that fails is dropped: the moment that needs the chunk gathers it on demand
    // and reports the error from its Acquire if it persists. Not with W > 1: the other ranks
    // did start its all_gather, so the sequences would part; the error ends the call.
    Status s = Gather(c);
    if (!s.ok() && layout_.world_size() > 1) {
      im.pending_prefetch.clear();
      return s;
    }
    if (!s.ok()) TZ_LOG(kWarn, kChunk) << "prefetch dropped: " << s.ToString();
  }
  im.pending_prefetch = std::move(later);
  return Status::OK();
}

Status ChunkManager::Release(std::span<const int> tensors, Phase phase) {
  Impl& im = *impl_;
  RETURN_IF_ERROR(im.ranks.OutOfStep());
  RETURN_IF_ERROR(states_->Release(tensors, phase));
  RETURN_IF_ERROR(FlushPrefetches());
  if (layout_.world_size() > 1) {
    RETURN_IF_ERROR(im.reduce->Finish(/*wait_all=*/false, /*wait_oldest=*/false));
  }
  if (im.mode != Impl::Mode::kReplay) {
    // Recording and on-demand iterations keep only chunks in COMPUTE on the device. A chunk
    // whose gradient went out through its slot is dropped too (ReduceChunk queued the copy).
    for (int t : tensors) {
      const int c = layout_.tensor(t).chunk;
      if (im.chunks[static_cast<size_t>(c)].cached && Evictable(c)) {
        RETURN_IF_ERROR(Evict(c));
      }
    }
  }
  return Status::OK();
}

void ChunkManager::ProfileNextIteration(Observer* observer, std::function<void()> on_begin) {
  impl_->observer = observer;
  impl_->on_profile_begin = std::move(on_begin);
}
bool ChunkManager::profiling() const { return impl_->profiling; }
bool ChunkManager::profile_pending() const { return impl_->observer != nullptr; }
const std::vector<ChunkManager::MomentProfile>& ChunkManager::moment_profiles() const {
  return impl_->profile;
}

void* ChunkManager::DevicePtr(int t) const {
  const TensorLoc& loc = layout_.tensor(t);
  const auto& rt = impl_->chunks[static_cast<size_t>(loc.chunk)];
  if (!rt.cached) return nullptr;
  return static_cast<uint8_t*>(rt.gathered) + DTypeBytes(layout_.dtype(), loc.offset);
}

void* ChunkManager::GradPtr(int t) const {
  const TensorLoc& loc = layout_.tensor(t);
  const auto& rt = impl_->chunks[static_cast<size_t>(loc.chunk)];
  if (SeparateGrads(loc.chunk)) {
    if (rt.grad_buf.data() == nullptr) return nullptr;
    return static_cast<uint8_t*>(rt.grad_buf.data()) + DTypeBytes(layout_.dtype(), loc.offset);
  }
  return DevicePtr(t);
}

}  // namespace tierzero
