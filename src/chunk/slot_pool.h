// SlotPool: the device memory gathered chunks live in after a plan: one region of chunk-sized
// slots, as many as the plan ever holds at once (recording iterations allocate per chunk
// instead). A slot is refilled only after the compute stream is done with its previous chunk
// (the event recorded when it was evicted) and any gradient copy out of it has finished.
//
// Thread-safety: the trainer's thread only.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "offload/device.h"

namespace tierzero {

class SlotPool {
 public:
  // Replaces the region with `slots` slots of `slot_bytes` (none when 0).
  Status Reserve(Device& device, int slots, uint64_t slot_bytes);
  // Frees the region.
  void Clear();

  bool has_free() const { return !free_.empty(); }
  // Takes a free slot and makes `stream` wait until its last chunk is no longer in use.
  StatusOr<int> Take(Device& device, StreamHandle stream);
  // Gives a slot back unused (nothing was queued into it).
  void Untake(int slot) { free_.push_back(slot); }
  void* data(int slot) const {
    return static_cast<uint8_t*>(region_.data()) + static_cast<uint64_t>(slot) * slot_bytes_;
  }

  // Gives a slot back once the compute stream is past `last_use` (an event recorded after the
  // chunk's last use), or, when null, past everything queued on `compute` so far.
  Status Free(Device& device, int slot, EventHandle last_use, StreamHandle compute);
  // A gradient copy out of the slot was queued on `stream`: the next chunk waits for it.
  Status CopyingOut(Device& device, int slot, StreamHandle stream);
  // The end of an iteration: every stream is synchronised, no copy is pending.
  void ForgetCopies();
  // The whole region, for use between iterations (no slot holds a chunk then).
  void* region() const { return region_.data(); }
  uint64_t region_bytes() const { return region_.bytes(); }

 private:
  DeviceBuffer region_;
  uint64_t slot_bytes_ = 0;
  std::vector<int> free_;
  // The compute stream is done with the slot's chunk once this event completes: the moment
  // event of the Acquire that evicted it, or the slot's own event (done_) recorded then.
  std::vector<EventHandle> last_use_;
  std::vector<Event> done_;
  std::vector<Event> copy_out_;  // D2H of gradients out of the slot done
  std::vector<bool> copy_pending_;
};

}  // namespace tierzero
