#include "chunk/chunk_manager.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <set>

#include "core/bytes.h"
#include "core/check.h"
#include "core/convert.h"
#include "core/logging.h"
#include "zero/collective.h"

namespace tierzero {

namespace {
constexpr auto kStagingTimeout = std::chrono::seconds(120);

// Note [Collectives on the trainer's thread]
// With W > 1 every collective on the communicator is started on the thread that drives the
// manager, never in a stream's host function: the ranks must start the same collectives in the
// same order, which only calls the trainer makes in program order can promise. (Device
// collectives are queued by that thread too, in program order, and run in that order on their
// own stream, over their own communicator: Note [Gathers on the device]. What follows is the
// path through host buffers.) So a gather's all_gather starts
// when the gather is issued (on demand at its Acquire, or as a planned prefetch at the next
// call after the moment's compute was queued). When the communicator is asynchronous (MPI's
// comm thread, Note [The MPI comm thread] in src/zero/mpi.cc) a host function on the H2D stream
// waits for it and checks the tags, and the H2D copies follow, so neither the trainer nor the
// compute stream waits: the gather overlaps compute like a one-rank prefetch. Otherwise the
// trainer waits for the all_gather before queuing the copies. A gradient chunk's D2H copy is
// waited for when the chunk's backward completes (on the simulated device the compute is done
// by then) and its reduce-scatter is started there and completed later, overlapping the rest
// of backward. The agreement at each Acquire keeps those sequences identical on every rank.
// EndIteration synchronises every stream, so no gather is in flight when the optimizer
// rewrites the shards it sends from, and an asynchronous gather's failure ends that call.
//
// Each rank's block of a gather carries a tag after its shard (chunk, moment, gather number),
// checked on arrival: ranks that somehow gather different chunks fail together with a message
// instead of computing on a chunk made of different chunks' shards.
struct GatherTag {
  int32_t chunk = -1;
  int32_t moment = -1;
  uint64_t seq = 0;
  bool operator==(const GatherTag&) const = default;
};
constexpr uint64_t kTagBytes = 64;  // room after each shard in a gather block

struct MomentTag {
  int32_t moment = 0;
  int32_t end = 0;  // 1: the rank is ending its iteration
  int32_t off_trace = 0;
  int32_t inference = 0;
  uint64_t hash = 0;
};

// FNV-1a over the moment's tensors (not chunks: ranks acquiring different tensors of one chunk
// would reduce it at different times).
uint64_t MomentHash(std::span<const int> tensors, bool backward) {
  uint64_t h = 1469598103934665603ull ^ (backward ? 0x9e3779b97f4a7c15ull : 0);
  for (int t : tensors) {
    h ^= static_cast<uint64_t>(t) + 0x100;
    h *= 1099511628211ull;
  }
  return h;
}

// acc[0 .. n) += src[0 .. n) in fp32 (gradient accumulation), converting in blocks through the
// stack.
Status AddToF32(float* acc, const void* src, DType dtype, uint64_t n) {
  constexpr uint64_t kBlock = 4096;
  float tmp[kBlock];
  const auto* s = static_cast<const uint8_t*>(src);
  for (uint64_t b = 0; b < n; b += kBlock) {
    const uint64_t m = std::min(kBlock, n - b);
    RETURN_IF_ERROR(Convert(s + DTypeBytes(dtype, b), dtype, tmp, DType::kF32, m));
    for (uint64_t k = 0; k < m; ++k) acc[b + k] += tmp[k];
  }
  return Status::OK();
}
}  // namespace

struct ChunkManager::Impl {
  Stream h2d, d2h;

  // Shards, per chunk, in the tier the placement chose.
  std::vector<DeviceBuffer> device_shard;
  std::unique_ptr<PinnedArena> host_arena;
  std::vector<PinnedSlot> host_shard;
  std::vector<NvmeExtent> nvme_shard;
  std::unique_ptr<PinnedArena> staging;  // NVMe reads on their way to the device
  std::unique_ptr<PinnedArena> grad_arena;
  std::vector<PinnedSlot> grad_shard;         // compute dtype, or fp32 with accumulation
  std::unique_ptr<PinnedArena> grad_staging;  // accumulation: D2H target before the fp32 add
  // W > 1. Staging slots hold a send area (an NVMe shard read, plus its tag) then the W blocks
  // of the all_gather; reduce slots hold the D2H copy of a gradient chunk, then (accumulation)
  // the reduce-scatter's result before it is added in fp32.
  uint64_t send_area_bytes = 0;
  std::unique_ptr<PinnedArena> reduce_staging;
  struct PendingReduce {
    int chunk;
    PinnedSlot slot;
    std::unique_ptr<CommRequest> request;
  };
  std::deque<PendingReduce> pending_reduce;
  uint64_t gather_seq = 0;
  double caller_gather_seconds[3] = {0, 0, 0};  // recording: collective time per tier
  int caller_gathers[3] = {0, 0, 0};

  // Device slots: after a plan, one region of `pool_slots` chunk-sized slots; during recording
  // iterations, one allocation per gathered chunk (freed as soon as the chunk leaves COMPUTE).
  DeviceBuffer pool;
  std::vector<int> free_slots;
  // The compute stream is done with the slot's chunk once this event completes: the moment
  // event of the Acquire that evicted it, or the slot's own event (slot_done) recorded then.
  std::vector<EventHandle> slot_last_use;
  std::vector<Event> slot_done;
  std::vector<Event> slot_copy_out;  // D2H of gradients out of the slot done
  std::vector<bool> slot_copy_pending;

  struct ChunkRt {
    bool cached = false;
    void* gathered = nullptr;
    int slot = -1;     // pool slot, or -1
    DeviceBuffer own;  // recording iterations
    Event ready;       // gather complete (H2D stream)
    bool ready_known_done = true;
    uint64_t ready_seq = 0;  // order of the gather's ready record (Note [One wait per moment])
    DeviceBuffer grad_buf;   // separate gradient chunk (accumulation, device-resident shards)
    bool grads_in_slot = false;
  };
  std::vector<ChunkRt> chunks;

  enum class Mode { kRecord, kReplay, kOnDemand };
  Mode mode = Mode::kRecord;
  bool inference = false;  // the iteration neither traces nor reduces
  bool record_next = true;
  int moment = 0;
  // Per moment: the compute stream reached its Acquire (recorded first, before evictions and
  // waits), and its waits are done (timed moments only).
  std::vector<Event> moment_begin, moment_start;
  uint64_t ready_records = 0;         // ready events recorded so far (ChunkRt::ready_seq)
  uint64_t acquires = 0;              // Acquire calls so far
  uint64_t event_acquire = 0;         // the Acquire call that last recorded its moment's event
  std::vector<int> pending_prefetch;  // decided at an Acquire, issued just after
  int moments_timed = 0;              // moments with begin/start events this iteration
  // Recording iterations time every gather on the H2D stream, per tier, for the plan.
  struct GatherTiming {
    Event start, end;
    Tier tier;
  };
  std::vector<GatherTiming> gather_timing;
  size_t gathers_timed = 0;
  // The next timing slot, its start recorded on the H2D stream.
  StatusOr<GatherTiming*> StartGatherTiming(Device& device, Tier tier) {
    if (gathers_timed == gather_timing.size()) {
      GatherTiming t;
      ASSIGN_OR_RETURN(t.start, Event::Create(device));
      ASSIGN_OR_RETURN(t.end, Event::Create(device));
      gather_timing.push_back(std::move(t));
    }
    GatherTiming* timing = &gather_timing[gathers_timed++];
    timing->tier = tier;
    RETURN_IF_ERROR(device.RecordEvent(timing->start.handle(), h2d.handle()));
    return timing;
  }
  double measured_seconds[3] = {0, 0, 0};  // mean gather time per Tier; 0 = not measured
  Event iteration_end;
  // Device collectives: recorded and waited for at once (a wait takes the latest record), to
  // order the comm stream after a shard's copy or a gradient chunk's compute, and the D2H stream
  // after a reduce-scatter.
  Event to_comm, from_comm;
  // Separate gradient chunks whose D2H copy is queued: freed once `done` (recorded after the
  // copy on the D2H stream) has passed, not at the end of the iteration, so backward with
  // accumulation holds only the grad chunks still in flight (ReapDeferred).
  struct Deferred {
    DeviceBuffer buf;
    Event done;
  };
  std::vector<Deferred> deferred_free;

  // Profiling (ProfileNextIteration).
  Timeline* timeline = nullptr;  // armed when set and not yet profiling
  bool profiling = false;
  std::vector<MomentProfile> profile;
  // Adds a transfer span to the timeline when the stream reaches the end of it; `start` is
  // shared with a host function queued before the transfer on the same stream.
  Status QueueSpan(Device& device, StreamHandle stream, Track track, std::string name, int chunk,
                   uint64_t bytes, const std::shared_ptr<double>& start) {
    Timeline* tl = timeline;
    const int m = moment - 1;
    return device.LaunchHostFunc(
        stream, [tl, track, name = std::move(name), chunk, bytes, start, m] {
          tl->Add({track, name, *start, tl->Now() - *start, m, chunk, bytes});
        });
  }
  // Where a span's start time goes between QueueStart and QueueSpan: nothing to allocate for a
  // transfer when not profiling (every use of it is behind the same check).
  std::shared_ptr<double> SpanStart(double now = 0) const {
    return profiling ? std::make_shared<double>(now) : nullptr;
  }
  Status QueueStart(Device& device, StreamHandle stream, const std::shared_ptr<double>& start) {
    Timeline* tl = timeline;
    return device.LaunchHostFunc(stream, [tl, start] { *start = tl->Now(); });
  }

