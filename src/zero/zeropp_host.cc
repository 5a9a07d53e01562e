// ZeRO++ through host buffers (zero/zeropp.h): the counterparts of HostGather and HostReduce
// (Note [Collectives on the trainer's thread] in gather_host.cc) for qwZ, hpZ and qgZ. Every
// collective starts on the trainer's thread in program order; what follows a collective (the
// dequantization, the fp32 sums) runs where the plain path's completion runs: a gather's on the
// H2D stream before its copy to the device, a reduction's in Finish.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <optional>
#include <string>

#include "comm/collective.h"
#include "comm/device_collectives.h"
#include "core/bytes.h"
#include "core/check.h"
#include "core/convert.h"
#include "zero/gather_internal.h"
#include "zero/zeropp.h"

namespace tierzero {

namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// How a gather's received blocks become the chunk: `ranks` blocks of `block` bytes at `recv`,
// each a payload then its tag. With `q` (qwZ) block r holds rank r's packed shard, dequantized
// into its place; else its first `payload` bytes are copied to chunk + r * payload (a rank's
// shard, or with hpZ's node gather a local rank's part). With `keep` (hpZ's first gather), the
// `keep_bytes` at chunk + keep_offset are copied there: this rank's part inside its node.
struct Assembly {
  const uint8_t* recv = nullptr;
  uint64_t block = 0, payload = 0;
  int ranks = 0;
  const ShardQuantization* q = nullptr;
  DType dtype = DType::kBF16;
  uint8_t* chunk = nullptr;
  uint8_t* keep = nullptr;
  uint64_t keep_offset = 0, keep_bytes = 0;
};

Status Assemble(const Assembly& a) {
  if (a.q != nullptr) {
    RETURN_IF_ERROR(DequantizeShards(*a.q, a.recv, a.block, a.dtype, a.chunk));
  } else {
    for (int r = 0; r < a.ranks; ++r) {
      std::memcpy(a.chunk + a.payload * static_cast<uint64_t>(r),
                  a.recv + a.block * static_cast<uint64_t>(r), a.payload);
    }
  }
  if (a.keep != nullptr) std::memcpy(a.keep, a.chunk + a.keep_offset, a.keep_bytes);
  return Status::OK();
}

// qwZ and/or hpZ through host buffers. A staging slot holds [an NVMe shard read][the send
// block][the received blocks][the assembled chunk]. A chunk's first gather of an iteration
// all-gathers every rank's shard (quantized with qwZ) over the world; with hpZ its completion
// keeps this rank's part of the assembled chunk in host memory, and the chunk's later gathers of
// the iteration all-gather the node's parts over a communicator of the node (Note [A secondary
// partition that is never stale] in zeropp_device.cc: the same reasoning holds here). The
// assembled chunk goes to the device in one H2D copy.
class ZeroPPHostGather final : public GatherStrategy {
 public:
  ZeroPPHostGather(TransferContext& ctx, Communicator& comm, const ZeroPPOptions& zeropp)
      : ctx_(ctx), comm_(comm), zeropp_(zeropp) {}

  Status Init(const GatherOptions& options);
  void Quiesce() override { (void)ctx_.h2d.Synchronize(); }
  bool StagesEveryChunk() const override { return true; }
  int staging_slots() const override { return static_cast<int>(staging_->num_slots()); }
  void BeginIteration() override { seq_ = 0; }

 private:
  Status Enqueue(int c, void* dst, const Event& ready) override;
  uint8_t* Secondary(int c) const {
    return secondary_ + static_cast<uint64_t>(c) * AlignUp(part_bytes_ + kGatherTagBytes, 64);
  }

