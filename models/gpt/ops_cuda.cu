// GPT ops on CUDA (gpt/ops_cuda.h). Kernels favour clarity and determinism over peak speed:
// one warp per row for row-wise ops (LayerNorm, softmax rows, cross-entropy), slabs of rows per
// thread block then one thread per column for column reductions, grid-stride loops for
// elementwise ops.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "gpt/cublas_api.h"
#include "gpt/flash_attention_cuda.h"
#include "gpt/kernels_cuda.cuh"
#include "gpt/ops_cuda.h"
#include "gpt/ops_cuda_impl.cuh"
#include "gpt/tensor_core_cuda.h"

namespace tierzero::gpt::cuda {
namespace {

// ---- elementwise ----------------------------------------------------------------------------

__global__ void AddKernel(const float* a, const float* b, float* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    y[i] = a[i] + b[i];
}
__global__ void AddInPlaceKernel(float* y, const float* a, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    y[i] += a[i];
}

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)

__global__ void GeluForwardKernel(const float* x, float* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float v = x[i];
    y[i] = 0.5f * v * (1.0f + tanhf(kGeluC * (v + 0.044715f * v * v * v)));
  }
}
__global__ void GeluBackwardKernel(const float* dy, const float* x, float* dx, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float v = x[i];
    const float t = tanhf(kGeluC * (v + 0.044715f * v * v * v));
    const float du = kGeluC * (1.0f + 3.0f * 0.044715f * v * v);
    dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
  }
}

// y[r, :] += bias
__global__ void AddBiasKernel(float* y, const float* bias, int64_t rows, int64_t cols) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows * cols;
       i += int64_t{gridDim.x} * blockDim.x)
    y[i] += bias[i % cols];
}
// out[c] += sum over rows of m[r, c], rows in order.
// Column sums in two passes, so that a few thousand columns still fill the GPU (one thread per
// column over 8192 rows took a quarter of a step's kernel time): each thread block sums a slab
// of kColumnSlab rows for its columns into partial[slab][column], then one thread per column
// adds the slabs in order into out. Fixed order, so a run repeats bit for bit. Slabs are 128 rows,
// more where the grid's y extent (65535) would not hold them.
struct Slabs {
  int64_t rows, count;
};
Slabs ColumnSlabs(int64_t rows) {
  const int64_t per = std::max<int64_t>(128, (rows + 65534) / 65535);
  return {per, rows == 0 ? 1 : (rows + per - 1) / per};
}

__global__ void ColumnPartialsKernel(const float* m, float* partial, int64_t rows, int64_t cols,
                                     int64_t slab) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = blockIdx.y * slab, r1 = min(rows, r0 + slab);
  float acc = 0;
  for (int64_t r = r0; r < r1; ++r) acc += m[r * cols + c];
  partial[blockIdx.y * cols + c] = acc;
}

// out[c] += sum over slabs of partial[slab][c], for `n` interleaved outputs (partial holds n
// arrays of slabs x cols back to back).
__global__ void ColumnTotalsKernel(const float* partial, int64_t slabs, int64_t cols, float* out0,
                                   float* out1) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= cols) return;
  float a = 0, b = 0;
  for (int64_t k = 0; k < slabs; ++k) {
    a += partial[k * cols + c];
    if (out1 != nullptr) b += partial[(slabs + k) * cols + c];
  }
  out0[c] += a;
  if (out1 != nullptr) out1[c] += b;
}

// ---- LayerNorm: a warp per row ----------------------------------------------------------------

