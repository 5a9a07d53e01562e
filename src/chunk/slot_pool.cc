#include "chunk/slot_pool.h"

#include <algorithm>

namespace tierzero {

Status SlotPool::Reserve(Device& device, int slots, uint64_t slot_bytes) {
  Clear();
  slot_bytes_ = slot_bytes;
  if (slots > 0) {
    auto region = DeviceBuffer::Allocate(device, static_cast<uint64_t>(slots) * slot_bytes);
    if (!region.ok()) {
      return std::move(region).status().WithContext("reserving " + std::to_string(slots) +
                                                    " chunk slots for the plan");
    }
    region_ = std::move(region).value();
  }
  for (int s = 0; s < slots; ++s) {
    free_.push_back(slots - 1 - s);
    Event a, b;
    ASSIGN_OR_RETURN(a, Event::Create(device));
    ASSIGN_OR_RETURN(b, Event::Create(device));
    last_use_.push_back(EventHandle{});
    done_.push_back(std::move(a));
    copy_out_.push_back(std::move(b));
  }
  copy_pending_.assign(static_cast<size_t>(slots), false);
  return Status::OK();
}

void SlotPool::Clear() {
  region_.Reset();
  free_.clear();
  last_use_.clear();
  done_.clear();
  copy_out_.clear();
  copy_pending_.clear();
}

StatusOr<int> SlotPool::Take(Device& device, StreamHandle stream) {
  const int s = free_.back();
  free_.pop_back();
  const size_t i = static_cast<size_t>(s);
  if (last_use_[i].impl != nullptr) RETURN_IF_ERROR(device.StreamWaitEvent(stream, last_use_[i]));
  if (copy_pending_[i]) {
    RETURN_IF_ERROR(device.StreamWaitEvent(stream, copy_out_[i].handle()));
    copy_pending_[i] = false;
  }
  return s;
}

Status SlotPool::Free(Device& device, int slot, EventHandle last_use, StreamHandle compute) {
  const size_t i = static_cast<size_t>(slot);
  if (last_use.impl != nullptr) {
    last_use_[i] = last_use;
  } else {
    RETURN_IF_ERROR(device.RecordEvent(done_[i].handle(), compute));
    last_use_[i] = done_[i].handle();
  }
  free_.push_back(slot);
  return Status::OK();
}

Status SlotPool::CopyingOut(Device& device, int slot, StreamHandle stream) {
  const size_t i = static_cast<size_t>(slot);
  RETURN_IF_ERROR(device.RecordEvent(copy_out_[i].handle(), stream));
  copy_pending_[i] = true;
  return Status::OK();
}

void SlotPool::ForgetCopies() { std::fill(copy_pending_.begin(), copy_pending_.end(), false); }

}  // namespace tierzero
