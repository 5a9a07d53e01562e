// Device copies of host vectors for the CUDA tests (which skip without a GPU): failures are test
// failures, and the caller frees what Upload returns with cudaFree.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace tierzero::testing_cuda {

template <typename T>
T* Upload(const std::vector<T>& h) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, sizeof(T) * std::max<size_t>(1, h.size())), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

template <typename T>
std::vector<T> Download(const T* d, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, sizeof(T) * n, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

}  // namespace tierzero::testing_cuda