  TransferContext& ctx_;
  Communicator& comm_;
  ZeroPPOptions zeropp_;
  std::shared_ptr<Communicator> node_;  // hpZ: this node's ranks
  std::vector<ShardQuantization> qwz_;  // per chunk, with qwZ
  std::unique_ptr<PinnedArena> staging_;
  uint64_t send_offset_ = 0, recv_offset_ = 0, chunk_offset_ = 0;
  // hpZ: every chunk's part (and room for a tag), and per chunk an event on the H2D stream after
  // the completion that filled it.
  std::unique_ptr<PinnedArena> secondary_arena_;
  PinnedSlot secondary_slot_;
  uint8_t* secondary_ = nullptr;
  std::vector<Event> part_ready_;
  uint64_t part_bytes_ = 0;
  uint64_t seq_ = 0;
};

Status ZeroPPHostGather::Init(const GatherOptions& options) {
  const ShardGeometry& g = ctx_.geometry();
  const uint64_t shard = g.shard_bytes();
  ASSIGN_OR_RETURN(ZeroPPHostSlots slots,
                   ZeroPPHostSlotBytes(g, ctx_.topology.local_size, zeropp_));
  if (zeropp_.qwz) {
    ASSIGN_OR_RETURN(qwz_, ChunkQuantizations(zeropp_.qwz_spec, zeropp_, g.num_chunks));
  }
  send_offset_ = AlignUp(shard + kGatherTagBytes, 4096);
  recv_offset_ = send_offset_ + slots.gather_send;
  chunk_offset_ = recv_offset_ + slots.gather_recv;
  ASSIGN_OR_RETURN(staging_,
                   internal::CreateStaging(ctx_, slots.gather_slot, options.staging_bytes));
  if (!zeropp_.hpz) return Status::OK();
  const int l = ctx_.topology.local_size;
  part_bytes_ = g.chunk_bytes() / static_cast<uint64_t>(l);
  ASSIGN_OR_RETURN(node_, comm_.Split(SplitBy::kNode));
  auto arena = PinnedArena::Create(&ctx_.device, slots.hpz, 1);
  if (!arena.ok()) return std::move(arena).status().WithContext("hpZ's secondary partition");
  secondary_arena_ = std::move(arena).value();
  ASSIGN_OR_RETURN(secondary_slot_, secondary_arena_->Acquire(StagingTimeout()));
  secondary_ = static_cast<uint8_t*>(secondary_slot_.data());
  for (int c = 0; c < g.num_chunks; ++c) {
    ASSIGN_OR_RETURN(Event e, Event::Create(ctx_.device));
    part_ready_.push_back(std::move(e));
  }
  return Status::OK();
}

Status ZeroPPHostGather::Enqueue(int c, void* dst, const Event& ready) {
  Device& device = ctx_.device;
  const ShardGeometry& g = ctx_.geometry();
  const uint64_t shard = g.shard_bytes();
  const StreamHandle h2d = ctx_.h2d.handle();
  TransferSpans& spans = ctx_.spans;
  Observer* obs = spans.observer();
  const int m = ctx_.moment - 1;
  const auto t0 = std::chrono::steady_clock::now();
  const bool first = ctx_.FirstGather(c);
  const bool in_node = zeropp_.hpz && !first;
  ASSIGN_OR_RETURN(PinnedSlot staging, staging_->Acquire(StagingTimeout()));
  auto* base = static_cast<uint8_t*>(staging.data());
  Assembly a;
  a.recv = base + recv_offset_;
  a.dtype = g.dtype;
  a.chunk = base + chunk_offset_;
  Communicator* comm = &comm_;
  uint8_t* send = nullptr;
  std::string name = "all_gather chunk " + std::to_string(c);
  if (in_node) {
    // The part the chunk's first gather kept, once that gather's completion has run.
    RETURN_IF_ERROR(part_ready_[static_cast<size_t>(c)].Synchronize());
    comm = node_.get();
    send = Secondary(c);
    a.payload = part_bytes_;
    name = "node " + name;
  } else {
    ASSIGN_OR_RETURN(uint8_t * local, internal::LocalShardOnHost(ctx_, c, base));
    if (zeropp_.qwz) {
      a.q = &qwz_[static_cast<size_t>(c)];
      send = base + send_offset_;
      RETURN_IF_ERROR(kernels::Quantize(a.q->layout(g.rank), local, g.dtype, send));
      a.payload = a.q->slot_bytes();
      name = "quantized " + name;
    } else {
      send = local;
      a.payload = shard;
    }
    if (zeropp_.hpz) {
      a.keep = Secondary(c);
      a.keep_offset = part_bytes_ * static_cast<uint64_t>(ctx_.topology.local_rank);
      a.keep_bytes = part_bytes_;
    }
  }
  a.block = a.payload + kGatherTagBytes;
  a.ranks = comm->size();
  const internal::GatherTag tag{c, m, seq_++};
  std::memcpy(send + a.payload, &tag, sizeof tag);
  const double comm_start = obs != nullptr ? obs->Now() : 0.0;
  ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req,
                   comm->AllGather(send, const_cast<uint8_t*>(a.recv), a.block, DType::kI8));
  ++ctx_.counters.all_gathers;
  const auto others = static_cast<uint64_t>(a.ranks - 1);
  const uint64_t unquantized = in_node ? part_bytes_ * others : shard * others;
  WireCounters& wire = first ? ctx_.counters.param_gather : ctx_.counters.param_regather;
  wire.Add(unquantized, a.block * others,
           in_node ? 0 : zero::CrossNodeBytes(a.block * others, ctx_.topology));
  const bool async = comm->asynchronous();
  auto failed = std::make_shared<std::atomic<bool>>(false);
  const internal::GatherArrival arrival{a.recv,       a.block, a.payload,  tag, a.ranks,
                                        comm->rank(), name,    comm_start, c};
  if (!async) {
    RETURN_IF_ERROR(internal::AwaitArrival(ctx_, *req, arrival));
    RETURN_IF_ERROR(Assemble(a));
  }
  const double caller_s = SecondsSince(t0);
  ctx_.counters.comm_seconds += caller_s;
  const Tier tier = ctx_.store.param_tier(c);
  ctx_.timer.AddCallerSeconds(tier, caller_s);
  ASSIGN_OR_RETURN(GatherTimer::Timing * timing, ctx_.timer.Start(device, h2d, tier));
  if (async) {
    // The H2D stream assembles the chunk once the all_gather arrived.
    RETURN_IF_ERROR(internal::QueueArrival(
        ctx_, std::move(req), arrival, [a] { return Assemble(a); }, failed));
  }
  if (a.keep != nullptr) {
    RETURN_IF_ERROR(device.RecordEvent(part_ready_[static_cast<size_t>(c)].handle(), h2d));
  }
  return internal::QueueChunkToDevice(ctx_, c, {{dst, a.chunk, g.chunk_bytes()}},
                                      std::move(staging), failed, timing, ready);
}

