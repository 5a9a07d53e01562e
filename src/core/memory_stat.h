// Memory statistics in the manner of PyTorch's CUDACachingAllocator: per pool, the bytes in use
// now, the peak, and the cumulative bytes allocated and freed. Devices, the pinned arena and the
// activation allocator report these; the profiler reads snapshots and never reaches inside.
#pragma once

#include <algorithm>
#include <cstdint>

namespace tierzero {

struct MemoryStat {
  uint64_t current = 0;    // bytes in use now
  uint64_t peak = 0;       // highest `current` since creation
  uint64_t allocated = 0;  // cumulative bytes handed out
  uint64_t freed = 0;      // cumulative bytes returned
  uint64_t num_allocs = 0;
  uint64_t num_frees = 0;
  uint64_t num_ooms = 0;  // requests refused for lack of capacity

  void OnAlloc(uint64_t bytes) {
    current += bytes;
    allocated += bytes;
    ++num_allocs;
    peak = std::max(peak, current);
  }
  void OnFree(uint64_t bytes) {
    current -= bytes;
    freed += bytes;
    ++num_frees;
  }
};

}  // namespace tierzero
