// The engine's state (Engine::Impl), shared by the files of src/engine; what Finalize's placement
// decides is placed_run.h, the tests' ways in internals.h.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "chunk/chunk_manager.h"
#include "chunk/layout.h"
#include "chunk/placement.h"
#include "core/aligned_buffer.h"
#include "core/mutex.h"
#include "core/tunable.h"
#include "engine/placed_run.h"
#include "offload/compute_gate.h"
#include "offload/device.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"
#include "profiler/report_snapshot.h"
#include "profiler/timeline.h"
#include "shard/shard_store.h"
#include "tierzero/engine.h"
#include "update/updater.h"

namespace tierzero {

class ActivationBuffer::Owner {
 public:
  virtual void FreeActivation(void* data, uint64_t bytes) = 0;

 protected:
  ~Owner() = default;
};

struct Engine::Impl final : ActivationBuffer::Owner {
  EngineConfig cfg;
  std::shared_ptr<Communicator> comm;
  std::vector<ParamSpec> params;
  std::vector<int64_t> numel;
  std::map<std::string, ParamId> by_name;
  bool finalized = false;
  // Expires with the engine: a ParamScope or ActivationBuffer that outlives it does nothing.
  std::shared_ptr<const void> alive = std::make_shared<int>(0);
  // ParamScopes acquired and not yet released; an AbortIteration that found some open waits
  // for the last (Note [An iteration aborted with scopes open], engine.cc).
  int open_scopes = 0;
  bool abort_pending = false;
  // Why a Finalize failed, when one did: the engine is then unusable (Finalize lays out, places
  // and allocates once; a second attempt kept the first's slices and device).
  std::string finalize_failed;

  std::unique_ptr<Device> device;
  bool host_compute = false;
  Stream compute;
  // The trainer's compute marked on the compute stream where it runs on the host
  // (offload/compute_gate.h): closed after each Acquire and Release, opened at the next call.
  std::unique_ptr<ComputeGate> gate;
  void OpenGate() {
    if (gate) gate->Open();
  }
  Status CloseGate(bool wait_reached) { return gate ? gate->Close(wait_reached) : Status::OK(); }
  std::unique_ptr<NvmeStore> nvme;
  // Wraps the NVMe tier's BlockIo (tests inject faults; EngineInternals::WrapNvmeIo).
  std::function<std::unique_ptr<BlockIo>(std::unique_ptr<BlockIo>)> nvme_wrap_io;
  // W > 1 with CollectivePath::kDevice; destroyed after the chunk manager that queues on it.
  std::unique_ptr<DeviceCollectives> device_comm;
  ChunkLayout layout;
  Placement placement;
  TierBudgets budgets;
  // The optimizer's update (src/update): declared before the store, whose host groups may point
  // into its side buffers after a speculative commit (Note [The speculative start]); Shutdown
  // (~Engine) joins its workers before the store or chunk manager goes.
  std::unique_ptr<Updater> updater;
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
  // A compute-dtype shard for parameter shards outside host memory (UpdaterParts::param_out).
  AlignedBuffer upload;

  bool in_iteration = false;
  bool iteration_train = true;
  int iterations_since_step = 0;
  // The training forward's span, from BeginIteration to the first backward Acquire less the
  // waits for the update's CPU chain (Updater::NoteForward).
  std::chrono::steady_clock::time_point forward_t0{};
  double forward_wait0 = 0;
  bool forward_open = false;
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
  // `producer`: tierzero's metadata (producer, step, and `metadata`) beside {"format": "pt"},
  // else that alone (as transformers writes it).
  Status ExportFiles(const std::vector<ExportFile>& files, DType dtype, const TensorNames& names,
                     bool producer, const std::map<std::string, std::string>& metadata = {});
  std::vector<size_t> GatherOrder() const;
  std::vector<ChunkManager::MomentProfile> profile;  // copied at the profiled EndIteration
  std::vector<TimelineEvent> profile_events;
  int64_t profile_iteration = -1;  // iterations counted from 0, evaluations included
  int64_t iterations = 0;
  // Every gather and reduction's bytes so far at the profiled iteration's start, then in it.
  WireBytes profile_wire_start, profile_wire;
  bool profile_step = false;                                   // the next Step adds its events
  double step_nvme_seconds = 0, step_seconds = 0;              // the profiled step's
  uint64_t step_nvme_bytes = 0, step_nvme_pipeline_bytes = 0;  // of it, in Step's pipeline
  uint64_t step_nvme_write_bytes = 0;  // optimizer states and NVMe parameter shards
  // The optimizer's NVMe counters when the profiled step's state reads began: in its last
  // micro-batch's backward (the read-ahead), before Step (Note [The profiled step's NVMe]).
  std::optional<OptimizerCounters> profile_optimizer_before;
  // Note [The collectives of training]
  // The seconds the training iterations spent in collectives (evaluations' left out): a step's
  // measured collectives were the run's whole time in them over its steps, evaluations included
  // (1.06 ms against 0.10 predicted: figures hunt 47).
  double train_comm_seconds = 0, iteration_comm0 = 0;
  void PrefetchStates() {
    if ((cm->profiling() || profile_step) && !profile_optimizer_before)
      profile_optimizer_before = optimizer().counters();
    updater->PrefetchStates();
  }

  void FreeActivation(void* data, uint64_t bytes) override;
  OptimizerStates& optimizer() const { return *store->optimizer(); }
  // Runs fn on one chunk's optimizer group as fp32 master, m and v (compressed moments decoded
  // for fn and, with write_back, encoded again; written back to NVMe with write_back).
  Status WithChunkState(int chunk, bool write_back,
                        const std::function<Status(float*, float*, float*)>& fn);
  // This rank's slice s of chunk c's moments as AdamBuffers sees them (param_io.cc).
  AdamBuffers SliceMoments(const OptimizerGroup& g, size_t s) const;
  // Finalize's steps (setup.cc).
  StatusOr<bool> ChooseCollectivePath(bool cuda);
  Status Finalize();                           // Engine::Finalize past its checks (setup.cc)
  Status NoScopeOpen(const char* call) const;  // Note [An iteration aborted with scopes open]
  Status Place(bool on_device);
  Status CheckHostMemory(bool cuda);  // Note [Host memory within the process's limit]
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
  Status SkipStep();
  // Whether this training iteration is the step's last micro-batch.
  bool LastMicroBatch() const {
    return iteration_train && iterations_since_step + 1 == cfg.grad_accumulation;
  }
  // The report's snapshot in parts (report.cc).
  void SnapshotLayout(ReportSnapshot& s) const;
  void SnapshotPlan(ReportSnapshot& s) const;
  void SnapshotRanks(ReportSnapshot& s) const;
  void SnapshotProfile(ReportSnapshot& s) const;
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

}  // namespace tierzero
