// Engine internals shared by engine.cc and checkpoint.cc.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "chunk/chunk_manager.h"
#include "chunk/layout.h"
#include "chunk/placement.h"
#include "core/aligned_buffer.h"
#include "core/mutex.h"
#include "core/tunable.h"
#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/device_adam.h"
#include "engine/update_plan.h"
#include "offload/device.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"
#include "profiler/report_snapshot.h"
#include "profiler/timeline.h"
#include "shard/shard_store.h"
#include "tierzero/engine.h"

namespace tierzero {

Status ValidateEngineConfig(const EngineConfig& config);

// What Finalize's placement decides (setup.cc): the shards' tiers, and the host memory the
// fixed buffers take beside them. Engine::Plan runs the same function.
struct PlacedRun {
  Placement placement;
  TierBudgets budgets;
  uint64_t staging_bytes = 0, swap_slot_bytes = 0;
  bool zeropp = false;  // W > 1 with a ZeRO++ option on
  uint64_t hpz_bytes = 0;
  Tier hpz_tier = Tier::kDevice;
};
// TZ_OPTIMIZER_WRITE_BEHIND (update_phase.cc).
bool OptimizerWritesBehind();
// TZ_UPDATE_BEHIND_FORWARD (update_phase.cc; Note [The update phase behind the next forward]).
extern Tunable<std::string> kUpdateBehindForward;

StatusOr<PlacedRun> PlaceRun(const ChunkLayout& layout, const EngineConfig& config, bool on_device,
                             int ranks_per_node);

class ActivationBuffer::Owner {
 public:
  virtual void FreeActivation(void* data, uint64_t bytes) = 0;

 protected:
  ~Owner() = default;
};

// Appends x to a window of the last `keep` samples (the oldest dropped) and returns the window's
// median: the update model's run-time rates and spans (update_phase.cc).
double AddSample(std::vector<double>& window, double x, size_t keep = 15);

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
  // Wraps the NVMe tier's BlockIo (tests inject faults; EngineInternals::WrapNvmeIo).
  std::function<std::unique_ptr<BlockIo>(std::unique_ptr<BlockIo>)> nvme_wrap_io;
  // W > 1 with CollectivePath::kDevice; destroyed after the chunk manager that queues on it.
  std::unique_ptr<DeviceCollectives> device_comm;
  ChunkLayout layout;
  Placement placement;
  TierBudgets budgets;
  // The speculative start's side buffers: declared before the store, whose host groups may
  // point into them after a commit (Note [The speculative start]).
  struct SpecBuffer {
    AlignedBuffer buf;
    Device* device = nullptr;  // registered with it (unregistered here)
    SpecBuffer(AlignedBuffer b, Device* d) : buf(std::move(b)), device(d) {}
    SpecBuffer(SpecBuffer&& o) noexcept
        : buf(std::move(o.buf)), device(std::exchange(o.device, nullptr)) {}
    SpecBuffer& operator=(SpecBuffer&&) = delete;
    ~SpecBuffer() {
      if (device != nullptr && buf.data() != nullptr)
        (void)device->UnregisterHostMemory(buf.data());
    }
  };
  std::vector<SpecBuffer> spec_memory;
  // Every shard of this rank: parameters, gradients, optimizer states. Destroyed after the
  // chunk manager, which gathers from it.
  std::unique_ptr<ShardStore> store;
  std::unique_ptr<ChunkManager> cm;
  uint64_t staging_bytes = 0;
  uint64_t swap_slot_bytes = 0;
  // ZeRO++ with W > 1 on the device path; hpZ's secondary partition and its tier.
  bool zeropp = false;
  uint64_t hpz_bytes = 0;
  Tier hpz_tier = Tier::kDevice;
  AlignedBuffer upload;  // compute-dtype shard for non-host parameter tiers
  std::unique_ptr<CpuAdam> adam_decay, adam_plain;
  // The update phase (update_phase.cc): device Adam, its three streams, the rates measured at
  // the first step, the plan made from them, and what the last step did.
  struct UpdatePhase {
    std::unique_ptr<DeviceAdam> decay, plain;
    Stream h2d, adam, d2h;
    std::vector<Event> up_done, adam_done, slot_free;  // per slot
    bool measured = false;
    UpdateRates rates;
    UpdatePlan plan;
    std::vector<double> measured_end_s;  // per group, from the phase's start (last step)
    double measured_s = 0;
    std::vector<double> phase_s;                     // every step's, for the median
    std::vector<double> cpu_rate_samples;            // CPU Adam params/s of the last phases
    std::vector<double> cpu_rate_samples_streaming;  // of those with streamed groups
    std::vector<double> link_samples;  // UpdateRates::link_slowdown_beside_cpu, the last phases'
    std::vector<UpdateGroup> plan_groups;  // what the plan was made from
    UpdateRates plan_rates;
    DeviceBuffer extra;  // device memory beyond the idle slot region, held for one phase
    std::chrono::steady_clock::time_point t0;  // the last phase's start
    std::vector<bool> skip;  // groups the speculative start already updated (this phase)
  } update;

