#include "zero/reduce.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <optional>

#include "comm/collective.h"
#include "core/bytes.h"
#include "core/check.h"
#include "core/convert.h"
#include "zero/gather.h"
#include "zero/gather_internal.h"

namespace tierzero {

// Note [Accumulating on the host's cores]: a micro-batch's gradient reaches the fp32 shard in
// a host function on the D2H stream, chunk by chunk while the backward goes on. On one thread a
// 17M-element chunk took 15 ms on the H100's host and the adds, not the backward, set the pace
// of an accumulated micro-batch (bench/RESULTS.md, gpu-speed: 1.08 s of adds a micro-batch at
// 1.21B parameters). The chunk is split into spans of kSpan elements over oneTBB's default
// arena; each element is added once (core/convert.h's AddToF32), so the result is the same on
// any number of threads.
Status AddToF32Parallel(float* acc, const void* src, DType dtype, uint64_t n) {
  constexpr uint64_t kSpan = uint64_t{1} << 18;
  const auto* s = static_cast<const uint8_t*>(src);
  if (n <= kSpan) return AddToF32(acc, src, dtype, n);
  const uint64_t spans = (n + kSpan - 1) / kSpan;
  std::atomic<bool> failed{false};
  Status first;
  std::mutex mu;
  tbb::parallel_for(uint64_t{0}, spans, [&](uint64_t i) {
    if (failed.load(std::memory_order_relaxed)) return;
    const uint64_t begin = i * kSpan, m = std::min(n, begin + kSpan) - begin;
    Status st = AddToF32(acc + begin, s + DTypeBytes(dtype, begin), dtype, m);
    if (!st.ok()) {
      std::lock_guard<std::mutex> lock(mu);
      if (!failed.exchange(true)) first = std::move(st);
    }
  });
  return first;
}

namespace internal {

Status CopyGradToShard(TransferContext& ctx, bool accumulate, PinnedArena* staging_arena, int c,
                       const void* src) {
  Device& device = ctx.device;
  const StreamHandle d2h = ctx.d2h.handle();
  const uint64_t bytes = ctx.geometry().shard_bytes();
  TransferSpans& spans = ctx.spans;
  const int m = ctx.moment - 1;
  auto start = spans.Start();
  if (spans.on()) RETURN_IF_ERROR(spans.QueueStart(device, d2h, start));
  void* shard = ctx.store.grad(c);
  if (ctx.store.grad_on_device(c)) {
    // Note [Gradient shards on the device] (chunk/placement.cc): copied, or added in fp32.
    if (accumulate) {
      RETURN_IF_ERROR(device.AccumulateAsync(static_cast<float*>(shard), src, ctx.geometry().dtype,
                                             ctx.geometry().shard_elems, d2h));
    } else {
      RETURN_IF_ERROR(device.CopyAsync(shard, src, bytes, CopyKind::kDeviceToDevice, d2h));
    }
    RETURN_IF_ERROR(ctx.MarkGradSourceRead());
    if (spans.on()) {
      // (Lane 1: nothing crossed the link; the report's D2H link counts lane 0 alone.)
      RETURN_IF_ERROR(
          spans.QueueSpan(device, d2h, Track::kD2H,
                          "grad " + std::to_string(c) +
                              (accumulate ? " (added on the device)" : " (on the device)"),
                          m, c, bytes, start, /*lane=*/1));
    }
    return Status::OK();
  }
  if (!accumulate) {
    RETURN_IF_ERROR(device.CopyAsync(shard, src, bytes, CopyKind::kDeviceToHost, d2h));
    RETURN_IF_ERROR(ctx.MarkGradSourceRead());
    if (spans.on()) {
      RETURN_IF_ERROR(spans.QueueSpan(device, d2h, Track::kD2H, "grad " + std::to_string(c), m, c,
                                      bytes, start));
    }
  } else {
    ASSIGN_OR_RETURN(PinnedSlot staging, staging_arena->Acquire(StagingTimeout()));
    void* staged = staging.data();
    RETURN_IF_ERROR(device.CopyAsync(staged, src, bytes, CopyKind::kDeviceToHost, d2h));
    RETURN_IF_ERROR(ctx.MarkGradSourceRead());  // before the add behind it
    auto shared_slot = std::make_shared<PinnedSlot>(std::move(staging));
    auto* acc = static_cast<float*>(shard);
    const uint64_t elems = ctx.geometry().shard_elems;
    const DType dt = ctx.geometry().dtype;
    RankAgreement* ranks = &ctx.ranks;
    RETURN_IF_ERROR(device.LaunchHostFunc(d2h, [shared_slot, acc, elems, dt, ranks, c] {
      // fp32 accumulation of this micro-batch's gradient. (A host function must not throw:
      // oneTBB's exception when a worker it wakes cannot start, under `ulimit -u`, fails the
      // iteration at its end as an asynchronous error does.)
      Status s;
      try {
        s = AddToF32Parallel(acc, shared_slot->data(), dt, elems);
      } catch (...) {
        s = StatusOfCurrentException();
      }
      if (!s.ok())
        ranks->SetAsyncError(
            std::move(s).WithContext("accumulating the gradient of chunk " + std::to_string(c)));
      shared_slot->Release();
    }));
    if (spans.on()) {
      RETURN_IF_ERROR(spans.QueueSpan(device, d2h, Track::kD2H,
                                      "grad " + std::to_string(c) + " (accumulated)", m, c, bytes,
                                      start));
    }
  }
  ctx.counters.d2h_bytes += bytes;
  return Status::OK();
}

}  // namespace internal

namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One rank: the chunk is the shard.
class LocalReduce : public ReduceStrategy {
 public:
  LocalReduce(TransferContext& ctx, const ReduceOptions& options) : ctx_(ctx), options_(options) {}

