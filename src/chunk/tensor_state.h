// Tensor and chunk states over one iteration (DESIGN.md section 4), and the checks that turn API
// misuse into a Status.
//
//   FREE            no payload (before Finalize)
//   HOLD            payload present, not used yet this iteration
//   COMPUTE         acquired by at least one live scope
//   HOLD_AFTER_FWD  released after forward (or after a backward use while more are due)
//   HOLD_AFTER_BWD  every backward use done: its gradient is final for this iteration
//
// Shared parameters are counted: a tensor used twice in forward reaches HOLD_AFTER_BWD only
// after its second backward release. Recomputation (activation checkpointing) acquires with
// Phase::kRecompute, which counts as neither. A chunk is evictable when none of its tensors is in
// COMPUTE, and backward-complete when all of its tensors are HOLD_AFTER_BWD; the tracker reports
// the latter once per iteration so the gradient can be reduced right away.
//
// Thread-safety: none; the chunk manager serialises calls.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "chunk/layout.h"
#include "core/status.h"
#include "tierzero/types.h"

namespace tierzero {

enum class TensorState : uint8_t { kFree, kHold, kCompute, kHoldAfterFwd, kHoldAfterBwd };

std::string_view TensorStateName(TensorState s);
std::string_view PhaseName(Phase p);

class StateTracker {
 public:
  // `on_chunk_grads_ready(chunk)` runs when a chunk becomes backward-complete.
  StateTracker(const ChunkLayout& layout, std::function<void(int chunk)> on_chunk_grads_ready);

  // FREE -> HOLD for every tensor (payload allocated).
  void MarkAllocated();
  // Starts an iteration: every tensor back to HOLD, use counts cleared.
  // FailedPrecondition if a tensor is still in COMPUTE (a scope outlived the iteration).
  Status BeginIteration();

  // Checks and applies an acquire/release of `tensors` in `phase`. On error nothing changes.
  // A tensor may appear once per call (InvalidArgument otherwise).
  Status Acquire(std::span<const int> tensors, Phase phase);
  Status Release(std::span<const int> tensors, Phase phase);
  // Exactly undoes the last successful Acquire of `tensors` in `phase` (the caller failed to
  // gather): states, use counts and chunk counters as before; no callback runs.
  void Unacquire(std::span<const int> tensors, Phase phase);

  // Ends backward: chunks with tensors that had no backward use (unused parameters) are reported
  // backward-complete now, in chunk order. FailedPrecondition if anything is in COMPUTE.
  Status FinishBackward();

  TensorState state(int tensor) const { return tensors_[static_cast<size_t>(tensor)].state; }
  int forward_uses(int tensor) const { return tensors_[static_cast<size_t>(tensor)].fwd_uses; }
  int backward_uses(int tensor) const { return tensors_[static_cast<size_t>(tensor)].bwd_uses; }
  bool ChunkEvictable(int chunk) const { return chunk_compute_[static_cast<size_t>(chunk)] == 0; }
  bool ChunkGradsReady(int chunk) const { return chunk_reduced_[static_cast<size_t>(chunk)]; }
  // True once any tensor of the chunk has been acquired for backward this iteration.
  bool ChunkBackwardStarted(int chunk) const {
    return chunk_bwd_started_[static_cast<size_t>(chunk)] > 0;
  }

 private:
  struct Tensor {
    TensorState state = TensorState::kFree;
    int fwd_uses = 0;
    int bwd_uses = 0;
    int live_scopes = 0;  // nesting of Acquire without Release
    Phase compute_phase = Phase::kForward;
    TensorState before_compute = TensorState::kHold;  // restored by Unacquire and recompute
  };
  Status CheckAcquire(int t, Phase phase) const;
  Status CheckRelease(int t, Phase phase) const;
  void MaybeChunkReady(int chunk);

  const ChunkLayout& layout_;
  std::function<void(int)> on_ready_;
  std::vector<Tensor> tensors_;
  std::vector<int> chunk_compute_;      // tensors of the chunk in COMPUTE
  std::vector<int> chunk_bwd_done_;     // tensors of the chunk in HOLD_AFTER_BWD
  std::vector<bool> chunk_reduced_;     // reported this iteration
  std::vector<int> chunk_bwd_started_;  // tensors of the chunk with a backward use
};

}  // namespace tierzero
