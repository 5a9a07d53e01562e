// The CPU chain's device gradient shards fetched one group ahead (Note [A CPU group's device
// gradient fetched ahead]).
#include <algorithm>

#include "update/updater.h"

namespace tierzero {

TZ_TUNABLE(bool, kGradFetchAhead, "TZ_GRAD_FETCH_AHEAD", true,
           "copy the CPU chain's next device gradient shard over while this group's Adam runs");

// Note [A CPU group's device gradient fetched ahead]
// A group the CPU updates whose gradient shard is on the device (its fp32 accumulation shard:
// Note [Accumulating on the device for host updates]) needs that shard in host memory first. One
// copy at a time before each Adam put the link's time in series with the CPU's: per 17.8M-element
// group on the H100 machine about 1.4 ms of copy to 5 ms of Adam. So the chain fetches one group
// ahead: before a group's Adam starts, the next group's copy is issued on a stream of its own
// into the other of two pinned slots, and a group's Adam waits only for its own copy's event.
// The order is OptimizerStates::ForEach's (host groups, then device groups, then NVMe ones, each
// in chunk order); a group found out of that order reads its shard as before, synchronously.
// The slots hold a gradient only within one chain (FetchEnd drains the stream and forgets them:
// the next step's gradients differ). The same bytes reach the same Adam, so nothing changes but
// the time; the cost model overlaps each copy with the Adam before it (Simulate, cost_model.cc).
// `TZ_GRAD_FETCH_AHEAD=0` turns it off. The two slots (pinned, two gradient shards: 136 MB for
// the 1.21B GPT's fp32 shards) are outside the host budget's fixed buffers, as the one bounce
// slot before them was. Made in the first chain that needs them, so a failure to page-lock them
// there leaves them unlocked (correct, the copies then wait) rather than failing the step.
Status Updater::FetchBegin(const std::function<bool(int)>& takes) {
  fetch_.order.clear();
  fetch_.issued = 0;
  fetch_.held[0] = fetch_.held[1] = -1;
  if (!kGradFetchAhead.Get()) return Status::OK();
  const int n = layout_.num_chunks();
  fetch_.position.assign(static_cast<size_t>(n), -1);
  for (const Tier t : {Tier::kHost, Tier::kDevice, Tier::kNvme}) {
    for (int c = 0; c < n; ++c) {
      if (optimizer().tier(c) != t || !takes(c) || !store_->grad_on_device(c)) continue;
      fetch_.position[static_cast<size_t>(c)] = static_cast<int>(fetch_.order.size());
      fetch_.order.push_back(c);
    }
  }
  if (fetch_.order.empty()) return Status::OK();
  if (!fetch_.arena) {
    ASSIGN_OR_RETURN(
        std::unique_ptr<PinnedArena> arena,
        PinnedArena::Create(device_, store_->grad_bytes(), 2, PinnedArena::Pinning::kBestEffort));
    ASSIGN_OR_RETURN(Stream stream, Stream::Create(*device_, "optimizer-grad-fetch"));
    std::vector<PinnedSlot> slots;
    std::vector<Event> done;
    for (int k = 0; k < 2; ++k) {
      std::optional<PinnedSlot> slot = arena->TryAcquire();
      if (!slot) return InternalError("the gradient fetch's slots are taken");
      slots.push_back(std::move(*slot));
      ASSIGN_OR_RETURN(Event e, Event::Create(*device_));
      done.push_back(std::move(e));
    }
    fetch_.arena = std::move(arena);
    fetch_.slots = std::move(slots);
    fetch_.done = std::move(done);
    fetch_.stream.emplace(std::move(stream));
  }
  return FetchNext(-1);  // the first group's copy
}

// Issues copies up to one group past `chunk` (-1: the first), each into the slot the group two
// places before it held.
Status Updater::FetchNext(int chunk) {
  if (fetch_.order.empty()) return Status::OK();
  const int at = chunk < 0 ? -1 : fetch_.position[static_cast<size_t>(chunk)];
  if (chunk >= 0 && at < 0) return Status::OK();  // not a fetched group
  const size_t want = std::min(fetch_.order.size(), static_cast<size_t>(at + 2));
  while (fetch_.issued < want) {
    const size_t k = fetch_.issued;
    const int c = fetch_.order[k];
    const size_t s = k % 2;
    fetch_.held[s] = -1;  // until its copy is enqueued
    RETURN_IF_ERROR(device_->CopyAsync(fetch_.slots[s].data(), store_->grad(c),
                                       store_->grad_bytes(), CopyKind::kDeviceToHost,
                                       fetch_.stream->handle()));
    RETURN_IF_ERROR(fetch_.done[s].Record(*fetch_.stream));
    fetch_.held[s] = c;
    moved_d2h_ += store_->grad_bytes();
    ++fetch_.issued;
  }
  return Status::OK();
}

void Updater::FetchEnd() {
  if (fetch_.stream) (void)fetch_.stream->Synchronize();
  fetch_.held[0] = fetch_.held[1] = -1;
  fetch_.order.clear();
  fetch_.issued = 0;
}

}  // namespace tierzero