  Status Init() {
    if (options_.accumulate) {
      ASSIGN_OR_RETURN(staging_,
                       PinnedArena::Create(&ctx_.device, ctx_.geometry().shard_bytes(), 2));
    }
    return Status::OK();
  }
  StatusOr<bool> Reduce(int c, void* device_grad, const Event&) override {
    RETURN_IF_ERROR(CopyToShard(c, device_grad));
    return true;
  }

 protected:
  // Queues the D2H copy of the local shard at `src` into chunk c's gradient shard (added in
  // fp32 with accumulation).
  Status CopyToShard(int c, const void* src) {
    return internal::CopyGradToShard(ctx_, options_.accumulate, staging_.get(), c, src);
  }

  TransferContext& ctx_;
  ReduceOptions options_;
  std::unique_ptr<PinnedArena> staging_;  // accumulation: D2H target before the fp32 add
};

// Device collectives: reduce-scattered in place on the comm stream once the compute stream has
// written the chunk (Note [Gathers on the device] in gather.cc).
class DeviceReduce final : public LocalReduce {
 public:
  DeviceReduce(TransferContext& ctx, DeviceCollectives& comm, const ReduceOptions& options)
      : LocalReduce(ctx, options), comm_(comm) {}

  Status CreateEvents() {
    ASSIGN_OR_RETURN(from_comm_, Event::Create(ctx_.device));
    return Status::OK();
  }
  StatusOr<bool> Reduce(int c, void* device_grad, const Event& written) override {
    ASSIGN_OR_RETURN(const void* mine, ReduceOnDevice(c, device_grad, written));
    RETURN_IF_ERROR(CopyToShard(c, mine));
    return true;
  }

 private:
  // Queues the reduce-scatter after `written`; returns where the local shard of the result is
  // (the D2H stream waits for it).
  StatusOr<const void*> ReduceOnDevice(int c, void* device_grad, const Event& written);

