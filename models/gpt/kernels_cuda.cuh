// Launch shapes and warp reductions shared by the GPT's CUDA files (gpt/ops_cuda.cu,
// gpt/tensor_core_cuda.cu). CUDA-only.
#pragma once

#include <cstdint>

namespace tierzero::gpt::cuda {

inline constexpr int kThreads = 256;
inline constexpr int kWarp = 32;

// Blocks to cover n items at `threads` per block (grid x allows 2^31 - 1).
inline unsigned Blocks(int64_t n, int threads = kThreads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}
// Blocks of kThreads for one warp per row.
inline unsigned WarpBlocks(int64_t rows) { return Blocks(rows, kThreads / kWarp); }

__device__ inline float WarpSum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float WarpMax(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace tierzero::gpt::cuda
