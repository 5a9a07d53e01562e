// Device copies of host vectors for the CUDA tests (which skip without a GPU): failures are test
// failures, and the caller frees what Upload returns with cudaFree.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
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

// Under compute-sanitizer (the device script sets TZ_UNDER_SANITIZER=1) the largest sizes are
// left out: racecheck's instrumentation made one megabyte-sized case outlast the call's budget
// (session 37). The smaller sizes still span several blocks and a ragged tail.
inline bool UnderSanitizer() {
  const char* v = std::getenv("TZ_UNDER_SANITIZER");
  return v != nullptr && *v != '\0' && *v != '0';
}

}  // namespace tierzero::testing_cuda
