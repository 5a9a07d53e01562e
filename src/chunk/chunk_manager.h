// ChunkManager: the device chunk cache and its execution (DESIGN.md sections 4-5). It owns the
// shards of every chunk in their tiers (device memory, pinned host memory, NVMe), builds gathered
// chunks in device slots with asynchronous copies, tracks tensor states, records the warm-up
// trace, plans, and replays the plan in later iterations.
//
// Iterations. BeginIteration, then Acquire/Release pairs (one Acquire is one moment), then
// EndIteration. The first iteration is the warm-up: it gathers on demand, keeps only chunks in
// COMPUTE on the device (so it cannot run out of memory as long as each moment fits), and records
// the moments with their non-model bytes (OnNonModelBytes) and compute times (device events).
// EndIteration then plans (chunk/plan.h). Later iterations replay the plan's decisions: evictions
// and gathers at each moment, prefetches included, so the compute stream waits only where the
// plan says a stall is unavoidable. An Acquire that differs from the trace switches the rest of
// the iteration to on-demand, and the next iteration records and plans again; nothing hangs.
//
// Gathers. W = 1: a device-resident shard is the gathered chunk (no copy); a host shard is copied
// H2D into a slot; an NVMe shard is read into a pinned staging slot, then copied H2D (the wait
// for the disk runs on the H2D stream, not on the caller). A slot is refilled only after the
// compute stream is done with its previous chunk (an event recorded at eviction) and any gradient
// copy out of it has finished.
//
// Gradients. Without accumulation a tensor's gradient goes into its own place in the gathered
// chunk (GradPtr == DevicePtr in backward: the trainer must finish reading the weight before it
// writes the gradient); with accumulation, for device-resident shards, and for chunks holding a
// tensor used more than once in forward (shared weights), into a separate, zeroed grad chunk. When
// every tensor of a chunk is HOLD_AFTER_BWD the gradient is copied D2H into the chunk's host
// gradient shard (bf16 without accumulation; accumulated into fp32 with it), on the D2H stream.
//
// Ranks (W > 1, options.comm). Every rank holds shard r of each chunk (shard_elems elements).
// A gather reads the local shard from its tier, all-gathers the shards into a pinned staging
// slot over the communicator, and copies the chunk H2D. A gradient chunk, once its backward is
// complete, is copied D2H and reduce-scattered (mean over ranks) into the local gradient shard;
// the reduce-scatter runs while backward goes on and is waited for at EndIteration. The ranks
// agree at every Acquire (one small all_gather): their moments must match (else an error names
// the ranks and what each acquired, instead of a hang or wrong data), a deviation from the
// trace on any rank sends every rank on demand, and plan inputs are the maximum over ranks, so
// all ranks replay the same plan and start the same collectives in the same order
// (Note [Collectives on the trainer's thread] in zero/gather_host.cc).
//
// Thread-safety: one thread drives a ChunkManager (the trainer's); calls are not concurrent.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "chunk/layout.h"
#include "chunk/placement.h"
#include "chunk/plan.h"
#include "chunk/tensor_state.h"
#include "chunk/trace.h"
#include "comm/device_collectives.h"
#include "core/status.h"
#include "offload/device.h"
#include "profiler/observer.h"
#include "shard/shard_store.h"
#include "tierzero/communicator.h"
#include "zero/zeropp.h"

