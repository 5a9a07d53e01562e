#include "shard/optimizer_states.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <utility>

#include "core/bytes.h"
#include "core/check.h"
#include "core/logging.h"
#include "offload/swapper.h"  // SwapSlotTimeout

namespace tierzero {

uint64_t GroupLayout::moment_offset(int which) const {
  const uint64_t moment = AlignUp(MomentWidth(format) * shard_elems, 64);
  return AlignUp(4 * shard_elems, 64) + static_cast<uint64_t>(which) * moment;
}

uint64_t GroupLayout::scale_offset(int which) const {
  const uint64_t scales = format == StateFormat::kInt8 ? AlignUp(4 * scale_blocks, 64) : 0;
  return moment_offset(2) + static_cast<uint64_t>(which) * scales;
}

uint64_t GroupLayout::bytes() const {
  // fp32: master | m | v, 12 bytes an element as they always were.
  return format == StateFormat::kF32 ? 12 * shard_elems : scale_offset(2);
}

OptimizerGroup GroupLayout::At(int chunk, void* memory) const {
  auto* base = static_cast<uint8_t*>(memory);
  OptimizerGroup g;
  g.chunk = chunk;
  g.format = format;
  g.master = reinterpret_cast<float*>(base);
  if (format == StateFormat::kF32) {
    g.m = g.master + shard_elems;
    g.v = g.master + 2 * shard_elems;
    return g;
  }
  g.m_state = base + moment_offset(0);
  g.v_state = base + moment_offset(1);
  if (format == StateFormat::kInt8) {
    g.m_scale = reinterpret_cast<float*>(base + scale_offset(0));
    g.v_scale = reinterpret_cast<float*>(base + scale_offset(1));
  }
  return g;
}

uint64_t OptimizerStates::SwapSlotBytes(const GroupLayout& layout) {
  return AlignUp(layout.bytes(), kNvmeAlignment);
}

StatusOr<std::unique_ptr<OptimizerStates>> OptimizerStates::Create(Device* device, NvmeStore* nvme,
                                                                   uint64_t shard_elems,
                                                                   std::vector<Tier> tier,
                                                                   StateFormat format,
                                                                   uint64_t scale_blocks) {
  if (format == StateFormat::kInt8 && scale_blocks < StateScaleCount(shard_elems)) {
    return InvalidArgumentError("8-bit optimizer states need at least " +
                                std::to_string(StateScaleCount(shard_elems)) +
                                " scale blocks a group, not " + std::to_string(scale_blocks));
  }
  for (Tier t : tier) {
    if (t == Tier::kDevice && device == nullptr) {
      return InvalidArgumentError("optimizer states placed on the device but no device is given");
    }
    if (t == Tier::kNvme && nvme == nullptr) {
      return InvalidArgumentError("optimizer states placed on NVMe but no NVMe store is open");
    }
  }
  GroupLayout layout;
  layout.shard_elems = shard_elems;
  layout.format = format;
  layout.scale_blocks = format == StateFormat::kInt8 ? scale_blocks : 0;
  std::unique_ptr<OptimizerStates> s(new OptimizerStates(device, nvme, layout, std::move(tier)));
  RETURN_IF_ERROR(s->Allocate());
  return s;
}

OptimizerStates::~OptimizerStates() {
  (void)Settle();  // nothing in flight into an extent about to be freed
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
      host_[c] =
          static_cast<uint8_t*>(host_memory_.data()) + static_cast<uint64_t>(h++) * group_bytes();
    }
  }
  if (any_nvme) {
    ASSIGN_OR_RETURN(swap_arena_, PinnedArena::Create(nullptr, SwapSlotBytes(layout_), 3));
    Status reg = nvme_->RegisterBuffers({{swap_arena_->base(), swap_arena_->total_bytes()}});
    if (!reg.ok()) {
      TZ_LOG(kWarn, kEngine) << "optimizer swap buffers not registered: " << reg.ToString();
    }
  }
  return Status::OK();
}

OptimizerGroup OptimizerStates::Group(int chunk, void* data) const {
  return layout_.At(chunk, data);
}

OptimizerGroup OptimizerStates::Resident(int chunk) const {
  const size_t c = static_cast<size_t>(chunk);
  TZ_CHECK(tier(chunk) != Tier::kNvme) << "chunk " << chunk << "'s optimizer states are on NVMe";
  return Group(chunk, tier(chunk) == Tier::kDevice ? device_group_[c] : host_[c]);
}

