// ZeRO++ on the device path (zero/zeropp.h): the gathers and reductions are queued on the device
// collectives' stream, in place in the chunk's slot, like DeviceGather and DeviceReduce (Note
// [Gathers on the device] in gather.cc).
#include <string>

#include "comm/collective.h"
#include "comm/quantized.h"
#include "core/bytes.h"
#include "zero/gather_internal.h"
#include "zero/zeropp.h"

namespace tierzero {

namespace {

// Note [A secondary partition that is never stale]
// hpZ keeps, for each chunk, the 1/L of the gathered chunk that is this rank's part inside its
// node (bytes [l * chunk / L, (l + 1) * chunk / L) for local rank l), copied out of the slot on
// the comm stream right after the chunk's all_gather. A later gather of the chunk in the same
// iteration copies the part back into the slot and all-gathers the node's parts in place,
// inside the node. The part is valid only in the iteration whose gather filled it: every
// iteration's first gather of a chunk is a full one that refills it. Parameters change only
// between iterations (Step, WriteParam, a checkpoint or safetensors load), so the secondary
// copy always holds what this iteration's forward computed on, whatever changed them, and no
// refresh call exists to be forgotten: the staleness after a load that other implementations
// hit cannot happen. It costs nothing extra, since the forward gather is made anyway. With qwZ
// the part holds the dequantized values, so backward computes on the same values as forward.
// Every rank gathers the same chunks in the same order (the agreement at each Acquire), so every
// rank makes the same choice between the full and the node gather.
class ZeroPPDeviceGather final : public GatherStrategy {
 public:
  ZeroPPDeviceGather(TransferContext& ctx, DeviceCollectives& comm, const ZeroPPOptions& zeropp)
      : ctx_(ctx), comm_(comm), zeropp_(zeropp) {}

  Status Init(const GatherOptions& options);
  void Quiesce() override {
    (void)ctx_.h2d.Synchronize();
    (void)comm_.Drain();
  }
  bool ReadyOffH2D() const override { return true; }
  int staging_slots() const override {
    return staging_ != nullptr ? static_cast<int>(staging_->num_slots()) : 0;
  }

 private:
  Status Enqueue(int c, void* dst, const Event& ready) override;
  // The chunk's gather across every rank (qwZ or plain), then (hpZ) the copy of its part.
  Status FullGather(int c, uint8_t* dst, WireCounters& wire);
  // hpZ: the part back into the slot, and the node's parts all-gathered around it.
  Status NodeGather(int c, uint8_t* dst);
  // The part between the slot and the secondary partition, on the comm stream.
  Status CopySecondary(int c, uint8_t* part, bool out);
  uint8_t* Secondary(int c) const { return secondary_ + static_cast<uint64_t>(c) * part_bytes_; }
  CopyKind SecondaryCopy(bool out) const {
    if (zeropp_.hpz_tier == Tier::kDevice) return CopyKind::kDeviceToDevice;
    return out ? CopyKind::kDeviceToHost : CopyKind::kHostToDevice;
  }

