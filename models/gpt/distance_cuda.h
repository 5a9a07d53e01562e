// How far apart two device matrices are, norm-wise: what the bf16 backend's attention check
// measures (Note [cuDNN checked against the fused kernels] in gpt/attention_cuda_bf16.cc).
// Included only by files built with the CUDA runtime's headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tierzero::gpt::cuda {

// Adds sum (a - b)^2 to sums[0] and sum b^2 to sums[1] (device doubles, added to atomically)
// over `rows` rows of `cols` elements, a's rows lda elements apart and b's ldb. A NaN or an
// infinity in either makes sums[0] NaN or infinite. Returns the launch error, if any.
cudaError_t AddSquaredDistance(const __nv_bfloat16* a, int64_t lda, const __nv_bfloat16* b,
                               int64_t ldb, int64_t rows, int64_t cols, double* sums,
                               cudaStream_t stream);
cudaError_t AddSquaredDistance(const float* a, int64_t lda, const float* b, int64_t ldb,
                               int64_t rows, int64_t cols, double* sums, cudaStream_t stream);

}  // namespace tierzero::gpt::cuda
