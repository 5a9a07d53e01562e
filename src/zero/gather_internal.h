// Shared by the gather strategies (zero/gather.h) and the reduce strategies (zero/reduce.h).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "offload/pinned_arena.h"
#include "tierzero/communicator.h"
#include "zero/transfer.h"

namespace tierzero::internal {

// Each rank's block of a gather through host buffers carries a tag after its payload (chunk,
// moment, gather number), checked on arrival: ranks that somehow gather different chunks fail
// together with a message instead of computing on a chunk made of different chunks' shards.
struct GatherTag {
  int32_t chunk = -1;
  int32_t moment = -1;
  uint64_t seq = 0;
  bool operator==(const GatherTag&) const = default;
};

// OK when each of the `ranks` blocks of `block` bytes at `recv` carries `tag` at offset
// `payload`; else FailedPrecondition naming both gathers (`me`: this rank, for the message).
Status CheckTags(const uint8_t* recv, uint64_t block, uint64_t payload, const GatherTag& tag,
                 int ranks, int me);

// Pinned staging slots of `slot_bytes`, as many as `staging_bytes` holds (2 to 32), registered
// with the NVMe store as fixed buffers when any parameter shard is on NVMe.
StatusOr<std::unique_ptr<PinnedArena>> CreateStaging(TransferContext& ctx, uint64_t slot_bytes,
                                                     uint64_t staging_bytes);

// Staging slots of one shard for NVMe reads (UploadShard), or null when no parameter shard is on
// NVMe.
StatusOr<std::unique_ptr<PinnedArena>> CreateShardStaging(TransferContext& ctx,
                                                          uint64_t staging_bytes);

// Chunk c's local parameter shard in host memory, for a gather through host buffers to send:
// the host shard itself (with kGatherTagBytes free after it), or the NVMe shard read into
// `read_area` (on this thread; room for the shard and a tag).
StatusOr<uint8_t*> LocalShardOnHost(TransferContext& ctx, int c, uint8_t* read_area);

// Queues on `stream` the return of a gather's staging slot, unless `failed` is set by then (an
// abandoned all_gather may still write into it: it is never given back).
Status ReleaseAfterGather(Device& device, StreamHandle stream, PinnedSlot slot,
                          const std::shared_ptr<std::atomic<bool>>& failed);

// Queues the copy of chunk c's local shard from its tier to `dst` (device memory) on the H2D
// stream: D2D from a device shard, H2D from a host one, an NVMe shard read into a slot of
// `staging` (required then) and copied from there, the H2D stream waiting for the disk.
Status UploadShard(TransferContext& ctx, PinnedArena* staging, int c, void* dst);
Status UploadFromNvme(TransferContext& ctx, PinnedArena& staging, int c, void* dst);

// Queues the D2H copy of a gradient shard at `src` (device memory) into chunk c's gradient
// shard on the D2H stream; with `accumulate`, through a slot of `staging` and added in fp32.
Status CopyGradToShard(TransferContext& ctx, bool accumulate, PinnedArena* staging, int c,
                       const void* src);

// ---- The steps every gather through host buffers takes (HostGather, ZeroPPHostGather) --------

// A host gather's preconditions: a communicator of the shards' ranks and room for a tag after
// each host parameter shard.
Status CheckHostGather(TransferContext& ctx, Communicator& comm);

// What a gather through host buffers checks when its all_gather arrives: `ranks` blocks of
// `block` bytes at `recv`, each `payload` bytes and then the tag (`me`: this rank).
struct GatherArrival {
  const uint8_t* recv = nullptr;
  uint64_t block = 0, payload = 0;
  GatherTag tag;
  int ranks = 0, me = 0;
  std::string span;  // the comm span's name
  double comm_start = 0;
  int chunk = 0;
};

// The all_gather waited for on this thread, its span and its tags checked.
Status AwaitArrival(TransferContext& ctx, CommRequest& request, const GatherArrival& a);

// The same queued on the H2D stream (the comm thread completes an asynchronous all_gather), then
// `then` (the chunk's assembly; may be empty): neither the trainer nor the compute stream waits
// (Note [Collectives on the trainer's thread]). On a failure the staging slot is never given back
// (`failed`) and the ranks are out of step.
Status QueueArrival(TransferContext& ctx, std::shared_ptr<CommRequest> request,
                    const GatherArrival& a, std::function<Status()> then,
                    const std::shared_ptr<std::atomic<bool>>& failed);

// One H2D copy of a gathered chunk's bytes.
struct ChunkCopy {
  void* dst;
  const void* src;
  uint64_t bytes;
};

// The gathered chunk's way to the device on the H2D stream: the copies under one H2D span, the
// staging slot given back after them (ReleaseAfterGather), the timing's end and `ready` recorded.
Status QueueChunkToDevice(TransferContext& ctx, int c, const std::vector<ChunkCopy>& copies,
                          PinnedSlot staging, const std::shared_ptr<std::atomic<bool>>& failed,
                          GatherTimer::Timing* timing, const Event& ready);

// ---- The steps every reduction through host buffers takes (HostReduce, ZeroPPHostReduce) ----

// A free slot of `slots`, completing the oldest pending reduction (`finish_oldest`; false when
// none is pending) while every slot holds one.
StatusOr<PinnedSlot> FreeReduceSlot(PinnedArena& slots,
                                    const std::function<StatusOr<bool>()>& finish_oldest);

// The D2H copy of gradient chunk c from `device_grad` into `host` (chunk_bytes), with its span,
// waited for.
Status CopyGradChunkDown(TransferContext& ctx, int c, const void* device_grad, void* host);

}  // namespace tierzero::internal
