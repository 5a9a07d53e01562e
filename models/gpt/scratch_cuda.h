// Device scratch that grows as needed (stream-ordered allocations), kept between calls: the bf16
// backend's column partials, sums and groups, and attention's row sums. Included only by files
// built with the CUDA runtime's headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "tierzero/status.h"

namespace tierzero::gpt::cuda {

template <typename T>
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (p_ != nullptr) cudaFreeAsync(p_, stream_);
  }
  // At least n elements on `stream`; null with *err set (when it held no error) when the device
  // has no room.
  T* Get(int64_t n, cudaStream_t stream, Status* err) {
    stream_ = stream;
    if (n > have_) {
      if (p_ != nullptr) cudaFreeAsync(p_, stream);
      p_ = nullptr;
      have_ = 0;
      if (const cudaError_t e =
              cudaMallocAsync(reinterpret_cast<void**>(&p_), sizeof(T) * n, stream);
          e != cudaSuccess) {
        cudaGetLastError();
        p_ = nullptr;
        if (err->ok())
          *err = OutOfMemoryError("GPT op scratch (" + std::to_string(sizeof(T) * n) +
                                  " bytes of device memory): " + cudaGetErrorString(e));
        return nullptr;
      }
      have_ = n;
    }
    return p_;
  }

 private:
  T* p_ = nullptr;
  int64_t have_ = 0;
  cudaStream_t stream_ = nullptr;
};

}  // namespace tierzero::gpt::cuda