  std::mutex async_mu;
  Status async_error;  // GUARDED_BY(async_mu): first failure inside a stream host function
  Status out_of_step;  // GUARDED_BY(async_mu): ChunkManager::out_of_step()
  // Records that the ranks are out of step because of `s`, and returns `s`. Any thread.
  Status LoseStep(Status s) {
    std::lock_guard<std::mutex> lock(async_mu);
    if (out_of_step.ok()) {
      out_of_step = FailedPreconditionError(
          "the ranks are out of step since an earlier failure (" + std::string(s.message()) +
          "); every rank must stop: restart from the last checkpoint");
    }
    return s;
  }
  Status OutOfStep() {
    std::lock_guard<std::mutex> lock(async_mu);
    return out_of_step;
  }
  void SetAsyncError(Status s) {
    std::lock_guard<std::mutex> lock(async_mu);
    if (async_error.ok()) async_error = std::move(s);
  }
};

ChunkManager::ChunkManager(Device& device, StreamHandle compute, NvmeStore* nvme,
                           const ChunkLayout& layout, const Placement& placement,
                           const ChunkManagerOptions& options)
    : device_(device),
      compute_(compute),
      nvme_(nvme),
      layout_(layout),
      placement_(placement),
      options_(options),
      impl_(std::make_unique<Impl>()) {}

ChunkManager::~ChunkManager() {
  if (impl_) {
    if (OnDevice()) (void)options_.device_comm->Drain();  // bounded by the deadline
    (void)device_.Synchronize();
    if (nvme_ != nullptr) {
      for (const NvmeExtent& e : impl_->nvme_shard) {
        if (e.valid()) (void)nvme_->Free(e);
      }
    }
  }
}

StatusOr<std::unique_ptr<ChunkManager>> ChunkManager::Create(
    Device& device, StreamHandle compute_stream, NvmeStore* nvme, const ChunkLayout& layout,
    const Placement& placement, const ChunkManagerOptions& options) {
  if (layout.world_size() > 1) {
    if (options.comm == nullptr || options.comm->size() != layout.world_size()) {
      return InvalidArgumentError("a layout for " + std::to_string(layout.world_size()) +
                                  " ranks needs a communicator of that size");
    }
    if (options.comm->backend() == "nccl") {
      return UnsupportedError(
          "the chunk manager gathers and reduces through host buffers; give it the MPI "
          "communicator (the NCCL one takes device buffers)");
    }
    if (options.device_comm != nullptr && options.device_comm->size() != layout.world_size()) {
      return InvalidArgumentError("device collectives over " +
                                  std::to_string(options.device_comm->size()) + " ranks for a " +
                                  std::to_string(layout.world_size()) + "-rank layout");
    }
    for (const ChunkPlacement& p : placement.chunks) {
      if (p.param == Tier::kDevice && options.device_comm == nullptr) {
        return UnsupportedError(
            "device-resident parameter shards with several ranks and host collectives; set "
            "ranks.collectives to device, or device_shard_budget to 0");
      }
    }
  }
  if (static_cast<int>(placement.chunks.size()) != layout.num_chunks()) {
    return InvalidArgumentError("placement covers " + std::to_string(placement.chunks.size()) +
                                " chunks, the layout has " + std::to_string(layout.num_chunks()));
  }
  if (options.device_budget_bytes < layout.chunk_bytes()) {
    return InvalidArgumentError("device budget " + FormatBytes(options.device_budget_bytes) +
                                " cannot hold one chunk of " + FormatBytes(layout.chunk_bytes()));
  }
  std::unique_ptr<ChunkManager> m(
      new ChunkManager(device, compute_stream, nvme, layout, placement, options));
  RETURN_IF_ERROR(m->Init());
  return m;
}

Status ChunkManager::Init() {
  Impl& im = *impl_;
  const int n = layout_.num_chunks();
  const int world = layout_.world_size();
  const uint64_t bytes = layout_.shard_bytes();  // the local shard (the chunk when W = 1)
  // With W > 1 over host buffers a host shard has room for its gather tag after it.
  const bool host_path = world > 1 && !OnDevice();
  const uint64_t host_slot_bytes = host_path ? AlignUp(bytes + kTagBytes, 4096) : bytes;
  ASSIGN_OR_RETURN(im.h2d, Stream::Create(device_, "h2d"));
  ASSIGN_OR_RETURN(im.d2h, Stream::Create(device_, "d2h"));
  im.device_shard.resize(static_cast<size_t>(n));
  im.host_shard.resize(static_cast<size_t>(n));
  im.nvme_shard.resize(static_cast<size_t>(n));
  im.grad_shard.resize(static_cast<size_t>(n));
  im.chunks.resize(static_cast<size_t>(n));

  int host_chunks = 0, nvme_chunks = 0;
  for (const ChunkPlacement& p : placement_.chunks) {
    host_chunks += p.param == Tier::kHost;
    nvme_chunks += p.param == Tier::kNvme;
  }
  if (nvme_chunks > 0 && nvme_ == nullptr) {
    return InvalidArgumentError(std::to_string(nvme_chunks) +
                                " parameter shards are placed on NVMe but no NVMe store is "
                                "configured; add nvme paths or raise the host budget");
  }
  if (host_chunks > 0) {
    ASSIGN_OR_RETURN(im.host_arena, PinnedArena::Create(&device_, host_slot_bytes,
                                                        static_cast<uint32_t>(host_chunks)));
  }
  if (nvme_chunks > 0 || host_path) {
    uint64_t slot = bytes;
    if (host_path) {
      im.send_area_bytes = host_slot_bytes;
      slot = im.send_area_bytes + AlignUp(static_cast<uint64_t>(world) * (bytes + kTagBytes), 4096);
    }
    const uint64_t slots = std::clamp<uint64_t>(options_.staging_bytes / slot, 2, 32);
    ASSIGN_OR_RETURN(im.staging, PinnedArena::Create(&device_, slot, static_cast<uint32_t>(slots)));
    if (nvme_chunks > 0) {
      // Staging slots are reused for every NVMe read: Note [Register reused buffers].
      Status reg = nvme_->RegisterBuffers({{im.staging->base(), im.staging->total_bytes()}});
      if (!reg.ok()) {
        TZ_LOG(kWarn, kChunk) << "NVMe staging not registered as fixed buffers: " << reg.ToString();
      }
    }
  }
  const uint64_t grad_bytes =
      options_.grad_accumulation ? layout_.shard_elems() * 4 : layout_.shard_bytes();
  ASSIGN_OR_RETURN(im.grad_arena,
                   PinnedArena::Create(&device_, grad_bytes, static_cast<uint32_t>(n)));
  if (host_path) {
    ASSIGN_OR_RETURN(
        im.reduce_staging,
        PinnedArena::Create(&device_, AlignUp(layout_.chunk_bytes() + layout_.shard_bytes(), 4096),
                            4));
  } else if (options_.grad_accumulation) {
    ASSIGN_OR_RETURN(im.grad_staging, PinnedArena::Create(&device_, bytes, 2));
  }
  std::vector<uint8_t> zeros;
  for (int c = 0; c < n; ++c) {
    const size_t i = static_cast<size_t>(c);
    switch (placement_.chunks[i].param) {
      case Tier::kDevice: {
        auto buf = DeviceBuffer::Allocate(device_, bytes);
        if (!buf.ok()) {
          return std::move(buf).status().WithContext("device-resident shard of chunk " +
                                                     std::to_string(c));
        }
        im.device_shard[i] = std::move(buf).value();
        RETURN_IF_ERROR(device_.MemsetAsync(im.device_shard[i].data(), 0, bytes, im.h2d.handle()));
        break;
      }
      case Tier::kHost: {
        auto slot = im.host_arena->TryAcquire();
        TZ_CHECK(slot.has_value());
        std::memset(slot->data(), 0, host_slot_bytes);
        im.host_shard[i] = std::move(*slot);
        break;
      }
      case Tier::kNvme: {
        ASSIGN_OR_RETURN(im.nvme_shard[i], nvme_->Allocate(bytes));
        if (zeros.empty()) zeros.assign(AlignUp(bytes, 4096) + 4096, 0);
        auto* aligned =
            reinterpret_cast<uint8_t*>(AlignUp(reinterpret_cast<uintptr_t>(zeros.data()), 4096));
        RETURN_IF_ERROR(nvme_->Write(im.nvme_shard[i], aligned));
        counters_.nvme_write_bytes += bytes;
        break;
      }
    }
    auto g = im.grad_arena->TryAcquire();
    TZ_CHECK(g.has_value());
    std::memset(g->data(), 0, g->bytes());
    im.grad_shard[i] = std::move(*g);
    ASSIGN_OR_RETURN(im.chunks[i].ready, Event::Create(device_));
  }
  ASSIGN_OR_RETURN(im.iteration_end, Event::Create(device_));
  ASSIGN_OR_RETURN(im.to_comm, Event::Create(device_));
  ASSIGN_OR_RETURN(im.from_comm, Event::Create(device_));
  RETURN_IF_ERROR(im.h2d.Synchronize());
  states_ = std::make_unique<StateTracker>(layout_, [this](int c) {
    if (impl_->inference) return;  // evaluation: the gradient shards keep what they hold
    Status s = ReduceChunk(c);
    if (!s.ok()) impl_->SetAsyncError(std::move(s));
  });
  states_->MarkAllocated();
  TZ_LOG(kInfo, kChunk) << layout_.num_chunks() << " chunks of "
                        << FormatBytes(layout_.chunk_bytes()) << " (shards of "
                        << FormatBytes(bytes) << " on " << world << " ranks); "
                        << placement_.Summary({0, 0, 0});
  return Status::OK();
}

std::vector<double> ChunkManager::GatherSeconds() const {
  std::vector<double> s(static_cast<size_t>(layout_.num_chunks()));
  const double bytes = static_cast<double>(layout_.chunk_bytes());
  const double* measured = impl_->measured_seconds;
  // (W > 1: the defaults leave out the all_gather; a recording iteration measures it.)
  for (size_t c = 0; c < s.size(); ++c) {
    switch (placement_.chunks[c].param) {
      case Tier::kDevice:
        s[c] = ShardIsGathered(static_cast<int>(c)) ? 0 : measured[0];
        break;
      case Tier::kHost:
        s[c] = measured[1] > 0 ? measured[1] : bytes / options_.h2d_bytes_per_second;
        break;
      case Tier::kNvme:
        s[c] = measured[2] > 0 ? measured[2]
                               : bytes / options_.h2d_bytes_per_second +
                                     bytes / options_.nvme_read_bytes_per_second;
        break;
    }
  }
  return s;
}

// ---- Shard contents
// ------------------------------------------------------------------------------

namespace {
Status NotBetweenIterations(bool in_iteration) {
  if (in_iteration) {
    return FailedPreconditionError("shard contents can change only between iterations");
  }
  return Status::OK();
}
}  // namespace

// Copies a tensor's parameters between `host` and its shard, wherever the shard lives.
Status ChunkManager::CopyTensorShard(int t, void* host, bool to_shard) {
  if (t < 0 || t >= layout_.num_tensors()) return InvalidArgumentError("unknown tensor");
  RETURN_IF_ERROR(NotBetweenIterations(impl_->moment > 0));
  Impl& im = *impl_;
  const TensorLoc& loc = layout_.tensor(t);
  const size_t c = static_cast<size_t>(loc.chunk);
  const ShardSlice* slice = nullptr;
  const std::vector<ShardSlice> slices = layout_.ShardSlices(loc.chunk, Rank());
  for (const ShardSlice& sl : slices) {
    if (sl.tensor == t) slice = &sl;
  }
  if (slice == nullptr) return Status::OK();  // no part of the tensor in this rank's shard
  const uint64_t off = DTypeBytes(layout_.dtype(), slice->shard_offset);
  const uint64_t len = DTypeBytes(layout_.dtype(), slice->numel);
  host = static_cast<uint8_t*>(host) + DTypeBytes(layout_.dtype(), slice->tensor_begin);
  auto copy = [&](uint8_t* shard) {
    if (to_shard) {
      std::memcpy(shard + off, host, len);
    } else {
      std::memcpy(host, shard + off, len);
    }
  };
  switch (placement_.chunks[c].param) {
    case Tier::kDevice: {
      auto* shard = static_cast<uint8_t*>(im.device_shard[c].data()) + off;
      const Stream& stream = to_shard ? im.h2d : im.d2h;
      RETURN_IF_ERROR(
          to_shard ? device_.CopyAsync(shard, host, len, CopyKind::kHostToDevice, stream.handle())
                   : device_.CopyAsync(host, shard, len, CopyKind::kDeviceToHost, stream.handle()));
      return stream.Synchronize();
    }
    case Tier::kHost:
      copy(static_cast<uint8_t*>(im.host_shard[c].data()));
      return Status::OK();
    case Tier::kNvme: {
      ASSIGN_OR_RETURN(PinnedSlot s, im.staging->Acquire(kStagingTimeout));
      RETURN_IF_ERROR(nvme_->Read(im.nvme_shard[c], s.data()));
      counters_.nvme_read_bytes += layout_.shard_bytes();
      copy(static_cast<uint8_t*>(s.data()));
      if (to_shard) {
        RETURN_IF_ERROR(nvme_->Write(im.nvme_shard[c], s.data()));
        counters_.nvme_write_bytes += layout_.shard_bytes();
      }
      return Status::OK();
    }
  }
  return Status::OK();
}

Status ChunkManager::WriteTensor(int t, const void* data) {
  // The host buffer is only read when copying to the shard.
  return CopyTensorShard(t, const_cast<void*>(data), /*to_shard=*/true);
}

Status ChunkManager::ReadTensor(int t, void* data) {
  return CopyTensorShard(t, data, /*to_shard=*/false);
}

Status ChunkManager::ReadGrad(int t, void* data) {
  if (t < 0 || t >= layout_.num_tensors()) return InvalidArgumentError("unknown tensor");
  RETURN_IF_ERROR(NotBetweenIterations(impl_->moment > 0));
  const TensorLoc& loc = layout_.tensor(t);
  const DType gt = GradDType();
  for (const ShardSlice& sl : layout_.ShardSlices(loc.chunk, Rank())) {
    if (sl.tensor != t) continue;
    std::memcpy(static_cast<uint8_t*>(data) + DTypeBytes(gt, sl.tensor_begin),
                static_cast<uint8_t*>(impl_->grad_shard[static_cast<size_t>(loc.chunk)].data()) +
                    DTypeBytes(gt, sl.shard_offset),
                DTypeBytes(gt, sl.numel));
  }
  return Status::OK();
}

void* ChunkManager::GradShard(int c) { return impl_->grad_shard[static_cast<size_t>(c)].data(); }

DType ChunkManager::GradDType() const {
  return options_.grad_accumulation ? DType::kF32 : layout_.dtype();
}

Tier ChunkManager::ParamTier(int c) const {
  return placement_.chunks[static_cast<size_t>(c)].param;
}

void* ChunkManager::HostParamShard(int c) {
  if (ParamTier(c) != Tier::kHost) return nullptr;
  return impl_->host_shard[static_cast<size_t>(c)].data();
}

Status ChunkManager::WriteParamShard(int c, const void* src) {
  if (c < 0 || c >= layout_.num_chunks()) return InvalidArgumentError("unknown chunk");
  RETURN_IF_ERROR(NotBetweenIterations(impl_->moment > 0));
  Impl& im = *impl_;
  const size_t i = static_cast<size_t>(c);
  const uint64_t bytes = layout_.shard_bytes();
  switch (ParamTier(c)) {
    case Tier::kDevice:
      RETURN_IF_ERROR(device_.CopyAsync(im.device_shard[i].data(), src, bytes,
                                        CopyKind::kHostToDevice, im.h2d.handle()));
      return im.h2d.Synchronize();
    case Tier::kHost:
      if (src != im.host_shard[i].data()) std::memcpy(im.host_shard[i].data(), src, bytes);
      return Status::OK();
    case Tier::kNvme:
      if (reinterpret_cast<uintptr_t>(src) % kNvmeAlignment != 0) {
        return InvalidArgumentError("an NVMe shard is written from a 4 KiB-aligned buffer");
      }
      RETURN_IF_ERROR(nvme_->Write(im.nvme_shard[i], src));
      counters_.nvme_write_bytes += bytes;
      return Status::OK();
  }
  return Status::OK();
}

Status ChunkManager::ZeroGrads() {
  RETURN_IF_ERROR(NotBetweenIterations(impl_->moment > 0));
  for (PinnedSlot& s : impl_->grad_shard) std::memset(s.data(), 0, s.bytes());
  return Status::OK();
}

int ChunkManager::Rank() const { return options_.comm != nullptr ? options_.comm->rank() : 0; }

// ---- Gathers, evictions, reductions
// --------------------------------------------------------------

Status ChunkManager::Gather(int c) {
  Impl& im = *impl_;
  Impl::ChunkRt& rt = im.chunks[static_cast<size_t>(c)];
  TZ_CHECK(!rt.cached) << "gather of cached chunk " << c;
  const Tier tier = placement_.chunks[static_cast<size_t>(c)].param;
  if (ShardIsGathered(c)) {
    rt.gathered = im.device_shard[static_cast<size_t>(c)].data();
    rt.cached = true;
    rt.ready_known_done = true;
    return Status::OK();
  }
  const uint64_t bytes = layout_.chunk_bytes();
  const StreamHandle h2d = im.h2d.handle();
  if (!im.free_slots.empty()) {
    const int s = im.free_slots.back();
    im.free_slots.pop_back();
    if (im.slot_last_use[static_cast<size_t>(s)].impl != nullptr) {
      RETURN_IF_ERROR(device_.StreamWaitEvent(h2d, im.slot_last_use[static_cast<size_t>(s)]));
    }
    if (im.slot_copy_pending[static_cast<size_t>(s)]) {
      RETURN_IF_ERROR(
          device_.StreamWaitEvent(h2d, im.slot_copy_out[static_cast<size_t>(s)].handle()));
      im.slot_copy_pending[static_cast<size_t>(s)] = false;
    }
    rt.slot = s;
    rt.gathered = static_cast<uint8_t*>(im.pool.data()) + static_cast<uint64_t>(s) * bytes;
  } else {
    auto buf = DeviceBuffer::Allocate(device_, bytes);
    if (!buf.ok()) {
      return std::move(buf).status().WithContext("gathering chunk " + std::to_string(c) +
                                                 " at moment " + std::to_string(im.moment));
    }
    rt.own = std::move(buf).value();
    rt.gathered = rt.own.data();
  }
  Status st = EnqueueGather(c, tier);
  if (!st.ok()) {
    // Nothing queued may still touch the slot, the buffer or a staging slot once we give them
    // back.
    (void)im.h2d.Synchronize();
    if (OnDevice()) (void)options_.device_comm->Drain();
    if (rt.slot >= 0) im.free_slots.push_back(rt.slot);
    rt.slot = -1;
    rt.own.Reset();
    rt.gathered = nullptr;
    return std::move(st).WithContext("gathering chunk " + std::to_string(c) + " at moment " +
                                     std::to_string(im.moment));
  }
  rt.ready_known_done = false;
  rt.ready_seq = ++im.ready_records;
  rt.cached = true;
  return Status::OK();
}

Status ChunkManager::EnqueueGather(int c, Tier tier) {
  if (layout_.world_size() > 1) {
    // A gather one rank could not start or finish leaves the ranks' collectives out of step.
    Status s = OnDevice() ? EnqueueDeviceGather(c, tier) : EnqueueShardedGather(c, tier);
    if (!s.ok()) return impl_->LoseStep(std::move(s));
    return s;
  }
  Impl& im = *impl_;
  Impl::ChunkRt& rt = im.chunks[static_cast<size_t>(c)];
  const StreamHandle h2d = im.h2d.handle();
  Impl::GatherTiming* timing = nullptr;
  if (im.mode == Impl::Mode::kRecord) {
    ASSIGN_OR_RETURN(timing, im.StartGatherTiming(device_, tier));
  }
  RETURN_IF_ERROR(QueueShardUpload(c, tier, rt.gathered));
  if (timing != nullptr) RETURN_IF_ERROR(device_.RecordEvent(timing->end.handle(), h2d));
  return device_.RecordEvent(rt.ready.handle(), h2d);
}

Status ChunkManager::QueueShardUpload(int c, Tier tier, void* dst) {
  Impl& im = *impl_;
  const uint64_t bytes = layout_.shard_bytes();  // the chunk when W = 1
  const StreamHandle h2d = im.h2d.handle();
  const bool prof = im.profiling;
  auto h2d_start = im.SpanStart();
  const std::string what = "chunk " + std::to_string(c);
  if (tier == Tier::kDevice) {
    RETURN_IF_ERROR(device_.CopyAsync(dst, im.device_shard[static_cast<size_t>(c)].data(), bytes,
                                      CopyKind::kDeviceToDevice, h2d));
  } else if (tier == Tier::kHost) {
    if (prof) RETURN_IF_ERROR(im.QueueStart(device_, h2d, h2d_start));
    RETURN_IF_ERROR(device_.CopyAsync(dst, im.host_shard[static_cast<size_t>(c)].data(), bytes,
                                      CopyKind::kHostToDevice, h2d));
    if (prof) RETURN_IF_ERROR(im.QueueSpan(device_, h2d, Track::kH2D, what, c, bytes, h2d_start));
    counters_.h2d_bytes += bytes;
  } else {
    ASSIGN_OR_RETURN(PinnedSlot staging, im.staging->Acquire(kStagingTimeout));
    auto read_start = im.SpanStart(prof ? im.timeline->Now() : 0.0);
    ASSIGN_OR_RETURN(NvmeStore::Ticket ticket,
                     nvme_->SubmitRead(im.nvme_shard[static_cast<size_t>(c)], staging.data()));
    void* staged = staging.data();
    auto shared_ticket = std::make_shared<NvmeStore::Ticket>(std::move(ticket));
    auto shared_slot = std::make_shared<PinnedSlot>(std::move(staging));
    Impl* impl = impl_.get();
    // The H2D stream waits for the disk, so the caller never does. Both functions own the
    // staging slot, so it stays taken until the copy out of it is done whatever fails.
    Timeline* tl = prof ? im.timeline : nullptr;
    const int m = im.moment - 1;
    RETURN_IF_ERROR(device_.LaunchHostFunc(
        h2d, [shared_ticket, shared_slot, impl, c, tl, read_start, h2d_start, bytes, m] {
          Status s = shared_ticket->Wait();
          // W > 1 on the device path: the all_gather still sends what the slot holds and every
          // rank computes on it; EndIteration's agreement fails them all, out of step. (Not out
          // of step here: this rank alone would then refuse its next Acquire, leaving the
          // others in the agreement until the deadline.)
          if (!s.ok())
            impl->SetAsyncError(std::move(s).WithContext("reading chunk " + std::to_string(c)));
          if (tl != nullptr) {
            // The read ran from its submission until the stream saw it complete.
            *h2d_start = tl->Now();
            tl->Add({Track::kNvmeRead, "chunk " + std::to_string(c), *read_start,
                     *h2d_start - *read_start, m, c, bytes});
          }
        }));
    RETURN_IF_ERROR(device_.CopyAsync(dst, staged, bytes, CopyKind::kHostToDevice, h2d));
    if (prof) RETURN_IF_ERROR(im.QueueSpan(device_, h2d, Track::kH2D, what, c, bytes, h2d_start));
    RETURN_IF_ERROR(device_.LaunchHostFunc(h2d, [shared_slot] { shared_slot->Release(); }));
    counters_.nvme_read_bytes += bytes;
    counters_.h2d_bytes += bytes;
  }
  return Status::OK();
}

// Note [Gathers on the device]
// With device collectives a gather moves only the local shard over the host link: it is copied
// (H2D, from NVMe through the staging slot, or D2D for a device-resident shard) to its own place
// in the chunk's slot on the H2D stream, and the comm stream, ordered after that copy with an
// event, all-gathers the other ranks' shards around it in place. The chunk is ready when the
// comm stream passes the all_gather. A gradient chunk is reduce-scattered in place on the comm
// stream once the compute stream has written it, and the D2H stream copies back only the local
// shard of the mean. The collectives are queued in the trainer's program order, the same on
// every rank (the agreement at each Acquire), and run in that order on the one comm stream; no
// rank's thread waits for one. There are no gather tags on this path (a tag would split the
// in-place chunk): the agreement at each Acquire already keeps the ranks' gathers identical.
Status ChunkManager::EnqueueDeviceGather(int c, Tier tier) {
  Impl& im = *impl_;
  Impl::ChunkRt& rt = im.chunks[static_cast<size_t>(c)];
  DeviceCollectives& dc = *options_.device_comm;
  const uint64_t shard = layout_.shard_bytes();
  auto* mine = static_cast<uint8_t*>(rt.gathered) + static_cast<uint64_t>(Rank()) * shard;
  Impl::GatherTiming* timing = nullptr;
  if (im.mode == Impl::Mode::kRecord) {
    ASSIGN_OR_RETURN(timing, im.StartGatherTiming(device_, tier));
  }
  RETURN_IF_ERROR(QueueShardUpload(c, tier, mine));
  RETURN_IF_ERROR(device_.RecordEvent(im.to_comm.handle(), im.h2d.handle()));
  RETURN_IF_ERROR(device_.StreamWaitEvent(dc.stream(), im.to_comm.handle()));
  auto comm_start = im.SpanStart();
  if (im.profiling) RETURN_IF_ERROR(im.QueueStart(device_, dc.stream(), comm_start));
  RETURN_IF_ERROR(dc.AllGather(mine, rt.gathered, shard, DType::kI8));
  ++counters_.all_gathers;
  if (im.profiling) {
    RETURN_IF_ERROR(im.QueueSpan(device_, dc.stream(), Track::kComm,
                                 "all_gather chunk " + std::to_string(c), c, layout_.chunk_bytes(),
                                 comm_start));
  }
  if (timing != nullptr) RETURN_IF_ERROR(device_.RecordEvent(timing->end.handle(), dc.stream()));
  return device_.RecordEvent(rt.ready.handle(), dc.stream());
}

Status ChunkManager::CheckDeviceCollectives() {
  if (!OnDevice()) return Status::OK();
  Status s = options_.device_comm->Check();
  if (!s.ok()) return impl_->LoseStep(std::move(s));
  return s;
}

StatusOr<const void*> ChunkManager::ReduceOnDevice(int c, void* device_grad, const Event& written) {
  Impl& im = *impl_;
  DeviceCollectives& dc = *options_.device_comm;
  auto* grad = static_cast<uint8_t*>(device_grad);
  uint8_t* mine = grad + static_cast<uint64_t>(Rank()) * layout_.shard_bytes();
  Status s = [&]() -> Status {
    RETURN_IF_ERROR(device_.StreamWaitEvent(dc.stream(), written.handle()));
    auto start = im.SpanStart();
    if (im.profiling) RETURN_IF_ERROR(im.QueueStart(device_, dc.stream(), start));
    RETURN_IF_ERROR(
        dc.ReduceScatter(grad, mine, layout_.shard_elems(), layout_.dtype(), ReduceOp::kMean));
    if (im.profiling) {
      RETURN_IF_ERROR(im.QueueSpan(device_, dc.stream(), Track::kComm,
                                   "reduce_scatter grad " + std::to_string(c), c,
                                   layout_.chunk_bytes(), start));
    }
    RETURN_IF_ERROR(device_.RecordEvent(im.from_comm.handle(), dc.stream()));
    return device_.StreamWaitEvent(im.d2h.handle(), im.from_comm.handle());
  }();
  // A reduce-scatter this rank could not queue leaves the ranks' collectives out of step.
  if (!s.ok()) return im.LoseStep(std::move(s));
  ++counters_.reduce_scatters;
  return static_cast<const void*>(mine);
}

// W > 1: the local shard (from host memory, or read from NVMe into the staging slot's send
// area) is all-gathered with its tag into the slot, started on this thread; the H2D stream then
// copies the W shards into the gathered chunk (Note [Collectives on the trainer's thread]).
Status ChunkManager::EnqueueShardedGather(int c, Tier tier) {
  Impl& im = *impl_;
  Impl::ChunkRt& rt = im.chunks[static_cast<size_t>(c)];
  const int world = layout_.world_size();
  const uint64_t shard = layout_.shard_bytes();
  const uint64_t block = shard + kTagBytes;
  const StreamHandle h2d = im.h2d.handle();
  const bool prof = im.profiling;
  const int m = im.moment - 1;
  const auto t0 = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(PinnedSlot staging, im.staging->Acquire(kStagingTimeout));
  auto* base = static_cast<uint8_t*>(staging.data());
  uint8_t* send = base;
  uint8_t* recv = base + im.send_area_bytes;
  if (tier == Tier::kHost) {
    send = static_cast<uint8_t*>(im.host_shard[static_cast<size_t>(c)].data());
  } else {
    const double read_start = prof ? im.timeline->Now() : 0.0;
    RETURN_IF_ERROR(nvme_->Read(im.nvme_shard[static_cast<size_t>(c)], send));
    counters_.nvme_read_bytes += shard;
    if (prof) {
      im.timeline->Add({Track::kNvmeRead, "chunk " + std::to_string(c), read_start,
                        im.timeline->Now() - read_start, m, c, shard});
    }
  }
  GatherTag tag;
  tag.chunk = c;
  tag.moment = m;
  tag.seq = im.gather_seq++;
  std::memcpy(send + shard, &tag, sizeof tag);
  const double comm_start = prof ? im.timeline->Now() : 0.0;
  ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req,
                   options_.comm->AllGather(send, recv, block, DType::kI8));
  ++counters_.all_gathers;
  // Every rank's block carries the tag of the gather it contributed to.
  auto check_tags = [recv, block, shard, tag, world, me = Rank()]() -> Status {
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
  };
  const bool async = options_.comm->asynchronous();
  std::shared_ptr<CommRequest> shared_req;
  auto failed = std::make_shared<std::atomic<bool>>(false);
  if (async) {
    shared_req = std::move(req);
  } else {
    RETURN_IF_ERROR(req->Wait());
    if (prof) {
      im.timeline->Add({Track::kComm, "all_gather chunk " + std::to_string(c), comm_start,
                        im.timeline->Now() - comm_start, m, c, layout_.chunk_bytes()});
    }
    RETURN_IF_ERROR(check_tags());
  }
  const double caller_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  counters_.comm_seconds += caller_s;
  Impl::GatherTiming* timing = nullptr;
  if (im.mode == Impl::Mode::kRecord) {
    im.caller_gather_seconds[static_cast<int>(tier)] += caller_s;
    ++im.caller_gathers[static_cast<int>(tier)];
    ASSIGN_OR_RETURN(timing, im.StartGatherTiming(device_, tier));
  }
  if (async) {
    // The H2D stream waits for the all_gather (the comm thread completes it), so neither the
    // caller nor the compute stream does (Note [Collectives on the trainer's thread]).
    Impl* impl = impl_.get();
    Timeline* tl = prof ? im.timeline : nullptr;
    const uint64_t chunk_bytes = layout_.chunk_bytes();
    RETURN_IF_ERROR(device_.LaunchHostFunc(
        h2d, [shared_req, check_tags, impl, tl, comm_start, m, c, chunk_bytes, failed] {
          Status st = shared_req->Wait();
          if (st.ok()) st = check_tags();
          if (!st.ok()) {
            // An abandoned all_gather may still write into the staging slot: it is never
            // given back, and the ranks are out of step.
            failed->store(true);
            st = std::move(st).WithContext("gathering chunk " + std::to_string(c));
            impl->SetAsyncError(st);
            (void)impl->LoseStep(std::move(st));
          }
          if (tl != nullptr) {
            tl->Add({Track::kComm, "all_gather chunk " + std::to_string(c), comm_start,
                     tl->Now() - comm_start, m, c, chunk_bytes});
          }
        }));
  }
  auto h2d_start = im.SpanStart();
  if (prof) RETURN_IF_ERROR(im.QueueStart(device_, h2d, h2d_start));
  for (int r = 0; r < world; ++r) {
    RETURN_IF_ERROR(device_.CopyAsync(static_cast<uint8_t*>(rt.gathered) + r * shard,
                                      recv + static_cast<uint64_t>(r) * block, shard,
                                      CopyKind::kHostToDevice, h2d));
  }
  counters_.h2d_bytes += layout_.chunk_bytes();
  if (prof) {
    RETURN_IF_ERROR(im.QueueSpan(device_, h2d, Track::kH2D, "chunk " + std::to_string(c), c,
                                 layout_.chunk_bytes(), h2d_start));
  }
  auto shared_slot = std::make_shared<PinnedSlot>(std::move(staging));
  RETURN_IF_ERROR(device_.LaunchHostFunc(h2d, [shared_slot, failed] {
    if (failed->load()) {
      static auto* leaked = new std::vector<std::shared_ptr<PinnedSlot>>();
      static std::mutex mu;
      std::lock_guard<std::mutex> lock(mu);
      leaked->push_back(shared_slot);
      return;
    }
    shared_slot->Release();
  }));
  if (timing != nullptr) RETURN_IF_ERROR(device_.RecordEvent(timing->end.handle(), h2d));
  return device_.RecordEvent(rt.ready.handle(), h2d);
}

