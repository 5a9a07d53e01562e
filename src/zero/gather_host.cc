// HostGather (zero/gather.h): W ranks gather through pinned host buffers over a host
// communicator.
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>

#include "comm/collective.h"
#include "core/bytes.h"
#include "core/mutex.h"
#include "zero/gather.h"
#include "zero/gather_internal.h"

namespace tierzero {

namespace {

// Note [Collectives on the trainer's thread]
// With W > 1 every collective on the communicator is started on the thread that drives the
// manager, never in a stream's host function: the ranks must start the same collectives in the
// same order, which only calls the trainer makes in program order can promise. (Device
// collectives are queued by that thread too, in program order, and run in that order on their
// own stream, over their own communicator: Note [Gathers on the device] in gather.cc. What
// follows is the path through host buffers.) So a gather's all_gather starts when the gather is
// issued (on demand at its Acquire, or as a planned prefetch at the next call after the
// moment's compute was queued). When the communicator is asynchronous (MPI's comm thread, Note
// [The MPI comm thread] in src/comm/mpi.cc) a host function on the H2D stream waits for it and
// checks the tags, and the H2D copies follow, so neither the trainer nor the compute stream
// waits: the gather overlaps compute like a one-rank prefetch. Otherwise the trainer waits for
// the all_gather before queuing the copies. A gradient chunk's D2H copy is waited for when the
// chunk's backward completes (on the simulated device the compute is done by then) and its
// reduce-scatter is started there and completed later, overlapping the rest of backward
// (zero/reduce.cc). The agreement at each Acquire keeps those sequences identical on every rank.
// EndIteration synchronises every stream, so no gather is in flight when the optimizer
// rewrites the shards it sends from, and an asynchronous gather's failure ends that call.
//
class HostGather final : public GatherStrategy {
 public:
  HostGather(TransferContext& ctx, Communicator& comm) : ctx_(ctx), comm_(comm) {}

  Status Init(const GatherOptions& options) {
    const ShardGeometry& g = ctx_.geometry();
    const uint64_t shard = g.shard_bytes();
    send_area_bytes_ = HostGatherSendAreaBytes(shard);
    const uint64_t slot = HostGatherSlotBytes(shard, g.world_size);
    ASSIGN_OR_RETURN(staging_, internal::CreateStaging(ctx_, slot, options.staging_bytes));
    return Status::OK();
  }

  void Quiesce() override { (void)ctx_.h2d.Synchronize(); }
  bool StagesEveryChunk() const override { return true; }
  int staging_slots() const override { return static_cast<int>(staging_->num_slots()); }
  void BeginIteration() override { seq_ = 0; }

 private:
  Status Enqueue(int c, void* dst, const Event& ready) override;
  TransferContext& ctx_;
  Communicator& comm_;
  std::unique_ptr<PinnedArena> staging_;
  uint64_t send_area_bytes_ = 0;
  uint64_t seq_ = 0;
};

// The local shard (from host memory, or read from NVMe into the staging slot's send area) is
// all-gathered with its tag into the slot, started on this thread; the H2D stream then copies
// the W shards into the gathered chunk (Note [Collectives on the trainer's thread]).
Status HostGather::Enqueue(int c, void* dst, const Event& ready) {
  Device& device = ctx_.device;
  const ShardGeometry& g = ctx_.geometry();
  const uint64_t shard = g.shard_bytes();
  const uint64_t block = shard + kGatherTagBytes;
  const StreamHandle h2d = ctx_.h2d.handle();
  TransferSpans& spans = ctx_.spans;
  Observer* obs = spans.observer();
  const int m = ctx_.moment - 1;
  const auto t0 = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(PinnedSlot staging, staging_->Acquire(StagingTimeout()));
  auto* base = static_cast<uint8_t*>(staging.data());
  uint8_t* recv = base + send_area_bytes_;
  ASSIGN_OR_RETURN(uint8_t * send, internal::LocalShardOnHost(ctx_, c, base));
  const internal::GatherTag tag{c, m, seq_++};
  std::memcpy(send + shard, &tag, sizeof tag);
  const double comm_start = obs != nullptr ? obs->Now() : 0.0;
  ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req,
                   comm_.AllGather(send, recv, block, DType::kI8));
  ++ctx_.counters.all_gathers;
  const auto others = static_cast<uint64_t>(g.world_size - 1);
  ctx_.GatherWire(c).Add(shard * others, block * others,
                         zero::CrossNodeBytes(block * others, ctx_.topology));
  const bool async = comm_.asynchronous();
  auto failed = std::make_shared<std::atomic<bool>>(false);
  const internal::GatherArrival arrival{
      recv,       block, shard, tag, g.world_size, g.rank, "all_gather chunk " + std::to_string(c),
      comm_start, c};
  if (!async) RETURN_IF_ERROR(internal::AwaitArrival(ctx_, *req, arrival));
  const double caller_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ctx_.counters.comm_seconds += caller_s;
  const Tier tier = ctx_.store.param_tier(c);
  ctx_.timer.AddCallerSeconds(tier, caller_s);
  ASSIGN_OR_RETURN(GatherTimer::Timing * timing, ctx_.timer.Start(device, h2d, tier));
  if (async) RETURN_IF_ERROR(internal::QueueArrival(ctx_, std::move(req), arrival, {}, failed));
  // The W blocks' payloads, each a shard, in rank order.
  std::vector<internal::ChunkCopy> copies;
  for (int r = 0; r < g.world_size; ++r) {
    copies.push_back(
        {static_cast<uint8_t*>(dst) + r * shard, recv + static_cast<uint64_t>(r) * block, shard});
  }
  return internal::QueueChunkToDevice(ctx_, c, copies, std::move(staging), failed, timing, ready);
}

}  // namespace