  // The update phase's CPU chain behind the next forward (update_tail.cc; Note [The update
  // phase behind the next forward]). The chunk manager's fence: it asks before each gather.
  struct UpdateTail final : ChunkManager::ParamFence {
    Mutex mu;
    CondVar cv;
    std::vector<uint8_t> done TZ_GUARDED_BY(mu);  // per chunk: its shard is current
    bool finished TZ_GUARDED_BY(mu) = false;
    Status status TZ_GUARDED_BY(mu);  // the worker's outcome, once finished
    // The trainer's thread only.
    bool active = false;  // a worker runs or has not been joined yet
    std::thread worker;
    // A failed chain left shards partly updated: every later gather and step fails with this
    // until a checkpoint is loaded.
    Status sticky;
    OptimizerCounters counters_at_launch;  // what stats() shows while the worker runs
    double device_end_s = 0;               // the device chain's end, from the phase's start
    double wait_s = 0;                     // the trainer waited for the worker, in all
    // Written by the worker before it finishes, read after the join.
    double cpu_end_s = 0, adam_s = 0;
    uint64_t adam_elems = 0;

    bool Ready(int chunk) override;
    Status Await(int chunk) override;
    void MarkDone(int chunk);
  };
  UpdateTail tail;
  // Waits for the update phase's CPU chain, if one still runs, and folds in what it measured;
  // its error (sticky) if it failed. Every entry point that touches shards or states calls it.
  Status AwaitUpdate();
  // Starts the CPU chain on the tail's worker (update_tail.cc; the device's groups are already
  // queued); false when no thread could be had (the caller then runs the chain itself).
  StatusOr<bool> LaunchUpdateTail(const AdamStepOptions& options);
  // The CPU's groups of the phase (update_phase.cc); `mark` tells the tail each finished chunk.
  Status RunCpuChain(const AdamStepOptions& options, bool profiled, bool mark, double& adam_s,
                     uint64_t& adam_elems);
  // Whether the CPU chain updates chunk c this phase: planned on the CPU and not already
  // updated by the speculative start.
  bool CpuChainTakes(int chunk) const;
  // What a phase measured, once both chains are done (update_phase.cc).
  void FinishUpdatePhase(double measured_s, double adam_s, uint64_t adam_elems, bool rate_sample);

  // The speculative start (speculation.cc; Note [The speculative start]).
  struct Speculation {
    struct Queue {
      Mutex mu;
      CondVar cv;
      std::deque<int> ready TZ_GUARDED_BY(mu);  // chunks whose gradient shard is final
      bool closed TZ_GUARDED_BY(mu) = false;
      int announced TZ_GUARDED_BY(mu) = 0;  // by the gradient callback, during backward
    };
    struct Slot {
      float* states;  // master | m | v
      uint8_t* out;   // the parameter shard's new contents
    };
    bool prepared = false;  // PrepareStep was called for the next step
    StepOptions options;
    AdamStepOptions so;
    // While a worker runs (the last micro-batch): the queue; only the worker touches the rest
    // until it is joined.
    std::shared_ptr<Queue> queue;
    std::thread worker;
    std::vector<bool> eligible, taken;
    std::vector<Slot> free;                  // side buffers holding no result
    std::vector<std::pair<int, Slot>> done;  // results waiting for the step
    Status error;
    bool last_clean = true;  // the previous step neither clipped nor was skipped
    bool told_no_room = false;
    uint64_t pool_bytes = 0;
    int last_announced = 0;  // chunks the last speculation heard of before EndIteration
  } spec;

