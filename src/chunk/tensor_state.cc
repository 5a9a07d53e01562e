#include "chunk/tensor_state.h"

#include <string>

#include "core/check.h"

namespace tierzero {

std::string_view TensorStateName(TensorState s) {
  switch (s) {
    case TensorState::kFree:
      return "FREE";
    case TensorState::kHold:
      return "HOLD";
    case TensorState::kCompute:
      return "COMPUTE";
    case TensorState::kHoldAfterFwd:
      return "HOLD_AFTER_FWD";
    case TensorState::kHoldAfterBwd:
      return "HOLD_AFTER_BWD";
  }
  return "?";
}

std::string_view PhaseName(Phase p) {
  switch (p) {
    case Phase::kForward:
      return "forward";
    case Phase::kBackward:
      return "backward";
    case Phase::kRecompute:
      return "recompute";
  }
  return "?";
}

StateTracker::StateTracker(const ChunkLayout& layout, std::function<void(int)> on_ready)
    : layout_(layout),
      on_ready_(std::move(on_ready)),
      tensors_(static_cast<size_t>(layout.num_tensors())),
      chunk_compute_(static_cast<size_t>(layout.num_chunks()), 0),
      chunk_bwd_done_(static_cast<size_t>(layout.num_chunks()), 0),
      chunk_reduced_(static_cast<size_t>(layout.num_chunks()), false),
      chunk_bwd_started_(static_cast<size_t>(layout.num_chunks()), 0) {}

void StateTracker::MarkAllocated() {
  for (Tensor& t : tensors_) {
    if (t.state == TensorState::kFree) t.state = TensorState::kHold;
  }
}

Status StateTracker::BeginIteration() {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].state == TensorState::kCompute) {
      return FailedPreconditionError("tensor '" + layout_.tensor_name(static_cast<int>(i)) +
                                     "' is still acquired at the start of an iteration; release "
                                     "every scope before Step()");
    }
  }
  for (Tensor& t : tensors_) {
    if (t.state != TensorState::kFree) t.state = TensorState::kHold;
    t.fwd_uses = t.bwd_uses = t.live_scopes = 0;
  }
  std::fill(chunk_compute_.begin(), chunk_compute_.end(), 0);
  std::fill(chunk_bwd_done_.begin(), chunk_bwd_done_.end(), 0);
  std::fill(chunk_reduced_.begin(), chunk_reduced_.end(), false);
  std::fill(chunk_bwd_started_.begin(), chunk_bwd_started_.end(), 0);
  return Status::OK();
}

Status StateTracker::CheckAcquire(int t, Phase phase) const {
  if (t < 0 || t >= layout_.num_tensors()) {
    return InvalidArgumentError("acquire of unknown tensor id " + std::to_string(t));
  }
  const Tensor& x = tensors_[static_cast<size_t>(t)];
  const std::string& name = layout_.tensor_name(t);
  auto bad = [&](const std::string& why) {
    return FailedPreconditionError("cannot acquire '" + name + "' for " +
                                   std::string(PhaseName(phase)) + ": " + why);
  };
  if (x.state == TensorState::kFree) return bad("the engine is not finalized");
  if (x.state == TensorState::kCompute && x.compute_phase != phase) {
    return bad("it is already acquired for " + std::string(PhaseName(x.compute_phase)));
  }
  if (phase == Phase::kForward && x.state == TensorState::kHoldAfterBwd) {
    return bad("its backward is already complete this iteration (call Step() first)");
  }
  if (phase == Phase::kBackward) {
    if (x.fwd_uses == 0) return bad("it was not used in this iteration's forward");
    if (x.bwd_uses >= x.fwd_uses && x.state != TensorState::kCompute) {
      return bad("it has had as many backward uses (" + std::to_string(x.bwd_uses) +
                 ") as forward uses");
    }
  }
  return Status::OK();
}

Status StateTracker::CheckRelease(int t, Phase phase) const {
  if (t < 0 || t >= layout_.num_tensors()) {
    return InvalidArgumentError("release of unknown tensor id " + std::to_string(t));
  }
  const Tensor& x = tensors_[static_cast<size_t>(t)];
  if (x.state != TensorState::kCompute) {
    return FailedPreconditionError("cannot release '" + layout_.tensor_name(t) +
                                   "': it is not acquired (state " +
                                   std::string(TensorStateName(x.state)) + ")");
  }
  if (x.compute_phase != phase) {
    return FailedPreconditionError("cannot release '" + layout_.tensor_name(t) + "' for " +
                                   std::string(PhaseName(phase)) + ": it was acquired for " +
                                   std::string(PhaseName(x.compute_phase)));
  }
  return Status::OK();
}