  DeviceCollectives& comm_;
  Event from_comm_;  // orders the D2H stream after a reduce-scatter
};

StatusOr<const void*> DeviceReduce::ReduceOnDevice(int c, void* device_grad, const Event& written) {
  Device& device = ctx_.device;
  const ShardGeometry& g = ctx_.geometry();
  auto* grad = static_cast<uint8_t*>(device_grad);
  uint8_t* mine = grad + static_cast<uint64_t>(g.rank) * g.shard_bytes();
  TransferSpans& spans = ctx_.spans;
  Status s = [&]() -> Status {
    RETURN_IF_ERROR(device.StreamWaitEvent(comm_.stream(), written.handle()));
    auto start = spans.Start();
    if (spans.on()) RETURN_IF_ERROR(spans.QueueStart(device, comm_.stream(), start));
    RETURN_IF_ERROR(comm_.ReduceScatter(grad, mine, g.shard_elems, g.dtype, ReduceOp::kMean));
    if (spans.on()) {
      RETURN_IF_ERROR(spans.QueueSpan(device, comm_.stream(), Track::kComm,
                                      "reduce_scatter grad " + std::to_string(c), ctx_.moment - 1,
                                      c, g.chunk_bytes(), start));
    }
    RETURN_IF_ERROR(device.RecordEvent(from_comm_.handle(), comm_.stream()));
    return device.StreamWaitEvent(ctx_.d2h.handle(), from_comm_.handle());
  }();
  // A reduce-scatter this rank could not queue leaves the ranks' collectives out of step.
  if (!s.ok()) return ctx_.ranks.LoseStep(std::move(s));
  ++ctx_.counters.reduce_scatters;
  const uint64_t sent = g.shard_bytes() * static_cast<uint64_t>(g.world_size - 1);
  ctx_.counters.grad_reduce.Add(sent, sent, zero::CrossNodeBytes(sent, ctx_.topology));
  return static_cast<const void*>(mine);
}

// W > 1 over host buffers: the gradient chunk is copied D2H into a reduce slot, waited for, and
// its reduce-scatter (mean over the ranks) started into the local gradient shard; Finish
// completes it (Note [Collectives on the trainer's thread] in gather_host.cc).
class HostReduce final : public ReduceStrategy {
 public:
  bool final_on_d2h() const override { return false; }  // Finish reduce-scatters
  HostReduce(TransferContext& ctx, Communicator& comm, const ReduceOptions& options)
      : ctx_(ctx), comm_(comm), options_(options) {}

  Status Init() {
    const ShardGeometry& g = ctx_.geometry();
    ASSIGN_OR_RETURN(
        slots_,
        PinnedArena::Create(&ctx_.device, AlignUp(g.chunk_bytes() + g.shard_bytes(), 4096), 4));
    return Status::OK();
  }
  StatusOr<bool> Reduce(int c, void* device_grad, const Event& written) override;
  Status Finish(bool wait_all, bool wait_oldest) override;

 private:
  struct Pending {
    int chunk;
    PinnedSlot slot;
    std::unique_ptr<CommRequest> request;
  };

  TransferContext& ctx_;
  Communicator& comm_;
  ReduceOptions options_;
  // The D2H copy of a gradient chunk, then (accumulation) the reduce-scatter's result before it
  // is added in fp32.
  std::unique_ptr<PinnedArena> slots_;
  std::deque<Pending> pending_;
};

StatusOr<bool> HostReduce::Reduce(int c, void* device_grad, const Event&) {
  const ShardGeometry& g = ctx_.geometry();
  const uint64_t bytes = g.chunk_bytes();
  const auto t0 = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(PinnedSlot slot, internal::FreeReduceSlot(*slots_, [this]() -> StatusOr<bool> {
                     if (pending_.empty()) return false;
                     RETURN_IF_ERROR(Finish(/*wait_all=*/false, /*wait_oldest=*/true));
                     return true;
                   }));
  RETURN_IF_ERROR(internal::CopyGradChunkDown(ctx_, c, device_grad, slot.data()));
  void* recv =
      options_.accumulate ? static_cast<uint8_t*>(slot.data()) + bytes : ctx_.store.grad(c);
  ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req,
                   comm_.ReduceScatter(slot.data(), recv, g.shard_elems, g.dtype, ReduceOp::kMean));
  ++ctx_.counters.reduce_scatters;
  const uint64_t sent = g.shard_bytes() * static_cast<uint64_t>(g.world_size - 1);
  ctx_.counters.grad_reduce.Add(sent, sent, zero::CrossNodeBytes(sent, ctx_.topology));
  pending_.push_back({c, std::move(slot), std::move(req)});
  ctx_.counters.comm_seconds += SecondsSince(t0);
  return false;  // the copy out of device_grad was waited for
}