// qgZ through host buffers: a gradient chunk is copied D2H into a reduce slot and waited for, its
// W shards quantized and the all_to_all inside the node started (Reduce); what arrived is summed,
// the all_to_all across nodes started, and the mean completed into the gradient shard
// (QuantizedReduction's stages, Note [Quantized collectives] in quantized.h), each hop on a
// communicator of its own, started at points of the program that are the same on every rank
// (Note [When qgZ's cross-node hop starts]).
class ZeroPPHostReduce final : public ReduceStrategy {
 public:
  bool final_on_d2h() const override { return false; }  // Finish reduce-scatters
  ZeroPPHostReduce(TransferContext& ctx, Communicator& comm, const ReduceOptions& options,
                   const ZeroPPOptions& zeropp)
      : ctx_(ctx), comm_(comm), options_(options), zeropp_(zeropp) {}

  Status Init();
  StatusOr<bool> Reduce(int c, void* device_grad, const Event& written) override;
  Status Finish(bool wait_all, bool wait_oldest) override;

 private:
  enum class Stage { kNodeHop, kSummed, kCrossHop };
  struct Pending {
    int chunk;
    PinnedSlot slot;
    std::unique_ptr<CommRequest> request;
    Stage stage = Stage::kNodeHop;
  };
  StatusOr<bool> NodeHopDone(Pending& p);
  Status Complete(Pending& p);
  Status StartCrossHops();
  uint8_t* Scratch(const Pending& p) const {
    return static_cast<uint8_t*>(p.slot.data()) + AlignUp(ctx_.geometry().chunk_bytes(), 64);
  }
  float* Mean(const Pending& p) const {
    return reinterpret_cast<float*>(Scratch(p) + scratch_bytes_);
  }