__global__ void LayerNormForwardKernel(const float* x, const float* gamma, const float* beta,
                                       float* y, float* mean, float* rstd, int64_t rows,
                                       int64_t cols) {
  const int64_t r = blockIdx.x * int64_t{blockDim.x / kWarp} + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const float* xr = x + r * cols;
  float s = 0;
  for (int64_t j = lane; j < cols; j += kWarp) s += xr[j];
  const float mu = WarpSum(s) / static_cast<float>(cols);
  float v = 0;
  for (int64_t j = lane; j < cols; j += kWarp) v += (xr[j] - mu) * (xr[j] - mu);
  const float rs = rsqrtf(WarpSum(v) / static_cast<float>(cols) + 1e-5f);
  float* yr = y + r * cols;
  for (int64_t j = lane; j < cols; j += kWarp) yr[j] = (xr[j] - mu) * rs * gamma[j] + beta[j];
  if (lane == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
}
__global__ void LayerNormBackwardRowsKernel(const float* dy, const float* x, const float* gamma,
                                            const float* mean, const float* rstd, float* dx,
                                            int64_t rows, int64_t cols) {
  const int64_t r = blockIdx.x * int64_t{blockDim.x / kWarp} + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const float* dyr = dy + r * cols;
  const float* xr = x + r * cols;
  const float mu = mean[r], rs = rstd[r];
  float sg = 0, sgx = 0;
  for (int64_t j = lane; j < cols; j += kWarp) {
    const float g = dyr[j] * gamma[j];
    sg += g;
    sgx += g * (xr[j] - mu) * rs;
  }
  sg = WarpSum(sg) / static_cast<float>(cols);
  sgx = WarpSum(sgx) / static_cast<float>(cols);
  float* dxr = dx + r * cols;
  for (int64_t j = lane; j < cols; j += kWarp) {
    const float xhat = (xr[j] - mu) * rs;
    dxr[j] = rs * (dyr[j] * gamma[j] - sg - xhat * sgx);
  }
}
// dgamma and dbeta slab partials (see ColumnPartialsKernel): [0, slabs) rows of partial hold
// dgamma's, [slabs, 2 slabs) dbeta's.
__global__ void LayerNormColumnPartialsKernel(const float* dy, const float* x, const float* mean,
                                              const float* rstd, float* partial, int64_t rows,
                                              int64_t cols, int64_t slab) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = blockIdx.y * slab, r1 = min(rows, r0 + slab);
  float ag = 0, ab = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const float d = dy[r * cols + c];
    ag += d * (x[r * cols + c] - mean[r]) * rstd[r];
    ab += d;
  }
  partial[blockIdx.y * cols + c] = ag;
  partial[(gridDim.y + blockIdx.y) * cols + c] = ab;
}

// ---- attention --------------------------------------------------------------------------------
// qkv rows are [q | k | v], each `channels` wide with heads of hd. One warp per (b, h, t) query
// row: lanes split the key positions for the scores, then the head dimension for the output.

// The warp's row of batch x heads x seq: `pos` is its position (the query in forward and dq, the
// key in dk/dv), and q/k/v(s) the head's slices of this batch's qkv row s.
struct AttnRow {
  int64_t row, pos, bh, b, h, seq, channels, hd, c3;
  int lane;
  float scale;  // 1 / sqrt(hd)
  const float* base;
  __device__ const float* q(int64_t s) const { return base + s * c3 + h * hd; }
  __device__ const float* k(int64_t s) const { return q(s) + channels; }
  __device__ const float* v(int64_t s) const { return q(s) + 2 * channels; }
  // The head's slice of a batch x seq x channels tensor (out, dout) at position s.
  template <typename T>
  __device__ T* at(T* x, int64_t s) const {
    return x + (b * seq + s) * channels + h * hd;
  }
};

// False for the warps past the last row (the whole warp returns together).
__device__ bool WarpAttnRow(const float* qkv, int64_t batch, int64_t seq, int64_t channels,
                            int64_t heads, AttnRow& r) {
  r.row = blockIdx.x * int64_t{blockDim.x / kWarp} + threadIdx.x / kWarp;
  r.lane = threadIdx.x % kWarp;
  if (r.row >= batch * heads * seq) return false;
  r.pos = r.row % seq;
  r.bh = r.row / seq;
  r.b = r.bh / heads;
  r.h = r.bh % heads;
  r.seq = seq;
  r.channels = channels;
  r.hd = channels / heads;
  r.c3 = 3 * channels;
  r.scale = rsqrtf(static_cast<float>(r.hd));
  r.base = qkv + r.b * seq * r.c3;
  return true;
}