  TransferContext& ctx_;
  DeviceCollectives& comm_;
  ZeroPPOptions zeropp_;
  std::unique_ptr<PinnedArena> staging_;  // NVMe reads on their way to the device
  std::vector<ShardQuantization> qwz_;    // per chunk, with qwZ
  Event to_comm_;
  // hpZ: every chunk's part, in device memory or one pinned host slot.
  DeviceBuffer secondary_device_;
  std::unique_ptr<PinnedArena> secondary_arena_;
  PinnedSlot secondary_slot_;
  uint8_t* secondary_ = nullptr;
  uint64_t part_bytes_ = 0;
  int local_rank_ = 0;
};

Status ZeroPPDeviceGather::Init(const GatherOptions& options) {
  const ShardGeometry& g = ctx_.geometry();
  ASSIGN_OR_RETURN(staging_, internal::CreateShardStaging(ctx_, options.staging_bytes));
  if (zeropp_.qwz) {
    ASSIGN_OR_RETURN(qwz_, ChunkQuantizations(zeropp_.qwz_spec, zeropp_, g.num_chunks));
    for (const ShardQuantization& q : qwz_) RETURN_IF_ERROR(comm_.PrepareQuantized(q));
  }
  ASSIGN_OR_RETURN(to_comm_, Event::Create(ctx_.device));
  if (!zeropp_.hpz) return Status::OK();
  const int l = comm_.node_size();
  if (l < 1 || g.world_size % l != 0) {
    return InvalidArgumentError(
        "hpZ needs the same number of ranks on every node: " + std::to_string(g.world_size) +
        " ranks do not split into nodes of " + std::to_string(l) +
        "; set ranks.ranks_per_node to a divisor of the rank count (or launch the same number "
        "of ranks on every node), or turn zeropp off");
  }
  local_rank_ = ctx_.topology.local_rank;
  part_bytes_ = g.chunk_bytes() / static_cast<uint64_t>(l);
  const uint64_t total = HpzBytes(g.num_chunks, g.chunk_bytes(), l);
  if (zeropp_.hpz_tier == Tier::kDevice) {
    auto buf = DeviceBuffer::Allocate(ctx_.device, total);
    if (!buf.ok()) return std::move(buf).status().WithContext("hpZ's secondary partition");
    secondary_device_ = std::move(buf).value();
    secondary_ = static_cast<uint8_t*>(secondary_device_.data());
  } else {
    auto arena = PinnedArena::Create(&ctx_.device, total, 1);
    if (!arena.ok()) return std::move(arena).status().WithContext("hpZ's secondary partition");
    secondary_arena_ = std::move(arena).value();
    ASSIGN_OR_RETURN(secondary_slot_, secondary_arena_->Acquire(StagingTimeout()));
    secondary_ = static_cast<uint8_t*>(secondary_slot_.data());
  }
  return Status::OK();
}

Status ZeroPPDeviceGather::Enqueue(int c, void* dst, const Event& ready) {
  auto* chunk = static_cast<uint8_t*>(dst);
  const bool first = ctx_.FirstGather(c);
  const Tier tier = ctx_.store.param_tier(c);
  GatherTimer::Timing* timing = nullptr;
  if (zeropp_.hpz && !first) {
    ASSIGN_OR_RETURN(timing, ctx_.timer.Start(ctx_.device, comm_.stream(), tier));
    RETURN_IF_ERROR(NodeGather(c, chunk));
  } else {
    ASSIGN_OR_RETURN(timing, ctx_.timer.Start(ctx_.device, ctx_.h2d.handle(), tier));
    RETURN_IF_ERROR(
        FullGather(c, chunk, first ? ctx_.counters.param_gather : ctx_.counters.param_regather));
  }
  if (timing != nullptr) {
    RETURN_IF_ERROR(ctx_.device.RecordEvent(timing->end.handle(), comm_.stream()));
  }
  return ctx_.device.RecordEvent(ready.handle(), comm_.stream());
}

Status ZeroPPDeviceGather::FullGather(int c, uint8_t* dst, WireCounters& wire) {
  Device& device = ctx_.device;
  const ShardGeometry& g = ctx_.geometry();
  const uint64_t shard = g.shard_bytes();
  uint8_t* mine = dst + static_cast<uint64_t>(g.rank) * shard;
  RETURN_IF_ERROR(internal::UploadShard(ctx_, staging_.get(), c, mine));
  RETURN_IF_ERROR(device.RecordEvent(to_comm_.handle(), ctx_.h2d.handle()));
  RETURN_IF_ERROR(device.StreamWaitEvent(comm_.stream(), to_comm_.handle()));
  TransferSpans& spans = ctx_.spans;
  auto start = spans.Start();
  if (spans.on()) RETURN_IF_ERROR(spans.QueueStart(device, comm_.stream(), start));
  const auto others = static_cast<uint64_t>(g.world_size - 1);
  std::string name = "all_gather chunk " + std::to_string(c);
  if (zeropp_.qwz) {
    const ShardQuantization& q = qwz_[static_cast<size_t>(c)];
    RETURN_IF_ERROR(comm_.QuantizedAllGather(q, mine, dst, g.dtype));
    wire.Add(shard * others, q.slot_bytes() * others,
             zero::CrossNodeBytes(q.slot_bytes() * others, ctx_.topology));
    name = "quantized " + name;
  } else {
    RETURN_IF_ERROR(comm_.AllGather(mine, dst, shard, DType::kI8));
    wire.Add(shard * others, shard * others, zero::CrossNodeBytes(shard * others, ctx_.topology));
  }
  ++ctx_.counters.all_gathers;
  if (spans.on()) {
    RETURN_IF_ERROR(spans.QueueSpan(device, comm_.stream(), Track::kComm, std::move(name),
                                    ctx_.moment - 1, c, g.chunk_bytes(), start));
  }
  if (!zeropp_.hpz) return Status::OK();
  // The secondary partition: this rank's part inside the node, as gathered (Note [A secondary
  // partition that is never stale]).
  return CopySecondary(c, dst + static_cast<uint64_t>(local_rank_) * part_bytes_, /*out=*/true);
}

// In host memory the secondary partition's copies cross the link: counted and traced as the
// link's (the profile's links and the plan's bytes per iteration counted neither; hunt 51).
Status ZeroPPDeviceGather::CopySecondary(int c, uint8_t* part, bool out) {
  Device& device = ctx_.device;
  const bool link = zeropp_.hpz_tier != Tier::kDevice;
  TransferSpans& spans = ctx_.spans;
  auto start = spans.Start();
  if (link && spans.on()) RETURN_IF_ERROR(spans.QueueStart(device, comm_.stream(), start));
  RETURN_IF_ERROR(
      out ? device.CopyAsync(Secondary(c), part, part_bytes_, SecondaryCopy(true), comm_.stream())
          : device.CopyAsync(part, Secondary(c), part_bytes_, SecondaryCopy(false),
                             comm_.stream()));
  if (!link) return Status::OK();
  (out ? ctx_.counters.d2h_bytes : ctx_.counters.h2d_bytes) += part_bytes_;
  if (spans.on()) {
    RETURN_IF_ERROR(spans.QueueSpan(device, comm_.stream(), out ? Track::kD2H : Track::kH2D,
                                    "hpZ part of chunk " + std::to_string(c), ctx_.moment - 1, c,
                                    part_bytes_, start));
  }
  return Status::OK();
}

Status ZeroPPDeviceGather::NodeGather(int c, uint8_t* dst) {
  Device& device = ctx_.device;
  uint8_t* mine = dst + static_cast<uint64_t>(local_rank_) * part_bytes_;
  // On the comm stream: after the slot is free (the H2D stream waited for that when the slot
  // was taken), after the full gather that filled the part (the same stream), and before the
  // all_gather that sends it.
  RETURN_IF_ERROR(device.RecordEvent(to_comm_.handle(), ctx_.h2d.handle()));
  RETURN_IF_ERROR(device.StreamWaitEvent(comm_.stream(), to_comm_.handle()));
  RETURN_IF_ERROR(CopySecondary(c, mine, /*out=*/false));
  TransferSpans& spans = ctx_.spans;
  auto start = spans.Start();
  if (spans.on()) RETURN_IF_ERROR(spans.QueueStart(device, comm_.stream(), start));
  RETURN_IF_ERROR(comm_.NodeAllGather(mine, dst, part_bytes_, DType::kI8));
  ++ctx_.counters.all_gathers;
  const uint64_t sent = part_bytes_ * static_cast<uint64_t>(comm_.node_size() - 1);
  ctx_.counters.param_regather.Add(sent, sent, 0);
  if (spans.on()) {
    RETURN_IF_ERROR(spans.QueueSpan(device, comm_.stream(), Track::kComm,
                                    "node all_gather chunk " + std::to_string(c), ctx_.moment - 1,
                                    c, ctx_.geometry().chunk_bytes(), start));
  }
  return Status::OK();
}

// qgZ on the device path: the gradient chunk is reduced in place on the comm stream by the
// two-hop quantized reduction, then the local shard of the mean is copied D2H as in
// DeviceReduce. (Without qgZ the chunk manager takes DeviceReduce itself.)
class ZeroPPDeviceReduce final : public ReduceStrategy {
 public:
  ZeroPPDeviceReduce(TransferContext& ctx, DeviceCollectives& comm, const ReduceOptions& options,
                     const ZeroPPOptions& zeropp)
      : ctx_(ctx), comm_(comm), options_(options), zeropp_(zeropp) {}

