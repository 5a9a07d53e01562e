// The optimizer's update of every shard this rank owns (docs/optimizer.md): the gradient norm,
// AdamW on each optimizer group wherever the cost model (update/cost_model.h) puts it (the CPU,
// the device with its states resident, or streamed there for the phase), the CPU's groups
// finishing behind the next forward with the chunk manager's gathers fenced on them, and the
// speculative start during the last micro-batch's backward.
//
// The engine tells it of each event of the iteration protocol and calls Step once per step; the
// Updater owns every thread, buffer, stream and measurement of the update. It works on a shard
// store, a device, a chunk manager and a communicator it does not own (UpdaterParts), which
// outlive its use of them: Shutdown ends that use, and the destructor calls it.
//
// Thread-safety: one thread (the trainer's) calls every method; the workers it starts (behind the
// forward, the speculative start) are its own and joined before any method that touches what
// they touch returns.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "chunk/chunk_manager.h"
#include "chunk/layout.h"
#include "core/aligned_buffer.h"
#include "core/mutex.h"
#include "core/status.h"
#include "core/tunable.h"
#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/device_adam.h"
#include "offload/device.h"
#include "offload/pinned_arena.h"
#include "profiler/report_snapshot.h"
#include "profiler/timeline.h"
#include "shard/shard_store.h"
#include "tierzero/communicator.h"
#include "tierzero/engine.h"
#include "update/cost_model.h"

namespace tierzero {

// What the Updater needs to know of the run (the engine's config, after placement).
struct UpdaterConfig {
  AdamConfig adam;  // without weight decay: the tensors with decay use `weight_decay`
  float weight_decay = 0;
  int cpu_threads = 0;  // CpuAdamOptions::threads
  DType compute_dtype = DType::kF32;
  int grad_accumulation = 1;
  OptimizerPlacement placement = OptimizerPlacement::kAuto;
  double device_fraction = 0;        // kFraction
  double host_device_adam_rate = 0;  // EngineConfig::host_device_adam_rate
  SpeculativeStep speculative_step = SpeculativeStep::kAuto;
  uint64_t host_budget = 0;  // sizes the rate probe (Note [Measuring the update phase's rates])
  // The host budget left after placement: the speculative start's side buffers' room.
  uint64_t speculation_room_bytes = 0;
  bool host_compute = false;  // the device computes on the CPU's cores (the simulated device)
  // How the moments are stored (the store's OptimizerStates::layout() says the same).
  StateFormat states = StateFormat::kF32;
};

// What it works on. Not owned; each outlives the Updater's use of it.
struct UpdaterParts {
  Device* device = nullptr;
  ShardStore* store = nullptr;  // gradients, parameter shards, optimizer states
  ChunkManager* cm = nullptr;   // its gathers fenced on the update; its idle slot memory
  const ChunkLayout* layout = nullptr;
  Communicator* comm = nullptr;    // the gradient norm's sum over ranks
  Timeline* timeline = nullptr;    // the profiled step's spans
  std::vector<bool> weight_decay;  // per tensor of the layout
  // One shard's bytes (padding zero) that a parameter shard outside host memory is written from;
  // shared with the engine's own writes, which never run while an update does.
  AlignedBuffer* param_out = nullptr;
};

// One step, as the engine computed it.
struct UpdateStepInputs {
  int64_t step = 1;  // the step's number: steps applied so far + 1
  float lr = 0;
  double grad_scale = 1;      // 1 / (loss scale x accumulation)
  double clip_grad_norm = 0;  // > 0: clip the global norm to it
  bool profiled = false;      // the timeline gets the step's spans
};

struct UpdateStepOutcome {
  bool applied = false;  // false: a gradient was not finite; nothing was updated
  double grad_norm = 0;  // unscaled; +inf when not finite
};

// What the update did, for EngineStats.
struct UpdaterStats {
  int optimizer_cpu_groups = 0, optimizer_resident_groups = 0, optimizer_streamed_groups = 0;
  double optimizer_predicted_seconds = 0, optimizer_phase_seconds = 0;
  int speculative_groups = 0;
  uint64_t speculative_steps = 0, speculative_rollbacks = 0;
};

// TZ_UPDATE_BEHIND_FORWARD (Note [The update phase behind the next forward]).
extern Tunable<std::string> kUpdateBehindForward;
extern Tunable<std::string> kNormAhead;  // speculation.cc
extern Tunable<bool> kGradFetchAhead;    // update_phase.cc
// TZ_OPTIMIZER_WRITE_BEHIND: the phase's last NVMe state writes finish behind the next forward.
bool OptimizerWritesBehind();

class Updater {
 public:
  // Creates CPU and device Adam, the phase's streams, and registers the chunk manager's fence.
  static StatusOr<std::unique_ptr<Updater>> Create(UpdaterParts parts, UpdaterConfig config);
  ~Updater();  // Shutdown()
  Updater(const Updater&) = delete;
  Updater& operator=(const Updater&) = delete;