namespace tierzero {

struct ChunkManagerOptions {
  // Device memory for gathered chunks and non-model data together (the plan's capacity). Not
  // included: device-resident shards, and in backward their separate gradient chunks (and, with
  // accumulation, every chunk's), which are allocated from the device beside it.
  uint64_t device_budget_bytes = 0;
  // Accumulate gradients over micro-batches (separate grad chunks, fp32 host shards).
  bool grad_accumulation = false;
  // Transfer rates the plan assumes until a recording iteration has timed real gathers (device
  // events around each gather, per tier), which then replace them. Defaults: 12 GB/s H2D, 2 GB/s
  // NVMe reads.
  double h2d_bytes_per_second = 12e9;
  double nvme_read_bytes_per_second = 2e9;
  // Pinned memory for NVMe reads on their way to the device, in chunk-sized slots (at least 2,
  // at most 32). A gather of an NVMe shard holds a slot from the disk read until its H2D copy is
  // done; when all are busy the caller waits, so this bounds how many NVMe prefetches can be in
  // flight. Default: 256 MiB.
  uint64_t staging_bytes = uint64_t{256} << 20;
  // Policy after warm-up: kPlan normally; kOnDemand and kLru for comparison (chunk_bench).
  CachePolicy policy = CachePolicy::kPlan;
  // The ranks sharing every chunk (W = layout world_size); null for one rank. A host
  // communicator (MPI): the ranks agree through it at every Acquire, and without device_comm the
  // gathers and reductions go through pinned host buffers over it (device-resident parameter
  // shards are then not supported).
  Communicator* comm = nullptr;
  // W > 1: collectives on device buffers, ordered on their own stream (NCCL on a GPU; host
  // functions over a duplicate of comm on the simulated device). Gathers copy the local shard to
  // its place in the slot and all-gather in place; gradient chunks are reduce-scattered in place
  // and only the local shard comes back to the host. Null: the host path. Default: null.
  DeviceCollectives* device_comm = nullptr;
  // W > 1: ZeRO++'s quantized gathers, secondary partition and quantized gradient reduction
  // (zero/zeropp.h; shard_runs is filled here from the layout). Only with device_comm created
  // with node_collectives. Default: all off.
  ZeroPPOptions zeropp;
  // Measure the compute-stream stall in every iteration (two device events per Acquire; about a
  // microsecond on HostSim). Default: false (recording iterations measure it regardless).
  bool measure_stalls = false;
};

struct ChunkCounters {
  uint64_t hits = 0;        // needed chunks already gathered (or in flight) at their moment
  uint64_t misses = 0;      // needed chunks gathered at their own moment
  uint64_t prefetches = 0;  // gathers started for a later moment
  uint64_t evictions = 0;
  uint64_t h2d_bytes = 0, d2h_bytes = 0, nvme_read_bytes = 0, nvme_write_bytes = 0;
  uint64_t deviations = 0;  // iterations that left the trace
  uint64_t plans = 0;       // plans computed
  uint64_t iterations = 0;
  // Compute-stream stall: seconds the compute stream waited at Acquires for gathers, measured
  // with device events in recording iterations and, with measure_stalls, in every iteration.
  // Not included: time the stream sat idle because the caller's thread was itself blocked (for
  // instance waiting for a free NVMe staging slot).
  double stall_seconds = 0;       // all measured iterations
  double last_stall_seconds = 0;  // the last measured iteration
  // W > 1: seconds the caller spent in gathers' all_gathers and waiting for reduce-scatters.
  double comm_seconds = 0;
  uint64_t reduce_scatters = 0, all_gathers = 0;
  // W > 1: the bytes of the forward gathers, the later gathers and the gradient reductions
  // (zero/transfer.h).
  WireBytes param_gather, param_regather, grad_reduce;
  WireBytes AllWire() const { return param_gather + param_regather + grad_reduce; }
};

// Moments a separate gradient chunk is held past the one that reduced it (Note [A gradient
// chunk held past its reduction], chunk_manager.cc; Engine::Plan counts the same).
inline constexpr int kGradChunkHeldMoments = 2;

class ChunkManager {
 public:
  // The shard store a manager with these arguments needs (ShardStore::Create), without
  // optimizer states: the caller adds their tiers when it keeps them in the store.
  static ShardStoreOptions StoreOptions(const ChunkLayout& layout, const Placement& placement,
                                        const ChunkManagerOptions& options);
  // `device`, `compute_stream`, `store` (made with StoreOptions) and `layout` must outlive the
  // manager. Chooses the gather and reduce paths (zero/gather.h, zero/reduce.h) once.
  static StatusOr<std::unique_ptr<ChunkManager>> Create(Device& device, StreamHandle compute_stream,
                                                        ShardStore& store,
                                                        const ChunkLayout& layout,
                                                        const Placement& placement,
                                                        const ChunkManagerOptions& options);
  ~ChunkManager();

