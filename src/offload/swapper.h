// Swapper: streams NVMe-resident blocks through a computation with disk and compute overlapped:
// while block i is computed, block i+1 is being read and block i-1 written back
// (read(i+1) | compute(i) | write(i-1)), using a bounded number of pinned buffers. The optimizer
// uses it for NVMe-resident shards, so the step costs max(disk time, Adam time), not the sum.
//
// Thread-safety: one pipeline per call; `compute` runs on the calling thread (it may itself be
// parallel) and is never called concurrently with itself.
#pragma once

#include <chrono>
#include <functional>
#include <span>

#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"

namespace tierzero {

struct SwapOptions {
  // Pinned buffers used, at least 3 (one reading, one computing, one writing); more lets reads
  // run further ahead. Default: 3.
  int buffers = 3;
  // Write each block back after compute. Default: true.
  bool write_back = true;
};

// For each extent in order: read it into a pinned slot, call compute(i, slot_data), write the
// slot back. REQUIRES: arena slots hold NvmeStore::RoundedBytes of every extent. Stops at the
// first error (I/O, or compute's Status) after waiting for the I/O in flight, and returns it with
// the block index as context; blocks after the failed one are neither computed nor written.
// How long a swap waits for a free pinned slot (the tunable TZ_SWAP_SLOT_TIMEOUT_S, 60 s).
std::chrono::milliseconds SwapSlotTimeout();

Status RunSwapPipeline(NvmeStore& store, std::span<const NvmeExtent> extents, PinnedArena& arena,
                       const std::function<Status(size_t index, void* data)>& compute,
                       const SwapOptions& options = {});

}  // namespace tierzero