Status ChunkManager::Evict(int c, int moment) {
  Impl& im = *impl_;
  Impl::ChunkRt& rt = im.chunks[static_cast<size_t>(c)];
  if (!rt.cached) return Status::OK();
  rt.cached = false;
  rt.grads_in_slot = false;
  ++counters_.evictions;
  if (ShardIsGathered(c)) {
    rt.gathered = nullptr;
    return Status::OK();
  }
  if (rt.slot >= 0) {
    // A gather the compute stream never waited for (a prefetch dropped off the trace) may still
    // be writing the slot on the comm stream, which the next gather's H2D copy does not wait for.
    const size_t s = static_cast<size_t>(rt.slot);
    EventHandle moment_event{};  // recorded before the wait below (Note [One wait per moment])
    if (moment >= 0) {
      ASSIGN_OR_RETURN(moment_event, MomentEvent(moment));
    }
    const bool waited = OnDevice() && !rt.ready_known_done;
    if (waited) RETURN_IF_ERROR(device_.StreamWaitEvent(compute_, rt.ready.handle()));
    if (moment_event.impl != nullptr && !waited) {
      // The moment's event follows the chunk's last use.
      im.slot_last_use[s] = moment_event;
    } else {
      // Everything enqueued on the compute stream so far includes the chunk's last use.
      RETURN_IF_ERROR(device_.RecordEvent(im.slot_done[s].handle(), compute_));
      im.slot_last_use[s] = im.slot_done[s].handle();
    }
    im.free_slots.push_back(rt.slot);
    rt.slot = -1;
  } else {
    // A recording iteration: free the memory once the compute stream (and any gradient copy)
    // is done with it, so warm-up never holds more than the chunks in COMPUTE.
    Event done;
    ASSIGN_OR_RETURN(done, Event::Create(device_));
    RETURN_IF_ERROR(device_.RecordEvent(done.handle(), compute_));
    RETURN_IF_ERROR(done.Synchronize());
    RETURN_IF_ERROR(rt.ready.Synchronize());  // a gather the compute stream never waited for
    RETURN_IF_ERROR(im.d2h.Synchronize());
    rt.own.Reset();
  }
  rt.gathered = nullptr;
  return Status::OK();
}