  Status Init() {
    const ShardGeometry& g = ctx_.geometry();
    if (options_.accumulate) {
      ASSIGN_OR_RETURN(staging_, PinnedArena::Create(&ctx_.device, g.shard_bytes(), 2));
    }
    ASSIGN_OR_RETURN(qgz_, ChunkQuantizations(zeropp_.qgz_spec, zeropp_, g.num_chunks));
    for (const ShardQuantization& q : qgz_) RETURN_IF_ERROR(comm_.PrepareQuantized(q));
    ASSIGN_OR_RETURN(from_comm_, Event::Create(ctx_.device));
    return Status::OK();
  }

  StatusOr<bool> Reduce(int c, void* device_grad, const Event& written) override {
    Status s = ReduceOnDevice(c, static_cast<uint8_t*>(device_grad), written);
    // A reduction this rank could not queue leaves the ranks' collectives out of step.
    if (!s.ok()) return ctx_.ranks.LoseStep(std::move(s));
    const ShardGeometry& g = ctx_.geometry();
    const uint8_t* mine =
        static_cast<uint8_t*>(device_grad) + static_cast<uint64_t>(g.rank) * g.shard_bytes();
    RETURN_IF_ERROR(internal::CopyGradToShard(ctx_, options_.accumulate, staging_.get(), c, mine));
    return true;
  }