  TransferContext& ctx_;
  Communicator& comm_;
  ReduceOptions options_;
  ZeroPPOptions zeropp_;
  std::shared_ptr<Communicator> node_, cross_;
  std::vector<ShardQuantization> qgz_;
  std::vector<QuantizedReduction> stages_;  // per chunk
  uint64_t scratch_bytes_ = 0;
  // [the D2H gradient chunk][the reduction's scratch][the fp32 mean of this rank's shard]
  std::unique_ptr<PinnedArena> slots_;
  std::deque<Pending> pending_;
};

Status ZeroPPHostReduce::Init() {
  const ShardGeometry& g = ctx_.geometry();
  const Topology& t = ctx_.topology;
  // Every rank checks its own place, and they fail together before the splits.
  RETURN_IF_ERROR(AgreeOnStatus(comm_, CheckNodeMajor(t)));
  ASSIGN_OR_RETURN(node_, comm_.Split(SplitBy::kNode));
  ASSIGN_OR_RETURN(cross_, comm_.Split(SplitBy::kLocalRank));
  ASSIGN_OR_RETURN(qgz_, ChunkQuantizations(zeropp_.qgz_spec, zeropp_, g.num_chunks));
  for (const ShardQuantization& q : qgz_) {
    ASSIGN_OR_RETURN(QuantizedReduction r,
                     QuantizedReduction::Create(q, t.local_size, t.local_rank, t.nodes, t.node));
    scratch_bytes_ = std::max(scratch_bytes_, AlignUp(r.scratch_bytes(), 64));
    stages_.push_back(r);
  }
  ASSIGN_OR_RETURN(ZeroPPHostSlots slots, ZeroPPHostSlotBytes(g, t.local_size, zeropp_));
  TZ_CHECK(slots.reduce_slot >=
           AlignUp(g.chunk_bytes(), 64) + scratch_bytes_ + g.shard_elems * sizeof(float));
  ASSIGN_OR_RETURN(slots_,
                   PinnedArena::Create(&ctx_.device, slots.reduce_slot, kZeroPPReduceSlots));
  return Status::OK();
}

StatusOr<bool> ZeroPPHostReduce::Reduce(int c, void* device_grad, const Event&) {
  const ShardGeometry& g = ctx_.geometry();
  const auto t0 = std::chrono::steady_clock::now();
  // Note [When qgZ's cross-node hop starts].
  RETURN_IF_ERROR(StartCrossHops());
  ASSIGN_OR_RETURN(PinnedSlot slot, internal::FreeReduceSlot(*slots_, [this]() -> StatusOr<bool> {
                     if (pending_.empty()) return false;
                     RETURN_IF_ERROR(Finish(/*wait_all=*/false, /*wait_oldest=*/true));
                     return true;
                   }));
  RETURN_IF_ERROR(internal::CopyGradChunkDown(ctx_, c, device_grad, slot.data()));
  Pending p{c, std::move(slot), nullptr};
  const QuantizedReduction& r = stages_[static_cast<size_t>(c)];
  uint8_t* scratch = Scratch(p);
  Status s = r.Quantize(p.slot.data(), g.dtype, scratch);
  if (!s.ok()) return ctx_.ranks.LoseStep(std::move(s));
  auto req =
      node_->AllToAll(r.to_peers(scratch), r.from_peers(scratch), r.node_block_bytes(), DType::kI8);
  if (!req.ok()) return ctx_.ranks.LoseStep(std::move(req).status());
  p.request = std::move(req).value();
  ++ctx_.counters.reduce_scatters;
  // Inside the node (L - 1) x N slots leave each rank, across nodes N - 1.
  const auto l = static_cast<uint64_t>(node_->size()), n = static_cast<uint64_t>(cross_->size());
  const uint64_t cross = r.slot_bytes() * (n - 1);
  ctx_.counters.grad_reduce.Add(g.shard_bytes() * static_cast<uint64_t>(g.world_size - 1),
                                r.slot_bytes() * (l - 1) * n + cross, cross);
  pending_.push_back(std::move(p));
  ctx_.counters.comm_seconds += SecondsSince(t0);
  return false;  // the copy out of device_grad was waited for
}

