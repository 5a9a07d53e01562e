// SlabAllocator: hands out aligned ranges of one fixed region (a device slab), best fit, with
// neighbouring free ranges merged on free. It deals in offsets, so the same code serves the
// cudaMalloc slab of CudaDevice and the host slab of HostSimDevice, and fragmentation behaves
// the same on both.
//
// Thread-safety: none; the owning device serialises calls.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "core/memory_stat.h"
#include "core/mutex.h"
#include "core/status.h"

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

// DeviceSlab: a device's memory as one slab at `base` handed out by a SlabAllocator under a
// lock; what CudaDevice (a cudaMalloc slab) and HostSimDevice (an mmap slab) share.
//
// Thread-safety: every method from any thread.
class DeviceSlab {
 public:
  // `label` names the device in errors ("device 'hostsim'", "GPU 'H100'").
  DeviceSlab(uint8_t* base, uint64_t capacity, uint64_t alignment, std::string label)
      : base_(base),
        capacity_(capacity),
        label_(std::move(label)),
        allocator_(capacity, alignment) {}

  uint8_t* base() const { return base_; }
  bool Contains(const void* p) const {
    const auto* b = static_cast<const uint8_t*>(p);
    return b >= base_ && b < base_ + capacity_;
  }
  // InvalidArgument for 0 bytes; OutOfMemory naming the capacity, what is in use and the
  // largest free block.
  StatusOr<void*> Allocate(uint64_t bytes);
  // REQUIRES: `p` came from Allocate (aborts otherwise).
  void Free(void* p);
  MemoryStat stat() const;
  uint64_t largest_free_block() const;

 private:
  uint8_t* const base_;
  const uint64_t capacity_;
  const std::string label_;
  mutable Mutex mu_;
  SlabAllocator allocator_ TZ_GUARDED_BY(mu_);
};

}  // namespace tierzero
