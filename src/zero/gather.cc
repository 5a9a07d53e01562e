// LocalGather and DeviceGather (zero/gather.h); HostGather is in gather_host.cc.
#include "zero/gather.h"

#include <algorithm>

#include "comm/collective.h"
#include "core/bytes.h"
#include "core/logging.h"
#include "core/tunable.h"
#include "zero/gather_internal.h"

namespace tierzero {

namespace {
TZ_TUNABLE_RANGE(double, kStagingTimeoutSeconds, "TZ_STAGING_TIMEOUT_S", 120.0,
                 "seconds a gather or reduction waits for a free pinned staging slot before "
                 "failing (0.001 to 1e6)",
                 1e-3, 1e6);
}  // namespace

std::chrono::milliseconds StagingTimeout() { return TunableSeconds(kStagingTimeoutSeconds); }

int StagingSlotCount(uint64_t slot_bytes, uint64_t staging_bytes) {
  return static_cast<int>(std::clamp<uint64_t>(staging_bytes / slot_bytes, 2, 32));
}

uint64_t HostGatherSendAreaBytes(uint64_t shard_bytes) {
  return AlignUp(shard_bytes + kGatherTagBytes, 4096);
}

uint64_t HostGatherSlotBytes(uint64_t shard_bytes, int world_size) {
  return HostGatherSendAreaBytes(shard_bytes) +
         AlignUp(static_cast<uint64_t>(world_size) * (shard_bytes + kGatherTagBytes), 4096);
}

namespace internal {

StatusOr<std::unique_ptr<PinnedArena>> CreateStaging(TransferContext& ctx, uint64_t slot_bytes,
                                                     uint64_t staging_bytes) {
  const uint64_t slots = static_cast<uint64_t>(StagingSlotCount(slot_bytes, staging_bytes));
  ASSIGN_OR_RETURN(std::unique_ptr<PinnedArena> arena,
                   PinnedArena::Create(&ctx.device, slot_bytes, static_cast<uint32_t>(slots)));
  bool nvme_shards = false;
  for (int c = 0; c < ctx.store.num_chunks(); ++c)
    nvme_shards |= ctx.store.param_tier(c) == Tier::kNvme;
  if (nvme_shards) {
    // Staging slots are reused for every NVMe read: Note [Register reused buffers].
    Status reg = ctx.store.nvme()->RegisterBuffers({{arena->base(), arena->total_bytes()}});
    if (!reg.ok()) {
      TZ_LOG(kWarn, kChunk) << "NVMe staging not registered as fixed buffers: " << reg.ToString();
    }
  }
  return arena;
}

StatusOr<std::unique_ptr<PinnedArena>> CreateShardStaging(TransferContext& ctx,
                                                          uint64_t staging_bytes) {
  for (int c = 0; c < ctx.store.num_chunks(); ++c) {
    if (ctx.store.param_tier(c) == Tier::kNvme) {
      return CreateStaging(ctx, ctx.geometry().shard_bytes(), staging_bytes);
    }
  }
  return std::unique_ptr<PinnedArena>();
}

}  // namespace internal

namespace {

// One rank: the shard is the chunk, uploaded from its tier on the H2D stream.
class LocalGather : public GatherStrategy {
 public:
  explicit LocalGather(TransferContext& ctx) : ctx_(ctx) {}

  Status Init(const GatherOptions& options) {
    ASSIGN_OR_RETURN(staging_, internal::CreateShardStaging(ctx_, options.staging_bytes));
    return Status::OK();
  }

  Status Enqueue(int c, void* dst, const Event& ready) override {
    const StreamHandle h2d = ctx_.h2d.handle();
    const Tier tier = ctx_.store.param_tier(c);
    ASSIGN_OR_RETURN(GatherTimer::Timing * timing, ctx_.timer.Start(ctx_.device, h2d, tier));
    RETURN_IF_ERROR(internal::UploadShard(ctx_, staging_.get(), c, dst));
    if (timing != nullptr) RETURN_IF_ERROR(ctx_.device.RecordEvent(timing->end.handle(), h2d));
    return ctx_.device.RecordEvent(ready.handle(), h2d);
  }
  void Quiesce() override { (void)ctx_.h2d.Synchronize(); }
  int staging_slots() const override {
    return staging_ != nullptr ? static_cast<int>(staging_->num_slots()) : 0;
  }