  bool in_iteration = false;
  bool iteration_train = true;
  int iterations_since_step = 0;
  // Training forwards' spans, from BeginIteration to the first backward Acquire less the waits
  // for the update phase's CPU chain: the time that chain can hide behind (the update plan's
  // UpdateBudget::behind_forward_s is their median). The last kForwardWindow of them.
  static constexpr size_t kForwardWindow = 15;
  std::vector<double> forward_spans;
  std::chrono::steady_clock::time_point forward_t0{};
  double forward_wait0 = 0;
  bool forward_open = false;
  // Backward spans before a Step, from the first Acquire (after the wait for the last CPU chain)
  // to the update plan: the time the NVMe groups' read-ahead had; the median of the last
  // kForwardWindow is UpdateRates::nvme_read_ahead_window_s.
  std::chrono::steady_clock::time_point backward_t0{};
  bool backward_open = false;
  std::vector<double> backward_spans;
  int64_t step = 0;
  float loss_scale = 1;
  int good_steps = 0;

  uint64_t act_current = 0, act_peak = 0;
  EngineStats stats;
  // Seconds between the ends of consecutive Steps, the last kStepWindow of them
  // (EngineStats::step_seconds_median); NoteStepEnd at each Step's end.
  static constexpr size_t kStepWindow = 256;
  std::vector<double> step_intervals;
  size_t step_interval_next = 0;
  std::chrono::steady_clock::time_point last_step_end{};
  void NoteStepEnd();
  // The Acquires of this training iteration, and of the one the current plan was made from
  // (Engine::WarmupTrace), with the plans counted then.
  struct Acquired {
    std::vector<ParamId> params;
    bool backward = false;
  };
  std::vector<Acquired> iteration_acquires, traced_acquires;
  uint64_t traced_plans = 0;

  // The profiled iteration and the step after it (the report's timeline and breakdown).
  Timeline timeline;
  // Note [Compute spans on the device's clock]: on a GPU the host returns from a moment's ops
  // long before the device has run them, so a moment's compute span is timed by events on the
  // compute stream (ready, release), placed on the timeline from `profile_origin`, an event
  // recorded on an idle stream when the profiled iteration began at `profile_origin_s`.
  struct MomentTimes {
    double call_s = 0, ready_s = 0, release_s = -1;  // Acquire called, returned; Release
    bool backward = false;
    Event ready_ev, release_ev;  // on the device's clock (device_timed)
  };
  std::vector<MomentTimes> moment_times;
  bool device_timed = false;
  Event profile_origin;
  double profile_origin_s = 0;
  // The device-timed spans placed on the timeline (EndIteration of the profiled iteration).
  void PlaceDeviceSpans();

  // safetensors.cc: writes each file's tensors (parameter indices, in the order the chunks
  // gather them: their bytes' order in the file); every rank gathers, rank 0 writes.
  struct ExportFile {
    std::string path;
    std::vector<size_t> tensors;
  };
  // `producer`: tierzero's metadata (producer, step) beside {"format": "pt"}, else that alone (as
  // transformers writes it).
  Status ExportFiles(const std::vector<ExportFile>& files, DType dtype, const TensorNames& names,
                     bool producer);
  std::vector<size_t> GatherOrder() const;
  std::vector<ChunkManager::MomentProfile> profile;  // copied at the profiled EndIteration
  std::vector<TimelineEvent> profile_events;
  int64_t profile_iteration = -1;  // iterations counted from 0, evaluations included
  int64_t iterations = 0;
  // Every gather and reduction's bytes so far at the profiled iteration's start, then in it.
  WireBytes profile_wire_start, profile_wire;
  bool profile_step = false;                       // the next Step adds its events
  double step_nvme_seconds = 0, step_seconds = 0;  // the profiled step's
  uint64_t step_nvme_bytes = 0;
  uint64_t step_nvme_write_bytes = 0;  // optimizer states and NVMe parameter shards

  // Note [Host compute on the simulated device] in engine.cc.
  struct Gate {
    Mutex mu;
    CondVar cv;
    bool entered TZ_GUARDED_BY(mu) = false;
    bool opened TZ_GUARDED_BY(mu) = false;
  };
  std::shared_ptr<Gate> gate;
  void OpenGate();
  Status PushGate(bool wait_entered);

