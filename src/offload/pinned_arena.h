// PinnedArena: one large host allocation carved into equal, 4 KiB-aligned slots, page-locked
// with the device (cudaHostRegister) when the device supports it, so NVMe -> pinned -> GPU
// needs no bounce copy and O_DIRECT can read straight into a slot.
//
// Slots are handed out as move-only PinnedSlot owners that return themselves on destruction.
//
// Thread-safety: TryAcquire, Acquire and slot release may be called from any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "core/memory_stat.h"
#include "core/mutex.h"
#include "core/status.h"
#include "offload/device.h"

namespace tierzero {

// Alignment and size granularity of slots: O_DIRECT's requirement on every disk we target.
inline constexpr uint64_t kPinnedAlignment = 4096;

class PinnedArena;

class PinnedSlot {
 public:
  PinnedSlot() = default;
  PinnedSlot(PinnedSlot&& other) noexcept { *this = std::move(other); }
  PinnedSlot& operator=(PinnedSlot&& other) noexcept;
  ~PinnedSlot() { Release(); }
  PinnedSlot(const PinnedSlot&) = delete;
  PinnedSlot& operator=(const PinnedSlot&) = delete;

  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  uint32_t index() const { return index_; }
  bool valid() const { return arena_ != nullptr; }
  // Returns the slot to the arena now.
  void Release();
  // Gives the slot up for good: a transfer that was abandoned (a failed collective) may still
  // write into it, so it is never handed out again, and the arena's memory then outlives the
  // arena (Note [An abandoned slot]).
  void Abandon();

 private:
  friend class PinnedArena;
  PinnedArena* arena_ = nullptr;
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
  uint32_t index_ = 0;
};

class PinnedArena {
 public:
  // Reserves num_slots slots of slot_bytes (rounded up to kPinnedAlignment) and registers them
  // with `device` when it has caps.pinned_host (device may be null: no registration).
  // REQUIRES: `device` outlives the arena (the destructor unregisters through it).
  // InvalidArgument for zero sizes; OutOfMemory when the memory cannot be had; the device's
  // error (with context) when registration fails.
  // With kBestEffort a failed registration is logged and the arena kept unregistered: copies
  // to and from it are then synchronous on a GPU, but correct (for buffers created mid-run,
  // whose registration failing must not fail a step).
  enum class Pinning { kRequired, kBestEffort };
  static StatusOr<std::unique_ptr<PinnedArena>> Create(Device* device, uint64_t slot_bytes,
                                                       uint32_t num_slots,
                                                       Pinning pinning = Pinning::kRequired);
  ~PinnedArena();
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  // A free slot, or nullopt when all are in use.
  std::optional<PinnedSlot> TryAcquire();
  // Waits up to `timeout` for a free slot; DeadlineExceeded names the arena's size if none came.
  StatusOr<PinnedSlot> Acquire(std::chrono::milliseconds timeout);

  uint64_t slot_bytes() const { return slot_bytes_; }
  uint32_t num_slots() const { return num_slots_; }
  void* base() const { return base_; }
  uint64_t total_bytes() const { return slot_bytes_ * num_slots_; }
  bool registered() const { return registered_; }
  // Bytes of slots in use.
  MemoryStat stat() const;

 private:
  friend class PinnedSlot;
  PinnedArena(Device* device, uint8_t* base, uint64_t slot_bytes, uint32_t num_slots);
  PinnedSlot MakeSlot(uint32_t index) TZ_REQUIRES(mu_);
  void Return(uint32_t index);
  void GiveUp(uint32_t index);

  Device* device_;
  uint8_t* base_;
  uint64_t slot_bytes_;
  uint32_t num_slots_;
  bool registered_ = false;
  mutable Mutex mu_;
  CondVar cv_;
  std::vector<uint32_t> free_ TZ_GUARDED_BY(mu_);
  uint32_t abandoned_ TZ_GUARDED_BY(mu_) = 0;  // slots given up (Abandon)
  MemoryStat stat_ TZ_GUARDED_BY(mu_);
};

}  // namespace tierzero
