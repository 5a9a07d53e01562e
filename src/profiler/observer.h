// Observer: what the transfer paths (the chunk manager's gathers and reductions) and the
// optimizer report while a profiled iteration runs, so that they hold no timeline of their own.
// The report's Timeline (profiler/timeline.h) is the observer the engine gives them; a trainer
// or a test may give its own.
//
// Thread-safety: Now and OnSpan are called from any thread (stream host functions, CPU Adam's
// worker threads); an implementation must allow that.
#pragma once

#include <cstdint>
#include <string>

namespace tierzero {

// The tracks of the Chrome trace, one per stream; the optimizer's also has one lane per CPU Adam
// worker thread.
enum class Track : uint8_t { kCompute, kH2D, kD2H, kNvmeRead, kNvmeWrite, kOptimizer, kComm };
const char* TrackName(Track t);
inline constexpr int kNumTracks = static_cast<int>(Track::kComm) + 1;  // kComm is the last

// The optimizer track's span of the update phase's rate probe (its first step: Note [Measuring
// the update phase's rates]); the report keeps it out of the NVMe waits.
inline constexpr const char* kRateProbeSpan = "measuring the update's rates";

struct TimelineEvent {
  Track track = Track::kCompute;
  std::string name;
  double start_s = 0, dur_s = 0;
  int moment = -1;     // the moment it belongs to (compute) or was issued at (transfers)
  int chunk = -1;      // the chunk moved or updated
  uint64_t bytes = 0;  // bytes moved
  int lane = 0;        // a sub-row of the track: CPU Adam's worker threads are lanes 1..N;
                       // the D2H stream's work on the device (a gradient kept there) lane 1
                       // (lane 0 alone is the link's: its bytes and busy time)
};

class Observer {
 public:
  virtual ~Observer() = default;
  // Seconds on the observer's clock (spans are given in it).
  virtual double Now() const = 0;
  // A span of work: a transfer, a collective, a moment's compute, an optimizer chunk.
  virtual void OnSpan(TimelineEvent e) = 0;
};

}  // namespace tierzero
