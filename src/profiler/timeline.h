// Timeline: the events of one profiled iteration, for the report's step-time breakdown and the
// Chrome trace (docs/report.md). Times are seconds on the host's steady clock since Begin().
//
// Events come from the caller's thread (compute spans, the optimizer) and from stream threads
// (host functions queued on the copy streams around each transfer, which run when the stream
// reaches them, so a transfer's span is when the stream really worked on it), hence the lock.
//
// Thread-safety: Add and Now from any thread; Begin and events() from the owner's thread while
// no events are being added.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace tierzero {

// The tracks of the Chrome trace, one per stream; the optimizer's also has one lane per CPU Adam
// worker thread.
enum class Track : uint8_t { kCompute, kH2D, kD2H, kNvmeRead, kNvmeWrite, kOptimizer, kComm };
const char* TrackName(Track t);
inline constexpr int kNumTracks = static_cast<int>(Track::kComm) + 1;  // kComm is the last

struct TimelineEvent {
  Track track = Track::kCompute;
  std::string name;
  double start_s = 0, dur_s = 0;
  int moment = -1;     // the moment it belongs to (compute) or was issued at (transfers)
  int chunk = -1;      // the chunk moved or updated
  uint64_t bytes = 0;  // bytes moved
  int lane = 0;        // a sub-row of the track: CPU Adam's worker threads are lanes 1..N
};

class Timeline {
 public:
  void Begin() {
    std::lock_guard<std::mutex> lock(mu_);
    t0_ = std::chrono::steady_clock::now();
    events_.clear();
  }
  double Now() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  void Add(TimelineEvent e) {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(e));
  }
  std::vector<TimelineEvent> events() const {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }

 private:
  mutable std::mutex mu_;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  std::vector<TimelineEvent> events_;
};

}  // namespace tierzero
