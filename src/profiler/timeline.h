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

#include "core/mutex.h"
#include "profiler/observer.h"

namespace tierzero {

class Timeline final : public Observer {
 public:
  void Begin() {
    MutexLock lock(mu_);
    t0_ = std::chrono::steady_clock::now();
    events_.clear();
  }
  double Now() const override {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  void Add(TimelineEvent e) {
    MutexLock lock(mu_);
    events_.push_back(std::move(e));
  }
  void OnSpan(TimelineEvent e) override { Add(std::move(e)); }
  std::vector<TimelineEvent> events() const {
    MutexLock lock(mu_);
    return events_;
  }

 private:
  mutable Mutex mu_;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  std::vector<TimelineEvent> events_ TZ_GUARDED_BY(mu_);
};

}  // namespace tierzero
