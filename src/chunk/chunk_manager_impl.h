// ChunkManager internals shared by chunk_manager.cc (the moment loop), chunk_gather.cc
// (gathers, evictions, reductions) and chunk_manager_end.cc (the end of an iteration, the plan).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "chunk/chunk_manager.h"
#include "chunk/slot_pool.h"
#include "comm/rank_agreement.h"
#include "zero/gather.h"
#include "zero/reduce.h"
#include "zero/transfer.h"

namespace tierzero {

struct ChunkManager::Impl {
  Impl(Device& device, StreamHandle compute, ShardStore& store, Communicator* comm)
      : ranks(comm), ctx(device, compute, store, ranks) {}

  RankAgreement ranks;
  TransferContext ctx;  // the copy streams, counters, spans, gather timer; ctx.moment
  std::unique_ptr<GatherStrategy> gather;
  std::unique_ptr<ReduceStrategy> reduce;
  SlotPool slots;  // after a plan

  struct ChunkRt {
    bool cached = false;
    void* gathered = nullptr;
    int slot = -1;     // pool slot, or -1
    DeviceBuffer own;  // recording iterations: one allocation per gathered chunk
    Event ready;       // gather complete
    bool ready_known_done = true;
    uint64_t ready_seq = 0;  // order of the gather's ready record (Note [One wait per moment])
    DeviceBuffer grad_buf;   // separate gradient chunk (accumulation, device-resident shards)
    bool grads_in_slot = false;
  };
  std::vector<ChunkRt> chunks;

  enum class Mode { kRecord, kReplay, kOnDemand };
  Mode mode = Mode::kRecord;
  bool inference = false;  // the iteration neither traces nor reduces
  bool record_next = true;
  // Per moment: the compute stream reached its Acquire (recorded first, before evictions and
  // waits), and its waits are done (timed moments only).
  std::vector<Event> moment_begin, moment_start;
  uint64_t ready_records = 0;           // ready events recorded so far (ChunkRt::ready_seq)
  uint64_t acquires = 0;                // Acquire calls so far
  uint64_t event_acquire = 0;           // the Acquire call that last recorded its moment's event
  std::vector<int> pending_prefetch;    // decided at an Acquire, issued just after
  std::function<void(int)> grad_final;  // SetGradFinalCallback
  int moments_timed = 0;                // moments with begin/start events this iteration
  double measured_seconds[kNumTiers] = {0, 0, 0};  // mean gather time per Tier; 0 = unmeasured
  Event iteration_end;
  // Separate gradient chunks whose reduction is queued: freed kGradChunkHeldMoments moments after
  // the one that released them, once `done` (recorded after the last read of the chunk on the
  // D2H stream) has passed (Note [A gradient chunk held past its reduction], FreeDeferred; Note
  // [A gradient chunk's memory outlives only its reads]).
  struct Deferred {
    DeviceBuffer buf;
    Event done;
    int released_at = 0;  // the moment whose Release reduced it
  };
  std::vector<Deferred> deferred_free;

  // Profiling (ProfileNextIteration).
  Observer* observer = nullptr;  // armed when set and not yet profiling
  std::function<void()> on_profile_begin;
  bool profiling = false;
  std::vector<MomentProfile> profile;
};

}  // namespace tierzero
