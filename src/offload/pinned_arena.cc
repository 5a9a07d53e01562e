#include "offload/pinned_arena.h"

#include <sys/mman.h>

#include <cerrno>
#include <utility>

#include "core/bytes.h"
#include "core/check.h"
#include "core/logging.h"
#include "core/mutex.h"

namespace tierzero {

PinnedSlot& PinnedSlot::operator=(PinnedSlot&& other) noexcept {
  if (this != &other) {
    Release();
    arena_ = std::exchange(other.arena_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    index_ = std::exchange(other.index_, 0);
  }
  return *this;
}

void PinnedSlot::Release() {
  if (arena_ != nullptr) arena_->Return(index_);
  arena_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

void PinnedSlot::Abandon() {
  if (arena_ != nullptr) arena_->GiveUp(index_);
  arena_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

StatusOr<std::unique_ptr<PinnedArena>> PinnedArena::Create(Device* device, uint64_t slot_bytes,
                                                           uint32_t num_slots, Pinning pinning) {
  if (slot_bytes == 0 || num_slots == 0) {
    return InvalidArgumentError("pinned arena needs slot_bytes > 0 and num_slots > 0, got " +
                                std::to_string(slot_bytes) + " and " + std::to_string(num_slots));
  }
  if (slot_bytes > (uint64_t{1} << 48) || num_slots > (1u << 24)) {
    return InvalidArgumentError("pinned arena of " + std::to_string(num_slots) + " slots of " +
                                std::to_string(slot_bytes) + " bytes is implausibly large");
  }
  const uint64_t slot = AlignUp(slot_bytes, kPinnedAlignment);
  const uint64_t total = slot * num_slots;
  if (total / num_slots != slot || total > (uint64_t{1} << 48)) {
    return OutOfMemoryError("pinned arena of " + std::to_string(num_slots) + " x " +
                            FormatBytes(slot) + " does not fit in the address space");
  }
  void* base = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    return ErrnoError("cannot map " + FormatBytes(total) + " for the pinned host arena", errno,
                      StatusCode::kOutOfMemory);
  }
  std::unique_ptr<PinnedArena> arena(
      new PinnedArena(device, static_cast<uint8_t*>(base), slot, num_slots));
  if (device != nullptr && device->info().caps.pinned_host) {
    Status st = device->RegisterHostMemory(base, total);
    if (st.ok()) {
      arena->registered_ = true;
    } else if (pinning == Pinning::kBestEffort) {
      TZ_LOG(kWarn, kOffload) << "cannot page-lock a " << FormatBytes(total) << " host buffer ("
                              << st.ToString()
                              << "); using it unlocked: its copies wait for the host";
    } else {
      return std::move(st).WithContext("registering the " + FormatBytes(total) +
                                       " pinned host arena");
    }
  }
  TZ_LOG(kInfo, kOffload) << "pinned arena: " << num_slots << " x " << FormatBytes(slot)
                          << (arena->registered_ ? ", page-locked" : "");
  return arena;
}

PinnedArena::PinnedArena(Device* device, uint8_t* base, uint64_t slot_bytes, uint32_t num_slots)
    : device_(device), base_(base), slot_bytes_(slot_bytes), num_slots_(num_slots) {
  free_.reserve(num_slots);
  for (uint32_t i = num_slots; i-- > 0;) free_.push_back(i);  // slot 0 handed out first
}

// Note [An abandoned slot]
// A collective that failed (a rank died, the ranks gathered different chunks) may still be
// writing into the staging slot it was given: the transport holds its address and no call takes
// it back. Such a slot is abandoned, not returned: never handed out again, and the arena's
// mapping is then kept (and stays registered) when the arena goes, so a late write lands in
// memory of ours rather than in whatever is mapped there next. The process is ending (the ranks
// are out of step) and the address space is given back at its exit. Before, the slot was kept
// out of the free list only, and the arena's destructor, finding it missing, aborted the run
// that was ending with an error.
PinnedArena::~PinnedArena() {
  uint32_t abandoned = 0;
  {
    MutexLock lock(mu_);
    abandoned = abandoned_;
    TZ_CHECK(free_.size() + abandoned_ == num_slots_)
        << num_slots_ - free_.size() - abandoned_ << " pinned slot(s) outlive the arena";
  }
  if (abandoned > 0) {
    TZ_LOG(kWarn, kOffload) << abandoned << " pinned slot(s) of a failed transfer were abandoned: "
                            << "the arena's " << FormatBytes(total_bytes())
                            << " stay mapped until the process ends";
    return;
  }
  if (registered_) {
    Status st = device_->UnregisterHostMemory(base_);
    if (!st.ok()) TZ_LOG(kWarn, kOffload) << "unregistering the pinned arena: " << st.ToString();
  }
  ::munmap(base_, total_bytes());
}

PinnedSlot PinnedArena::MakeSlot(uint32_t index) {
  PinnedSlot s;
  s.arena_ = this;
  s.index_ = index;
  s.data_ = base_ + static_cast<uint64_t>(index) * slot_bytes_;
  s.bytes_ = slot_bytes_;
  stat_.OnAlloc(slot_bytes_);
  return s;
}

std::optional<PinnedSlot> PinnedArena::TryAcquire() {
  MutexLock lock(mu_);
  if (free_.empty()) return std::nullopt;
  uint32_t index = free_.back();
  free_.pop_back();
  return MakeSlot(index);
}

StatusOr<PinnedSlot> PinnedArena::Acquire(std::chrono::milliseconds timeout) {
  MutexLock lock(mu_);
  if (!cv_.WaitFor(lock, timeout, [&]() TZ_REQUIRES(mu_) { return !free_.empty(); })) {
    return Status(StatusCode::kDeadlineExceeded, "no pinned slot became free within " +
                                                     std::to_string(timeout.count()) + " ms (all " +
                                                     std::to_string(num_slots_) + " slots of " +
                                                     FormatBytes(slot_bytes_) + " in use)");
  }
  uint32_t index = free_.back();
  free_.pop_back();
  return MakeSlot(index);
}

void PinnedArena::Return(uint32_t index) {
  {
    MutexLock lock(mu_);
    free_.push_back(index);
    stat_.OnFree(slot_bytes_);
  }
  cv_.NotifyOne();
}

void PinnedArena::GiveUp(uint32_t index) {
  MutexLock lock(mu_);
  ++abandoned_;
  stat_.OnFree(slot_bytes_);
  (void)index;  // (kept out of free_ for good)
}

MemoryStat PinnedArena::stat() const {
  MutexLock lock(mu_);
  return stat_;
}

}  // namespace tierzero
