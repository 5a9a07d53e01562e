// The GPT's products on bf16 tensor cores (CudaOps with tensor_cores; gpt/ops_cuda.h): the same
// contracts as the fp32 ops, fp32 in and out, but each product's operands rounded to bf16 and
// multiplied on the tensor cores with fp32 accumulation (cublasGemmStridedBatchedEx). Attention
// is four batched products per sequence of the batch (scores, weighted sum; in backward the
// probability and value gradients, then the query and key gradients) around two row kernels
// (the causal softmax; the softmax gradient), so its T x T work runs on the tensor cores too.
// See Note [bf16 products around fp32 activations].
//
// Results are within bf16 rounding of the fp32 ops (tests/gpt/ops_cuda_test.cc), and repeat bit
// for bit. Included only by gpt/ops_cuda.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gpt/cublas_api.h"
#include "tierzero/status.h"

namespace tierzero::gpt::cuda {

class TensorCoreOps {
 public:
  // blas: a handle on `stream` in CUBLAS_DEFAULT_MATH. Errors go to *first_error (kept if set).
  TensorCoreOps(const CublasApi* api, cublasHandle_t blas, cudaStream_t stream, Status* first_error)
      : api_(api), blas_(blas), stream_(stream), first_error_(first_error) {}
  ~TensorCoreOps();
  TensorCoreOps(const TensorCoreOps&) = delete;
  TensorCoreOps& operator=(const TensorCoreOps&) = delete;

  // As CudaOps::Gemm (row-major C = alpha op(A) op(B) + beta C), operands rounded to bf16.
  void Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
            int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
  // As CudaOps::AttentionForward / AttentionBackward.
  void AttentionForward(const float* qkv, float* out, float* probs, int64_t batch, int64_t seq,
                        int64_t channels, int64_t heads);
  void AttentionBackward(const float* dout, const float* qkv, const float* probs, float* dqkv,
                         int64_t batch, int64_t seq, int64_t channels, int64_t heads);

 private:
  // Row-major, strided-batched: C_i = alpha op(A_i) op(B_i) + beta C_i for i < batch.
  void Product(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
               const __nv_bfloat16* a, int64_t lda, int64_t stride_a, const __nv_bfloat16* b,
               int64_t ldb, int64_t stride_b, float beta, float* c, int64_t ldc, int64_t stride_c,
               int64_t batch);
  // `rows` x `cols` of src (row stride ld) as a dense bf16 matrix in scratch buffer `slot`.
  __nv_bfloat16* Rounded(int slot, const float* src, int64_t rows, int64_t cols, int64_t ld);
  void* Scratch(int slot, uint64_t bytes);
  void Check(cudaError_t e, const char* what);
  void CheckBlas(cublasStatus_t s, const char* what);

  static constexpr int kSlots = 4;
  const CublasApi* api_;
  cublasHandle_t blas_;
  cudaStream_t stream_;
  Status* first_error_;
  void* scratch_[kSlots] = {};
  uint64_t scratch_bytes_[kSlots] = {};
};

}  // namespace tierzero::gpt::cuda
