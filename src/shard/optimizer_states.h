// OptimizerStates: the fp32 master weights, m and v of every chunk's shard (shard_elems each),
// in host memory, in device memory (a group the device updates in place, Twin-Flow style:
// docs/optimizer.md) or, per chunk, in one NVMe extent; and the optimizer groups through which
// the step, a checkpoint and the parameter accessors reach them. An NVMe group is streamed through
// a few pinned swap slots (offload/swapper.h): read, handed to the caller, written back; a device
// group is handed to host callers through a bounce buffer, copied there and back synchronously.
//
// Thread-safety: one thread calls; `fn` runs on that thread.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/state_format.h"
#include "core/status.h"
#include "offload/device.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"
#include "offload/tier.h"

namespace tierzero {

// One chunk's optimizer state, in memory for the duration of a call: the fp32 master and the
// moments, fp32 (m, v) or compressed (m_state, v_state and with kInt8 their block scales).
struct OptimizerGroup {
  int chunk = -1;
  float* master = nullptr;
  float* m = nullptr;  // kF32 only
  float* v = nullptr;
  StateFormat format = StateFormat::kF32;
  void* m_state = nullptr;  // kBF16, kInt8
  void* v_state = nullptr;
  float* m_scale = nullptr;  // kInt8: GroupLayout::scale_blocks each
  float* v_scale = nullptr;
};

// Where a group's parts lie in its memory: [master][m][v][m scales][v scales], each 64-byte
// aligned. `scale_blocks`: the 8-bit scales per moment, enough for every slice's blocks
// (Note [8-bit blocks per slice] in update/updater.cc).
struct GroupLayout {
  uint64_t shard_elems = 0;
  StateFormat format = StateFormat::kF32;
  uint64_t scale_blocks = 0;
  uint64_t moment_offset(int which) const;  // 0: m, 1: v
  uint64_t scale_offset(int which) const;
  uint64_t bytes() const;  // the whole group
  OptimizerGroup At(int chunk, void* memory) const;
};
using OptimizerGroupFn = std::function<Status(const OptimizerGroup&)>;

struct OptimizerCounters {
  uint64_t nvme_read_bytes = 0;
  uint64_t nvme_write_bytes = 0;
  double nvme_seconds = 0;  // in the swap pipeline of ForEach
};

class OptimizerStates {
 public:
  // `tier[c]` is kHost, kDevice or kNvme; `nvme` must outlive the states when any is kNvme,
  // `device` when any is kDevice (host groups are registered with it for asynchronous copies).
  static StatusOr<std::unique_ptr<OptimizerStates>> Create(Device* device, NvmeStore* nvme,
                                                           uint64_t shard_elems,
                                                           std::vector<Tier> tier,
                                                           StateFormat format = StateFormat::kF32,
                                                           uint64_t scale_blocks = 0);
  ~OptimizerStates();

  Tier tier(int chunk) const { return tier_[static_cast<size_t>(chunk)]; }
  int num_chunks() const { return static_cast<int>(tier_.size()); }
  // Bytes of one group (master, m and v) and of a swap slot.
  uint64_t group_bytes() const { return layout_.bytes(); }
  const GroupLayout& layout() const { return layout_; }
  static uint64_t SwapSlotBytes(const GroupLayout& layout);

  // Fills every group (without reading first: the states have no contents yet); NVMe groups are
  // written behind while the next is filled.
  Status Init(const OptimizerGroupFn& fn);
  // Runs fn over every group for which `include` is true (every group when it is empty): host
  // groups first, then device groups through the bounce buffer, then the NVMe groups through the
  // swap pipeline (device and NVMe groups written back when write_back). NVMe groups staged by
  // Prefetch are not read again. With write_behind the last NVMe groups' writes may still be in
  // flight on return (Note [Optimizer I/O around the step]); any later access waits for them.
  Status ForEach(const OptimizerGroupFn& fn, bool write_back,
                 const std::function<bool(int)>& include = {}, bool write_behind = false);
  // Starts reading the NVMe groups `include` selects, in ForEach's order, into the swap slots
  // that are free, and returns at once (it never waits for the disk): a later ForEach over the
  // same groups finds them read. Retires writes behind that have completed. Returns how many
  // groups are staged (read or being read).
  StatusOr<int> Prefetch(const std::function<bool(int)>& include = {});
  int staged() const { return static_cast<int>(reads_.size()); }
  // Waits for every write behind and drops every staged read: afterwards the disk holds every
  // NVMe group and no swap slot is in use. The first write's error, if one failed; a write
  // behind that failed twice (its group lost) fails every later call (With, ForEach, Prefetch,
  // Settle) for the life of these states.
  Status Settle();
  // Runs fn on one group (an NVMe group read into a swap slot and, with write_back, written).
  Status With(int chunk, bool write_back, const OptimizerGroupFn& fn);

