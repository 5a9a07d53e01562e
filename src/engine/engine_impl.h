// Engine internals shared by engine.cc and checkpoint.cc.
#pragma once

#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "chunk/chunk_manager.h"
#include "chunk/layout.h"
#include "chunk/placement.h"
#include "cpu_adam/cpu_adam.h"
#include "offload/device.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"
#include "tierzero/engine.h"

namespace tierzero {

Status ValidateEngineConfig(const EngineConfig& config);

class ActivationBuffer::Owner {
 public:
  virtual void FreeActivation(void* data, uint64_t bytes) = 0;

 protected:
  ~Owner() = default;
};

// 4 KiB-aligned host memory (O_DIRECT-able), freed on destruction.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  static AlignedBuffer Allocate(uint64_t bytes) {
    AlignedBuffer b;
    const uint64_t rounded = (bytes + 4095) / 4096 * 4096;
    b.data_ = std::aligned_alloc(4096, rounded == 0 ? 4096 : rounded);
    b.bytes_ = b.data_ != nullptr ? rounded : 0;
    return b;
  }
  AlignedBuffer(AlignedBuffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_) {
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~AlignedBuffer() { std::free(data_); }
  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
};

struct Engine::Impl final : ActivationBuffer::Owner {
  EngineConfig cfg;
  std::shared_ptr<Communicator> comm;
  std::vector<ParamSpec> params;
  std::vector<int64_t> numel;
  std::map<std::string, ParamId> by_name;
  bool finalized = false;

  std::unique_ptr<Device> device;
  bool host_compute = false;
  Stream compute;
  std::unique_ptr<NvmeStore> nvme;
  // W > 1 with CollectivePath::kDevice; destroyed after the chunk manager that queues on it.
  std::unique_ptr<DeviceCollectives> device_comm;
  ChunkLayout layout;
  Placement placement;
  TierBudgets budgets;
  std::unique_ptr<ChunkManager> cm;
  uint64_t staging_bytes = 0;
  uint64_t swap_slot_bytes = 0;

  // Optimizer state of a chunk's shard: fp32 master, m, v (shard_elems each, in that order),
  // in host memory or in one NVMe extent.
  struct OptimShard {
    float* host = nullptr;
    NvmeExtent extent;
    bool on_nvme = false;
  };
  std::vector<OptimShard> optim;
  AlignedBuffer optim_host;
  std::unique_ptr<PinnedArena> swap_arena;  // NVMe optimizer states on their way through Adam
  AlignedBuffer upload;                     // compute-dtype shard for non-host parameter tiers
  std::unique_ptr<CpuAdam> adam_decay, adam_plain;

  bool in_iteration = false;
  bool iteration_train = true;
  int iterations_since_step = 0;
  int64_t step = 0;
  float loss_scale = 1;
  int good_steps = 0;

  uint64_t act_current = 0, act_peak = 0;
  EngineStats stats;

  // The profiled iteration and the step after it (the report's timeline and breakdown).
  Timeline timeline;
  struct MomentTimes {
    double call_s = 0, ready_s = 0, release_s = -1;  // Acquire called, returned; Release
    bool backward = false;
  };
  std::vector<MomentTimes> moment_times;
  std::vector<ChunkManager::MomentProfile> profile;  // copied at the profiled EndIteration
  std::vector<TimelineEvent> profile_events;
  int64_t profile_iteration = -1;  // iterations counted from 0, evaluations included
  int64_t iterations = 0;
  bool profile_step = false;                       // the next Step adds its events
  double step_nvme_seconds = 0, step_seconds = 0;  // the profiled step's
  uint64_t step_nvme_bytes = 0;
  uint64_t step_nvme_write_bytes = 0;  // optimizer states and NVMe parameter shards

  // Note [Host compute on the simulated device] in engine.cc.
  struct Gate {
    std::mutex mu;
    std::condition_variable cv;
    bool entered = false;
    bool opened = false;
  };
  std::shared_ptr<Gate> gate;
  void OpenGate();
  Status PushGate(bool wait_entered);

  void FreeActivation(void* data, uint64_t bytes) override;
  Status ForEachOptimChunk(const std::function<Status(int, float*, float*, float*)>& fn,
                           bool write_back);
  Status InitOptimChunks(const std::function<Status(int, float*, float*, float*)>& fn);
  Status WithChunkState(int chunk, bool write_back,
                        const std::function<Status(float*, float*, float*)>& fn);
  Status UploadChunk(int chunk, const float* master);
  // The whole chunk's fp32 master weights (chunk_elems), gathered from the ranks' shards
  // (collective with W > 1).
  Status GatherChunkMaster(int chunk, std::vector<float>& full);
  int world() const { return layout.world_size(); }
  // The trainer's collectives and the device collectives together.
  CommStats comm_stats() const {
    CommStats s = comm->stats();
    if (device_comm) {
      s.collectives += device_comm->stats().collectives;
      s.bytes_sent += device_comm->stats().bytes_sent;
    }
    return s;
  }
  // This rank's slices of chunk c's tensors (ChunkLayout::ShardSlices).
  std::vector<std::vector<ShardSlice>> slices;
};

}  // namespace tierzero