__global__ void AttentionForwardKernel(const float* qkv, float* out, float* probs, int64_t batch,
                                       int64_t seq, int64_t channels, int64_t heads) {
  AttnRow r;
  if (!WarpAttnRow(qkv, batch, seq, channels, heads, r)) return;
  const int64_t t = r.pos, hd = r.hd;
  const int lane = r.lane;
  const float* q = r.q(t);
  float* pr = probs + r.row * seq;
  float mx = -INFINITY;
  for (int64_t s = lane; s <= t; s += kWarp) {
    const float* k = r.k(s);
    float dot = 0;
    for (int64_t d = 0; d < hd; ++d) dot += q[d] * k[d];
    pr[s] = dot * r.scale;
    mx = fmaxf(mx, pr[s]);
  }
  mx = WarpMax(mx);
  float sum = 0;
  for (int64_t s = lane; s <= t; s += kWarp) {
    pr[s] = expf(pr[s] - mx);
    sum += pr[s];
  }
  const float inv = 1.0f / WarpSum(sum);
  for (int64_t s = lane; s < seq; s += kWarp) pr[s] = s <= t ? pr[s] * inv : 0.0f;
  __syncwarp();
  float* o = r.at(out, t);
  for (int64_t d = lane; d < hd; d += kWarp) {
    float acc = 0;
    for (int64_t s = 0; s <= t; ++s) acc += pr[s] * r.v(s)[d];
    o[d] = acc;
  }
}

// D[b, h, t] = sum_s p[t, s] (dout[t] . v[s])  (= dout[t] . out[t])
__global__ void AttentionRowDotKernel(const float* dout, const float* qkv, const float* probs,
                                      float* dsum, int64_t batch, int64_t seq, int64_t channels,
                                      int64_t heads) {
  AttnRow r;
  if (!WarpAttnRow(qkv, batch, seq, channels, heads, r)) return;
  const int64_t t = r.pos;
  const float* dor = r.at(dout, t);
  const float* pr = probs + r.row * seq;
  float acc = 0;
  for (int64_t s = r.lane; s <= t; s += kWarp) {
    const float* v = r.v(s);
    float dot = 0;
    for (int64_t d = 0; d < r.hd; ++d) dot += dor[d] * v[d];
    acc += pr[s] * dot;
  }
  acc = WarpSum(acc);
  if (r.lane == 0) dsum[r.row] = acc;
}

// ds[t, s] = p[t, s] (dout[t] . v[s] - D[t]) scale. dq[t] = sum_{s <= t} ds[t, s] k[s]: one warp
// per query row t.
__global__ void AttentionDqKernel(const float* dout, const float* qkv, const float* probs,
                                  const float* dsum, float* dqkv, int64_t batch, int64_t seq,
                                  int64_t channels, int64_t heads) {
  AttnRow r;
  if (!WarpAttnRow(qkv, batch, seq, channels, heads, r)) return;
  const int64_t t = r.pos, hd = r.hd;
  const int lane = r.lane;
  const float* dor = r.at(dout, t);
  const float* pr = probs + r.row * seq;
  float* dq = dqkv + (r.q(t) - qkv);  // the same offset in dqkv as q in qkv
  for (int64_t d = lane; d < hd; d += kWarp) dq[d] = 0;
  __syncwarp();
  for (int64_t s = 0; s <= t; ++s) {
    const float* v = r.v(s);
    float dot = 0;
    for (int64_t d = lane; d < hd; d += kWarp) dot += dor[d] * v[d];
    dot = WarpSum(dot);
    const float ds = pr[s] * (dot - dsum[r.row]) * r.scale;
    const float* k = r.k(s);
    for (int64_t d = lane; d < hd; d += kWarp) dq[d] += ds * k[d];
  }
}

// For key position s: dk[s] = sum_{t >= s} ds[t, s] q[t], dv[s] = sum_{t >= s} p[t, s] dout[t].
__global__ void AttentionDkvKernel(const float* dout, const float* qkv, const float* probs,
                                   const float* dsum, float* dqkv, int64_t batch, int64_t seq,
                                   int64_t channels, int64_t heads) {
  AttnRow r;
  if (!WarpAttnRow(qkv, batch, seq, channels, heads, r)) return;
  const int64_t s = r.pos, hd = r.hd, bh = r.bh;
  const int lane = r.lane;
  const float* v = r.v(s);
  float* dk = dqkv + (r.k(s) - qkv);
  float* dv = dk + channels;
  for (int64_t d = lane; d < hd; d += kWarp) {
    dk[d] = 0;
    dv[d] = 0;
  }
  __syncwarp();
  for (int64_t t = s; t < seq; ++t) {
    const float* dor = r.at(dout, t);
    const float p = probs[(bh * seq + t) * seq + s];
    float dot = 0;
    for (int64_t d = lane; d < hd; d += kWarp) dot += dor[d] * v[d];
    dot = WarpSum(dot);
    const float ds = p * (dot - dsum[bh * seq + t]) * r.scale;
    const float* q = r.q(t);
    for (int64_t d = lane; d < hd; d += kWarp) {
      dk[d] += ds * q[d];
      dv[d] += p * dor[d];
    }
  }
}