  // ---- The iteration protocol's events
  // Waits for the CPU chain behind the forward, if one runs, and folds in what it measured; its
  // error (sticky until ClearError) if it failed. Every caller that touches shards or states
  // first calls it.
  Status Await();
  // PrepareStep's options: the speculative start may use them (Note [The speculative start]).
  void Prepare(const StepOptions& options);
  // A training iteration begins: on the step's last micro-batch, the speculative start may
  // begin (`step`: steps applied so far; the loss scale of this micro-batch).
  Status BeginTraining(bool last_micro_batch, int64_t step, float loss_scale);
  // A training forward ended after `seconds` (less its waits for this Updater): the time the
  // CPU chain can hide behind.
  void NoteForward(double seconds);
  // A profiled training forward's span on the device's clock (Note [The forward's time on the
  // device]): on a GPU the host's span above is only its enqueueing.
  void NoteDeviceForward(double seconds) { device_forward_s_ = std::max(seconds, 0.0); }
  // The step's last backward began (after Await): the NVMe read-ahead's window starts.
  void NoteLastBackward();
  // Best effort: the NVMe groups' states start coming in (Note [Optimizer I/O around the step]).
  void PrefetchStates();
  // The iteration ended: the speculative start's results are kept for the Step (`keep`: the
  // gradients all arrived) or dropped.
  void EndIteration(bool keep);
  // The speculative results are dropped (an aborted iteration, values replaced by a load).
  void Discard();
  // A checkpoint replaced every state: a failed chain's sticky error no longer holds.
  void ClearError() { tail_.sticky = Status::OK(); }
  // Joins every worker and unregisters the fence and callbacks; idempotent.
  void Shutdown();

  // ---- The step
  // The norm over every rank, then AdamW over every group (unless a gradient is not finite), each
  // group's new compute-dtype parameters written to its shard. With accumulation the gradient
  // shards are cleared once their groups are updated.
  StatusOr<UpdateStepOutcome> Step(const UpdateStepInputs& in);
  // AdamW on group g's states with its shard's gradient, the new compute-dtype parameters into
  // `out` (the chunk's shard layout; padding untouched).
  Status AdamInto(const OptimizerGroup& g, uint8_t* out, const AdamStepOptions& options);

  // ---- What it did
  const UpdaterStats& stats() const { return stats_; }
  // Bytes the update phase moved over the link (gradients and states up, parameters and states
  // down, device gradient shards copied over for the CPU's Adam): what Engine::Plan's per-step
  // bytes count beside the iterations' (the rate probe's are not counted).
  uint64_t moved_h2d_bytes() const { return moved_h2d_.load(std::memory_order_relaxed); }
  uint64_t moved_d2h_bytes() const { return moved_d2h_.load(std::memory_order_relaxed); }
  double wait_seconds() const { return tail_.wait_s; }  // the trainer waited for the CPU chain
  bool behind_active() const { return tail_.active; }   // a CPU chain runs behind the forward
  // The optimizer's counters; while a chain runs behind the forward, those at its launch.
  OptimizerCounters optimizer_counters() const;
  uint64_t side_buffer_bytes() const { return spec_.pool_bytes; }  // in the host tier's usage
  int last_announced() const { return spec_.last_announced; }      // chunks the last start heard of
  // Chunks whose host gradient shards the last Step found summed during the backward.
  int last_summed_ahead() const { return last_summed_ahead_; }
  // CPU updates whose device gradient shard was fetched ahead (Note [A CPU group's device
  // gradient fetched ahead]), over the run.
  uint64_t gradients_fetched_ahead() const { return fetch_.groups; }
  void Snapshot(ReportSnapshot::Update& u) const;
  CpuAdam& cpu_adam() { return *adam_plain_; }

