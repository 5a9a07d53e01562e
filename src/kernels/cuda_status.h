// CUDA runtime errors as Status, for the CUDA translation units of every module (include only
// where cuda_runtime.h is available).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "tierzero/status.h"

namespace tierzero {

// Turns a cudaError_t into a Status naming the call and the site (NCCLCHECK-style):
// OutOfMemory for an allocation failure, Unavailable for no device or driver, Internal otherwise.
// Clears the thread's last error, so a handled, non-sticky error does not resurface later.
inline Status CudaStatus(cudaError_t err, const std::string& call, const char* file, int line) {
  const StatusCode code = err == cudaErrorMemoryAllocation ? StatusCode::kOutOfMemory
                          : err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver
                              ? StatusCode::kUnavailable
                              : StatusCode::kInternal;
  Status s(code, call + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  (void)cudaGetLastError();
  s.AddFrame(file, line);
  return s;
}

}  // namespace tierzero

#define CUDA_RETURN_IF_ERROR(call)                                            \
  do {                                                                        \
    cudaError_t tz_cuda_err_ = (call);                                        \
    if (tz_cuda_err_ != cudaSuccess) {                                        \
      return ::tierzero::CudaStatus(tz_cuda_err_, #call, __FILE__, __LINE__); \
    }                                                                         \
  } while (0)
