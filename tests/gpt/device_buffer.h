// A device buffer for the GPU tests (cudaMalloc'd, freed on scope exit): filled from the host or
// zeroed, read back after the device finishes. Failures are test failures (EXPECT).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace tierzero::testing_cuda {

template <typename T>
class DeviceBuffer {
 public:
  // n elements, copied from h (n of them) or zeroed.
  explicit DeviceBuffer(size_t n, const T* h = nullptr) : n_(n) {
    EXPECT_EQ(cudaMalloc(&p_, sizeof(T) * std::max<size_t>(1, n)), cudaSuccess);
    if (h != nullptr)
      EXPECT_EQ(cudaMemcpy(p_, h, sizeof(T) * n, cudaMemcpyHostToDevice), cudaSuccess);
    else
      EXPECT_EQ(cudaMemset(p_, 0, sizeof(T) * n), cudaSuccess);
  }
  explicit DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size(), h.data()) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(p_); }
  T* get() const { return p_; }
  // The contents, after everything enqueued on the device.
  std::vector<T> Get() const {
    std::vector<T> h(n_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(h.data(), p_, sizeof(T) * n_, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

}  // namespace tierzero::testing_cuda
