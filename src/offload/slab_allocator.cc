#include "offload/slab_allocator.h"

#include "core/bytes.h"
#include "core/check.h"
#include "core/mutex.h"

namespace tierzero {

SlabAllocator::SlabAllocator(uint64_t capacity, uint64_t alignment)
    : capacity_(capacity), alignment_(alignment) {
  TZ_CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0) << alignment;
  TZ_CHECK(capacity % alignment == 0) << capacity << " % " << alignment;
  if (capacity > 0) InsertFree(0, capacity);
}

void SlabAllocator::InsertFree(uint64_t offset, uint64_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

void SlabAllocator::EraseFree(std::map<uint64_t, uint64_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_by_offset_.erase(it);
}

std::optional<uint64_t> SlabAllocator::Allocate(uint64_t bytes) {
  if (bytes > capacity_) {  // also keeps AlignUp below from wrapping around
    ++stat_.num_ooms;
    return std::nullopt;
  }
  const uint64_t size = AlignUp(bytes == 0 ? 1 : bytes, alignment_);
  auto best = free_by_size_.lower_bound({size, 0});
  if (best == free_by_size_.end()) {
    ++stat_.num_ooms;
    return std::nullopt;
  }
  const uint64_t offset = best->second;
  const uint64_t block = best->first;
  EraseFree(free_by_offset_.find(offset));
  if (block > size) InsertFree(offset + size, block - size);
  live_.emplace(offset, size);
  stat_.OnAlloc(size);
  return offset;
}

uint64_t SlabAllocator::Free(uint64_t offset) {
  auto it = live_.find(offset);
  TZ_CHECK(it != live_.end()) << "free of offset " << offset << " that is not allocated";
  uint64_t start = offset;
  uint64_t size = it->second;
  const uint64_t freed = size;
  live_.erase(it);
  stat_.OnFree(freed);
  // Merge with the free neighbours on both sides.
  auto next = free_by_offset_.lower_bound(start);
  if (next != free_by_offset_.end() && next->first == start + size) {
    size += next->second;
    EraseFree(next);
  }
  auto prev = free_by_offset_.lower_bound(start);
  if (prev != free_by_offset_.begin()) {
    --prev;
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      EraseFree(prev);
    }
  }
  InsertFree(start, size);
  return freed;
}

uint64_t SlabAllocator::largest_free_block() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

StatusOr<void*> DeviceSlab::Allocate(uint64_t bytes) {
  if (bytes == 0) return InvalidArgumentError("device allocation of 0 bytes");
  MutexLock lock(mu_);
  std::optional<uint64_t> offset = allocator_.Allocate(bytes);
  if (!offset) {
    return OutOfMemoryError(label_ + " cannot allocate " + FormatBytes(bytes) + ": capacity " +
                            FormatBytes(capacity_) + ", in use " +
                            FormatBytes(allocator_.stat().current) + ", largest free block " +
                            FormatBytes(allocator_.largest_free_block()) +
                            " (raise the device budget or lower what the run keeps on the device)");
  }
  return static_cast<void*>(base_ + *offset);
}

void DeviceSlab::Free(void* ptr) {
  if (ptr == nullptr) return;
  TZ_CHECK(Contains(ptr)) << "Free of " << ptr << ", which is not device memory of " << label_;
  MutexLock lock(mu_);
  allocator_.Free(static_cast<uint64_t>(static_cast<uint8_t*>(ptr) - base_));
}

MemoryStat DeviceSlab::stat() const {
  MutexLock lock(mu_);
  return allocator_.stat();
}

uint64_t DeviceSlab::largest_free_block() const {
  MutexLock lock(mu_);
  return allocator_.largest_free_block();
}

}  // namespace tierzero
