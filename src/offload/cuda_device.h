// CudaDevice: a Device on an NVIDIA GPU.
//
// - Memory: one cudaMalloc slab of the configured capacity reserved at creation, carved by
//   SlabAllocator (no cudaMalloc/cudaFree on the hot path, and fragmentation identical to
//   HostSimDevice).
// - Streams: cudaStreamNonBlocking streams (they do not synchronise with the legacy default
//   stream); events with timing.
// - Kernels: src/kernels (casts, with the rounding of core/convert.h).
// - Host memory: RegisterHostMemory is cudaHostRegister.
//
// A build without CUDA compiles cuda_device_stub.cc instead: CudaDeviceCount() is 0 and
// CreateCudaDevice returns Unavailable, so callers need no #ifdefs.
//
// Thread-safety: as for Device. The device is made current (cudaSetDevice) on every thread that
// calls into it.
#pragma once

#include <memory>

#include "offload/device.h"

namespace tierzero {

struct CudaDeviceOptions {
  // CUDA device ordinal. Default: 0.
  int ordinal = 0;
  // Size of the slab reserved at creation. 0 means all free memory less `headroom_bytes`.
  // Default: 0.
  uint64_t capacity_bytes = 0;
  // Memory left to cuBLAS workspaces, NCCL and the CUDA context when capacity_bytes is 0.
  // Default: 1 GiB.
  uint64_t headroom_bytes = uint64_t{1} << 30;
};

// Number of usable CUDA devices; 0 without a GPU, without a driver, or in a build without CUDA.
int CudaDeviceCount();

// Free memory of CUDA device `ordinal` (cudaMemGetInfo); 0 without that device.
uint64_t CudaFreeBytes(int ordinal);

// Creates a CudaDevice. Unavailable without a GPU (the message says why: no driver, no device,
// built without CUDA); OutOfMemory when the slab cannot be reserved (naming the bytes asked and
// the bytes free).
StatusOr<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions& options);

}  // namespace tierzero