 private:
  Status ReduceOnDevice(int c, uint8_t* grad, const Event& written);

  TransferContext& ctx_;
  DeviceCollectives& comm_;
  ReduceOptions options_;
  ZeroPPOptions zeropp_;
  std::unique_ptr<PinnedArena> staging_;  // accumulation: D2H target before the fp32 add
  std::vector<ShardQuantization> qgz_;    // per chunk
  Event from_comm_;
};

Status ZeroPPDeviceReduce::ReduceOnDevice(int c, uint8_t* grad, const Event& written) {
  Device& device = ctx_.device;
  const ShardGeometry& g = ctx_.geometry();
  uint8_t* mine = grad + static_cast<uint64_t>(g.rank) * g.shard_bytes();
  RETURN_IF_ERROR(device.StreamWaitEvent(comm_.stream(), written.handle()));
  TransferSpans& spans = ctx_.spans;
  auto start = spans.Start();
  if (spans.on()) RETURN_IF_ERROR(spans.QueueStart(device, comm_.stream(), start));
  const uint64_t unquantized = g.shard_bytes() * static_cast<uint64_t>(g.world_size - 1);
  const ShardQuantization& q = qgz_[static_cast<size_t>(c)];
  RETURN_IF_ERROR(comm_.QuantizedReduceScatter(q, grad, mine, g.dtype));
  // Inside the node (L - 1) x N slots leave each rank, across nodes N - 1.
  const auto l = static_cast<uint64_t>(comm_.node_size());
  const uint64_t n = static_cast<uint64_t>(g.world_size) / l;
  const uint64_t cross = q.slot_bytes() * (n - 1);
  ctx_.counters.grad_reduce.Add(unquantized, q.slot_bytes() * (l - 1) * n + cross, cross);
  ++ctx_.counters.reduce_scatters;
  if (spans.on()) {
    RETURN_IF_ERROR(spans.QueueSpan(device, comm_.stream(), Track::kComm,
                                    "quantized reduce_scatter grad " + std::to_string(c),
                                    ctx_.moment - 1, c, g.chunk_bytes(), start));
  }
  RETURN_IF_ERROR(device.RecordEvent(from_comm_.handle(), comm_.stream()));
  return device.StreamWaitEvent(ctx_.d2h.handle(), from_comm_.handle());
}

}  // namespace

StatusOr<std::vector<ShardQuantization>> ChunkQuantizations(const kernels::QuantSpec& spec,
                                                            const ZeroPPOptions& zeropp,
                                                            int num_chunks) {
  if (static_cast<int>(zeropp.shard_runs.size()) != num_chunks) {
    return InvalidArgumentError("ZeRO++ needs the runs of every chunk's shards");
  }
  std::vector<ShardQuantization> q;
  for (int c = 0; c < num_chunks; ++c) {
    auto made = ShardQuantization::Create(spec, zeropp.shard_runs[static_cast<size_t>(c)]);
    if (!made.ok()) {
      return std::move(made).status().WithContext("quantizing chunk " + std::to_string(c));
    }
    q.push_back(std::move(made).value());
  }
  return q;
}

StatusOr<std::unique_ptr<GatherStrategy>> CreateZeroPPDeviceGather(TransferContext& ctx,
                                                                   DeviceCollectives& comm,
                                                                   const GatherOptions& options,
                                                                   const ZeroPPOptions& zeropp) {
  if (comm.size() != ctx.geometry().world_size) {
    return InvalidArgumentError("device collectives over " + std::to_string(comm.size()) +
                                " ranks for shards of " +
                                std::to_string(ctx.geometry().world_size) + " ranks");
  }
  auto g = std::make_unique<ZeroPPDeviceGather>(ctx, comm, zeropp);
  RETURN_IF_ERROR(g->Init(options));
  return std::unique_ptr<GatherStrategy>(std::move(g));
}

StatusOr<std::unique_ptr<ReduceStrategy>> CreateZeroPPDeviceReduce(TransferContext& ctx,
                                                                   DeviceCollectives& comm,
                                                                   const ReduceOptions& options,
                                                                   const ZeroPPOptions& zeropp) {
  auto r = std::make_unique<ZeroPPDeviceReduce>(ctx, comm, options, zeropp);
  RETURN_IF_ERROR(r->Init());
  return std::unique_ptr<ReduceStrategy>(std::move(r));
}

}  // namespace tierzero
