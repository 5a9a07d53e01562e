// MemoryTracer: records the warm-up iteration's access pattern, the trace the plan consumes
// (chunk/plan.h; DESIGN.md section 5).
//
// A moment is one Acquire. For each moment the tracer keeps the chunks it needs, the non-model
// (activation) bytes when it began, the peak of non-model bytes until the next moment began, and
// the compute time the caller measured for it. Non-model bytes come from the engine's tracked
// activation allocator, which reports every change through OnNonModelBytes, so the peak is exact
// (no sampling or polling).
//
// Thread-safety: none; the engine serialises calls.
#pragma once

#include <cstdint>
#include <vector>

namespace tierzero {

struct Moment {
  std::vector<int> chunks;      // chunks the moment needs, in the order acquired
  uint64_t nonmodel_bytes = 0;  // non-model bytes in use when the moment began
  uint64_t nonmodel_peak = 0;   // the most in use between this moment and the next
  double compute_seconds = 0;   // the moment's compute time as measured by the caller
  bool backward = false;        // acquired for backward (gradients are written)
  std::vector<int> held;        // other chunks still acquired by outer scopes (not evictable)
};

class MemoryTracer {
 public:
  // Clears the trace; `current_nonmodel` is what is in use now.
  void Begin(uint64_t current_nonmodel = 0);
  // Every change of non-model bytes in use.
  void OnNonModelBytes(uint64_t current);
  // A moment begins; returns its index.
  int BeginMoment(std::vector<int> chunks, bool backward = false);
  // Records chunks held by outer scopes during the last moment.
  void SetHeld(std::vector<int> held);
  // Drops the last moment (its Acquire failed).
  void PopMoment();
  // Closes the trace (the last moment's peak).
  void Finish();

  const std::vector<Moment>& moments() const { return moments_; }
  uint64_t current_nonmodel() const { return current_; }

 private:
  std::vector<Moment> moments_;
  uint64_t current_ = 0;
  uint64_t peak_since_moment_ = 0;
};

}  // namespace tierzero
