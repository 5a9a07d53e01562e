// GatherStrategy: how a chunk's parameters reach device memory from this rank's shard and, with
// W > 1, the other ranks' shards. One strategy is chosen when the chunk manager is created:
//
//   LocalGather   one rank: the shard is the chunk; copied H2D from host memory, read from NVMe
//                 into a pinned staging slot then copied, or copied D2D from a device shard.
//   HostGather    W ranks over a host communicator (MPI): the local shard and a tag are
//                 all-gathered into a pinned staging slot on the trainer's thread, and the W
//                 shards copied H2D (Note [Collectives on the trainer's thread] in gather_host.cc).
//   DeviceGather  W ranks with device collectives (NCCL, or host functions on the simulated
//                 device): the local shard is copied to its place in the chunk and the others
//                 all-gathered around it in place (Note [Gathers on the device] in gather.cc).
//
// A new way of gathering (quantized weights, a secondary partition) is one more implementation
// of this interface and one more case in the engine's choice (engine/setup.cc).
//
// Thread-safety: the trainer's thread calls a strategy (through the chunk manager).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "comm/device_collectives.h"
#include "core/status.h"
#include "offload/pinned_arena.h"
#include "tierzero/communicator.h"
#include "zero/transfer.h"

namespace tierzero {

// Room after each shard in a HostGather block for its tag; host parameter shards keep it free
// (ShardStoreOptions::host_param_tail_bytes).
inline constexpr uint64_t kGatherTagBytes = 64;

struct GatherOptions {
  // Pinned memory for NVMe reads on their way to the device (and, HostGather, for the
  // all_gather's blocks), in slots of one shard (HostGather: one gathered chunk), at least 2 and
  // at most 32. A gather through a slot holds it until its H2D copy is done; when all are busy
  // the caller waits (the tunable TZ_STAGING_TIMEOUT_S at most).
  uint64_t staging_bytes = uint64_t{256} << 20;
};

class GatherStrategy {
 public:
  virtual ~GatherStrategy() = default;

  // An iteration begins (HostGather numbers its gathers' tags from 0).
  virtual void BeginIteration() {}

  // Queues the gather of `chunk` into `dst` (chunk_bytes of device memory) and records `ready`
  // on the stream that completes it. With W > 1 a failure leaves the ranks out of step (the
  // chunk manager records it: RankAgreement::LoseStep).
  virtual Status Enqueue(int chunk, void* dst, const Event& ready) = 0;
  // After a failed Enqueue: returns once nothing queued can still touch `dst` or a staging slot.
  virtual void Quiesce() = 0;
  // `ready` is recorded on a stream other than the H2D stream (the comm stream), which the next
  // gather into the same memory does not wait for by itself.
  virtual bool ReadyOffH2D() const { return false; }
  // Every gather passes through a staging slot, whatever the shard's tier (the plan keeps its
  // prefetches within the slots: Note [Prefetches within the staging slots] in plan.cc).
  virtual bool StagesEveryChunk() const { return false; }
  // Gathers that can hold a staging slot at once (0: no staging).
  virtual int staging_slots() const = 0;
};

StatusOr<std::unique_ptr<GatherStrategy>> CreateLocalGather(TransferContext& ctx,
                                                            const GatherOptions& options);
// `comm` (asynchronous or not) must outlive the strategy; host parameter shards need
// kGatherTagBytes after them.
StatusOr<std::unique_ptr<GatherStrategy>> CreateHostGather(TransferContext& ctx, Communicator& comm,
                                                           const GatherOptions& options);
StatusOr<std::unique_ptr<GatherStrategy>> CreateDeviceGather(TransferContext& ctx,
                                                             DeviceCollectives& comm,
                                                             const GatherOptions& options);

// The staging timeout (the tunable TZ_STAGING_TIMEOUT_S, default 120 s).
std::chrono::milliseconds StagingTimeout();

// Pinned staging slots of `slot_bytes` within `staging_bytes`: at least 2, at most 32.
int StagingSlotCount(uint64_t slot_bytes, uint64_t staging_bytes);
// A staging slot of the host-buffer gather: a send area (an NVMe shard read, plus its tag), then
// the W tagged blocks. Its send area alone is the first term.
uint64_t HostGatherSendAreaBytes(uint64_t shard_bytes);
uint64_t HostGatherSlotBytes(uint64_t shard_bytes, int world_size);

}  // namespace tierzero
