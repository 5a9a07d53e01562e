// HostSimDevice: a Device whose "device memory" is host memory with a hard capacity, so the
// whole engine runs, and its placement decisions can be studied, on a machine without a GPU.
//
// - Memory: one slab of `capacity_bytes`, reserved with mmap (pages are touched, and count in
//   RSS, only when used), carved by SlabAllocator exactly as CudaDevice carves its cudaMalloc
//   slab.
// - Streams: each stream is a worker thread that executes its queue in order. Events order
//   streams as on CUDA. Kernels (CastAsync) run on the stream's thread with the CPU SIMD code.
// - Throttling: with a bandwidth set for a direction, every copy in that direction occupies a
//   shared link for bytes / bandwidth seconds (copies on different streams queue for the link,
//   as they would for one PCIe direction), so transfer time is what a GPU would show.
// - Pointer checks: device-side pointers of copies and kernels must lie inside the slab; a
//   violation is InvalidArgument, which catches engine bugs a GPU would report as a fault.
//
// Thread-safety: as for Device, with two limits of this simulation: Synchronize() must not run
// concurrently with DestroyStream() of a stream it is draining, and an event recorded on two
// streams at once completes when the later record does (CUDA tracks only the latest record;
// tierzero records each event on one stream at a time).
#pragma once

#include <memory>
#include <string>

#include "offload/device.h"

namespace tierzero {

struct HostSimOptions {
  // Device memory capacity. Default: 1 GiB. Rounded up to kDeviceAlignment.
  uint64_t capacity_bytes = uint64_t{1} << 30;
  // Link bandwidths in bytes/s; 0 means unthrottled (memcpy speed). Default: 0.
  double h2d_bytes_per_second = 0;
  double d2h_bytes_per_second = 0;
  double d2d_bytes_per_second = 0;
  // Name shown in logs and reports. Default: "hostsim".
  std::string name = "hostsim";
  // Fault the whole slab in at creation, as real device memory is always resident, so that no
  // first write pays for page faults (a 2 MiB first memset costs ~1.5 ms here). For benchmarks;
  // by default the slab is reserved and faulted in lazily. Default: false.
  bool populate = false;
  // When > 0, a stream waiting on another stream's event polls for it, napping from 2 us up to
  // this many microseconds (at most 1000) between looks, and the recording stream wakes nobody: on
  // a GPU, a stream's signal costs that stream nothing (Note [Stream waits that cost the signaller
  // nothing]). For benchmarks; 0 (the default) wakes stream waiters with a condition variable.
  double poll_stream_waits_us = 0;
};

// Creates a HostSimDevice. InvalidArgument for a zero capacity, a negative bandwidth, or a poll
// cap outside [0, 1000] us;
// OutOfMemory when the address space for the slab cannot be reserved.
StatusOr<std::unique_ptr<Device>> CreateHostSimDevice(const HostSimOptions& options);

}  // namespace tierzero