// Note [Gathers start when their moment begins]
// The trainer's thread runs ahead of the compute stream (all work is asynchronous), so it reaches
// moment k's Acquire long before the device does. The plan decided what to gather "when moment k
// begins" on the device, so the H2D stream first waits for the compute stream to get there. This
// keeps on-demand gathers on demand (they would otherwise prefetch by accident, and the
// comparison in chunk_bench would mean nothing), and the plan's prefetches at the distance the
// plan chose, which the slot budget was checked for.
// Note [One wait per moment]
// Every stream operation costs something: driver time on the caller's thread with CUDA, a
// hand-off between threads on HostSim. So an Acquire queues as little as it can on the compute
// stream (nothing at all when its chunks are all in place and not timed):
//   - At most one event (moment_begin[k]), recorded when first needed, before any wait the
//     Acquire queues there. Its gathers wait for it (Note [Gathers start when their moment
//     begins]), and a slot it evicts is free once it completes: everything the caller queued
//     before this Acquire includes the evicted chunk's last use. (An eviction that must first
//     wait for its chunk's collective records the slot's own event after that wait.)
//   - At most one wait, for the needed chunk whose gather was recorded last. Every gather's
//     ready event is recorded on the same in-order stream (the H2D stream, or the comm stream
//     on the device collective path; device-resident shards have none), in ready_seq order, so
//     when the last is done, so are the others.
// It used to be one event per evicted slot, one more for the gathers, one wait per chunk.
StatusOr<EventHandle> ChunkManager::MomentEvent(int k) {
  Impl& im = *impl_;
  const EventHandle e = im.moment_begin[static_cast<size_t>(k)].handle();
  if (im.event_acquire != im.acquires) {
    RETURN_IF_ERROR(device_.RecordEvent(e, compute_));
    im.event_acquire = im.acquires;
  }
  return e;
}