// ---- embeddings, cross-entropy, casts --------------------------------------------------------

__global__ void EmbeddingForwardKernel(const int32_t* tokens, const float* wte, const float* wpe,
                                       float* x, int64_t rows, int64_t seq, int64_t channels) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows * channels;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / channels, c = i % channels;
    // (No position table for a rotary model, as the bf16 kernel allows.)
    x[i] = wte[int64_t{tokens[r]} * channels + c] +
           (wpe != nullptr ? wpe[(r % seq) * channels + c] : 0.0f);
  }
}
// One thread per channel, rows in order: the same additions in the same order as the CPU.
__global__ void EmbeddingBackwardKernel(const int32_t* tokens, const float* dx, float* dwte,
                                        float* dwpe, int64_t rows, int64_t seq, int64_t channels) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= channels) return;
  for (int64_t r = 0; r < rows; ++r) {
    const float d = dx[r * channels + c];
    dwte[int64_t{tokens[r]} * channels + c] += d;
    if (dwpe != nullptr) dwpe[(r % seq) * channels + c] += d;
  }
}

// A warp per row: row_loss = mask (logsumexp - logit[target]); dlogits = w (softmax - onehot).
__global__ void CrossEntropyKernel(const float* logits, const int32_t* targets, const float* mask,
                                   float* dlogits, int32_t* argmax, double* row_loss, int64_t rows,
                                   int64_t vocab, double w_per_mask) {
  const int64_t r = blockIdx.x * int64_t{blockDim.x / kWarp} + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const float* l = logits + r * vocab;
  float mx = -INFINITY;
  int64_t best = vocab;
  for (int64_t j = lane; j < vocab; j += kWarp) {
    if (l[j] > mx || (l[j] == mx && j < best)) {
      mx = l[j];
      best = j;
    }
  }
  // The first index of the maximum, as the CPU's scan finds it.
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const float om = __shfl_xor_sync(0xffffffffu, mx, o);
    const int64_t ob = __shfl_xor_sync(0xffffffffu, best, o);
    if (om > mx || (om == mx && ob < best)) {
      mx = om;
      best = ob;
    }
  }
  double sum = 0;
  for (int64_t j = lane; j < vocab; j += kWarp) sum += exp(static_cast<double>(l[j] - mx));
  for (int o = kWarp / 2; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const double lse = log(sum) + static_cast<double>(mx);
  if (lane == 0) {
    if (argmax != nullptr) argmax[r] = static_cast<int32_t>(best);
    row_loss[r] = mask[r] * (lse - static_cast<double>(l[targets[r]]));
  }
  if (dlogits != nullptr) {
    const double w = mask[r] * w_per_mask;
    float* d = dlogits + r * vocab;
    for (int64_t j = lane; j < vocab; j += kWarp) {
      const double p = exp(static_cast<double>(l[j]) - lse);
      d[j] = static_cast<float>(w * (p - (j == targets[r] ? 1.0 : 0.0)));
    }
  }
}

}  // namespace

