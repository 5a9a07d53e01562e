// TransferContext: what the chunk manager and its gather and reduce strategies (zero/gather.h,
// zero/reduce.h) share: the device and its copy streams, this rank's shard store, the rank
// agreement, the transfer counters, the profiled iteration's observer and the gather timer of
// a recording iteration. The chunk manager owns it and drives the moments; a strategy moves
// bytes.
//
// Thread-safety: the trainer's thread uses the context; the spans' host functions run on stream
// threads and touch only the observer (which allows that).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/rank_agreement.h"
#include "core/status.h"
#include "offload/device.h"
#include "profiler/observer.h"
#include "shard/shard_store.h"
#include "tierzero/communicator.h"

namespace tierzero {

// WireBytes (tierzero/communicator.h) that a strategy adds its collectives to.
struct WireCounters : WireBytes {
  void Add(uint64_t unquantized, uint64_t sent, uint64_t cross_node) {
    ++collectives;
    bytes_unquantized += unquantized;
    bytes_sent += sent;
    bytes_cross_node += cross_node;
  }
};

struct TransferCounters {
  uint64_t h2d_bytes = 0, d2h_bytes = 0, nvme_read_bytes = 0;
  uint64_t all_gathers = 0, reduce_scatters = 0;
  // W > 1: seconds the caller spent in gathers' all_gathers and waiting for reduce-scatters.
  double comm_seconds = 0;
  // W > 1: a chunk's first gather of an iteration (forward), its later ones (backward and
  // recomputation), and the gradients' reductions.
  WireCounters param_gather, param_regather, grad_reduce;
};

// The spans of a profiled iteration's transfers. A transfer queued on a stream is bracketed by
// two host functions on that stream (QueueStart, QueueSpan), so its span is when the stream
// really worked on it; the start time passes between them through a shared double.
class TransferSpans {
 public:
  // Reports to `observer` from now on (null: stops).
  void Observe(Observer* observer) { observer_ = observer; }
  bool on() const { return observer_ != nullptr; }
  Observer* observer() const { return observer_; }
  // Where a span's start time goes between QueueStart and QueueSpan: null when not observing
  // (every use of it is behind the same check), so an unprofiled transfer allocates nothing.
  std::shared_ptr<double> Start(double now = 0) const {
    return on() ? std::make_shared<double>(now) : nullptr;
  }
  Status QueueStart(Device& device, StreamHandle stream, const std::shared_ptr<double>& start);
  // Reports the span when `stream` reaches it; `moment` is the moment it was issued at; `lane`
  // as TimelineEvent's (1 for a stream's work that does not cross its link).
  Status QueueSpan(Device& device, StreamHandle stream, Track track, std::string name, int moment,
                   int chunk, uint64_t bytes, const std::shared_ptr<double>& start, int lane = 0);

 private:
  Observer* observer_ = nullptr;
};

// A recording iteration times every gather on the stream that completes it, per tier, for the
// plan; with W > 1 over host buffers the caller's own part (the all_gather) is added.
class GatherTimer {
 public:
  struct Timing {
    Event start, end;
    Tier tier = Tier::kHost;
  };
  void set_recording(bool on) { recording_ = on; }
  bool recording() const { return recording_; }
  // The next timing, its start recorded on `stream`; null when not recording.
  StatusOr<Timing*> Start(Device& device, StreamHandle stream, Tier tier);
  // The caller spent `seconds` before the device part of a gather from `tier` (recording only).
  void AddCallerSeconds(Tier tier, double seconds);
  // The mean gather time per tier of this iteration's timings into measured[tier] (tiers
  // without a gather keep theirs), and starts over.
  void Finish(Device& device, double measured[kNumTiers]);

 private:
  bool recording_ = false;
  std::vector<Timing> timing_;
  size_t used_ = 0;
  double caller_seconds_[kNumTiers] = {0, 0, 0};
  int caller_gathers_[kNumTiers] = {0, 0, 0};
};

struct TransferContext {
  TransferContext(Device& d, StreamHandle c, ShardStore& s, RankAgreement& r)
      : device(d), compute(c), store(s), ranks(r) {}
  // Creates the H2D and D2H streams.
  Status Init();

  Device& device;
  StreamHandle compute;
  ShardStore& store;
  RankAgreement& ranks;
  Stream h2d, d2h;
  // Moments begun in this iteration: transfers issued now belong to moment - 1.
  int moment = 0;
  // Per chunk: gathered earlier in this iteration (cleared when one begins).
  std::vector<uint8_t> gathered;
  // The world's topology (W > 1), for the bytes that cross nodes.
  Topology topology;
  // The counters of a gather of chunk c now: param_gather for its first of the iteration, else
  // param_regather.
  WireCounters& GatherWire(int c) {
    return FirstGather(c) ? counters.param_gather : counters.param_regather;
  }
  // Marks chunk c gathered; whether this is its first gather of the iteration.
  bool FirstGather(int c) {
    if (gathered.size() < static_cast<size_t>(geometry().num_chunks))
      gathered.assign(static_cast<size_t>(geometry().num_chunks), 0);
    const bool first = gathered[static_cast<size_t>(c)] == 0;
    gathered[static_cast<size_t>(c)] = 1;
    return first;
  }
  TransferCounters counters;
  TransferSpans spans;
  GatherTimer timer;
  // Set by the chunk manager around the reduction of a separate gradient chunk: recorded on the
  // D2H stream right after the last operation that reads the chunk, before any host function
  // queued behind it (Note [A gradient chunk's memory outlives only its reads]).
  Event* grad_source_read = nullptr;
  bool grad_source_recorded = false;
  // Records grad_source_read on the D2H stream, when set.
  Status MarkGradSourceRead();

  const ShardGeometry& geometry() const { return store.geometry(); }
};

}  // namespace tierzero