  void FreeActivation(void* data, uint64_t bytes) override;
  OptimizerStates& optimizer() const { return *store->optimizer(); }
  // Runs fn on one chunk's optimizer group (written back to NVMe with write_back).
  Status WithChunkState(int chunk, bool write_back,
                        const std::function<Status(float*, float*, float*)>& fn) {
    return optimizer().With(chunk, write_back,
                            [&](const OptimizerGroup& g) { return fn(g.master, g.m, g.v); });
  }
  // Finalize's steps (setup.cc).
  StatusOr<bool> ChooseCollectivePath(bool cuda);
  Status Place(bool on_device);
  Status OpenDevice(bool cuda);
  Status CreateShards(bool on_device);
  Status CreateOptimizer();
  Status InitialValues();
  Status UploadChunk(int chunk, const float* master);
  Status DropAccumulated();
  Status CheckAccess(std::string_view what, ParamId p, size_t n, std::string_view into,
                     bool anytime) const;
  // Step's parts (step.cc).
  Status CheckStep(const StepOptions& options);
  StatusOr<double> GradSumSquares();
  Status SkipStep();
  Status AdamGroup(const OptimizerGroup& group, const AdamStepOptions& options, bool profiled);
  Status AdamInto(const OptimizerGroup& group, uint8_t* out, const AdamStepOptions& options);
  // The update phase (update_phase.cc).
  Status CreateUpdatePhase();
  std::vector<UpdateGroup> UpdateGroups() const;
  StatusOr<UpdateRates> MeasureUpdateRates(void* device_scratch, uint64_t scratch_bytes);
  Status RunUpdatePhase(const AdamStepOptions& options, bool profiled);
  void PrefetchStates();  // best effort: failures surface at the Step
  bool prefetch_warned = false;
  // The speculative start (speculation.cc).
  int SpeculationSlots(int want);
  Status MaybeStartSpeculation();
  void SpeculationWorker(Speculation::Queue& q);
  void EndSpeculation(bool keep);
  void DiscardSpeculation();
  StatusOr<std::vector<bool>> CommitSpeculation(bool exact);
  Status EnqueueDeviceGroup(int chunk, UpdateWhere where, int slot, uint8_t* slot_mem,
                            const AdamStepOptions& options);
  // The report's snapshot in parts (report.cc).
  void SnapshotLayout(ReportSnapshot& s) const;
  void SnapshotPlan(ReportSnapshot& s) const;
  void SnapshotRanks(ReportSnapshot& s) const;
  void SnapshotProfile(ReportSnapshot& s) const;
  void SnapshotUpdate(ReportSnapshot& s) const;
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
      s.bytes_cross_node += device_comm->stats().bytes_cross_node;
    }
    return s;
  }
  // This rank's slices of chunk c's tensors (ChunkLayout::ShardSlices).
  std::vector<std::vector<ShardSlice>> slices;
};

// Internal ways into an engine, for tests and the library's own tools.
struct EngineInternals {
  static Engine::Impl& Of(Engine& engine) { return *engine.impl_; }
  // Before Finalize: the NVMe tier's BlockIo goes through `wrap` (a FaultInjectionBlockIo).
  static void WrapNvmeIo(Engine& engine,
                         std::function<std::unique_ptr<BlockIo>(std::unique_ptr<BlockIo>)> wrap) {
    engine.impl_->nvme_wrap_io = std::move(wrap);
  }
  // An engine that runs on `device` instead of the one the config names (engine-level tests
  // give it a FaultInjectionDevice). The device must outlive nothing the engine hands out.
  static StatusOr<std::unique_ptr<Engine>> CreateOnDevice(const EngineConfig& config,
                                                          std::shared_ptr<Communicator> comm,
                                                          std::unique_ptr<Device> device) {
    if (device == nullptr) return InvalidArgumentError("CreateOnDevice without a device");
    EngineConfig c = config;
    c.device = device->info().kind == DeviceKind::kCuda ? DeviceChoice::kCuda : DeviceChoice::kHost;
    ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::Create(c, std::move(comm)));
    e->impl_->device = std::move(device);
    return e;
  }
};

}  // namespace tierzero