// The node hop's arrival: summed in fp32 (and requantized for the cross hop). True when that
// completed the reduction (one node).
StatusOr<bool> ZeroPPHostReduce::NodeHopDone(Pending& p) {
  const QuantizedReduction& r = stages_[static_cast<size_t>(p.chunk)];
  RETURN_IF_ERROR(r.SumNode(Scratch(p), Mean(p)));
  p.request.reset();
  if (!r.one_node()) {
    p.stage = Stage::kSummed;
    return false;
  }
  RETURN_IF_ERROR(Complete(p));
  return true;
}

// The mean into the gradient shard (added in fp32 with accumulation).
Status ZeroPPHostReduce::Complete(Pending& p) {
  const ShardGeometry& g = ctx_.geometry();
  float* mean = Mean(p);
  RETURN_IF_ERROR(stages_[static_cast<size_t>(p.chunk)].Finish(Scratch(p), mean));
  if (options_.accumulate) {
    auto* acc = static_cast<float*>(ctx_.store.grad(p.chunk));
    for (uint64_t i = 0; i < g.shard_elems; ++i) acc[i] += mean[i];
    return Status::OK();
  }
  return Convert(mean, DType::kF32, ctx_.store.grad(p.chunk), g.dtype, g.shard_elems);
}

// Note [When qgZ's cross-node hop starts]
// A rank may block in a collective only if every other rank starts it at a point of its program
// no later than the blocking point; else the others can block in a later collective (an
// Acquire's agreement) that this rank never reaches. The node hops start in Reduce, in program
// order. The cross hops start here, called at the start of every Reduce and in Finish's waits,
// also program points, whatever each rank's tests saw: every pending reduction still in its node
// hop is waited for (its node hop started at an earlier Reduce on every rank of the node), summed
// and its cross hop started, in order. Finish's tests only complete what arrived, never start.
Status ZeroPPHostReduce::StartCrossHops() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    Pending& p = *it;
    Status s;
    if (p.stage == Stage::kNodeHop) {
      s = p.request->Wait();
      if (s.ok()) {
        auto done = NodeHopDone(p);
        if (!done.ok()) s = done.status();
        if (done.ok() && *done) {
          it = pending_.erase(it);
          continue;
        }
      }
    }
    if (s.ok() && p.stage == Stage::kSummed) {
      const QuantizedReduction& r = stages_[static_cast<size_t>(p.chunk)];
      uint8_t* scratch = Scratch(p);
      auto req =
          cross_->AllToAll(r.partial(scratch), r.from_nodes(scratch), r.slot_bytes(), DType::kI8);
      if (req.ok()) {
        p.request = std::move(req).value();
        p.stage = Stage::kCrossHop;
      } else {
        s = req.status();
      }
    }
    if (!s.ok()) {
      pending_.erase(it);
      return ctx_.ranks.LoseStep(std::move(s));
    }
    ++it;
  }
  return Status::OK();
}