Status HostReduce::Finish(bool wait_all, bool wait_oldest) {
  const ShardGeometry& g = ctx_.geometry();
  const auto t0 = std::chrono::steady_clock::now();
  Status first;
  for (auto it = pending_.begin(); it != pending_.end();) {
    bool done = false;
    if (wait_all || (wait_oldest && it == pending_.begin())) {
      Status s = it->request->Wait();
      if (!s.ok() && first.ok()) first = std::move(s);
      done = true;
    } else {
      auto t = it->request->Test();
      if (!t.ok() && first.ok()) first = t.status();
      done = !t.ok() || *t;
    }
    if (!done) {
      ++it;
      continue;
    }
    if (options_.accumulate && first.ok()) {
      const auto* src = static_cast<const uint8_t*>(it->slot.data()) + g.chunk_bytes();
      auto* acc = static_cast<float*>(ctx_.store.grad(it->chunk));
      RETURN_IF_ERROR(AddToF32Parallel(acc, src, g.dtype, g.shard_elems));
    }
    it = pending_.erase(it);
  }
  if (!pending_.empty() || wait_all || wait_oldest) ctx_.counters.comm_seconds += SecondsSince(t0);
  if (!first.ok()) return ctx_.ranks.LoseStep(std::move(first));
  return Status::OK();
}

}  // namespace

namespace internal {

StatusOr<PinnedSlot> FreeReduceSlot(PinnedArena& slots,
                                    const std::function<StatusOr<bool>()>& finish_oldest) {
  std::optional<PinnedSlot> slot = slots.TryAcquire();
  while (!slot.has_value()) {
    ASSIGN_OR_RETURN(const bool finished, finish_oldest());
    TZ_CHECK(finished) << "reduce slots taken with no reduction pending";
    slot = slots.TryAcquire();
  }
  return std::move(*slot);
}

Status CopyGradChunkDown(TransferContext& ctx, int c, const void* device_grad, void* host) {
  Device& device = ctx.device;
  const StreamHandle d2h = ctx.d2h.handle();
  const uint64_t bytes = ctx.geometry().chunk_bytes();
  TransferSpans& spans = ctx.spans;
  auto start = spans.Start();
  if (spans.on()) RETURN_IF_ERROR(spans.QueueStart(device, d2h, start));
  RETURN_IF_ERROR(device.CopyAsync(host, device_grad, bytes, CopyKind::kDeviceToHost, d2h));
  if (spans.on()) {
    RETURN_IF_ERROR(spans.QueueSpan(device, d2h, Track::kD2H, "grad " + std::to_string(c),
                                    ctx.moment - 1, c, bytes, start));
  }
  RETURN_IF_ERROR(ctx.d2h.Synchronize());
  ctx.counters.d2h_bytes += bytes;
  return Status::OK();
}

}  // namespace internal

StatusOr<std::unique_ptr<ReduceStrategy>> CreateLocalReduce(TransferContext& ctx,
                                                            const ReduceOptions& options) {
  auto r = std::make_unique<LocalReduce>(ctx, options);
  RETURN_IF_ERROR(r->Init());
  return std::unique_ptr<ReduceStrategy>(std::move(r));
}

StatusOr<std::unique_ptr<ReduceStrategy>> CreateHostReduce(TransferContext& ctx, Communicator& comm,
                                                           const ReduceOptions& options) {
  auto r = std::make_unique<HostReduce>(ctx, comm, options);
  RETURN_IF_ERROR(r->Init());
  return std::unique_ptr<ReduceStrategy>(std::move(r));
}

StatusOr<std::unique_ptr<ReduceStrategy>> CreateDeviceReduce(TransferContext& ctx,
                                                             DeviceCollectives& comm,
                                                             const ReduceOptions& options) {
  auto r = std::make_unique<DeviceReduce>(ctx, comm, options);
  RETURN_IF_ERROR(r->Init());
  RETURN_IF_ERROR(r->CreateEvents());
  return std::unique_ptr<ReduceStrategy>(std::move(r));
}

}  // namespace tierzero