Status ChunkManager::GathersStartNow(int k) {
  ASSIGN_OR_RETURN(EventHandle e, MomentEvent(k));
  return device_.StreamWaitEvent(impl_->h2d.handle(), e);
}

bool ChunkManager::Evictable(int c) const {
  // A chunk holding some, not all, of its in-place gradients keeps its slot until reduced.
  return states_->ChunkEvictable(c) &&
         (SeparateGrads(c) || !states_->ChunkBackwardStarted(c) || states_->ChunkGradsReady(c));
}

// Gradients go to a separate grad chunk with accumulation, for device-resident shards on one rank
// (the gathered copy is the shard), and for chunks with a tensor used more than once in forward
// (its first backward use would otherwise overwrite the weight its second one still reads).
bool ChunkManager::ShardIsGathered(int c) const {
  return layout_.world_size() == 1 &&
         placement_.chunks[static_cast<size_t>(c)].param == Tier::kDevice;
}

bool ChunkManager::SeparateGrads(int c) const {
  if (options_.grad_accumulation || ShardIsGathered(c)) {
    return true;
  }
  for (int t : layout_.chunk(c).tensors) {
    if (states_->forward_uses(t) > 1) return true;
  }
  return false;
}

Status ChunkManager::ReduceChunk(int c) {
  Impl& im = *impl_;
  Impl::ChunkRt& rt = im.chunks[static_cast<size_t>(c)];
  const size_t i = static_cast<size_t>(c);
  const StreamHandle d2h = im.d2h.handle();
  Event written;
  ASSIGN_OR_RETURN(written, Event::Create(device_));
  RETURN_IF_ERROR(device_.RecordEvent(written.handle(), compute_));
  RETURN_IF_ERROR(device_.StreamWaitEvent(d2h, written.handle()));
  const uint64_t bytes = layout_.shard_bytes();  // what comes back to the host (W = 1: the chunk)
  const bool sharded = layout_.world_size() > 1 && !OnDevice();  // over host buffers
  if (!SeparateGrads(c)) {
    if (!rt.cached) {
      // No tensor of the chunk had a backward use: its gradient is zero (on every rank: the
      // ranks' moments agree).
      std::memset(im.grad_shard[i].data(), 0, im.grad_shard[i].bytes());
      return Status::OK();
    }
    // Tensors without a backward use still hold parameters in the slot: zero them first.
    for (int t : layout_.chunk(c).tensors) {
      if (states_->backward_uses(t) > 0) continue;
      const TensorLoc& loc = layout_.tensor(t);
      RETURN_IF_ERROR(device_.MemsetAsync(
          static_cast<uint8_t*>(rt.gathered) + DTypeBytes(layout_.dtype(), loc.offset), 0,
          DTypeBytes(layout_.dtype(), loc.numel), compute_));
    }
    RETURN_IF_ERROR(device_.RecordEvent(written.handle(), compute_));
    RETURN_IF_ERROR(device_.StreamWaitEvent(d2h, written.handle()));
    if (sharded) {
      RETURN_IF_ERROR(ReduceAcrossRanks(c, rt.gathered));
      if (rt.slot >= 0) {
        RETURN_IF_ERROR(
            device_.RecordEvent(im.slot_copy_out[static_cast<size_t>(rt.slot)].handle(), d2h));
        im.slot_copy_pending[static_cast<size_t>(rt.slot)] = true;
      }
      rt.grads_in_slot = true;
      return Status::OK();
    }
    const void* src = rt.gathered;
    if (OnDevice()) {
      ASSIGN_OR_RETURN(src, ReduceOnDevice(c, rt.gathered, written));
    }
    auto start = im.SpanStart();
    if (im.profiling) RETURN_IF_ERROR(im.QueueStart(device_, d2h, start));
    RETURN_IF_ERROR(
        device_.CopyAsync(im.grad_shard[i].data(), src, bytes, CopyKind::kDeviceToHost, d2h));
    if (im.profiling) {
      RETURN_IF_ERROR(
          im.QueueSpan(device_, d2h, Track::kD2H, "grad " + std::to_string(c), c, bytes, start));
    }
    if (rt.slot >= 0) {
      RETURN_IF_ERROR(
          device_.RecordEvent(im.slot_copy_out[static_cast<size_t>(rt.slot)].handle(), d2h));
      im.slot_copy_pending[static_cast<size_t>(rt.slot)] = true;
    }
    rt.grads_in_slot = true;
  } else if (rt.grad_buf.data() == nullptr) {
    // No backward use: zero without accumulation, nothing to add with it.
    if (!options_.grad_accumulation)
      std::memset(im.grad_shard[i].data(), 0, im.grad_shard[i].bytes());
    return Status::OK();
  } else if (sharded) {
    RETURN_IF_ERROR(ReduceAcrossRanks(c, rt.grad_buf.data()));
    rt.grad_buf.Reset();  // ReduceAcrossRanks waited for its copy
    return Status::OK();
  } else {
    const void* src = rt.grad_buf.data();
    if (OnDevice()) {
      ASSIGN_OR_RETURN(src, ReduceOnDevice(c, rt.grad_buf.data(), written));
    }
    auto start = im.SpanStart();
    if (im.profiling) RETURN_IF_ERROR(im.QueueStart(device_, d2h, start));
    if (!options_.grad_accumulation) {
      RETURN_IF_ERROR(
          device_.CopyAsync(im.grad_shard[i].data(), src, bytes, CopyKind::kDeviceToHost, d2h));
      if (im.profiling) {
        RETURN_IF_ERROR(
            im.QueueSpan(device_, d2h, Track::kD2H, "grad " + std::to_string(c), c, bytes, start));
      }
    } else {
      ASSIGN_OR_RETURN(PinnedSlot staging, im.grad_staging->Acquire(kStagingTimeout));
      void* staged = staging.data();
      RETURN_IF_ERROR(device_.CopyAsync(staged, src, bytes, CopyKind::kDeviceToHost, d2h));
      auto shared_slot = std::make_shared<PinnedSlot>(std::move(staging));
      auto* acc = static_cast<float*>(im.grad_shard[i].data());
      const uint64_t elems = layout_.shard_elems();
      const DType dt = layout_.dtype();
      RETURN_IF_ERROR(device_.LaunchHostFunc(d2h, [shared_slot, acc, elems, dt] {
        // fp32 accumulation of this micro-batch's gradient.
        TZ_CHECK_OK(AddToF32(acc, shared_slot->data(), dt, elems));
        shared_slot->Release();
      }));
      if (im.profiling) {
        RETURN_IF_ERROR(im.QueueSpan(device_, d2h, Track::kD2H,
                                     "grad " + std::to_string(c) + " (accumulated)", c, bytes,
                                     start));
      }
    }
    Impl::Deferred d;
    ASSIGN_OR_RETURN(d.done, Event::Create(device_));
    RETURN_IF_ERROR(device_.RecordEvent(d.done.handle(), d2h));
    d.buf = std::move(rt.grad_buf);
    im.deferred_free.push_back(std::move(d));
  }
  counters_.d2h_bytes += bytes;
  return Status::OK();
}

