// SlabAllocator: hands out aligned ranges of one fixed region (a device slab), best fit, with
// neighbouring free ranges merged on free. It deals in offsets, so the same code serves the
// cudaMalloc slab of CudaDevice and the host slab of HostSimDevice, and fragmentation behaves
// the same on both.
//
// Thread-safety: none; the owning device serialises calls.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "core/memory_stat.h"

namespace tierzero {

class SlabAllocator {
 public:
  // REQUIRES: alignment is a power of two; capacity is a multiple of it.
  SlabAllocator(uint64_t capacity, uint64_t alignment);

  // The offset of a new range of `bytes` rounded up to the alignment, or nullopt when no free
  // range is large enough (counted in stat().num_ooms).
  std::optional<uint64_t> Allocate(uint64_t bytes);
  // Returns the range starting at `offset` and the bytes it held.
  // REQUIRES: `offset` is the start of a live allocation (aborts otherwise: a double free).
  uint64_t Free(uint64_t offset);
  // Size of the live allocation at `offset`, or 0 when there is none.
  uint64_t AllocationSize(uint64_t offset) const;

  uint64_t capacity() const { return capacity_; }
  uint64_t largest_free_block() const;
  const MemoryStat& stat() const { return stat_; }

 private:
  void InsertFree(uint64_t offset, uint64_t size);
  void EraseFree(std::map<uint64_t, uint64_t>::iterator it);

  uint64_t capacity_;
  uint64_t alignment_;
  std::map<uint64_t, uint64_t> free_by_offset_;           // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;  // (size, offset)
  std::map<uint64_t, uint64_t> live_;                     // offset -> size
  MemoryStat stat_;
};

}  // namespace tierzero