Status ZeroPPHostReduce::Finish(bool wait_all, bool wait_oldest) {
  const auto t0 = std::chrono::steady_clock::now();
  if (wait_all || wait_oldest) RETURN_IF_ERROR(StartCrossHops());
  Status first;
  for (auto it = pending_.begin(); it != pending_.end();) {
    Pending& p = *it;
    const bool wait = wait_all || (wait_oldest && it == pending_.begin());
    bool done = false;
    Status s = [&]() -> Status {
      if (p.stage == Stage::kSummed) return Status::OK();  // its cross hop starts later
      if (wait) {
        RETURN_IF_ERROR(p.request->Wait());
      } else {
        ASSIGN_OR_RETURN(bool arrived, p.request->Test());
        if (!arrived) return Status::OK();
      }
      if (p.stage == Stage::kNodeHop) {
        ASSIGN_OR_RETURN(done, NodeHopDone(p));
        return Status::OK();
      }
      RETURN_IF_ERROR(Complete(p));
      done = true;
      return Status::OK();
    }();
    if (!s.ok() && first.ok()) first = std::move(s);
    if (done || !s.ok()) {
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
  if (wait_all || wait_oldest || !pending_.empty()) ctx_.counters.comm_seconds += SecondsSince(t0);
  if (!first.ok()) return ctx_.ranks.LoseStep(std::move(first));
  return Status::OK();
}

}  // namespace

StatusOr<ZeroPPHostSlots> ZeroPPHostSlotBytes(const ShardGeometry& g, int node_size,
                                              const ZeroPPOptions& zeropp) {
  ZeroPPHostSlots s;
  if (node_size < 1 || g.world_size % node_size != 0) {
    return InvalidArgumentError(
        "ZeRO++ needs the same number of ranks on every node: " + std::to_string(g.world_size) +
        " ranks do not split into nodes of " + std::to_string(node_size) +
        "; set ranks.ranks_per_node to a divisor of the rank count (or launch the same number "
        "of ranks on every node), or turn zeropp off");
  }
  const uint64_t shard = g.shard_bytes(), chunk = g.chunk_bytes();
  const auto w = static_cast<uint64_t>(g.world_size), l = static_cast<uint64_t>(node_size);
  if (zeropp.qwz || zeropp.hpz) {
    uint64_t payload = shard;
    if (zeropp.qwz) {
      ASSIGN_OR_RETURN(std::vector<ShardQuantization> qs,
                       ChunkQuantizations(zeropp.qwz_spec, zeropp, g.num_chunks));
      payload = 0;
      for (const ShardQuantization& q : qs) payload = std::max(payload, q.slot_bytes());
    }
    uint64_t send = payload + kGatherTagBytes, recv = w * (payload + kGatherTagBytes);
    if (zeropp.hpz) {
      const uint64_t part = chunk / l + kGatherTagBytes;
      send = std::max(send, part);
      recv = std::max(recv, l * part);
      s.hpz = static_cast<uint64_t>(g.num_chunks) * AlignUp(chunk / l + kGatherTagBytes, 64);
    }
    s.gather_send = AlignUp(send, 4096);
    s.gather_recv = AlignUp(recv, 4096);
    s.gather_slot = AlignUp(shard + kGatherTagBytes, 4096) + s.gather_send + s.gather_recv + chunk;
  }
  if (zeropp.qgz) {
    ASSIGN_OR_RETURN(std::vector<ShardQuantization> qs,
                     ChunkQuantizations(zeropp.qgz_spec, zeropp, g.num_chunks));
    uint64_t scratch = 0;
    for (const ShardQuantization& q : qs) {
      ASSIGN_OR_RETURN(QuantizedReduction r,
                       QuantizedReduction::Create(q, node_size, 0, g.world_size / node_size, 0));
      scratch = std::max(scratch, AlignUp(r.scratch_bytes(), 64));
    }
    s.reduce_slot = AlignUp(chunk, 64) + scratch + g.shard_elems * sizeof(float);
  }
  return s;
}

StatusOr<std::unique_ptr<GatherStrategy>> CreateZeroPPHostGather(TransferContext& ctx,
                                                                 Communicator& comm,
                                                                 const GatherOptions& options,
                                                                 const ZeroPPOptions& zeropp) {
  RETURN_IF_ERROR(internal::CheckHostGather(ctx, comm));
  auto g = std::make_unique<ZeroPPHostGather>(ctx, comm, zeropp);
  RETURN_IF_ERROR(g->Init(options));
  return std::unique_ptr<GatherStrategy>(std::move(g));
}

StatusOr<std::unique_ptr<ReduceStrategy>> CreateZeroPPHostReduce(TransferContext& ctx,
                                                                 Communicator& comm,
                                                                 const ReduceOptions& options,
                                                                 const ZeroPPOptions& zeropp) {
  auto r = std::make_unique<ZeroPPHostReduce>(ctx, comm, options, zeropp);
  RETURN_IF_ERROR(r->Init());
  return std::unique_ptr<ReduceStrategy>(std::move(r));
}

}  // namespace tierzero