// W > 1: the gradient chunk is copied D2H into a reduce slot, waited for, and its reduce-scatter
// (mean over the ranks) started into the local gradient shard; FinishReductions completes it.
Status ChunkManager::ReduceAcrossRanks(int c, const void* device_grad) {
  Impl& im = *impl_;
  const StreamHandle d2h = im.d2h.handle();
  const uint64_t bytes = layout_.chunk_bytes();
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<PinnedSlot> slot = im.reduce_staging->TryAcquire();
  while (!slot.has_value()) {
    // Every slot holds a reduce-scatter in flight: complete the oldest.
    TZ_CHECK(!im.pending_reduce.empty()) << "reduce slots taken with no reduction pending";
    RETURN_IF_ERROR(FinishReductions(/*wait_all=*/false, /*wait_oldest=*/true));
    slot = im.reduce_staging->TryAcquire();
  }
  auto start = im.SpanStart();
  if (im.profiling) RETURN_IF_ERROR(im.QueueStart(device_, d2h, start));
  RETURN_IF_ERROR(
      device_.CopyAsync(slot->data(), device_grad, bytes, CopyKind::kDeviceToHost, d2h));
  if (im.profiling) {
    RETURN_IF_ERROR(
        im.QueueSpan(device_, d2h, Track::kD2H, "grad " + std::to_string(c), c, bytes, start));
  }
  RETURN_IF_ERROR(im.d2h.Synchronize());
  counters_.d2h_bytes += bytes;
  void* recv = options_.grad_accumulation ? static_cast<uint8_t*>(slot->data()) + bytes
                                          : im.grad_shard[static_cast<size_t>(c)].data();
  ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req,
                   options_.comm->ReduceScatter(slot->data(), recv, layout_.shard_elems(),
                                                layout_.dtype(), ReduceOp::kMean));
  ++counters_.reduce_scatters;
  im.pending_reduce.push_back({c, std::move(*slot), std::move(req)});
  counters_.comm_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return Status::OK();
}

