// The GPT's products on bf16 tensor cores (gpt/tensor_core_cuda.h).
//
// Note [bf16 products around fp32 activations]
// The GPT keeps its activations, gradients and element-wise math in fp32 on every backend, so
// that the CPU, the simulated device and the GPU share one model (gpt.cc) and the fp32 path stays
// exact for the equivalence tests. With compute dtype bf16 on a GPU, only the products change:
// each operand is rounded to bf16 into a scratch buffer (one pass, 6 bytes per element against
// the product's 2k FLOPs per output), multiplied on the tensor cores with fp32 accumulation, and
// written in fp32. This is what mixed precision computes (bf16 operands, fp32 sums) at the cost
// of the rounding passes and fp32 activation traffic, which a bf16 activation layout would save;
// bench/RESULTS.md measures where the time goes. Attention's scores and probabilities are
// products too: the T x T score matrix of each head is computed whole by a batched product
// (the masked half included: tensor cores at twice the work beat the CUDA cores at the causal
// half), masked and normalised by a row kernel that also writes the bf16 copy the next product
// reads.
#include <cmath>
#include <string>

#include "gpt/kernels_cuda.cuh"
#include "gpt/tensor_core_cuda.h"

namespace tierzero::gpt::cuda {
namespace {

// dst (dense, rows x cols) = bf16(src[r * ld + c]), rounding to nearest even; `width` (1 or 4)
// consecutive elements per thread, 4 when cols, ld and src allow 16-byte loads (one index
// division per four elements: the scalar kernel was 14% of a step's kernel time).
template <int width>
__global__ void RoundKernel(const float* src, int64_t rows, int64_t cols, int64_t ld,
                            __nv_bfloat16* dst) {
  const int64_t n = rows * cols / width;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t e = i * width, r = e / cols, c = e - r * cols;
    if constexpr (width == 4) {
      const float4 v = *reinterpret_cast<const float4*>(src + r * ld + c);
      __nv_bfloat162* d = reinterpret_cast<__nv_bfloat162*>(dst + e);
      d[0] = __floats2bfloat162_rn(v.x, v.y);
      d[1] = __floats2bfloat162_rn(v.z, v.w);
    } else {
      dst[e] = __float2bfloat16_rn(src[r * ld + c]);
    }
  }
}

// One warp per score row (b, h, t) of `rows`, each `seq` long and already scaled: the causal
// softmax in place (zeros above the diagonal, as the CPU writes) and its bf16 copy in p16.
__global__ void CausalSoftmaxKernel(float* scores, __nv_bfloat16* p16, int64_t rows, int64_t seq) {
  const int64_t row = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / kWarp;
  if (row >= rows) return;
  const int lane = threadIdx.x % kWarp;
  const int64_t t = row % seq;
  float* r = scores + row * seq;
  __nv_bfloat16* r16 = p16 + row * seq;
  float mx = -INFINITY;
  for (int64_t s = lane; s <= t; s += kWarp) mx = fmaxf(mx, r[s]);
  mx = WarpMax(mx);
  float sum = 0;
  for (int64_t s = lane; s <= t; s += kWarp) {
    const float e = expf(r[s] - mx);
    r[s] = e;
    sum += e;
  }
  const float inv = 1.0f / WarpSum(sum);
  for (int64_t s = lane; s < seq; s += kWarp) {
    const float p = s <= t ? r[s] * inv : 0.0f;
    r[s] = p;
    r16[s] = __float2bfloat16_rn(p);
  }
}

// One warp per row (b, h, t): ds[s] = p[s] (dp[s] - sum_s' p[s'] dp[s']) scale for s <= t, zero
// above the diagonal, in bf16 (the operand of the query and key gradient products).
__global__ void SoftmaxGradKernel(const float* probs, const float* dp, __nv_bfloat16* ds16,
                                  int64_t rows, int64_t seq, float scale) {
  const int64_t row = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / kWarp;
  if (row >= rows) return;
  const int lane = threadIdx.x % kWarp;
  const int64_t t = row % seq;
  const float* p = probs + row * seq;
  const float* g = dp + row * seq;
  float d = 0;
  for (int64_t s = lane; s <= t; s += kWarp) d += p[s] * g[s];
  d = WarpSum(d);
  __nv_bfloat16* out = ds16 + row * seq;
  for (int64_t s = lane; s < seq; s += kWarp)
    out[s] = __float2bfloat16_rn(s <= t ? p[s] * (g[s] - d) * scale : 0.0f);
}

}  // namespace

TensorCoreOps::~TensorCoreOps() {
  for (void* p : scratch_)
    if (p != nullptr) cudaFreeAsync(p, stream_);
}

void TensorCoreOps::Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess && first_error_->ok())
    *first_error_ = InternalError(std::string(what) + ": " + cudaGetErrorString(e));
}

void TensorCoreOps::CheckBlas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS && first_error_->ok())
    *first_error_ = InternalError(std::string(what) + ": cuBLAS status " + std::to_string(s));
}

void* TensorCoreOps::Scratch(int slot, uint64_t bytes) {
  if (bytes > scratch_bytes_[slot]) {
    if (scratch_[slot] != nullptr) Check(cudaFreeAsync(scratch_[slot], stream_), "cudaFreeAsync");
    scratch_[slot] = nullptr;
    scratch_bytes_[slot] = 0;
    Check(cudaMallocAsync(&scratch_[slot], bytes, stream_), "cudaMallocAsync (bf16 operands)");
    if (scratch_[slot] != nullptr) scratch_bytes_[slot] = bytes;
  }
  return scratch_[slot];
}