 protected:
  TransferContext& ctx_;
  std::unique_ptr<PinnedArena> staging_;  // NVMe reads on their way to the device
};

}  // namespace

namespace internal {

Status UploadShard(TransferContext& ctx, PinnedArena* arena, int c, void* dst) {
  const uint64_t bytes = ctx.geometry().shard_bytes();  // the chunk when W = 1
  const StreamHandle h2d = ctx.h2d.handle();
  const Tier tier = ctx.store.param_tier(c);
  if (tier == Tier::kDevice) {
    return ctx.device.CopyAsync(dst, ctx.store.device_param(c), bytes, CopyKind::kDeviceToDevice,
                                h2d);
  }
  if (tier == Tier::kNvme) return UploadFromNvme(ctx, *arena, c, dst);
  TransferSpans& spans = ctx.spans;
  auto start = spans.Start();
  if (spans.on()) RETURN_IF_ERROR(spans.QueueStart(ctx.device, h2d, start));
  RETURN_IF_ERROR(
      ctx.device.CopyAsync(dst, ctx.store.host_param(c), bytes, CopyKind::kHostToDevice, h2d));
  if (spans.on()) {
    RETURN_IF_ERROR(spans.QueueSpan(ctx.device, h2d, Track::kH2D, "chunk " + std::to_string(c),
                                    ctx.moment - 1, c, bytes, start));
  }
  ctx.counters.h2d_bytes += bytes;
  return Status::OK();
}

Status UploadFromNvme(TransferContext& ctx, PinnedArena& arena, int c, void* dst) {
  const uint64_t bytes = ctx.geometry().shard_bytes();
  const StreamHandle h2d = ctx.h2d.handle();
  TransferSpans& spans = ctx.spans;
  Observer* obs = spans.observer();
  auto h2d_start = spans.Start();
  ASSIGN_OR_RETURN(PinnedSlot staging, arena.Acquire(StagingTimeout()));
  auto read_start = spans.Start(obs != nullptr ? obs->Now() : 0.0);
  ASSIGN_OR_RETURN(NvmeStore::Ticket ticket,
                   ctx.store.nvme()->SubmitRead(ctx.store.nvme_param(c), staging.data()));
  void* staged = staging.data();
  auto shared_ticket = std::make_shared<NvmeStore::Ticket>(std::move(ticket));
  auto shared_slot = std::make_shared<PinnedSlot>(std::move(staging));
  RankAgreement* ranks = &ctx.ranks;
  const int m = ctx.moment - 1;
  // The H2D stream waits for the disk, so the caller never does. Both functions own the staging
  // slot, so it stays taken until the copy out of it is done whatever fails.
  RETURN_IF_ERROR(ctx.device.LaunchHostFunc(
      h2d, [shared_ticket, shared_slot, ranks, c, obs, read_start, h2d_start, bytes, m] {
        Status s = shared_ticket->Wait();
        // W > 1 on the device path: the all_gather still sends what the slot holds and every
        // rank computes on it; EndIteration's agreement fails them all, out of step. (Not out of
        // step here: this rank alone would then refuse its next Acquire, leaving the others in
        // the agreement until the deadline.)
        if (!s.ok())
          ranks->SetAsyncError(std::move(s).WithContext("reading chunk " + std::to_string(c)));
        if (obs != nullptr) {
          // The read ran from its submission until the stream saw it complete.
          *h2d_start = obs->Now();
          obs->OnSpan({Track::kNvmeRead, "chunk " + std::to_string(c), *read_start,
                       *h2d_start - *read_start, m, c, bytes});
        }
      }));
  RETURN_IF_ERROR(ctx.device.CopyAsync(dst, staged, bytes, CopyKind::kHostToDevice, h2d));
  if (spans.on()) {
    RETURN_IF_ERROR(spans.QueueSpan(ctx.device, h2d, Track::kH2D, "chunk " + std::to_string(c), m,
                                    c, bytes, h2d_start));
  }
  RETURN_IF_ERROR(ctx.device.LaunchHostFunc(h2d, [shared_slot] { shared_slot->Release(); }));
  ctx.counters.nvme_read_bytes += bytes;
  ctx.counters.h2d_bytes += bytes;
  return Status::OK();
}

}  // namespace internal

namespace {

// Note [Gathers on the device]
// With device collectives a gather moves only the local shard over the host link: it is copied
// (H2D, from NVMe through the staging slot, or D2D for a device-resident shard) to its own place
// in the chunk's slot on the H2D stream, and the comm stream, ordered after that copy with an
// event, all-gathers the other ranks' shards around it in place. The chunk is ready when the
// comm stream passes the all_gather. A gradient chunk is reduce-scattered in place on the comm
// stream once the compute stream has written it, and the D2H stream copies back only the local
// shard of the mean (zero/reduce.cc). The collectives are queued in the trainer's program order,
// the same on every rank (the agreement at each Acquire), and run in that order on the one comm
// stream; no rank's thread waits for one. There are no gather tags on this path (a tag would
// split the in-place chunk): the agreement at each Acquire already keeps the ranks' gathers
// identical.
class DeviceGather final : public LocalGather {
 public:
  DeviceGather(TransferContext& ctx, DeviceCollectives& comm) : LocalGather(ctx), comm_(comm) {}

