// The compute gate (compute_gate.h; Note [Host compute on the simulated device]).
#include "offload/compute_gate.h"

#include "core/mutex.h"

namespace tierzero {

struct ComputeGate::State {
  Mutex mu;
  CondVar cv;
  bool entered TZ_GUARDED_BY(mu) = false;
  bool opened TZ_GUARDED_BY(mu) = false;
};

void ComputeGate::Open() {
  if (!pending_) return;
  {
    MutexLock lock(pending_->mu);
    pending_->opened = true;
  }
  pending_->cv.NotifyAll();
  pending_.reset();
}

Status ComputeGate::Close(bool wait_reached) {
  Open();  // at most one gate is closed at a time
  auto g = std::make_shared<State>();
  RETURN_IF_ERROR(device_.LaunchHostFunc(stream_, [g] {
    MutexLock lock(g->mu);
    g->entered = true;
    g->cv.NotifyAll();
    g->cv.Wait(lock, [&]() TZ_REQUIRES(g->mu) { return g->opened; });
  }));
  pending_ = g;
  if (wait_reached) {
    MutexLock lock(g->mu);
    g->cv.Wait(lock, [&]() TZ_REQUIRES(g->mu) { return g->entered; });
  }
  return Status::OK();
}

}  // namespace tierzero
