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

void MemoryTracer::SetComputeSeconds(int moment, double seconds) {
  if (moment >= 0 && moment < static_cast<int>(moments_.size())) {
    moments_[static_cast<size_t>(moment)].compute_seconds = seconds;
  }
}

void MemoryTracer::Finish() {
  if (!moments_.empty()) moments_.back().nonmodel_peak = peak_since_moment_;
}

uint64_t MemoryTracer::SequenceHash() const {
  // FNV-1a over (moment separator, chunk ids).
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xFF;
      h *= 1099511628211ull;
    }
  };
  for (const Moment& m : moments_) {
    mix(m.backward ? ~1ull : ~0ull);
    for (int c : m.chunks) mix(static_cast<uint64_t>(c));
  }
  return h;
}

}  // namespace tierzero