  // ---- Shard contents (between iterations) ----
  // (A tensor's values are written and its gradient read by the engine, through the shard store:
  // src/engine/param_io.cc.)
  // Clears every gradient shard (the start of an accumulation window).
  Status ZeroGrads();
  ShardStore& store() const { return store_; }

  // ---- Iterations ----
  // An inference iteration (evaluation) acquires for forward only, gathers on demand, and leaves
  // the trace, the plan and the gradient shards untouched.
  Status BeginIteration(bool inference = false);
  // Gathers the chunks of `tensors` (a moment) and makes the compute stream wait for them.
  Status Acquire(std::span<const int> tensors, Phase phase);
  Status Release(std::span<const int> tensors, Phase phase);
  // Device pointer of a tensor's parameters (valid while acquired), and where its gradient goes
  // (valid while acquired for backward).
  void* DevicePtr(int tensor) const;
  void* GradPtr(int tensor) const;
  // Non-model bytes in use, reported by the activation allocator on every change.
  void OnNonModelBytes(uint64_t current) { tracer_.OnNonModelBytes(current); }
  // Calls fn(chunk) (from a stream's thread) as each chunk's gradient shard becomes final in
  // this rank's memory during backward, where the reduction's last step is a D2H copy (one
  // rank, and the device collectives); with host collectives nothing is called (the shards are
  // final at EndIteration). For the next training iteration only; null clears it.
  void SetGradFinalCallback(std::function<void(int chunk)> fn);
  // Whether a chunk's parameter shard is current. Between a Step and the next backward the
  // optimizer may still be updating shards (Note [The update phase behind the next forward] in
  // engine/update_tail.cc): a gather of chunk c first calls Await(c); on one rank a prefetch of
  // a chunk not Ready yet is put off to the next Acquire or Release (on several ranks it waits,
  // since the ranks' gathers must stay in one order). Both are called on the trainer's thread.
  class ParamFence {
   public:
    virtual bool Ready(int chunk) = 0;    // never blocks
    virtual Status Await(int chunk) = 0;  // blocks until current, or the update's error
   protected:
    ~ParamFence() = default;
  };
  // Null (the default): every shard is always current. The fence must outlive the manager or be
  // cleared first.
  void SetParamFence(ParamFence* fence) { fence_ = fence; }
  // Finishes backward (reduces the remaining chunks), waits for all copies, and after a
  // recording iteration computes the plan. Budget errors (a moment that cannot fit) surface here.
  Status EndIteration();

  // OK, or why the ranks are out of step (W > 1): their programs differed at an agreement, or
  // one of the collectives that keep them in step failed. Nothing in flight can be cancelled
  // and the ranks cannot be brought back in step, so from then on every call that would start
  // a collective fails with this (the trainer aborts; restart from the last checkpoint).
  Status out_of_step() const;
  // Makes out_of_step() return an error naming `why`: for a failure that left this rank's state
  // partly updated (a checkpoint load that failed while writing).
  void MarkOutOfStep(Status why);