StatusOr<std::unique_ptr<CudaOps>> CudaOps::Create(void* stream, bool tensor_cores,
                                                   bool fused_attention) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return UnavailableError("no CUDA device for the GPT's CUDA ops");
  }
  auto cublas = LoadCublas();
  if (!cublas.ok()) return cublas.status();
  std::unique_ptr<CudaOps> ops(new CudaOps());
  ops->impl_ = std::make_unique<Impl>();
  Impl& im = *ops->impl_;
  im.cublas = *cublas;
  im.stream = static_cast<cudaStream_t>(stream);
  if (const cublasStatus_t s = im.cublas->Create(&im.blas); s != CUBLAS_STATUS_SUCCESS) {
    im.blas = nullptr;
    return InternalError("cublasCreate failed with cuBLAS status " + std::to_string(s));
  }
  im.CheckBlas(im.cublas->SetStream(im.blas, im.stream), "cublasSetStream");
  // Plain fp32 products (no TF32), so results match the CPU's to fp32 rounding; or bf16
  // operands on the tensor cores (Note [bf16 products around fp32 activations]).
  im.CheckBlas(
      im.cublas->SetMathMode(im.blas, tensor_cores ? CUBLAS_DEFAULT_MATH : CUBLAS_PEDANTIC_MATH),
      "cublasSetMathMode");
  if (tensor_cores)
    im.tc = std::make_unique<TensorCoreOps>(im.cublas, im.blas, im.stream, &im.first_error);
  im.fused_attention = tensor_cores && fused_attention;
  if (!im.first_error.ok()) return im.first_error;
  return std::move(ops);
}

CudaOps::~CudaOps() {
  if (!impl_) return;
  impl_->tc.reset();
  if (impl_->dsum != nullptr) cudaFreeAsync(impl_->dsum, impl_->stream);
  if (impl_->partial != nullptr) cudaFreeAsync(impl_->partial, impl_->stream);
  if (impl_->row_loss != nullptr) cudaFreeAsync(impl_->row_loss, impl_->stream);
  cudaStreamSynchronize(impl_->stream);
  if (impl_->blas != nullptr) impl_->cublas->Destroy(impl_->blas);
}

Status CudaOps::status() const { return impl_->first_error; }

void CudaOps::Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                   int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (impl_->tc) return impl_->tc->Gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
  impl_->CheckBlas(
      impl_->cublas->Sgemm(impl_->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                           ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                           static_cast<int>(k), &alpha, b, static_cast<int>(ldb), a,
                           static_cast<int>(lda), &beta, c, static_cast<int>(ldc)),
      "cublasSgemm");
}

// out[c] += sum over rows of m[r, c] (the slabs of ColumnSlabs, then the slabs in order).
void CudaOps::ColumnSums(const float* m, float* out, int64_t rows, int64_t cols) {
  const Slabs sl = ColumnSlabs(rows);
  float* partial = impl_->Grow(impl_->partial, impl_->partial_elems, sl.count * cols);
  if (partial == nullptr) return;
  ColumnPartialsKernel<<<dim3(Blocks(cols), static_cast<unsigned>(sl.count)), kThreads, 0,
                         impl_->stream>>>(m, partial, rows, cols, sl.rows);
  impl_->CheckLaunch("ColumnPartialsKernel");
  ColumnTotalsKernel<<<Blocks(cols), kThreads, 0, impl_->stream>>>(partial, sl.count, cols, out,
                                                                   nullptr);
  impl_->CheckLaunch("ColumnTotalsKernel");
}

void CudaOps::LinearForward(const float* x, const float* w, const float* bias, float* y,
                            int64_t rows, int64_t in, int64_t out) {
  Gemm(false, false, rows, out, in, 1.0f, x, in, w, out, 0.0f, y, out);
  if (bias != nullptr) {
    AddBiasKernel<<<Blocks(rows * out), kThreads, 0, impl_->stream>>>(y, bias, rows, out);
    impl_->CheckLaunch("AddBiasKernel");
  }
}

void CudaOps::LinearBackward(const float* dy, const float* x, const float* w, float* dx, float* dw,
                             float* dbias, int64_t rows, int64_t in, int64_t out) {
  if (dx != nullptr) Gemm(false, true, rows, in, out, 1.0f, dy, out, w, out, 0.0f, dx, in);
  Gemm(true, false, in, out, rows, 1.0f, x, in, dy, out, 1.0f, dw, out);
  if (dbias != nullptr) ColumnSums(dy, dbias, rows, out);
}

void CudaOps::LinearForwardOutIn(const float* x, const float* w, const float* bias, float* y,
                                 int64_t rows, int64_t in, int64_t out) {
  Gemm(false, true, rows, out, in, 1.0f, x, in, w, in, 0.0f, y, out);
  if (bias != nullptr) {
    AddBiasKernel<<<Blocks(rows * out), kThreads, 0, impl_->stream>>>(y, bias, rows, out);
    impl_->CheckLaunch("AddBiasKernel");
  }
}

