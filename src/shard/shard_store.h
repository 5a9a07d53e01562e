// ShardStore: every per-chunk shard this rank owns, in the tier the placement chose (DESIGN.md
// section 4): the compute-dtype parameter shard (device memory, pinned host memory or NVMe), the
// gradient shard (pinned host memory, where CPU Adam reads it, or device memory for a chunk the
// device's Adam updates: Note [Gradient shards on the device] in chunk/placement.cc), and the
// optimizer states (fp32
// master, m, v: host memory or NVMe, shard/optimizer_states.h).
//
// The store holds bytes and moves them between the host and their tier; it knows nothing of
// tensors, moments or ranks' collectives. The chunk manager gathers chunks from the parameter
// shards and reduces gradients into the gradient shards (chunk/chunk_manager.h); the optimizer
// step iterates the optimizer groups and writes the parameter shards back (engine/step.cc).
//
// Thread-safety: one thread (the trainer's) calls the store, between the iterations that read
// and write its shards; the gather and reduce paths touch the shards' memory from stream
// threads only while an iteration runs. One exception: the update phase's worker writes
// parameter shards (WriteParam) and clears gradient shards while the next forward gathers chunks
// it has finished (Note [The update phase behind the next forward]); counters() is safe then.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/status.h"
#include "offload/device.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"
#include "offload/tier.h"
#include "shard/optimizer_states.h"
#include "tierzero/types.h"

namespace tierzero {

// The shape of a rank's shards: W ranks each hold shard_elems elements of every chunk.
struct ShardGeometry {
  int num_chunks = 0;
  int world_size = 1;
  int rank = 0;
  uint64_t shard_elems = 0;
  DType dtype = DType::kBF16;  // of parameter shards (the compute dtype)

  uint64_t shard_bytes() const { return DTypeBytes(dtype, shard_elems); }
  uint64_t chunk_bytes() const { return shard_bytes() * static_cast<uint64_t>(world_size); }
};

struct ShardStoreOptions {
  ShardGeometry geometry;
  // Per chunk: the tier of its parameter shard, and of its optimizer states (host or NVMe;
  // empty: the store keeps no optimizer states, as in the chunk manager's own tests).
  std::vector<Tier> param_tier;
  std::vector<Tier> optimizer_tier;
  // How the moments are stored, and with kInt8 the scale blocks a group holds (OptimizerStates).
  StateFormat optimizer_format = StateFormat::kF32;
  uint64_t optimizer_scale_blocks = 0;
  // Gradient shards in fp32 (gradient accumulation) instead of the compute dtype.
  bool fp32_grads = false;
  // Per chunk, the tier of its gradient shard: host or device (empty: every one in host memory).
  std::vector<Tier> grad_tier;
  // False: no gradient shards at all (an engine that never steps); grad() is then null,
  // grad_bytes() 0, and ZeroGrads does nothing.
  bool grads = true;
  // Room kept after each host parameter shard, for the gather paths that send a tag with the
  // shard (zero/gather.h).
  uint64_t host_param_tail_bytes = 0;
};

// Parameter-shard traffic to NVMe (the optimizer's own is in OptimizerStates::counters()).
struct ShardCounters {
  uint64_t nvme_read_bytes = 0;
  uint64_t nvme_write_bytes = 0;
};

class ShardStore {
 public:
  // Allocates every shard, zeroed (OutOfMemory naming the tier when one cannot be had).
  // `device` and `nvme` (null when nothing is placed on NVMe) must outlive the store.
  static StatusOr<std::unique_ptr<ShardStore>> Create(Device& device, NvmeStore* nvme,
                                                      ShardStoreOptions options);
  ~ShardStore();
  ShardStore(const ShardStore&) = delete;
  ShardStore& operator=(const ShardStore&) = delete;

  const ShardGeometry& geometry() const { return options_.geometry; }
  int num_chunks() const { return options_.geometry.num_chunks; }
  NvmeStore* nvme() const { return nvme_; }

