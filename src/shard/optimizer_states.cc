#include "shard/optimizer_states.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>

#include "core/bytes.h"
#include "core/check.h"
#include "core/logging.h"
#include "offload/swapper.h"

namespace tierzero {

uint64_t OptimizerStates::SwapSlotBytes(uint64_t shard_elems) {
  return AlignUp(shard_elems * 12, kNvmeAlignment);
}

StatusOr<std::unique_ptr<OptimizerStates>> OptimizerStates::Create(Device* device, NvmeStore* nvme,
                                                                   uint64_t shard_elems,
                                                                   std::vector<Tier> tier) {
  for (Tier t : tier) {
    if (t == Tier::kDevice && device == nullptr) {
      return InvalidArgumentError("optimizer states placed on the device but no device is given");
    }
    if (t == Tier::kNvme && nvme == nullptr) {
      return InvalidArgumentError("optimizer states placed on NVMe but no NVMe store is open");
    }
  }
  std::unique_ptr<OptimizerStates> s(
      new OptimizerStates(device, nvme, shard_elems, std::move(tier)));
  RETURN_IF_ERROR(s->Allocate());
  return s;
}

OptimizerStates::~OptimizerStates() {
  for (const NvmeExtent& e : extent_) {
    if (e.valid()) (void)nvme_->Free(e);
  }
  if (host_registered_) (void)device_->UnregisterHostMemory(host_memory_.data());
}

Status OptimizerStates::Allocate() {
  const size_t n = tier_.size();
  host_.assign(n, nullptr);
  extent_.resize(n);
  device_group_.assign(n, nullptr);
  int on_host = 0, on_device = 0;
  for (Tier t : tier_) {
    on_host += t == Tier::kHost;
    on_device += t == Tier::kDevice;
  }
  if (on_host > 0) {
    host_memory_ = AlignedBuffer::Allocate(static_cast<uint64_t>(on_host) * group_bytes());
    if (host_memory_.data() == nullptr) {
      return OutOfMemoryError("optimizer states: " + FormatBytes(on_host * group_bytes()));
    }
    if (device_ != nullptr) {
      // Pinned, so the update phase's copies of streamed groups are asynchronous on a GPU.
      Status reg = device_->RegisterHostMemory(host_memory_.data(), host_memory_.bytes());
      if (reg.ok()) {
        host_registered_ = true;
      } else {
        TZ_LOG(kWarn, kEngine) << "optimizer states not page-locked: " << reg.ToString();
      }
    }
  }
  if (on_device > 0) {
    auto mem = DeviceBuffer::Allocate(*device_, static_cast<uint64_t>(on_device) * group_bytes());
    if (!mem.ok()) {
      return std::move(mem).status().WithContext(
          "optimizer states of " + std::to_string(on_device) + " groups on the device");
    }
    device_memory_ = std::move(mem).value();
    ASSIGN_OR_RETURN(stream_, Stream::Create(*device_, "optimizer-states"));
  }
  bool any_nvme = false;
  int h = 0, d = 0;
  for (size_t c = 0; c < n; ++c) {
    if (tier_[c] == Tier::kNvme) {
      ASSIGN_OR_RETURN(extent_[c], nvme_->Allocate(group_bytes()));
      any_nvme = true;
    } else if (tier_[c] == Tier::kDevice) {
      device_group_[c] =
          static_cast<uint8_t*>(device_memory_.data()) + static_cast<uint64_t>(d++) * group_bytes();
    } else {
      host_[c] = reinterpret_cast<float*>(host_memory_.data()) +
                 static_cast<uint64_t>(h++) * 3 * shard_elems_;
    }
  }
  if (any_nvme) {
    ASSIGN_OR_RETURN(swap_arena_, PinnedArena::Create(nullptr, SwapSlotBytes(shard_elems_), 3));
    Status reg = nvme_->RegisterBuffers({{swap_arena_->base(), swap_arena_->total_bytes()}});
    if (!reg.ok()) {
      TZ_LOG(kWarn, kEngine) << "optimizer swap buffers not registered: " << reg.ToString();
    }
  }
  return Status::OK();
}

OptimizerGroup OptimizerStates::Group(int chunk, void* data) const {
  auto* f = static_cast<float*>(data);
  return {chunk, f, f + shard_elems_, f + 2 * shard_elems_};
}

OptimizerGroup OptimizerStates::Resident(int chunk) const {
  const size_t c = static_cast<size_t>(chunk);
  TZ_CHECK(tier(chunk) != Tier::kNvme) << "chunk " << chunk << "'s optimizer states are on NVMe";
  return Group(chunk, tier(chunk) == Tier::kDevice ? device_group_[c] : host_[c]);
}

Status OptimizerStates::WithDevice(int chunk, bool fresh, bool write_back,
                                   const OptimizerGroupFn& fn) {
  if (bounce_.data() == nullptr) {
    bounce_ = AlignedBuffer::Allocate(group_bytes());
    if (bounce_.data() == nullptr) {
      return OutOfMemoryError("the bounce buffer of a device optimizer group (" +
                              FormatBytes(group_bytes()) + ")");
    }
  }
  void* dev = device_group_[static_cast<size_t>(chunk)];
  if (!fresh) {
    RETURN_IF_ERROR(device_->CopyAsync(bounce_.data(), dev, group_bytes(), CopyKind::kDeviceToHost,
                                       stream_.handle()));
    RETURN_IF_ERROR(stream_.Synchronize());
  }
  RETURN_IF_ERROR(fn(Group(chunk, bounce_.data())));
  if (!write_back) return Status::OK();
  RETURN_IF_ERROR(device_->CopyAsync(dev, bounce_.data(), group_bytes(), CopyKind::kHostToDevice,
                                     stream_.handle()));
  return stream_.Synchronize();
}

Status OptimizerStates::Init(const OptimizerGroupFn& fn) {
  // NVMe groups are written behind: while one slot's write is in flight the next group is
  // filled in another (a 2B-parameter model writes 24 GB here). Every write is waited for before
  // returning, also on error (Ticket's destructor blocks until its I/O is done).
  struct InFlight {
    PinnedSlot slot;
    NvmeStore::Ticket ticket;
  };
  std::deque<InFlight> writes;
  auto retire_oldest = [&]() -> Status {
    Status s = writes.front().ticket.Wait();
    writes.pop_front();
    return s;
  };
  // (No swap arena without NVMe groups.)
  const size_t max_in_flight = swap_arena_ ? std::max<size_t>(1, swap_arena_->num_slots() - 1) : 1;
  for (int c = 0; c < num_chunks(); ++c) {
    if (tier(c) == Tier::kDevice) {
      RETURN_IF_ERROR(WithDevice(c, /*fresh=*/true, /*write_back=*/true, fn));
      continue;
    }
    if (tier(c) != Tier::kNvme) {
      RETURN_IF_ERROR(fn(Group(c, host_[static_cast<size_t>(c)])));
      continue;
    }
    if (writes.size() >= max_in_flight) RETURN_IF_ERROR(retire_oldest());
    ASSIGN_OR_RETURN(PinnedSlot slot, swap_arena_->Acquire(SwapSlotTimeout()));
    RETURN_IF_ERROR(fn(Group(c, slot.data())));
    ASSIGN_OR_RETURN(NvmeStore::Ticket ticket,
                     nvme_->SubmitWrite(extent_[static_cast<size_t>(c)], slot.data()));
    writes.push_back({std::move(slot), std::move(ticket)});
    counters_.nvme_write_bytes += group_bytes();
  }
  while (!writes.empty()) RETURN_IF_ERROR(retire_oldest());
  return Status::OK();
}

Status OptimizerStates::ForEach(const OptimizerGroupFn& fn, bool write_back,
                                const std::function<bool(int)>& include) {
  std::vector<int> on_nvme, on_device;
  std::vector<NvmeExtent> extents;
  for (int c = 0; c < num_chunks(); ++c) {
    if (include && !include(c)) continue;
    if (tier(c) == Tier::kNvme) {
      on_nvme.push_back(c);
      extents.push_back(extent_[static_cast<size_t>(c)]);
      continue;
    }
    if (tier(c) == Tier::kDevice) {
      on_device.push_back(c);
      continue;
    }
    RETURN_IF_ERROR(fn(Group(c, host_[static_cast<size_t>(c)])));
  }
  for (int c : on_device) RETURN_IF_ERROR(WithDevice(c, /*fresh=*/false, write_back, fn));
  if (on_nvme.empty()) return Status::OK();
  SwapOptions so;
  so.write_back = write_back;
  const auto t0 = std::chrono::steady_clock::now();
  Status s = RunSwapPipeline(
      *nvme_, extents, *swap_arena_,
      [&](size_t i, void* data) -> Status { return fn(Group(on_nvme[i], data)); }, so);
  counters_.nvme_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const uint64_t bytes = extents.size() * group_bytes();
  counters_.nvme_read_bytes += bytes;
  if (write_back) counters_.nvme_write_bytes += bytes;
  return s;
}

Status OptimizerStates::With(int chunk, bool write_back, const OptimizerGroupFn& fn) {
  if (chunk < 0 || chunk >= num_chunks()) return InvalidArgumentError("unknown chunk");
  const size_t c = static_cast<size_t>(chunk);
  if (tier(chunk) == Tier::kDevice) return WithDevice(chunk, /*fresh=*/false, write_back, fn);
  if (tier(chunk) != Tier::kNvme) return fn(Group(chunk, host_[c]));
  ASSIGN_OR_RETURN(PinnedSlot slot, swap_arena_->Acquire(SwapSlotTimeout()));
  RETURN_IF_ERROR(nvme_->Read(extent_[c], slot.data()));
  RETURN_IF_ERROR(fn(Group(chunk, slot.data())));
  if (write_back) RETURN_IF_ERROR(nvme_->Write(extent_[c], slot.data()));
  return Status::OK();
}

StatusOr<OptimizerStates::NvmeRates> OptimizerStates::MeasureNvmeRates(int rounds) {
  int first = -1;
  for (int c = 0; c < num_chunks() && first < 0; ++c) {
    if (tier(c) == Tier::kNvme) first = c;
  }
  if (first < 0) return NvmeRates{};
  const NvmeExtent& e = extent_[static_cast<size_t>(first)];
  ASSIGN_OR_RETURN(PinnedSlot slot, swap_arena_->Acquire(SwapSlotTimeout()));
  ASSIGN_OR_RETURN(PinnedSlot other, swap_arena_->Acquire(SwapSlotTimeout()));
  using Clock = std::chrono::steady_clock;
  auto secs = [](Clock::time_point a, Clock::time_point b) {
    return std::max(std::chrono::duration<double>(b - a).count(), 1e-9);
  };
  std::vector<double> rd, wr, both;
  for (int r = 0; r < std::max(rounds, 1); ++r) {
    auto t0 = Clock::now();
    RETURN_IF_ERROR(nvme_->Read(e, slot.data()));
    auto t1 = Clock::now();
    RETURN_IF_ERROR(nvme_->Write(e, slot.data()));
    auto t2 = Clock::now();
    // A read and a write of the same bytes at once (both slots hold the group's contents, so
    // whichever lands first, the extent and the read see the same bytes).
    {
      ASSIGN_OR_RETURN(NvmeStore::Ticket w, nvme_->SubmitWrite(e, slot.data()));
      ASSIGN_OR_RETURN(NvmeStore::Ticket rt, nvme_->SubmitRead(e, other.data()));
      RETURN_IF_ERROR(w.Wait());
      RETURN_IF_ERROR(rt.Wait());
    }
    auto t3 = Clock::now();
    rd.push_back(secs(t0, t1));
    wr.push_back(secs(t1, t2));
    both.push_back(secs(t2, t3));
  }
  std::sort(rd.begin(), rd.end());
  std::sort(wr.begin(), wr.end());
  std::sort(both.begin(), both.end());
  const double bytes = static_cast<double>(group_bytes());
  return NvmeRates{bytes / rd[rd.size() / 2], bytes / wr[wr.size() / 2],
                   2 * bytes / both[both.size() / 2]};
}

}  // namespace tierzero