void CudaOps::LinearBackwardOutIn(const float* dy, const float* x, const float* w, float* dx,
                                  float* dw, float* dbias, int64_t rows, int64_t in, int64_t out) {
  if (dx != nullptr) Gemm(false, false, rows, in, out, 1.0f, dy, out, w, in, 0.0f, dx, in);
  Gemm(true, false, out, in, rows, 1.0f, dy, out, x, in, 1.0f, dw, in);
  if (dbias != nullptr) ColumnSums(dy, dbias, rows, out);
}

void CudaOps::LayerNormForward(const float* x, const float* gamma, const float* beta, float* y,
                               float* mean, float* rstd, int64_t rows, int64_t cols) {
  LayerNormForwardKernel<<<WarpBlocks(rows), kThreads, 0, impl_->stream>>>(x, gamma, beta, y, mean,
                                                                           rstd, rows, cols);
  impl_->CheckLaunch("LayerNormForwardKernel");
}

void CudaOps::LayerNormBackward(const float* dy, const float* x, const float* gamma,
                                const float* mean, const float* rstd, float* dx, float* dgamma,
                                float* dbeta, int64_t rows, int64_t cols) {
  LayerNormBackwardRowsKernel<<<WarpBlocks(rows), kThreads, 0, impl_->stream>>>(
      dy, x, gamma, mean, rstd, dx, rows, cols);
  impl_->CheckLaunch("LayerNormBackwardRowsKernel");
  const Slabs sl = ColumnSlabs(rows);
  float* partial = impl_->Grow(impl_->partial, impl_->partial_elems, 2 * sl.count * cols);
  if (partial == nullptr) return;
  LayerNormColumnPartialsKernel<<<dim3(Blocks(cols), static_cast<unsigned>(sl.count)), kThreads, 0,
                                  impl_->stream>>>(dy, x, mean, rstd, partial, rows, cols, sl.rows);
  impl_->CheckLaunch("LayerNormColumnPartialsKernel");
  ColumnTotalsKernel<<<Blocks(cols), kThreads, 0, impl_->stream>>>(partial, sl.count, cols, dgamma,
                                                                   dbeta);
  impl_->CheckLaunch("ColumnTotalsKernel");
}

void CudaOps::GeluForward(const float* x, float* y, int64_t n) {
  GeluForwardKernel<<<Blocks(n), kThreads, 0, impl_->stream>>>(x, y, n);
  impl_->CheckLaunch("GeluForwardKernel");
}

void CudaOps::GeluBackward(const float* dy, const float* x, float* dx, int64_t n) {
  GeluBackwardKernel<<<Blocks(n), kThreads, 0, impl_->stream>>>(dy, x, dx, n);
  impl_->CheckLaunch("GeluBackwardKernel");
}

bool CudaOps::fused_attention(int64_t head_dim) const {
  return impl_->fused_attention && FusedAttentionHeadWidth(head_dim);
}

void CudaOps::AttentionForward(const float* qkv, float* out, float* state, int64_t batch,
                               int64_t seq, int64_t channels, int64_t heads) {
  if (fused_attention(channels / heads)) {
    impl_->Check(FusedAttentionForward(qkv, out, state, batch, seq, channels, heads, impl_->stream),
                 "FusedAttentionForward");
    return;
  }
  if (impl_->tc) return impl_->tc->AttentionForward(qkv, out, state, batch, seq, channels, heads);
  AttentionForwardKernel<<<WarpBlocks(batch * heads * seq), kThreads, 0, impl_->stream>>>(
      qkv, out, state, batch, seq, channels, heads);
  impl_->CheckLaunch("AttentionForwardKernel");
}