namespace internal {

Status CheckHostGather(TransferContext& ctx, Communicator& comm) {
  if (comm.size() != ctx.geometry().world_size) {
    return InvalidArgumentError("a communicator of " + std::to_string(comm.size()) +
                                " ranks for shards of " +
                                std::to_string(ctx.geometry().world_size) + " ranks");
  }
  if (ctx.store.host_param_tail_bytes() < kGatherTagBytes) {
    return InvalidArgumentError(
        "gathers through host buffers need room for a tag after each host parameter shard "
        "(ShardStoreOptions::host_param_tail_bytes)");
  }
  return Status::OK();
}

Status AwaitArrival(TransferContext& ctx, CommRequest& request, const GatherArrival& a) {
  RETURN_IF_ERROR(request.Wait());
  if (Observer* obs = ctx.spans.observer(); obs != nullptr) {
    obs->OnSpan({Track::kComm, a.span, a.comm_start, obs->Now() - a.comm_start, ctx.moment - 1,
                 a.chunk, ctx.geometry().chunk_bytes()});
  }
  return CheckTags(a.recv, a.block, a.payload, a.tag, a.ranks, a.me);
}

Status QueueArrival(TransferContext& ctx, std::shared_ptr<CommRequest> request,
                    const GatherArrival& a, std::function<Status()> then,
                    const std::shared_ptr<std::atomic<bool>>& failed) {
  RankAgreement* ranks = &ctx.ranks;
  Observer* obs = ctx.spans.observer();
  const int m = ctx.moment - 1;
  const uint64_t chunk_bytes = ctx.geometry().chunk_bytes();
  return ctx.device.LaunchHostFunc(
      ctx.h2d.handle(), [request, a, then = std::move(then), ranks, obs, m, chunk_bytes, failed] {
        Status st = request->Wait();
        if (obs != nullptr) {
          obs->OnSpan({Track::kComm, a.span, a.comm_start, obs->Now() - a.comm_start, m, a.chunk,
                       chunk_bytes});
        }
        if (st.ok()) st = CheckTags(a.recv, a.block, a.payload, a.tag, a.ranks, a.me);
        if (st.ok() && then) {
          try {  // (a host function must not throw)
            st = then();
          } catch (...) {
            st = StatusOfCurrentException();
          }
        }
        if (!st.ok()) {
          // An abandoned all_gather may still write into the staging slot: it is never given
          // back, and the ranks are out of step.
          failed->store(true);
          st = std::move(st).WithContext("gathering chunk " + std::to_string(a.chunk));
          ranks->SetAsyncError(st);
          (void)ranks->LoseStep(std::move(st));
        }
      });
}

Status QueueChunkToDevice(TransferContext& ctx, int c, const std::vector<ChunkCopy>& copies,
                          PinnedSlot staging, const std::shared_ptr<std::atomic<bool>>& failed,
                          GatherTimer::Timing* timing, const Event& ready) {
  Device& device = ctx.device;
  const StreamHandle h2d = ctx.h2d.handle();
  TransferSpans& spans = ctx.spans;
  const uint64_t chunk_bytes = ctx.geometry().chunk_bytes();
  auto start = spans.Start();
  if (spans.on()) RETURN_IF_ERROR(spans.QueueStart(device, h2d, start));
  for (const ChunkCopy& k : copies) {
    RETURN_IF_ERROR(device.CopyAsync(k.dst, k.src, k.bytes, CopyKind::kHostToDevice, h2d));
  }
  ctx.counters.h2d_bytes += chunk_bytes;
  if (spans.on()) {
    RETURN_IF_ERROR(spans.QueueSpan(device, h2d, Track::kH2D, "chunk " + std::to_string(c),
                                    ctx.moment - 1, c, chunk_bytes, start));
  }
  RETURN_IF_ERROR(ReleaseAfterGather(device, h2d, std::move(staging), failed));
  if (timing != nullptr) RETURN_IF_ERROR(device.RecordEvent(timing->end.handle(), h2d));
  return device.RecordEvent(ready.handle(), h2d);
}

StatusOr<uint8_t*> LocalShardOnHost(TransferContext& ctx, int c, uint8_t* read_area) {
  if (ctx.store.param_tier(c) == Tier::kHost) return static_cast<uint8_t*>(ctx.store.host_param(c));
  const uint64_t shard = ctx.geometry().shard_bytes();
  Observer* obs = ctx.spans.observer();
  const double read_start = obs != nullptr ? obs->Now() : 0.0;
  RETURN_IF_ERROR(ctx.store.nvme()->Read(ctx.store.nvme_param(c), read_area));
  ctx.counters.nvme_read_bytes += shard;
  if (obs != nullptr) {
    obs->OnSpan({Track::kNvmeRead, "chunk " + std::to_string(c), read_start,
                 obs->Now() - read_start, ctx.moment - 1, c, shard});
  }
  return read_area;
}

Status ReleaseAfterGather(Device& device, StreamHandle stream, PinnedSlot slot,
                          const std::shared_ptr<std::atomic<bool>>& failed) {
  auto shared_slot = std::make_shared<PinnedSlot>(std::move(slot));
  return device.LaunchHostFunc(stream, [shared_slot, failed] {
    if (failed->load()) {
      // An abandoned all_gather may still write into the slot: Note [An abandoned slot].
      shared_slot->Abandon();
      return;
    }
    shared_slot->Release();
  });
}

// Every rank's block carries the tag of the gather it contributed to.
Status CheckTags(const uint8_t* recv, uint64_t block, uint64_t shard, const GatherTag& tag,
                 int world, int me) {
  for (int r = 0; r < world; ++r) {
    GatherTag got;
    std::memcpy(&got, recv + static_cast<uint64_t>(r) * block + shard, sizeof got);
    if (!(got == tag)) {
      return FailedPreconditionError(
          "the ranks gathered different chunks: rank " + std::to_string(me) + " chunk " +
          std::to_string(tag.chunk) + " (moment " + std::to_string(tag.moment) + ", gather " +
          std::to_string(tag.seq) + "), rank " + std::to_string(r) + " chunk " +
          std::to_string(got.chunk) + " (moment " + std::to_string(got.moment) + ", gather " +
          std::to_string(got.seq) +
          "); every rank must acquire the same parameters in the same order");
    }
  }
  return Status::OK();
}

}  // namespace internal

StatusOr<std::unique_ptr<GatherStrategy>> CreateHostGather(TransferContext& ctx, Communicator& comm,
                                                           const GatherOptions& options) {
  RETURN_IF_ERROR(internal::CheckHostGather(ctx, comm));
  auto g = std::make_unique<HostGather>(ctx, comm);
  RETURN_IF_ERROR(g->Init(options));
  return std::unique_ptr<GatherStrategy>(std::move(g));
}

}  // namespace tierzero
