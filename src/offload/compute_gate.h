// The compute gate of a device whose trainer computes on the host (DeviceCaps::host_compute):
// the span of the trainer's own compute marked on a stream, so that the stream's events time it.
//
// Note [Host compute on the simulated device]
// On HostSim the trainer computes on the CPU, on its own thread, so the compute stream has
// nothing queued and its events would say every moment took no time: the plan would be made
// blind, and stalls measured on the stream would be the gathers' whole duration. Instead, after
// each Acquire and Release the engine closes the gate: a host function queued on the compute
// stream that blocks until the trainer's next call into the engine opens it. The stream then is
// busy exactly while the trainer computes, so the chunk manager's events time each moment's
// compute and each moment's wait as they would on a GPU, and prefetches are issued against real
// compute times. Acquire returns once the stream has reached its gate, i.e. once its gathers are
// complete. The gate is opened before every call into the chunk manager (which may synchronise on
// the stream). A device without the capability needs no gate: its stream runs the compute.
//
// Thread-safety: one thread (the trainer's) calls Close and Open; the stream's host function
// waits on the gate's own state.
#pragma once

#include <memory>

#include "core/status.h"
#include "offload/device.h"

namespace tierzero {

class ComputeGate {
 public:
  // `device` and `stream` outlive the gate.
  ComputeGate(Device& device, StreamHandle stream) : device_(device), stream_(stream) {}
  ~ComputeGate() { Open(); }
  ComputeGate(const ComputeGate&) = delete;
  ComputeGate& operator=(const ComputeGate&) = delete;

  // Queues a closed gate on the stream (the trainer computes from here); with `wait_reached`,
  // returns once the stream has reached it (its earlier work, the gathers, is done).
  Status Close(bool wait_reached);
  // Opens the last gate closed, if any: the trainer calls into the engine again.
  void Open();

 private:
  struct State;
  Device& device_;
  StreamHandle stream_;
  std::shared_ptr<State> pending_;
};

}  // namespace tierzero