namespace {
Status CheckDistinct(std::span<const int> tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    for (size_t j = i + 1; j < tensors.size(); ++j) {
      if (tensors[i] == tensors[j]) {
        return InvalidArgumentError("tensor id " + std::to_string(tensors[i]) +
                                    " is listed twice in one acquire/release");
      }
    }
  }
  return Status::OK();
}
}  // namespace

Status StateTracker::Acquire(std::span<const int> tensors, Phase phase) {
  RETURN_IF_ERROR(CheckDistinct(tensors));
  for (int t : tensors) RETURN_IF_ERROR(CheckAcquire(t, phase));
  for (int t : tensors) {
    Tensor& x = tensors_[static_cast<size_t>(t)];
    if (x.live_scopes++ == 0) {
      ++chunk_compute_[static_cast<size_t>(layout_.tensor(t).chunk)];
      x.before_compute = x.state;
      x.state = TensorState::kCompute;
      x.compute_phase = phase;
    }
    if (phase == Phase::kForward) ++x.fwd_uses;
    if (phase == Phase::kBackward && x.bwd_uses++ == 0) {
      ++chunk_bwd_started_[static_cast<size_t>(layout_.tensor(t).chunk)];
    }
  }
  return Status::OK();
}

void StateTracker::Unacquire(std::span<const int> tensors, Phase phase) {
  for (int t : tensors) {
    Tensor& x = tensors_[static_cast<size_t>(t)];
    TZ_CHECK(x.state == TensorState::kCompute && x.live_scopes > 0) << layout_.tensor_name(t);
    const size_t chunk = static_cast<size_t>(layout_.tensor(t).chunk);
    if (phase == Phase::kForward) --x.fwd_uses;
    if (phase == Phase::kBackward && --x.bwd_uses == 0) --chunk_bwd_started_[chunk];
    if (--x.live_scopes == 0) {
      --chunk_compute_[chunk];
      x.state = x.before_compute;
    }
  }
}

Status StateTracker::Release(std::span<const int> tensors, Phase phase) {
  RETURN_IF_ERROR(CheckDistinct(tensors));
  for (int t : tensors) RETURN_IF_ERROR(CheckRelease(t, phase));
  for (int t : tensors) {
    Tensor& x = tensors_[static_cast<size_t>(t)];
    TZ_CHECK(x.live_scopes > 0) << layout_.tensor_name(t);
    if (--x.live_scopes > 0) continue;
    const int chunk = layout_.tensor(t).chunk;
    --chunk_compute_[static_cast<size_t>(chunk)];
    if (phase == Phase::kRecompute) {
      // Recomputation changes nothing about the tensor's progress through the iteration.
      x.state = x.before_compute;
      continue;
    }
    if (phase == Phase::kBackward && x.bwd_uses >= x.fwd_uses) {
      x.state = TensorState::kHoldAfterBwd;
      ++chunk_bwd_done_[static_cast<size_t>(chunk)];
      MaybeChunkReady(chunk);
    } else {
      x.state = TensorState::kHoldAfterFwd;
    }
  }
  return Status::OK();
}

void StateTracker::MaybeChunkReady(int chunk) {
  const size_t c = static_cast<size_t>(chunk);
  if (chunk_reduced_[c]) return;
  if (chunk_bwd_done_[c] >= static_cast<int>(layout_.chunk(chunk).tensors.size())) {
    chunk_reduced_[c] = true;
    if (on_ready_) on_ready_(chunk);
  }
}

Status StateTracker::FinishBackward() {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].state == TensorState::kCompute) {
      return FailedPreconditionError("tensor '" + layout_.tensor_name(static_cast<int>(i)) +
                                     "' is still acquired at the end of backward");
    }
  }
  for (int c = 0; c < layout_.num_chunks(); ++c) {
    if (chunk_reduced_[static_cast<size_t>(c)]) continue;
    for (int t : layout_.chunk(c).tensors) {
      Tensor& x = tensors_[static_cast<size_t>(t)];
      if (x.state != TensorState::kHoldAfterBwd) {
        x.state = TensorState::kHoldAfterBwd;
        ++chunk_bwd_done_[static_cast<size_t>(c)];
      }
    }
    MaybeChunkReady(c);
  }
  return Status::OK();
}

}  // namespace tierzero
