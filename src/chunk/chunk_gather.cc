// ChunkManager: gathers into slots, evictions, and the reduction of a gradient chunk once its
// backward is complete. How the bytes move is the gather and reduce strategies' (zero/gather.h,
// zero/reduce.h); where they land and when memory is free again is decided here.
#include <cstring>

#include "chunk/chunk_manager.h"
#include "chunk/chunk_manager_impl.h"
#include "core/check.h"

namespace tierzero {

Status ChunkManager::Gather(int c) {
  Impl& im = *impl_;
  Impl::ChunkRt& rt = im.chunks[static_cast<size_t>(c)];
  TZ_CHECK(!rt.cached) << "gather of cached chunk " << c;
  if (fence_ != nullptr) {
    // The shard's update must be finished first (Note [The update phase behind the next
    // forward]); a failed update fails the gather, on every rank that had it fail.
    Status current = fence_->Await(c);
    if (!current.ok() && layout_.world_size() > 1) current = im.ranks.LoseStep(std::move(current));
    if (!current.ok()) {
      return std::move(current).WithContext("gathering chunk " + std::to_string(c) +
                                            ", whose optimizer update had not finished");
    }
  }
  if (ShardIsGathered(c)) {
    rt.gathered = store_.device_param(c);
    rt.cached = true;
    rt.ready_known_done = true;
    return Status::OK();
  }
  const std::string where =
      "gathering chunk " + std::to_string(c) + " at moment " + std::to_string(im.ctx.moment);
  if (im.slots.has_free()) {
    ASSIGN_OR_RETURN(rt.slot, im.slots.Take(device_, im.ctx.h2d.handle()));
    rt.gathered = im.slots.data(rt.slot);
  } else {
    auto buf = DeviceBuffer::Allocate(device_, layout_.chunk_bytes());
    if (!buf.ok()) return std::move(buf).status().WithContext(where);
    rt.own = std::move(buf).value();
    rt.gathered = rt.own.data();
  }
  Status st = im.gather->Enqueue(c, rt.gathered, rt.ready);
  // With W > 1 a gather one rank could not queue leaves the ranks' collectives out of step (every
  // strategy's, so it is said here once).
  if (!st.ok() && layout_.world_size() > 1) st = im.ranks.LoseStep(std::move(st));
  if (!st.ok()) {
    // Nothing queued may still touch the slot, the buffer or a staging slot once we give them
    // back.
    im.gather->Quiesce();
    if (rt.slot >= 0) im.slots.Untake(rt.slot);
    rt.slot = -1;
    rt.own.Reset();
    rt.gathered = nullptr;
    return std::move(st).WithContext(where);
  }
  rt.ready_known_done = false;
  rt.ready_seq = ++im.ready_records;
  rt.cached = true;
  return Status::OK();
}

Status ChunkManager::Evict(int c, int moment) {
  Impl& im = *impl_;
  Impl::ChunkRt& rt = im.chunks[static_cast<size_t>(c)];
  if (!rt.cached) return Status::OK();
  rt.cached = false;
  rt.grads_in_slot = false;
  ++counters_.evictions;
  if (ShardIsGathered(c)) {
    rt.gathered = nullptr;
    return Status::OK();
  }
  if (rt.slot >= 0) {
    // A gather the compute stream never waited for (a prefetch dropped off the trace) may still
    // be writing the slot on the comm stream, which the next gather's H2D copy does not wait for.
    EventHandle moment_event{};  // recorded before the wait below (Note [One wait per moment])
    if (moment >= 0) {
      ASSIGN_OR_RETURN(moment_event, MomentEvent(moment));
    }
    const bool waited = im.gather->ReadyOffH2D() && !rt.ready_known_done;
    if (waited) RETURN_IF_ERROR(device_.StreamWaitEvent(compute_, rt.ready.handle()));
    // The moment's event follows the chunk's last use; after the wait, everything enqueued on
    // the compute stream so far does (the pool records the slot's own event).
    RETURN_IF_ERROR(
        im.slots.Free(device_, rt.slot, waited ? EventHandle{} : moment_event, compute_));
    rt.slot = -1;
  } else {
    // A recording iteration: free the memory once the compute stream (and any gradient copy)
    // is done with it, so warm-up never holds more than the chunks in COMPUTE.
    Event done;
    ASSIGN_OR_RETURN(done, Event::Create(device_));
    RETURN_IF_ERROR(device_.RecordEvent(done.handle(), compute_));
    RETURN_IF_ERROR(done.Synchronize());
    RETURN_IF_ERROR(rt.ready.Synchronize());  // a gather the compute stream never waited for
    RETURN_IF_ERROR(im.ctx.d2h.Synchronize());
    rt.own.Reset();
  }
  rt.gathered = nullptr;
  return Status::OK();
}

// Note [Gathers start when their moment begins]
// The trainer's thread runs ahead of the compute stream (all work is asynchronous), so it reaches
// moment k's Acquire long before the device does. The plan decided what to gather "when moment k
// begins" on the device, so the H2D stream first waits for the compute stream to get there. This
// keeps on-demand gathers on demand (they would otherwise prefetch by accident, and the
// comparison in chunk_bench would mean nothing), and the plan's prefetches at the distance the
// plan chose, which the slot budget was checked for.
// Note [One wait per moment]
// Every stream operation costs something: driver time on the caller's thread with CUDA, a
// hand-off between threads on HostSim. So an Acquire queues as little as it can on the compute
// stream (nothing at all when its chunks are all in place and not timed):
//   - At most one event (moment_begin[k]), recorded when first needed, before any wait the
//     Acquire queues there. Its gathers wait for it (Note [Gathers start when their moment
//     begins]), and a slot it evicts is free once it completes: everything the caller queued
//     before this Acquire includes the evicted chunk's last use. (An eviction that must first
//     wait for its chunk's collective records the slot's own event after that wait.)
//   - At most one wait, for the needed chunk whose gather was recorded last. Every gather's
//     ready event is recorded on the same in-order stream (the H2D stream, or the comm stream
//     on the device collective path; device-resident shards have none), in ready_seq order, so
//     when the last is done, so are the others.
// It used to be one event per evicted slot, one more for the gathers, one wait per chunk.
StatusOr<EventHandle> ChunkManager::MomentEvent(int k) {
  Impl& im = *impl_;
  const EventHandle e = im.moment_begin[static_cast<size_t>(k)].handle();
  if (im.event_acquire != im.acquires) {
    RETURN_IF_ERROR(device_.RecordEvent(e, compute_));
    im.event_acquire = im.acquires;
  }
  return e;
}

Status ChunkManager::GathersStartNow(int k) {
  ASSIGN_OR_RETURN(EventHandle e, MomentEvent(k));
  return device_.StreamWaitEvent(impl_->ctx.h2d.handle(), e);
}

bool ChunkManager::Evictable(int c) const {
  // A chunk holding some, not all, of its in-place gradients keeps its slot until reduced.
  return states_->ChunkEvictable(c) &&
         (SeparateGrads(c) || !states_->ChunkBackwardStarted(c) || states_->ChunkGradsReady(c));
}

bool ChunkManager::ShardIsGathered(int c) const {
  return layout_.world_size() == 1 && store_.param_tier(c) == Tier::kDevice;
}

// Gradients go to a separate grad chunk with accumulation, for device-resident shards on one rank
// (the gathered copy is the shard), and for chunks with a tensor used more than once in forward
// (its first backward use would otherwise overwrite the weight its second one still reads).
bool ChunkManager::SeparateGrads(int c) const {
  if (options_.grad_accumulation || ShardIsGathered(c)) {
    return true;
  }
  for (int t : layout_.chunk(c).tensors) {
    if (states_->forward_uses(t) > 1) return true;
  }
  return false;
}

// Called when every tensor of chunk c is HOLD_AFTER_BWD: its gradient goes to the host.
Status ChunkManager::ReduceChunk(int c) {
  const StreamHandle d2h = impl_->ctx.d2h.handle();
  Event written;
  ASSIGN_OR_RETURN(written, Event::Create(device_));
  RETURN_IF_ERROR(device_.RecordEvent(written.handle(), compute_));
  RETURN_IF_ERROR(device_.StreamWaitEvent(d2h, written.handle()));
  RETURN_IF_ERROR(SeparateGrads(c) ? ReduceSeparate(c, written) : ReduceInSlot(c, written));
  if (impl_->grad_final && impl_->reduce->final_on_d2h()) {
    RETURN_IF_ERROR(device_.LaunchHostFunc(d2h, [fn = impl_->grad_final, c] { fn(c); }));
  }
  return Status::OK();
}

// The gradient was written over the parameters in the chunk's slot.
Status ChunkManager::ReduceInSlot(int c, const Event& written) {
  Impl& im = *impl_;
  Impl::ChunkRt& rt = im.chunks[static_cast<size_t>(c)];
  const StreamHandle d2h = im.ctx.d2h.handle();
  if (!rt.cached) {
    // No tensor of the chunk had a backward use: its gradient is zero (on every rank: the
    // ranks' moments agree).
    return store_.ZeroGrad(c);
  }
  // Tensors without a backward use still hold parameters in the slot: zero them first.
  for (int t : layout_.chunk(c).tensors) {
    if (states_->backward_uses(t) > 0) continue;
    const TensorLoc& loc = layout_.tensor(t);
    RETURN_IF_ERROR(device_.MemsetAsync(
        static_cast<uint8_t*>(rt.gathered) + DTypeBytes(layout_.dtype(), loc.offset), 0,
        DTypeBytes(layout_.dtype(), loc.numel), compute_));
  }
  RETURN_IF_ERROR(device_.RecordEvent(written.handle(), compute_));
  RETURN_IF_ERROR(device_.StreamWaitEvent(d2h, written.handle()));
  RETURN_IF_ERROR(im.reduce->Reduce(c, rt.gathered, written).status());
  if (rt.slot >= 0) RETURN_IF_ERROR(im.slots.CopyingOut(device_, rt.slot, d2h));
  rt.grads_in_slot = true;
  return Status::OK();
}

// The gradient is in its own grad chunk, freed once the copy out of it is done.
//
// Note [A gradient chunk's memory outlives only its reads]
// The event FreeDeferred waits for is recorded right after the last operation that reads the
// chunk (the copy or fp32 add out of it, on the D2H stream), not after the whole reduction:
// behind that copy the D2H stream may run host functions (the host-side fp32 accumulation of a
// micro-batch's gradient, a profiled iteration's span stamps), and on CUDA every stream's host
// functions may run one after another on one driver thread, behind an H2D host function that
// waits for an NVMe read. The trainer's wait at Acquire would then wait for them, not for the
// memory (review 40, F1). Strategies whose last read is elsewhere (a collective's, which the
// D2H stream waits for before copying its result) are covered by the copy after it; one that
// records nothing gets the event after the whole reduction, as before.
Status ChunkManager::ReduceSeparate(int c, const Event& written) {
  Impl& im = *impl_;
  Impl::ChunkRt& rt = im.chunks[static_cast<size_t>(c)];
  if (rt.grad_buf.data() == nullptr) {
    // No backward use: zero without accumulation, nothing to add with it.
    return options_.grad_accumulation ? Status::OK() : store_.ZeroGrad(c);
  }
  // (Held as long even when the strategy waited for its copy: Note [A gradient chunk held past
  // its reduction].)
  Impl::Deferred d;
  ASSIGN_OR_RETURN(d.done, Event::Create(device_));
  im.ctx.grad_source_read = &d.done;
  im.ctx.grad_source_recorded = false;
  const Status reduced = im.reduce->Reduce(c, rt.grad_buf.data(), written).status();
  im.ctx.grad_source_read = nullptr;
  RETURN_IF_ERROR(reduced);
  // A strategy whose last read of the chunk is not a copy on the D2H stream: after all of it.
  if (!im.ctx.grad_source_recorded) {
    RETURN_IF_ERROR(device_.RecordEvent(d.done.handle(), im.ctx.d2h.handle()));
  }
  d.released_at = im.ctx.moment - 1;
  d.buf = std::move(rt.grad_buf);
  im.deferred_free.push_back(std::move(d));
  return Status::OK();
}

}  // namespace tierzero