  void Quiesce() override {
    (void)ctx_.h2d.Synchronize();
    (void)comm_.Drain();
  }
  bool ReadyOffH2D() const override { return true; }
  Status CreateEvents() {
    ASSIGN_OR_RETURN(to_comm_, Event::Create(ctx_.device));
    return Status::OK();
  }

 private:
  Status Enqueue(int c, void* dst, const Event& ready) override;

  DeviceCollectives& comm_;
  Event to_comm_;  // orders the comm stream after the shard's copy (a wait takes the latest record)
};

Status DeviceGather::Enqueue(int c, void* dst, const Event& ready) {
  Device& device = ctx_.device;
  const ShardGeometry& g = ctx_.geometry();
  const uint64_t shard = g.shard_bytes();
  auto* mine = static_cast<uint8_t*>(dst) + static_cast<uint64_t>(g.rank) * shard;
  const Tier tier = ctx_.store.param_tier(c);
  ASSIGN_OR_RETURN(GatherTimer::Timing * timing, ctx_.timer.Start(device, ctx_.h2d.handle(), tier));
  RETURN_IF_ERROR(internal::UploadShard(ctx_, staging_.get(), c, mine));
  RETURN_IF_ERROR(device.RecordEvent(to_comm_.handle(), ctx_.h2d.handle()));
  RETURN_IF_ERROR(device.StreamWaitEvent(comm_.stream(), to_comm_.handle()));
  TransferSpans& spans = ctx_.spans;
  auto comm_start = spans.Start();
  if (spans.on()) RETURN_IF_ERROR(spans.QueueStart(device, comm_.stream(), comm_start));
  RETURN_IF_ERROR(comm_.AllGather(mine, dst, shard, DType::kI8));
  ++ctx_.counters.all_gathers;
  const uint64_t sent = shard * static_cast<uint64_t>(g.world_size - 1);
  ctx_.GatherWire(c).Add(sent, sent, zero::CrossNodeBytes(sent, ctx_.topology));
  if (spans.on()) {
    RETURN_IF_ERROR(spans.QueueSpan(device, comm_.stream(), Track::kComm,
                                    "all_gather chunk " + std::to_string(c), ctx_.moment - 1, c,
                                    g.chunk_bytes(), comm_start));
  }
  if (timing != nullptr) RETURN_IF_ERROR(device.RecordEvent(timing->end.handle(), comm_.stream()));
  return device.RecordEvent(ready.handle(), comm_.stream());
}

}  // namespace

StatusOr<std::unique_ptr<GatherStrategy>> CreateLocalGather(TransferContext& ctx,
                                                            const GatherOptions& options) {
  auto g = std::make_unique<LocalGather>(ctx);
  RETURN_IF_ERROR(g->Init(options));
  return std::unique_ptr<GatherStrategy>(std::move(g));
}

StatusOr<std::unique_ptr<GatherStrategy>> CreateDeviceGather(TransferContext& ctx,
                                                             DeviceCollectives& comm,
                                                             const GatherOptions& options) {
  if (comm.size() != ctx.geometry().world_size) {
    return InvalidArgumentError("device collectives over " + std::to_string(comm.size()) +
                                " ranks for shards of " +
                                std::to_string(ctx.geometry().world_size) + " ranks");
  }
  auto g = std::make_unique<DeviceGather>(ctx, comm);
  RETURN_IF_ERROR(g->Init(options));
  RETURN_IF_ERROR(g->CreateEvents());
  return std::unique_ptr<GatherStrategy>(std::move(g));
}

}  // namespace tierzero
