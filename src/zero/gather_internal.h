// Shared by the gather strategies (zero/gather.h) and the reduce strategies (zero/reduce.h).
#pragma once

#include <memory>

#include "offload/pinned_arena.h"
#include "zero/transfer.h"

namespace tierzero::internal {

// Pinned staging slots of `slot_bytes`, as many as `staging_bytes` holds (2 to 32), registered
// with the NVMe store as fixed buffers when any parameter shard is on NVMe.
StatusOr<std::unique_ptr<PinnedArena>> CreateStaging(TransferContext& ctx, uint64_t slot_bytes,
                                                     uint64_t staging_bytes);

}  // namespace tierzero::internal
