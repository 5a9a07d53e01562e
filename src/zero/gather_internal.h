// Shared by the gather strategies (zero/gather.h) and the reduce strategies (zero/reduce.h).
#pragma once

#include <memory>

#include "offload/pinned_arena.h"
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

// Queues the copy of chunk c's local shard from its tier to `dst` (device memory) on the H2D
// stream: D2D from a device shard, H2D from a host one, an NVMe shard read into a slot of
// `staging` (required then) and copied from there, the H2D stream waiting for the disk.
Status UploadShard(TransferContext& ctx, PinnedArena* staging, int c, void* dst);
Status UploadFromNvme(TransferContext& ctx, PinnedArena& staging, int c, void* dst);

// Queues the D2H copy of a gradient shard at `src` (device memory) into chunk c's gradient
// shard on the D2H stream; with `accumulate`, through a slot of `staging` and added in fp32.
Status CopyGradToShard(TransferContext& ctx, bool accumulate, PinnedArena* staging, int c,
                       const void* src);

}  // namespace tierzero::internal
