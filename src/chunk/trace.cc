#include "chunk/trace.h"

#include <algorithm>

namespace tierzero {

void MemoryTracer::Begin(uint64_t current_nonmodel) {
  moments_.clear();
  current_ = peak_since_moment_ = current_nonmodel;
}

void MemoryTracer::OnNonModelBytes(uint64_t current) {
  current_ = current;
  peak_since_moment_ = std::max(peak_since_moment_, current);
}

int MemoryTracer::BeginMoment(std::vector<int> chunks, bool backward) {
  if (!moments_.empty()) moments_.back().nonmodel_peak = peak_since_moment_;
  Moment m;
  m.chunks = std::move(chunks);
  m.nonmodel_bytes = current_;
  m.backward = backward;
  peak_since_moment_ = current_;
  moments_.push_back(std::move(m));
  return static_cast<int>(moments_.size()) - 1;
}

void MemoryTracer::SetHeld(std::vector<int> held) {
  if (!moments_.empty()) moments_.back().held = std::move(held);
}

void MemoryTracer::PopMoment() {
  if (!moments_.empty()) moments_.pop_back();
}

void MemoryTracer::Finish() {
  if (!moments_.empty()) moments_.back().nonmodel_peak = peak_since_moment_;
}

}  // namespace tierzero
