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
#include <functional>
#include <memory>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/status.h"
#include "offload/device.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"
#include "offload/tier.h"

namespace tierzero {

// One chunk's optimizer state, in memory for the duration of a call.
struct OptimizerGroup {
  int chunk = -1;
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
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
                                                           std::vector<Tier> tier);
  ~OptimizerStates();

  Tier tier(int chunk) const { return tier_[static_cast<size_t>(chunk)]; }
  int num_chunks() const { return static_cast<int>(tier_.size()); }
  // Bytes of one group (master, m and v) and of a swap slot.
  uint64_t group_bytes() const { return shard_elems_ * 12; }
  static uint64_t SwapSlotBytes(uint64_t shard_elems);

  // Fills every group (without reading first: the states have no contents yet); NVMe groups are
  // written behind while the next is filled.
  Status Init(const OptimizerGroupFn& fn);
  // Runs fn over every group for which `include` is true (every group when it is empty): host
  // groups first, then device groups through the bounce buffer, then the NVMe groups through the
  // swap pipeline (device and NVMe groups written back when write_back).
  Status ForEach(const OptimizerGroupFn& fn, bool write_back,
                 const std::function<bool(int)>& include = {});
  // Runs fn on one group (an NVMe group read into a swap slot and, with write_back, written).
  Status With(int chunk, bool write_back, const OptimizerGroupFn& fn);

  // A host or device group's own memory (master, m, v in host memory or in device memory), for
  // the update phase's copies. REQUIRES: tier(chunk) is not kNvme.
  OptimizerGroup Resident(int chunk) const;

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
  OptimizerStates(Device* device, NvmeStore* nvme, uint64_t shard_elems, std::vector<Tier> tier)
      : device_(device), nvme_(nvme), shard_elems_(shard_elems), tier_(std::move(tier)) {}
  Status Allocate();
  OptimizerGroup Group(int chunk, void* data) const;
  // fn on a device group through the bounce buffer: copied in first unless `fresh`, and back
  // when write_back.
  Status WithDevice(int chunk, bool fresh, bool write_back, const OptimizerGroupFn& fn);

  Device* device_;
  NvmeStore* nvme_;
  uint64_t shard_elems_;
  std::vector<Tier> tier_;
  std::vector<float*> host_;  // per chunk, into host_memory_ (null on NVMe)
  std::vector<NvmeExtent> extent_;
  AlignedBuffer host_memory_;
  bool host_registered_ = false;
  std::vector<void*> device_group_;  // per chunk, into device_memory_ (null unless kDevice)
  DeviceBuffer device_memory_;
  Stream stream_;         // the bounce buffer's copies
  AlignedBuffer bounce_;  // a device group on its way through a host caller, made on first use
  std::unique_ptr<PinnedArena> swap_arena_;  // NVMe groups on their way through the caller
  OptimizerCounters counters_;
};

}  // namespace tierzero