void* OptimizerStates::SwapHost(int chunk, void* replacement) {
  TZ_CHECK(tier(chunk) == Tier::kHost) << "chunk " << chunk << "'s states are not in host memory";
  return std::exchange(host_[static_cast<size_t>(chunk)], replacement);
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
  RETURN_IF_ERROR(Settle());
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

// Note [Optimizer I/O around the step]
// The update phase's NVMe groups cost read + Adam + write each, overlapped as a pipeline in the
// three swap slots (read(i+1) | Adam(i) | write(i-1)); what the pipeline cannot hide is its
// first read and its last writes. Both move out of the phase: the engine calls Prefetch while
// backward computes (the states do not depend on the gradients), so up to three groups are read
// before the phase starts, and the phase returns with its last writes in flight (write_behind),
// to finish behind the next forward. No memory is added: prefetched reads and writes behind
// live in the same three swap slots, which the host budget already counts (the engine's fixed
// host bytes). Staged data is never stale: a group is read only after its own write behind has
// completed (WaitWrites), every other access (With, Init, the rate probe) first Settles, and a
// ForEach over groups other than those staged drops the staged reads. An error of a write
// behind surfaces at the next call that retires it, naming the chunk.
Status OptimizerStates::RetireWrite() {
  InFlight w = std::move(writes_.front());
  writes_.pop_front();
  Status s = w.ticket.Wait();
  if (s.ok()) return Status::OK();
  // The slot still holds the states: one more try, synchronously, before they are lost.
  const NvmeExtent& e = extent_[static_cast<size_t>(w.chunk)];
  Status again = nvme_->Write(e, w.slot.data());
  if (again.ok()) {
    TZ_LOG(kWarn, kEngine) << "writing chunk " << w.chunk << "'s optimizer states failed once ("
                           << s.ToString() << "); written again";
    return Status::OK();
  }
  // The group's states are lost: every later access reports it (sticky, the first such group),
  // not only this call.
  Status lost = std::move(again).WithContext(
      "writing chunk " + std::to_string(w.chunk) +
      "'s optimizer states behind the step (failed twice; its states on disk are lost: resume "
      "from the last checkpoint)");
  if (failed_.ok()) failed_ = lost;
  return lost;
}

Status OptimizerStates::WaitWrites(int chunk) {
  while (std::any_of(writes_.begin(), writes_.end(),
                     [&](const InFlight& w) { return w.chunk == chunk; })) {
    RETURN_IF_ERROR(RetireWrite());
  }
  return Status::OK();
}

StatusOr<std::optional<PinnedSlot>> OptimizerStates::FreeSlot() {
  for (;;) {
    if (std::optional<PinnedSlot> slot = swap_arena_->TryAcquire()) return slot;
    if (writes_.empty()) return std::optional<PinnedSlot>();
    RETURN_IF_ERROR(RetireWrite());
  }
}

StatusOr<bool> OptimizerStates::StartRead(int chunk) {
  RETURN_IF_ERROR(WaitWrites(chunk));
  ASSIGN_OR_RETURN(std::optional<PinnedSlot> slot, FreeSlot());
  if (!slot) return false;
  RETURN_IF_ERROR(Stage(chunk, std::move(*slot)));
  return true;
}

Status OptimizerStates::Stage(int chunk, PinnedSlot slot) {
  ASSIGN_OR_RETURN(NvmeStore::Ticket t,
                   nvme_->SubmitRead(extent_[static_cast<size_t>(chunk)], slot.data()));
  reads_.push_back({chunk, std::move(slot), std::move(t)});
  counters_.nvme_read_bytes += group_bytes();
  return Status::OK();
}

Status OptimizerStates::Settle() {
  Status first = failed_;
  while (!writes_.empty()) {
    Status s = RetireWrite();
    if (first.ok() && !s.ok()) first = std::move(s);
  }
  reads_.clear();  // each Ticket waits for its read, then the slot returns
  return first;
}

StatusOr<int> OptimizerStates::Prefetch(const std::function<bool(int)>& include) {
  RETURN_IF_ERROR(failed_);
  if (!swap_arena_) return 0;
  // Completed writes behind give their slots back; none is waited for.
  while (!writes_.empty() && writes_.front().ticket.Done()) RETURN_IF_ERROR(RetireWrite());
  size_t k = 0;  // the staged reads are a prefix of the groups in order
  for (int c = 0; c < num_chunks(); ++c) {
    if (tier(c) != Tier::kNvme || (include && !include(c))) continue;
    if (k < reads_.size()) {
      if (reads_[k].chunk != c) break;  // staged for another selection: leave it
      ++k;
      continue;
    }
    // A group whose own write is still in flight is not waited for here.
    if (std::any_of(writes_.begin(), writes_.end(),
                    [&](const InFlight& w) { return w.chunk == c && !w.ticket.Done(); })) {
      break;
    }
    std::optional<PinnedSlot> slot = swap_arena_->TryAcquire();
    if (!slot) break;
    RETURN_IF_ERROR(WaitWrites(c));  // done: retired without blocking
    RETURN_IF_ERROR(Stage(c, std::move(*slot)));
    ++k;
  }
  return static_cast<int>(reads_.size());
}

Status OptimizerStates::ForEach(const OptimizerGroupFn& fn, bool write_back,
                                const std::function<bool(int)>& include, bool write_behind) {
  RETURN_IF_ERROR(failed_);
  std::vector<int> on_nvme, on_device;
  for (int c = 0; c < num_chunks(); ++c) {
    if (include && !include(c)) continue;
    if (tier(c) == Tier::kNvme) {
      on_nvme.push_back(c);
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
  // Staged reads of other groups than these, in this order, are dropped.
  for (size_t k = 0; k < reads_.size(); ++k) {
    if (k >= on_nvme.size() || reads_[k].chunk != on_nvme[k]) {
      reads_.clear();
      break;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  // On every way out: the I/O time counted; without write_behind (or after an error) nothing
  // left in flight.
  struct AtExit {
    OptimizerStates* s;
    bool settle;
    std::chrono::steady_clock::time_point t0;
    ~AtExit() {
      if (settle) (void)s->Settle();
      s->counters_.nvme_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  } at_exit{this, true, t0};
  // The pipeline: group i computed while group i+1 is read and earlier groups are written.
  size_t next = reads_.size();  // the next group whose read is to start
  for (size_t i = 0; i < on_nvme.size(); ++i) {
    if (next == i) {
      ASSIGN_OR_RETURN(bool started, StartRead(on_nvme[next]));
      if (!started) return InternalError("no swap slot free for the optimizer pipeline's read");
      ++next;
    }
    if (next < on_nvme.size() && next == i + 1) {
      ASSIGN_OR_RETURN(bool started, StartRead(on_nvme[next]));
      next += started ? 1 : 0;
    }
    InFlight r = std::move(reads_.front());
    reads_.pop_front();
    Status s = r.ticket.Wait();
    if (s.ok()) s = fn(Group(r.chunk, r.slot.data()));
    if (!s.ok()) {
      return std::move(s).WithContext("optimizer group of chunk " + std::to_string(r.chunk) +
                                      " (NVMe)");
    }
    if (!write_back) continue;  // the slot returns here
    ASSIGN_OR_RETURN(NvmeStore::Ticket w,
                     nvme_->SubmitWrite(extent_[static_cast<size_t>(r.chunk)], r.slot.data()));
    writes_.push_back({r.chunk, std::move(r.slot), std::move(w)});
    counters_.nvme_write_bytes += group_bytes();
  }
  at_exit.settle = false;
  if (!write_behind) {
    while (!writes_.empty()) RETURN_IF_ERROR(RetireWrite());
  }
  return Status::OK();
}

Status OptimizerStates::With(int chunk, bool write_back, const OptimizerGroupFn& fn) {
  RETURN_IF_ERROR(failed_);
  if (chunk < 0 || chunk >= num_chunks()) return InvalidArgumentError("unknown chunk");
  const size_t c = static_cast<size_t>(chunk);
  if (tier(chunk) == Tier::kDevice) return WithDevice(chunk, /*fresh=*/false, write_back, fn);
  if (tier(chunk) != Tier::kNvme) return fn(Group(chunk, host_[c]));
  RETURN_IF_ERROR(Settle());
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
  RETURN_IF_ERROR(Settle());
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