// Completes the reduce-scatters that are done (all of them with wait_all, the oldest with
// wait_oldest); with accumulation adds each result into the fp32 gradient shard.
Status ChunkManager::FinishReductions(bool wait_all, bool wait_oldest) {
  Impl& im = *impl_;
  const auto t0 = std::chrono::steady_clock::now();
  Status first;
  for (auto it = im.pending_reduce.begin(); it != im.pending_reduce.end();) {
    bool done = false;
    if (wait_all || (wait_oldest && it == im.pending_reduce.begin())) {
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
    if (options_.grad_accumulation && first.ok()) {
      const auto* src = static_cast<const uint8_t*>(it->slot.data()) + layout_.chunk_bytes();
      auto* acc = static_cast<float*>(im.grad_shard[static_cast<size_t>(it->chunk)].data());
      RETURN_IF_ERROR(AddToF32(acc, src, layout_.dtype(), layout_.shard_elems()));
    }
    it = im.pending_reduce.erase(it);
  }
  if (!im.pending_reduce.empty() || wait_all || wait_oldest) {
    counters_.comm_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (!first.ok()) return im.LoseStep(std::move(first));
  return Status::OK();
}

// W > 1: the ranks compare their moment (or the end of their iteration) and whether they left
// the trace; see the header.
Status ChunkManager::AgreeOnMoment(int k, uint64_t hash, bool end, bool* off_trace) {
  MomentTag mine;
  mine.moment = k;
  mine.end = end ? 1 : 0;
  mine.off_trace = *off_trace ? 1 : 0;
  mine.inference = impl_->inference ? 1 : 0;
  mine.hash = hash;
  const auto t0 = std::chrono::steady_clock::now();
  auto gathered = zero::AllGatherValue(*options_.comm, mine);
  if (!gathered.ok()) return impl_->LoseStep(gathered.status());
  const std::vector<MomentTag>& all = *gathered;
  counters_.comm_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto describe = [](int r, const MomentTag& t) {
    std::string what = t.end ? "ended its iteration after " + std::to_string(t.moment) + " moments"
                             : "began moment " + std::to_string(t.moment);
    return "rank " + std::to_string(r) + " " + what + (t.inference ? " (evaluation)" : "");
  };
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    const MomentTag& t = all[static_cast<size_t>(r)];
    if (t.moment != mine.moment || t.end != mine.end || t.hash != mine.hash ||
        t.inference != mine.inference) {
      std::string msg =
          "the ranks' programs differ: " + describe(Rank(), mine) + ", " + describe(r, t);
      if (!t.end && !mine.end && t.moment == mine.moment)
        msg += ", with different parameters or phase";
      return impl_->LoseStep(FailedPreconditionError(
          msg +
          "; every rank must run the same iterations, acquiring the same parameters in "
          "the same order"));
    }
    if (t.off_trace) *off_trace = true;
  }
  return Status::OK();
}

// W > 1, after a recording iteration: the plan's inputs become the maximum over the ranks, so
// that every rank computes the same plan (and issues the same gathers).
Status ChunkManager::AgreeOnPlanInputs(std::vector<Moment>& moments) {
  Impl& im = *impl_;
  std::vector<double> mine;
  for (const Moment& m : moments) {
    mine.push_back(m.compute_seconds);
    mine.push_back(static_cast<double>(m.nonmodel_bytes));
    mine.push_back(static_cast<double>(m.nonmodel_peak));
  }
  for (double t : im.measured_seconds) mine.push_back(t);
  ASSIGN_OR_RETURN(std::vector<uint8_t> raw,
                   zero::AllGatherBytes(*options_.comm, mine.data(), mine.size() * 8));
  std::vector<double> most = mine;
  for (int r = 0; r < options_.comm->size(); ++r) {
    const auto* theirs = reinterpret_cast<const double*>(raw.data()) + r * mine.size();
    for (size_t i = 0; i < mine.size(); ++i) most[i] = std::max(most[i], theirs[i]);
  }
  for (size_t k = 0; k < moments.size(); ++k) {
    moments[k].compute_seconds = most[3 * k];
    moments[k].nonmodel_bytes = static_cast<uint64_t>(most[3 * k + 1]);
    moments[k].nonmodel_peak = static_cast<uint64_t>(most[3 * k + 2]);
  }
  for (int t = 0; t < 3; ++t) im.measured_seconds[t] = most[3 * moments.size() + t];
  return Status::OK();
}

// ---- Iterations
// ----------------------------------------------------------------------------------

Status ChunkManager::out_of_step() const { return impl_->OutOfStep(); }
void ChunkManager::MarkOutOfStep(Status why) { (void)impl_->LoseStep(std::move(why)); }

Status ChunkManager::BeginIteration(bool inference) {
  Impl& im = *impl_;
  RETURN_IF_ERROR(im.OutOfStep());
  RETURN_IF_ERROR(states_->BeginIteration());
  im.moment = 0;
  im.gather_seq = 0;
  im.inference = inference;
  im.profiling = false;  // (an iteration that failed while profiling is profiled again)
  if (inference) {
    im.mode = Impl::Mode::kOnDemand;
    return Status::OK();
  }
  im.mode = (im.record_next || !has_plan_) ? Impl::Mode::kRecord : Impl::Mode::kReplay;
  if (im.mode == Impl::Mode::kReplay && im.timeline != nullptr) {
    im.profiling = true;
    im.profile.clear();
    im.timeline->Begin();
  }
  if (im.mode == Impl::Mode::kRecord) {
    tracer_.Begin(tracer_.current_nonmodel());
    // Recording gathers into per-chunk allocations; the old plan's slot region would only take
    // memory from them (and from the activations).
    im.pool.Reset();
    im.free_slots.clear();
  }
  return Status::OK();
}

Status ChunkManager::Acquire(std::span<const int> tensors, Phase phase) {
  Impl& im = *impl_;
  RETURN_IF_ERROR(im.OutOfStep());
  if (im.inference && phase != Phase::kForward) {
    return FailedPreconditionError("an inference iteration acquires for forward only, not " +
                                   std::string(PhaseName(phase)));
  }
  RETURN_IF_ERROR(states_->Acquire(tensors, phase));
  // The moment's chunks, in order of first appearance.
  std::vector<int> needed;
  for (int t : tensors) {
    const int c = layout_.tensor(t).chunk;
    if (std::find(needed.begin(), needed.end(), c) == needed.end()) needed.push_back(c);
  }
  const int k = im.moment++;
  ++im.acquires;
  const size_t traced = tracer_.moments().size();
  Status st = AcquireChunks(k, needed, tensors, phase);
  if (!st.ok()) {
    // Leave everything as it was before the call: states, use counts, trace, moment count.
    states_->Unacquire(tensors, phase);
    if (tracer_.moments().size() > traced) tracer_.PopMoment();
    --im.moment;
  }
  return st;
}

Status ChunkManager::AcquireChunks(int k, const std::vector<int>& needed,
                                   std::span<const int> tensors, Phase phase) {
  Impl& im = *impl_;
  ReapDeferred();
  RETURN_IF_ERROR(FlushPrefetches());
  bool off_trace =
      im.mode == Impl::Mode::kReplay &&
      (k >= static_cast<int>(trace_.size()) || trace_[static_cast<size_t>(k)].chunks != needed ||
       trace_[static_cast<size_t>(k)].backward != (phase == Phase::kBackward));
  if (layout_.world_size() > 1) {
    // (With W > 1 the evictions' check below is made here, so all ranks leave the plan together.)
    if (im.mode == Impl::Mode::kReplay && !off_trace) {
      for (int c : schedule_.moments[static_cast<size_t>(k)].evict) off_trace |= !Evictable(c);
    }
    RETURN_IF_ERROR(FinishReductions(/*wait_all=*/false, /*wait_oldest=*/false));
    RETURN_IF_ERROR(CheckDeviceCollectives());
    RETURN_IF_ERROR(AgreeOnMoment(k, MomentHash(tensors, phase == Phase::kBackward),
                                  /*end=*/false, &off_trace));
  }
  if (im.mode == Impl::Mode::kReplay && off_trace) {
    // Off the trace: on demand for the rest of the iteration, record and plan again next time.
    ++counters_.deviations;
    im.mode = Impl::Mode::kOnDemand;
    im.record_next = true;
    TZ_LOG(kInfo, kChunk) << "moment " << k << " differs from the trace; on-demand until the "
                          << "iteration ends, then recording and planning again";
  }
  const bool timed = im.mode == Impl::Mode::kRecord || options_.measure_stalls || im.profiling;
  if (im.mode == Impl::Mode::kRecord) {
    tracer_.BeginMoment(needed, phase == Phase::kBackward);
    std::vector<int> held;  // chunks outer scopes still hold
    for (int c = 0; c < layout_.num_chunks(); ++c) {
      if (!states_->ChunkEvictable(c) &&
          std::find(needed.begin(), needed.end(), c) == needed.end()) {
        held.push_back(c);
      }
    }
    if (!held.empty()) tracer_.SetHeld(std::move(held));
  }
  // The moment's event, recorded when first needed: the gathers wait for it, evicted slots are
  // free after it, and timed moments measure from it (Note [One wait per moment]).
  while (im.moment_begin.size() <= static_cast<size_t>(k)) {
    Event b, s;
    ASSIGN_OR_RETURN(b, Event::Create(device_));
    ASSIGN_OR_RETURN(s, Event::Create(device_));
    im.moment_begin.push_back(std::move(b));
    im.moment_start.push_back(std::move(s));
  }
  if (timed) {
    RETURN_IF_ERROR(MomentEvent(k).status());
    im.moments_timed = k + 1;
  }
  for (int c : needed) {
    if (im.chunks[static_cast<size_t>(c)].cached) ++counters_.hits;
  }
  if (im.mode == Impl::Mode::kReplay) {
    const MomentDecision& d = schedule_.moments[static_cast<size_t>(k)];
    for (int c : d.evict) {
      if (!Evictable(c)) {
        // The plan would drop a chunk still in use (a scope or unreduced gradients): the program
        // is not the one traced. Stay safe: on demand for the rest of the iteration.
        ++counters_.deviations;
        im.mode = Impl::Mode::kOnDemand;
        im.record_next = true;
        TZ_LOG(kInfo, kChunk) << "moment " << k << ": the plan evicts chunk " << c
                              << ", which is still in use; on-demand for this iteration";
        break;
      }
    }
  }
  if (im.mode == Impl::Mode::kReplay) {
    const MomentDecision& d = schedule_.moments[static_cast<size_t>(k)];
    for (int c : d.evict) RETURN_IF_ERROR(Evict(c, k));
    for (int c : needed) {
      // Device-resident shards are never in the plan's gathers: they are the gathered copy.
      if (!im.chunks[static_cast<size_t>(c)].cached && ShardIsGathered(c)) {
        RETURN_IF_ERROR(Gather(c));
      }
    }
    if (!d.gather.empty()) RETURN_IF_ERROR(GathersStartNow(k));
    // The moment's own misses now; its prefetches once the caller has queued the moment's
    // compute (Note [Prefetches after the moment's compute is queued]).
    for (int c : d.gather) {
      if (im.chunks[static_cast<size_t>(c)].cached) continue;
      if (std::find(needed.begin(), needed.end(), c) != needed.end()) {
        ++counters_.misses;
        RETURN_IF_ERROR(Gather(c));
      } else {
        im.pending_prefetch.push_back(c);
      }
    }
    // Whatever a dropped prefetch left out is gathered now.
    bool started = !d.gather.empty();
    for (int c : needed) {
      if (im.chunks[static_cast<size_t>(c)].cached) continue;
      if (!started) RETURN_IF_ERROR(GathersStartNow(k));
      started = true;
      ++counters_.misses;
      RETURN_IF_ERROR(Gather(c));
    }
  } else {
    if (im.mode == Impl::Mode::kOnDemand) {
      // Keep only what this moment needs plus chunks still in use by live scopes.
      for (int c = 0; c < layout_.num_chunks(); ++c) {
        const bool want = std::find(needed.begin(), needed.end(), c) != needed.end();
        if (!want && im.chunks[static_cast<size_t>(c)].cached && Evictable(c)) {
          RETURN_IF_ERROR(Evict(c, k));
        }
      }
    }
    bool tied = false;
    for (int c : needed) {
      if (im.chunks[static_cast<size_t>(c)].cached) continue;
      if (!tied) RETURN_IF_ERROR(GathersStartNow(k));
      tied = true;
      ++counters_.misses;
      RETURN_IF_ERROR(Gather(c));
    }
  }
  const Impl::ChunkRt* latest = nullptr;  // the needed gather recorded last, if not done
  for (int c : needed) {
    Impl::ChunkRt& rt = im.chunks[static_cast<size_t>(c)];
    TZ_CHECK(rt.cached) << "chunk " << c << " not gathered at moment " << k;
    if (!rt.ready_known_done) {
      ASSIGN_OR_RETURN(bool done, device_.EventDone(rt.ready.handle()));
      if (done) {
        rt.ready_known_done = true;
      } else if (latest == nullptr || rt.ready_seq > latest->ready_seq) {
        latest = &rt;
      }
    }
    if (phase == Phase::kBackward && SeparateGrads(c) && rt.grad_buf.data() == nullptr) {
      ASSIGN_OR_RETURN(rt.grad_buf, DeviceBuffer::Allocate(device_, layout_.chunk_bytes()));
      RETURN_IF_ERROR(device_.MemsetAsync(rt.grad_buf.data(), 0, layout_.chunk_bytes(), compute_));
    }
  }
  if (latest != nullptr) RETURN_IF_ERROR(device_.StreamWaitEvent(compute_, latest->ready.handle()));
  if (timed) {
    RETURN_IF_ERROR(
        device_.RecordEvent(im.moment_start[static_cast<size_t>(k)].handle(), compute_));
  }
  if (im.profiling) {
    MomentProfile p;
    p.residency.resize(static_cast<size_t>(layout_.num_chunks()));
    for (int c = 0; c < layout_.num_chunks(); ++c) {
      const Impl::ChunkRt& rt = im.chunks[static_cast<size_t>(c)];
      const Tier tier = placement_.chunks[static_cast<size_t>(c)].param;
      p.residency[static_cast<size_t>(c)] =
          rt.cached || tier == Tier::kDevice ? 'D' : (tier == Tier::kHost ? 'H' : 'N');
      if (rt.cached && !ShardIsGathered(c)) p.device_chunk_bytes += layout_.chunk_bytes();
      if (rt.grad_buf.data() != nullptr) p.device_chunk_bytes += layout_.chunk_bytes();
    }
    p.nonmodel_bytes = tracer_.current_nonmodel();
    p.prefetch = im.pending_prefetch;
    im.profile.push_back(std::move(p));
  }
  return Status::OK();
}

void ChunkManager::ReapDeferred() {
  auto& v = impl_->deferred_free;
  size_t keep = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    auto done = device_.EventDone(v[i].done.handle());
    if (done.ok() && *done) continue;  // its copy is done: freed when the vector shrinks
    if (keep != i) v[keep] = std::move(v[i]);
    ++keep;
  }
  v.resize(keep);
}

// Note [Prefetches after the moment's compute is queued]
// A gather is a handful of queue operations (and an io_uring submission for NVMe), cheap but
// not free: issuing the prefetches of a moment before returning from its Acquire delays the
// moment's compute by all of them (0.9 ms for the 26 chunks the plan fetches at the first moment
// of chunk_bench). They are issued at the next Release or Acquire instead, after the caller has
// queued the moment's compute. Their timing on the device does not change: the H2D stream
// already waits for the moment to begin (Note [Gathers start when their moment begins]), and
// nothing else is queued on it in between.
Status ChunkManager::FlushPrefetches() {
  Impl& im = *impl_;
  for (int c : im.pending_prefetch) {
    if (im.chunks[static_cast<size_t>(c)].cached) continue;
    ++counters_.prefetches;
    // A prefetch that fails is dropped: the moment that needs the chunk gathers it on demand
    // and reports the error from its Acquire if it persists. Not with W > 1: the other ranks
    // did start its all_gather, so the sequences would part; the error ends the call.
    Status s = Gather(c);
    if (!s.ok() && layout_.world_size() > 1) {
      im.pending_prefetch.clear();
      return s;
    }
    if (!s.ok()) TZ_LOG(kWarn, kChunk) << "prefetch dropped: " << s.ToString();
  }
  im.pending_prefetch.clear();
  return Status::OK();
}

Status ChunkManager::Release(std::span<const int> tensors, Phase phase) {
  Impl& im = *impl_;
  RETURN_IF_ERROR(im.OutOfStep());
  RETURN_IF_ERROR(states_->Release(tensors, phase));
  RETURN_IF_ERROR(FlushPrefetches());
  ReapDeferred();
  if (layout_.world_size() > 1) {
    RETURN_IF_ERROR(FinishReductions(/*wait_all=*/false, /*wait_oldest=*/false));
  }
  if (im.mode != Impl::Mode::kReplay) {
    // Recording and on-demand iterations keep only chunks in COMPUTE on the device. A chunk
    // whose gradient went out through its slot is dropped too (ReduceChunk queued the copy).
    for (int t : tensors) {
      const int c = layout_.tensor(t).chunk;
      if (im.chunks[static_cast<size_t>(c)].cached && Evictable(c)) {
        RETURN_IF_ERROR(Evict(c));
      }
    }
  }
  return Status::OK();
}