  // ---- Parameter shards ----
  Tier param_tier(int chunk) const { return options_.param_tier[static_cast<size_t>(chunk)]; }
  // The shard's memory in its tier: device memory, pinned host memory (with
  // host_param_tail_bytes after it), or an NVMe extent. Null (invalid) for the other tiers.
  void* device_param(int chunk) const;
  void* host_param(int chunk) const;
  const NvmeExtent& nvme_param(int chunk) const;
  uint64_t host_param_tail_bytes() const { return options_.host_param_tail_bytes; }
  // Writes a whole parameter shard from `src` (shard_bytes; 4 KiB aligned when the shard is on
  // NVMe). A host shard may be written in place (src == host_param).
  Status WriteParam(int chunk, const void* src);
  // Copies `bytes` at byte `offset` of the shard from (to_shard) or to `host`, wherever the
  // shard lives (an NVMe shard is read, changed and written back whole).
  Status CopyParamBytes(int chunk, uint64_t offset, uint64_t bytes, void* host, bool to_shard);

  // ---- Gradient shards (pinned host memory, or device memory where grad_on_device) ----
  DType grad_dtype() const { return options_.fp32_grads ? DType::kF32 : geometry().dtype; }
  // The shard's memory: a device pointer where grad_on_device(chunk), never to be read on the
  // host (ReadGradShard copies it).
  void* grad(int chunk) const {
    const size_t i = static_cast<size_t>(chunk);
    if (!options_.grads) return nullptr;
    return grad_on_device(chunk) ? device_grads_[i].data() : grad_shards_[i].data();
  }
  bool grad_on_device(int chunk) const {
    return options_.grads && !options_.grad_tier.empty() &&
           options_.grad_tier[static_cast<size_t>(chunk)] == Tier::kDevice;
  }
  bool any_grad_on_device() const { return device_grad_chunks_ > 0; }
  bool has_grads() const { return options_.grads; }
  uint64_t grad_bytes() const {
    return options_.grads ? DTypeBytes(grad_dtype(), geometry().shard_elems) : 0;
  }
  // Copies the whole gradient shard into `host` (grad_bytes), from either tier.
  Status ReadGradShard(int chunk, void* host);
  // Zeroes the shards (a device shard synchronously, on the store's stream).
  Status ZeroGrads();
  Status ZeroGrad(int chunk);

  // ---- Optimizer states ----
  // Null when the store was created without optimizer tiers.
  OptimizerStates* optimizer() const { return optimizer_.get(); }

  // Safe from any thread: the optimizer's worker writes NVMe parameter shards while the trainer
  // reads these (Note [The update phase behind the next forward]).
  ShardCounters counters() const {
    return {nvme_read_bytes_.load(std::memory_order_relaxed),
            nvme_write_bytes_.load(std::memory_order_relaxed)};
  }

 private:
  ShardStore(Device& device, NvmeStore* nvme, ShardStoreOptions options);
  Status Init();
  Status InitParam(int chunk, std::vector<uint8_t>& zeros);
  // Synchronous copy between the host and a device-resident shard.
  Status CopyDevice(void* dst, const void* src, uint64_t bytes, CopyKind kind);
  Status CheckChunk(int chunk) const;

  Device& device_;
  NvmeStore* nvme_;
  ShardStoreOptions options_;
  Stream stream_;  // copies to and from device-resident shards (created when there are some)
  std::vector<DeviceBuffer> device_shards_;
  std::unique_ptr<PinnedArena> host_arena_;
  std::vector<PinnedSlot> host_shards_;
  std::vector<NvmeExtent> nvme_shards_;
  AlignedBuffer scratch_;  // an NVMe shard on its way through CopyParamBytes
  std::unique_ptr<PinnedArena> grad_arena_;
  std::vector<PinnedSlot> grad_shards_;  // host tier (empty slots for device ones)
  std::vector<DeviceBuffer> device_grads_;
  int device_grad_chunks_ = 0;
  std::unique_ptr<OptimizerStates> optimizer_;
  std::atomic<uint64_t> nvme_read_bytes_{0}, nvme_write_bytes_{0};
};

// Zeroes host memory over oneTBB's arena in 1 MiB spans (Note [Clearing gradient shards on the
// host's cores]): how ZeroGrads clears host gradient shards, and what the update phase's rate
// probe times.
void ZeroHostParallel(void* p, uint64_t bytes);

}  // namespace tierzero