 private:
  Updater(UpdaterParts parts, UpdaterConfig config);
  // The speculative start's side buffers (page-locked when the device allows).
  struct SideBuffer {
    AlignedBuffer buf;
    Device* device = nullptr;  // registered with it (unregistered here)
    SideBuffer(AlignedBuffer b, Device* d) : buf(std::move(b)), device(d) {}
    SideBuffer(SideBuffer&& o) noexcept
        : buf(std::move(o.buf)), device(std::exchange(o.device, nullptr)) {}
    SideBuffer& operator=(SideBuffer&&) = delete;
    ~SideBuffer() {
      if (device != nullptr && buf.data() != nullptr)
        (void)device->UnregisterHostMemory(buf.data());
    }
  };
  // The update phase (update_phase.cc): device Adam, its three streams, the rates measured at
  // the first step, the assignment made from them, and what the last step did.
  struct Phase {
    std::unique_ptr<DeviceAdam> decay, plain;
    Stream h2d, adam, d2h;
    std::vector<Event> up_done, adam_done, slot_free;  // per slot
    bool measured = false;
    UpdateRates rates;
    UpdateAssignment assignment;
    std::vector<double> measured_end_s;  // per group, from the phase's start (last step)
    double measured_s = 0;
    std::vector<double> phase_s;                     // every step's, for the median
    std::vector<double> cpu_rate_samples;            // CPU Adam params/s of the last phases
    std::vector<double> cpu_rate_samples_streaming;  // of those with streamed groups
    std::vector<double> clear_rate_samples;          // host clears behind the forward, bytes/s
    std::vector<double> link_samples;  // UpdateRates::link_slowdown_beside_cpu, the last phases'
    std::vector<UpdateGroup> assigned_groups;  // what the assignment was made from
    UpdateRates assigned_rates;
    DeviceBuffer extra;  // device memory beyond the idle slot region, held for one phase
    std::chrono::steady_clock::time_point t0;  // the last phase's start
    std::vector<bool> skip;  // groups the speculative start already updated (this phase)
  };
  // The CPU chain behind the next forward (behind_forward.cc; Note [The update phase behind the
  // next forward]): the chunk manager's fence, asked before each gather.
  struct Behind final : ChunkManager::ParamFence {
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
    OptimizerCounters counters_at_launch;  // what stats show while the worker runs
    double device_end_s = 0;               // the device chain's end, from the phase's start
    double wait_s = 0;                     // the trainer waited for the worker, in all
    int64_t step = 0;                      // the step it updates (for its error)
    // Written by the worker before it finishes, read after the join.
    double cpu_end_s = 0, adam_s = 0;
    uint64_t adam_elems = 0;
    // The host gradient shards it cleared (Note [The accumulation clear in the model]).
    double clear_s = 0;
    uint64_t clear_bytes = 0;