  bool has_plan() const { return has_plan_; }
  // The plan's slot region, idle between EndIteration and the next BeginIteration (every chunk
  // released, every stream drained): the optimizer's update phase borrows it (docs/optimizer.md).
  // The borrower's work must be finished before the next iteration begins. Null/0 without a plan.
  void* idle_slot_memory() const;
  uint64_t idle_slot_bytes() const;
  const Schedule& schedule() const { return schedule_; }
  const std::vector<Moment>& trace() const { return trace_; }
  // The manager's counters with the transfers' and the parameter shards' NVMe traffic.
  ChunkCounters counters() const;
  const ChunkLayout& layout() const { return layout_; }
  const StateTracker& states() const { return *states_; }
  // ---- Profiling (the memory placement report) ----
  // Profiles the next planned training iteration: its transfers are reported to `observer`
  // (profiler/observer.h), and every moment's residency, device memory and stall are kept
  // (moment_profiles()). `on_begin` (may be empty) runs when that iteration begins (the
  // engine restarts its timeline there). `observer` must outlive that iteration.
  void ProfileNextIteration(Observer* observer, std::function<void()> on_begin = {});
  // True from the BeginIteration of the profiled iteration to its EndIteration.
  bool profiling() const;
  // A planned iteration still to come will be profiled.
  bool profile_pending() const;
  struct MomentProfile {
    // Per chunk, where its parameters are while the moment computes: 'D' gathered on the
    // device (or a device-resident shard), 'H' only in host memory, 'N' only on NVMe.
    std::string residency;
    uint64_t device_chunk_bytes = 0;  // gathered chunks in device memory (slots, grad chunks)
    uint64_t nonmodel_bytes = 0;      // activations when the moment began
    double stall_s = 0;               // the compute stream waited for gathers
    std::vector<int> prefetch;        // gathers issued at this moment for later moments
  };
  // The last profiled iteration's moments; empty before one.
  const std::vector<MomentProfile>& moment_profiles() const;

  // Seconds each chunk's gather takes in the plan: measured in the last recording iteration
  // (mean per tier), else from the configured rates.
  std::vector<double> GatherSeconds() const;

 private:
  struct Impl;
  ParamFence* fence_ = nullptr;
  ChunkManager(Device& device, StreamHandle compute, ShardStore& store, const ChunkLayout& layout,
               const Placement& placement, const ChunkManagerOptions& options);
  Status Init();
  // The moment loop (chunk_manager.cc).
  Status AcquireChunks(int moment, const std::vector<int>& needed, std::span<const int> tensors,
                       Phase phase);
  // Whether moment k leaves the trace (W > 1: agreed with the other ranks).
  StatusOr<bool> OffTrace(int k, const std::vector<int>& needed, std::span<const int> tensors,
                          Phase phase);
  void LeavePlan(int k, const std::string& why);
  void TraceMoment(const std::vector<int>& needed, Phase phase);
  Status ReplayMoment(int k, const std::vector<int>& needed);
  Status OnDemandMoment(int k, const std::vector<int>& needed);
  Status GatherMissing(int k, const std::vector<int>& needed, bool started);
  // Makes the compute stream wait for the needed chunks (one wait) and allocates gradient
  // chunks for backward.
  Status WaitForNeeded(int k, const std::vector<int>& needed, Phase phase);
  void ProfileMoment(int k);
  Status FlushPrefetches();
  // Frees the separate gradient chunks released before moment `before` (Note [A gradient chunk
  // held past its reduction]), waiting for their copies where they are not done.
  Status FreeDeferred(int before);
  // Gathers, evictions and reductions (chunk_gather.cc).
  Status Gather(int chunk);
  // `moment`: the current Acquire's moment, whose event then marks the chunk's last use (-1:
  // record the slot's own event).
  Status Evict(int chunk, int moment = -1);
  // Moment k's event, recorded on the compute stream on the current Acquire's first call.
  StatusOr<EventHandle> MomentEvent(int k);
  Status GathersStartNow(int moment);
  Status ReduceChunk(int chunk);
  Status ReduceInSlot(int chunk, const Event& written);
  Status ReduceSeparate(int chunk, const Event& written);
  bool SeparateGrads(int chunk) const;
  // The gathered chunk is the device-resident shard itself (one rank).
  bool ShardIsGathered(int chunk) const;
  bool Evictable(int chunk) const;
  // The end of an iteration (chunk_manager_end.cc).
  Status FinishTransfers();
  void MeasureStalls();
  Status ReleaseChunks();
  Status Replan(std::vector<Moment> moments);
  StatusOr<Schedule> PlanFrom(const std::vector<Moment>& moments);

  Device& device_;
  StreamHandle compute_;
  ShardStore& store_;
  const ChunkLayout& layout_;
  Placement placement_;
  ChunkManagerOptions options_;
  std::unique_ptr<StateTracker> states_;
  MemoryTracer tracer_;
  std::vector<Moment> trace_;
  Schedule schedule_;
  bool has_plan_ = false;
  ChunkCounters counters_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tierzero