__nv_bfloat16* TensorCoreOps::Rounded(int slot, const float* src, int64_t rows, int64_t cols,
                                      int64_t ld) {
  auto* dst = static_cast<__nv_bfloat16*>(Scratch(slot, 2 * static_cast<uint64_t>(rows * cols)));
  if (dst == nullptr || rows * cols == 0) return dst;
  if (cols % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0)
    RoundKernel<4><<<Blocks(rows * cols / 4), kThreads, 0, stream_>>>(src, rows, cols, ld, dst);
  else
    RoundKernel<1><<<Blocks(rows * cols), kThreads, 0, stream_>>>(src, rows, cols, ld, dst);
  Check(cudaGetLastError(), "RoundKernel");
  return dst;
}

void TensorCoreOps::Product(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                            const __nv_bfloat16* a, int64_t lda, int64_t stride_a,
                            const __nv_bfloat16* b, int64_t ldb, int64_t stride_b, float beta,
                            float* c, int64_t ldc, int64_t stride_c, int64_t batch) {
  if (a == nullptr || b == nullptr) return;  // a scratch allocation failed: already reported
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
  CheckBlas(api_->GemmStridedBatchedEx(
                blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b,
                CUDA_R_16BF, static_cast<int>(ldb), stride_b, a, CUDA_R_16BF, static_cast<int>(lda),
                stride_a, &beta, c, CUDA_R_32F, static_cast<int>(ldc), stride_c,
                static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            "cublasGemmStridedBatchedEx (bf16)");
}

void TensorCoreOps::Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                         const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                         float* c, int64_t ldc) {
  const int64_t a_rows = ta ? k : m, a_cols = ta ? m : k;
  const int64_t b_rows = tb ? n : k, b_cols = tb ? k : n;
  const __nv_bfloat16* a16 = Rounded(0, a, a_rows, a_cols, lda);
  const __nv_bfloat16* b16 = Rounded(1, b, b_rows, b_cols, ldb);
  Product(ta, tb, m, n, k, alpha, a16, a_cols, 0, b16, b_cols, 0, beta, c, ldc, 0, 1);
}

void TensorCoreOps::AttentionForward(const float* qkv, float* out, float* probs, int64_t batch,
                                     int64_t seq, int64_t channels, int64_t heads) {
  const int64_t T = seq, C = channels, H = heads, hd = C / H, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const __nv_bfloat16* x = Rounded(0, qkv, batch * T, C3, C3);
  auto* p16 = static_cast<__nv_bfloat16*>(Scratch(2, 2 * static_cast<uint64_t>(batch * H * T * T)));
  if (x == nullptr || p16 == nullptr) return;
  for (int64_t b = 0; b < batch; ++b) {  // scores = scale q k^T, per head
    const __nv_bfloat16* xb = x + b * T * C3;
    Product(false, true, T, T, hd, scale, xb, C3, hd, xb + C, C3, hd, 0.0f, probs + b * H * T * T,
            T, T * T, H);
  }
  CausalSoftmaxKernel<<<WarpBlocks(batch * H * T), kThreads, 0, stream_>>>(probs, p16,
                                                                           batch * H * T, T);
  Check(cudaGetLastError(), "CausalSoftmaxKernel");
  for (int64_t b = 0; b < batch; ++b) {  // out = p v, per head
    Product(false, false, T, hd, T, 1.0f, p16 + b * H * T * T, T, T * T, x + b * T * C3 + 2 * C, C3,
            hd, 0.0f, out + b * T * C, C, hd, H);
  }
}

void TensorCoreOps::AttentionBackward(const float* dout, const float* qkv, const float* probs,
                                      float* dqkv, int64_t batch, int64_t seq, int64_t channels,
                                      int64_t heads) {
  const int64_t T = seq, C = channels, H = heads, hd = C / H, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const __nv_bfloat16* x = Rounded(0, qkv, batch * T, C3, C3);
  const __nv_bfloat16* g = Rounded(1, dout, batch * T, C, C);
  __nv_bfloat16* p16 = Rounded(2, probs, batch * H * T, T, T);
  auto* dp = static_cast<float*>(Scratch(3, 4 * static_cast<uint64_t>(batch * H * T * T)));
  if (x == nullptr || g == nullptr || p16 == nullptr || dp == nullptr) return;
  for (int64_t b = 0; b < batch; ++b) {
    const __nv_bfloat16* xb = x + b * T * C3;
    const __nv_bfloat16* gb = g + b * T * C;
    // dv = p^T dout, dp = dout v^T
    Product(true, false, T, hd, T, 1.0f, p16 + b * H * T * T, T, T * T, gb, C, hd, 0.0f,
            dqkv + b * T * C3 + 2 * C, C3, hd, H);
    Product(false, true, T, T, hd, 1.0f, gb, C, hd, xb + 2 * C, C3, hd, 0.0f, dp + b * H * T * T, T,
            T * T, H);
  }
  // ds overwrites p16, which the value gradients above read first (stream order).
  SoftmaxGradKernel<<<WarpBlocks(batch * H * T), kThreads, 0, stream_>>>(probs, dp, p16,
                                                                         batch * H * T, T, scale);
  Check(cudaGetLastError(), "SoftmaxGradKernel");
  for (int64_t b = 0; b < batch; ++b) {
    const __nv_bfloat16* xb = x + b * T * C3;
    const __nv_bfloat16* ds = p16 + b * H * T * T;
    // dq = ds k, dk = ds^T q
    Product(false, false, T, hd, T, 1.0f, ds, T, T * T, xb + C, C3, hd, 0.0f, dqkv + b * T * C3, C3,
            hd, H);
    Product(true, false, T, hd, T, 1.0f, ds, T, T * T, xb, C3, hd, 0.0f, dqkv + b * T * C3 + C, C3,
            hd, H);
  }
}

}  // namespace tierzero::gpt::cuda