    bool Ready(int chunk) override;
    Status Await(int chunk) override;
    void MarkDone(int chunk);
  };
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
      void* states;  // a group's memory (OptimizerStates::layout())
      uint8_t* out;  // the parameter shard's new contents
    };
    bool prepared = false;  // Prepare was called for the next step
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
    // Note [The gradient norm summed as the shards become final]: the worker's sums of the host
    // gradient shards' slices, for the next Step; `summed[c]` says chunk c's are there.
    bool sum_ahead = false;  // this worker sums
    std::vector<bool> summed;
    std::vector<std::vector<double>> sums;
  };
  static constexpr size_t kSpanWindow = 15;

  OptimizerStates& optimizer() const { return *store_->optimizer(); }
  int world() const { return layout_.world_size(); }
  Status Init();
  Status CreatePhase();  // update_phase.cc
  StatusOr<double> GradSumSquares();
  Status HostSliceSums(int chunk, std::vector<double>& out) const;
  Status SumChunkAhead(int chunk);  // speculation.cc
  StatusOr<std::vector<double>> DeviceSliceSums();
  Status AdamGroup(const OptimizerGroup& group, const AdamStepOptions& options, bool profiled);
  // Slice s of group g's chunk as AdamBuffers: its master, moments (Note [8-bit blocks per
  // slice]), gradient (in `grad`, the shard's) and output (in `out`, the shard's layout).
  AdamBuffers SliceBuffers(const OptimizerGroup& g, size_t s, const uint8_t* grad,
                           uint8_t* out) const;
  // The update phase (update_phase.cc).
  std::vector<UpdateGroup> Groups() const;
  StatusOr<UpdateRates> MeasureRates(void* device_scratch, uint64_t scratch_bytes);
  Status RunPhase(const AdamStepOptions& options, bool profiled);
  Status EnqueueDeviceGroup(int chunk, UpdateWhere where, int slot, uint8_t* slot_mem,
                            const AdamStepOptions& options);
  // The CPU's groups of the phase; `mark` tells the fence each finished chunk.
  Status RunCpuChain(const AdamStepOptions& options, bool profiled, bool mark, double& adam_s,
                     uint64_t& adam_elems);
  // Whether the CPU chain updates chunk c this phase: assigned to the CPU and not already
  // updated by the speculative start.
  bool CpuChainTakes(int chunk) const;
  // What a phase measured, once both chains are done.
  void FinishPhase(double measured_s, double adam_s, uint64_t adam_elems, bool rate_sample);
  // Behind the forward (behind_forward.cc): false when no thread could be had (the caller then
  // runs the chain itself).
  StatusOr<bool> LaunchBehind(const AdamStepOptions& options);
  // The speculative start (speculation.cc).
  int SpeculationSlots(int want);
  void SpeculationWorker(Speculation::Queue& q);
  void EndSpeculation(bool keep);
  StatusOr<std::vector<bool>> CommitSpeculation(bool exact);

  UpdaterConfig cfg_;
  Device* device_;
  ShardStore* store_;
  ChunkManager* cm_;
  const ChunkLayout& layout_;
  Communicator* comm_;
  Timeline& timeline_;
  AlignedBuffer& out_;  // UpdaterParts::param_out
  // A device gradient shard brought over for a CPU update of its group (a device group the
  // cost model sends to the CPU, or a host group whose accumulation shard is on the device: Note
  // [Accumulating on the device for host updates]); pinned, made on first use.
  std::atomic<uint64_t> moved_h2d_{0}, moved_d2h_{0};
  std::unique_ptr<PinnedArena> grad_bounce_arena_;
  std::optional<PinnedSlot> grad_bounce_;
  // Note [A CPU group's device gradient fetched ahead] (grad_fetch.cc): while the CPU chain's
  // Adam runs on one group, the next group's device gradient shard comes over into the other
  // slot. Only the chain's thread touches it, between FetchBegin and FetchEnd.
  struct GradFetch {
    std::unique_ptr<PinnedArena> arena;  // two slots of a gradient shard, made on first use
    std::vector<PinnedSlot> slots;
    std::optional<Stream> stream;
    std::vector<Event> done;    // per slot: its copy has landed
    int held[2] = {-1, -1};     // the chunk each slot holds (or is receiving)
    std::vector<int> order;     // the chain's chunks with a device gradient, in order
    std::vector<int> position;  // per chunk: its place in `order`, or -1
    size_t issued = 0;          // copies issued: order[0 .. issued)
    uint64_t groups = 0;        // updates that read a fetched gradient (for tests)
  } fetch_;
  Status FetchBegin(const std::function<bool(int)>& takes);
  Status FetchNext(int chunk);  // before chunk's Adam: the next one's copy
  void FetchEnd();
  std::vector<bool> decays_;                     // per tensor
  std::vector<std::vector<ShardSlice>> slices_;  // per chunk: this rank's tensor slices
  bool shut_down_ = false;

  std::unique_ptr<CpuAdam> adam_decay_, adam_plain_;
  std::vector<SideBuffer> side_memory_;
  Phase phase_;
  Behind tail_;
  Speculation spec_;
  int last_summed_ahead_ = 0;
  // Training forwards' spans less their waits for the CPU chain (NoteForward) and the last
  // micro-batches' backward spans up to the step (the NVMe read-ahead's window), the last
  // kSpanWindow of each.
  std::vector<double> forward_spans_, backward_spans_;
  double device_forward_s_ = 0;  // NoteDeviceForward; 0: none measured
  std::chrono::steady_clock::time_point backward_t0_{};
  bool backward_open_ = false;
  bool prefetch_warned_ = false;
  UpdaterStats stats_;
};

// Appends x to a window of the last `keep` samples (the oldest dropped) and returns the window's
// median.
double AddSample(std::vector<double>& window, double x, size_t keep = 15);

}  // namespace tierzero