  // A host or device group's own memory (master, m, v in host memory or in device memory), for
  // the update phase's copies. REQUIRES: tier(chunk) is not kNvme.
  OptimizerGroup Resident(int chunk) const;
  // Makes `replacement` (group_bytes(), laid out as layout()) chunk's host group and returns the
  // memory it had, which becomes the caller's to reuse while these states live (the speculative
  // start's commit: Note [The speculative start] in update/speculation.cc). REQUIRES:
  // tier(chunk) is kHost; `replacement` outlives its use here.
  void* SwapHost(int chunk, void* replacement);

  // The disk's rates for one group's states, in bytes/s: the first NVMe group read into a swap
  // slot and written back unchanged, alone and then both at once (as the swap pipeline overlaps
  // them: bytes read and written per second), `rounds` times, the median of each. Zeros without
  // NVMe groups.
  struct NvmeRates {
    double read = 0, write = 0, duplex = 0;
  };
  StatusOr<NvmeRates> MeasureNvmeRates(int rounds);

  const OptimizerCounters& counters() const { return counters_; }

 private:
  OptimizerStates(Device* device, NvmeStore* nvme, GroupLayout layout, std::vector<Tier> tier)
      : device_(device), nvme_(nvme), layout_(layout), tier_(std::move(tier)) {}
  Status Allocate();
  OptimizerGroup Group(int chunk, void* data) const;
  // fn on a device group through the bounce buffer: copied in first unless `fresh`, and back
  // when write_back.
  Status WithDevice(int chunk, bool fresh, bool write_back, const OptimizerGroupFn& fn);

  Device* device_;
  NvmeStore* nvme_;
  GroupLayout layout_;
  std::vector<Tier> tier_;
  std::vector<void*> host_;  // per chunk, into host_memory_ (null on NVMe)
  std::vector<NvmeExtent> extent_;
  AlignedBuffer host_memory_;
  bool host_registered_ = false;
  std::vector<void*> device_group_;  // per chunk, into device_memory_ (null unless kDevice)
  DeviceBuffer device_memory_;
  Stream stream_;         // the bounce buffer's copies
  AlignedBuffer bounce_;  // a device group on its way through a host caller, made on first use
  std::unique_ptr<PinnedArena> swap_arena_;  // NVMe groups on their way through the caller
  OptimizerCounters counters_;
  // NVMe groups in swap slots between calls (Note [Optimizer I/O around the step]): reads
  // started ahead of ForEach, in its order, and writes left in flight by it. Declared after the
  // arena: destroyed first (a Ticket's destructor waits for its I/O, then the slot returns).
  struct InFlight {
    int chunk = -1;
    PinnedSlot slot;
    NvmeStore::Ticket ticket;
  };
  std::deque<InFlight> reads_, writes_;
  // A write behind that failed twice: its group is lost, and every later access says so.
  Status failed_;
  // Writes behind: the oldest waited for and its slot returned (its error, with the chunk).
  Status RetireWrite();
  // Retires writes until none of `chunk` is in flight.
  Status WaitWrites(int chunk);
  // A free swap slot, retiring writes behind (oldest first) while none is free; nullopt when
  // every slot holds a staged read.
  StatusOr<std::optional<PinnedSlot>> FreeSlot();
  // Starts reading `chunk` into a free slot (false when there is none).
  StatusOr<bool> StartRead(int chunk);
  // Starts reading `chunk` into `slot` (its write behind already retired): a staged read.
  Status Stage(int chunk, PinnedSlot slot);
};

}  // namespace tierzero