void ChunkManager::ProfileNextIteration(Timeline* timeline) { impl_->timeline = timeline; }
bool ChunkManager::profiling() const { return impl_->profiling; }
const std::vector<ChunkManager::MomentProfile>& ChunkManager::moment_profiles() const {
  return impl_->profile;
}

void* ChunkManager::DevicePtr(int t) const {
  const TensorLoc& loc = layout_.tensor(t);
  const auto& rt = impl_->chunks[static_cast<size_t>(loc.chunk)];
  if (!rt.cached) return nullptr;
  return static_cast<uint8_t*>(rt.gathered) + DTypeBytes(layout_.dtype(), loc.offset);
}

void* ChunkManager::GradPtr(int t) const {
  const TensorLoc& loc = layout_.tensor(t);
  const auto& rt = impl_->chunks[static_cast<size_t>(loc.chunk)];
  if (SeparateGrads(loc.chunk)) {
    if (rt.grad_buf.data() == nullptr) return nullptr;
    return static_cast<uint8_t*>(rt.grad_buf.data()) + DTypeBytes(layout_.dtype(), loc.offset);
  }
  return DevicePtr(t);
}

Status ChunkManager::EndIteration() {
  Impl& im = *impl_;
  RETURN_IF_ERROR(im.OutOfStep());  // no teardown: the manager takes no more work
  im.pending_prefetch.clear();      // nothing left to use them
  if (layout_.world_size() > 1) {
    bool unused = false;
    RETURN_IF_ERROR(AgreeOnMoment(im.moment, 0, /*end=*/true, &unused));
  }
  RETURN_IF_ERROR(states_->FinishBackward());
  if (layout_.world_size() > 1) {
    Status s = FinishReductions(/*wait_all=*/true, /*wait_oldest=*/false);
    if (!s.ok()) im.SetAsyncError(std::move(s));
    if (OnDevice()) {
      s = options_.device_comm->Drain();
      if (!s.ok()) im.SetAsyncError(im.LoseStep(std::move(s)));
    }
  }
  const Impl::Mode mode = im.mode;
  if (mode == Impl::Mode::kRecord) {
    RETURN_IF_ERROR(device_.RecordEvent(im.iteration_end.handle(), compute_));
  }
  RETURN_IF_ERROR(device_.Synchronize());
  // Compute-stream stall: per moment, from reaching its Acquire to passing the waits.
  if (im.moments_timed > 0) {
    double stall = 0;
    for (int k = 0; k < im.moments_timed; ++k) {
      auto t = device_.ElapsedSeconds(im.moment_begin[static_cast<size_t>(k)].handle(),
                                      im.moment_start[static_cast<size_t>(k)].handle());
      if (t.ok()) stall += std::max(0.0, *t);
      if (t.ok() && im.profiling && static_cast<size_t>(k) < im.profile.size())
        im.profile[static_cast<size_t>(k)].stall_s = std::max(0.0, *t);
    }
    counters_.last_stall_seconds = stall;
    counters_.stall_seconds += stall;
    im.moments_timed = 0;
  }
  // Gathered copies do not outlive the iteration: the optimizer changes the shards.
  for (int c = 0; c < layout_.num_chunks(); ++c) RETURN_IF_ERROR(Evict(c));
  RETURN_IF_ERROR(device_.Synchronize());
  for (auto& rt : im.chunks) rt.grad_buf.Reset();  // also after a failed reduction: no stale data
  im.deferred_free.clear();
  std::fill(im.slot_copy_pending.begin(), im.slot_copy_pending.end(), false);
  if (layout_.world_size() > 1) {
    // A failure inside a stream (an NVMe read, a collective on the device) reaches only its
    // rank, but what it left in a gathered chunk reached every rank: all of them fail, out of
    // step (Note [Agreeing on an outcome]).
    Status mine;
    {
      std::lock_guard<std::mutex> lock(im.async_mu);
      mine = im.async_error;
    }
    Status agreed = zero::AgreeOnStatus(*options_.comm, mine);
    if (!agreed.ok()) {
      {
        std::lock_guard<std::mutex> lock(im.async_mu);
        im.async_error = Status::OK();
      }
      im.moment = 0;
      return im.LoseStep(std::move(agreed));
    }
  }
  ++counters_.iterations;
  if (im.profiling) {
    im.profiling = false;
    im.timeline = nullptr;
  }
  if (im.inference) {
    im.inference = false;
    im.moment = 0;
    return Status::OK();
  }
  if (mode == Impl::Mode::kReplay && im.moment != static_cast<int>(trace_.size())) {
    ++counters_.deviations;
    im.record_next = true;  // fewer moments than the trace
  }
  im.moment = 0;
  {
    std::lock_guard<std::mutex> lock(im.async_mu);
    if (!im.async_error.ok()) {
      Status s = std::move(im.async_error);
      im.async_error = Status::OK();
      return s;
    }
  }
  if (mode != Impl::Mode::kRecord) return Status::OK();

  // Plan from the recorded iteration, with the gather times it measured.
  {
    double sum[3] = {0, 0, 0};
    int count[3] = {0, 0, 0};
    for (size_t g = 0; g < im.gathers_timed; ++g) {
      auto t = device_.ElapsedSeconds(im.gather_timing[g].start.handle(),
                                      im.gather_timing[g].end.handle());
      if (!t.ok()) continue;
      const int tier = static_cast<int>(im.gather_timing[g].tier);
      sum[tier] += *t;
      ++count[tier];
    }
    for (int tier = 0; tier < 3; ++tier) {
      if (count[tier] > 0) im.measured_seconds[tier] = sum[tier] / count[tier];
      // W > 1: the all_gather (and NVMe read) the caller did before the H2D copies.
      if (im.caller_gathers[tier] > 0) {
        im.measured_seconds[tier] += im.caller_gather_seconds[tier] / im.caller_gathers[tier];
      }
      im.caller_gather_seconds[tier] = 0;
      im.caller_gathers[tier] = 0;
    }
    im.gathers_timed = 0;
    TZ_LOG(kInfo, kChunk) << "measured gathers: host " << im.measured_seconds[1] * 1e3
                          << " ms, nvme " << im.measured_seconds[2] * 1e3 << " ms per chunk";
  }
  tracer_.Finish();
  std::vector<Moment> moments = tracer_.moments();
  for (size_t k = 0; k < moments.size(); ++k) {
    EventHandle end =
        k + 1 < moments.size() ? im.moment_begin[k + 1].handle() : im.iteration_end.handle();
    auto t = device_.ElapsedSeconds(im.moment_start[k].handle(), end);
    moments[k].compute_seconds = t.ok() ? std::max(0.0, *t) : 0.0;
  }
  if (layout_.world_size() > 1) RETURN_IF_ERROR(AgreeOnPlanInputs(moments));
  PlanOptions po;
  po.device_capacity = options_.device_budget_bytes;
  po.workspace_bytes = options_.workspace_bytes;
  po.chunk_bytes = layout_.chunk_bytes();
  po.gather_seconds = GatherSeconds();
  const size_t nc = static_cast<size_t>(layout_.num_chunks());
  po.grads_in_place.resize(nc);
  po.reduced_at_end.resize(nc);
  po.always_resident.resize(nc);
  po.staged.resize(nc);
  // Note [Prefetches within the staging slots] (plan.cc).
  const bool host_path = layout_.world_size() > 1 && !OnDevice();
  po.staging_slots = im.staging != nullptr ? static_cast<int>(im.staging->num_slots()) : 0;
  if (nvme_ != nullptr && po.staging_slots > 0 && !host_path) {
    // Asynchronous reads beyond the NVMe queue would hold up the caller in the same way (the
    // host path reads synchronously, one at a time).
    po.staging_slots = std::min(po.staging_slots, nvme_->TransfersInFlight(layout_.shard_bytes()));
  }
  for (int c = 0; c < layout_.num_chunks(); ++c) {
    const size_t i = static_cast<size_t>(c);
    po.grads_in_place[i] = !SeparateGrads(c);
    po.always_resident[i] = ShardIsGathered(c);
    po.staged[i] = host_path || placement_.chunks[i].param == Tier::kNvme;
    for (int t : layout_.chunk(c).tensors) {
      if (states_->backward_uses(t) == 0) po.reduced_at_end[i] = true;
    }
  }
  auto schedule = Simulate(moments, po, options_.policy);
  if (!schedule.ok()) return std::move(schedule).status().WithContext("planning after warm-up");
  // The slot region: as many slots as the schedule ever holds (device-resident chunks need none).
  std::set<int> resident;
  size_t most = 0;
  for (const MomentDecision& d : schedule->moments) {
    for (int c : d.evict) resident.erase(c);
    for (int c : d.gather) {
      if (!ShardIsGathered(c)) resident.insert(c);
    }
    most = std::max(most, resident.size());
  }
  im.pool.Reset();
  im.free_slots.clear();
  im.slot_last_use.clear();
  im.slot_done.clear();
  im.slot_copy_out.clear();
  if (most > 0) {
    auto pool = DeviceBuffer::Allocate(device_, most * layout_.chunk_bytes());
    if (!pool.ok()) {
      return std::move(pool).status().WithContext("reserving " + std::to_string(most) +
                                                  " chunk slots for the plan");
    }
    im.pool = std::move(pool).value();
  }
  for (size_t s = 0; s < most; ++s) {
    im.free_slots.push_back(static_cast<int>(most - 1 - s));
    Event a, b;
    ASSIGN_OR_RETURN(a, Event::Create(device_));
    ASSIGN_OR_RETURN(b, Event::Create(device_));
    im.slot_last_use.push_back(EventHandle{});
    im.slot_done.push_back(std::move(a));
    im.slot_copy_out.push_back(std::move(b));
  }
  im.slot_copy_pending.assign(most, false);
  trace_ = std::move(moments);
  schedule_ = std::move(schedule).value();
  has_plan_ = true;
  im.record_next = false;
  ++counters_.plans;
  TZ_LOG(kInfo, kChunk) << "plan (" << CachePolicyName(options_.policy) << "): " << trace_.size()
                        << " moments, " << most << " slots, predicted stall " << schedule_.stall_s
                        << " s";
  return Status::OK();
}

}  // namespace tierzero
