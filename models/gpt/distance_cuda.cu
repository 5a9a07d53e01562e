// gpt/distance_cuda.h: one pass over both matrices, each thread's sums in double, reduced over
// the warp and added by one lane per warp.
#include <algorithm>

#include "gpt/distance_cuda.h"

namespace tierzero::gpt::cuda {
namespace {

__device__ inline float Widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline float Widen(float x) { return x; }

template <typename T>
__global__ void SquaredDistanceKernel(const T* a, int64_t lda, const T* b, int64_t ldb,
                                      int64_t rows, int64_t cols, double* sums) {
  double diff = 0, ref = 0;
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const double x = Widen(a[r * lda + c]), y = Widen(b[r * ldb + c]);
    diff += (x - y) * (x - y);
    ref += y * y;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    diff += __shfl_down_sync(0xffffffffu, diff, offset);
    ref += __shfl_down_sync(0xffffffffu, ref, offset);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&sums[0], diff);
    atomicAdd(&sums[1], ref);
  }
}

template <typename T>
cudaError_t Launch(const T* a, int64_t lda, const T* b, int64_t ldb, int64_t rows, int64_t cols,
                   double* sums, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((rows * cols + kThreads - 1) / kThreads, 2048);
  SquaredDistanceKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a, lda, b, ldb,
                                                                                rows, cols, sums);
  return cudaGetLastError();
}

}  // namespace

cudaError_t AddSquaredDistance(const __nv_bfloat16* a, int64_t lda, const __nv_bfloat16* b,
                               int64_t ldb, int64_t rows, int64_t cols, double* sums,
                               cudaStream_t stream) {
  return Launch(a, lda, b, ldb, rows, cols, sums, stream);
}
cudaError_t AddSquaredDistance(const float* a, int64_t lda, const float* b, int64_t ldb,
                               int64_t rows, int64_t cols, double* sums, cudaStream_t stream) {
  return Launch(a, lda, b, ldb, rows, cols, sums, stream);
}

}  // namespace tierzero::gpt::cuda