void CudaOps::AttentionBackward(const float* dout, const float* qkv, const float* out,
                                const float* state, float* dqkv, int64_t batch, int64_t seq,
                                int64_t channels, int64_t heads) {
  const int64_t rows = batch * heads * seq;
  if (fused_attention(channels / heads)) {
    float* rowdot = impl_->Grow(impl_->dsum, impl_->dsum_elems, rows);
    if (rowdot == nullptr) return;
    impl_->Check(FusedAttentionBackward(dout, qkv, out, state, rowdot, dqkv, batch, seq, channels,
                                        heads, impl_->stream),
                 "FusedAttentionBackward");
    return;
  }
  const float* probs = state;
  if (impl_->tc)
    return impl_->tc->AttentionBackward(dout, qkv, probs, dqkv, batch, seq, channels, heads);
  float* dsum = impl_->Grow(impl_->dsum, impl_->dsum_elems, rows);
  if (dsum == nullptr) return;
  const unsigned blocks = WarpBlocks(rows);
  AttentionRowDotKernel<<<blocks, kThreads, 0, impl_->stream>>>(dout, qkv, probs, dsum, batch, seq,
                                                                channels, heads);
  impl_->CheckLaunch("AttentionRowDotKernel");
  AttentionDqKernel<<<blocks, kThreads, 0, impl_->stream>>>(dout, qkv, probs, dsum, dqkv, batch,
                                                            seq, channels, heads);
  impl_->CheckLaunch("AttentionDqKernel");
  AttentionDkvKernel<<<blocks, kThreads, 0, impl_->stream>>>(dout, qkv, probs, dsum, dqkv, batch,
                                                             seq, channels, heads);
  impl_->CheckLaunch("AttentionDkvKernel");
}

void CudaOps::EmbeddingForward(const int32_t* tokens, const float* wte, const float* wpe, float* x,
                               int64_t batch, int64_t seq, int64_t channels) {
  EmbeddingForwardKernel<<<Blocks(batch * seq * channels), kThreads, 0, impl_->stream>>>(
      tokens, wte, wpe, x, batch * seq, seq, channels);
  impl_->CheckLaunch("EmbeddingForwardKernel");
}

void CudaOps::EmbeddingBackward(const int32_t* tokens, const float* dx, float* dwte, float* dwpe,
                                int64_t batch, int64_t seq, int64_t channels) {
  EmbeddingBackwardKernel<<<Blocks(channels), kThreads, 0, impl_->stream>>>(
      tokens, dx, dwte, dwpe, batch * seq, seq, channels);
  impl_->CheckLaunch("EmbeddingBackwardKernel");
}

StatusOr<double> CudaOps::CrossEntropy(const float* logits, const int32_t* targets,
                                       const float* mask, float* dlogits, int32_t* argmax,
                                       int64_t rows, int64_t vocab, double scale) {
  if (rows == 0) return 0.0;
  Impl& im = *impl_;
  im.host_mask.resize(static_cast<size_t>(rows));
  im.host_loss.resize(static_cast<size_t>(rows));
  im.Check(cudaMemcpyAsync(im.host_mask.data(), mask, sizeof(float) * rows, cudaMemcpyDeviceToHost,
                           im.stream),
           "cudaMemcpyAsync (mask)");
  im.Check(cudaStreamSynchronize(im.stream), "cudaStreamSynchronize");
  double count = 0;
  for (float m : im.host_mask) count += m;
  const double inv = count > 0 ? 1.0 / count : 0.0;
  double* row_loss = im.Grow(im.row_loss, im.row_loss_elems, rows);
  if (row_loss == nullptr) return im.first_error;
  CrossEntropyKernel<<<WarpBlocks(rows), kThreads, 0, im.stream>>>(
      logits, targets, mask, dlogits, argmax, row_loss, rows, vocab, inv * scale);
  im.CheckLaunch("CrossEntropyKernel");
  im.Check(cudaMemcpyAsync(im.host_loss.data(), row_loss, sizeof(double) * rows,
                           cudaMemcpyDeviceToHost, im.stream),
           "cudaMemcpyAsync (loss)");
  im.Check(cudaStreamSynchronize(im.stream), "cudaStreamSynchronize");
  if (!im.first_error.ok()) return im.first_error;
  double loss = 0;
  for (double v : im.host_loss) loss += v;
  return loss * inv;
}

void CudaOps::Add(const float* a, const float* b, float* y, int64_t n) {
  AddKernel<<<Blocks(n), kThreads, 0, impl_->stream>>>(a, b, y, n);
  impl_->CheckLaunch("AddKernel");
}

void CudaOps::AddInPlace(float* y, const float* a, int64_t n) {
  AddInPlaceKernel<<<Blocks(n), kThreads, 0, impl_->stream>>>(y, a, n);
  impl_->CheckLaunch("AddInPlaceKernel");
}

}  // namespace tierzero::gpt::cuda
