// The bf16 backend's element-wise kernels (gpt/bf16_kernels_cuda.h). A warp per row for the
// row-wise ops (LayerNorm), a block per row for the classifier (rows of up to hundreds of
// thousands of logits), slabs of rows then one thread per column for column sums, grid-stride
// loops for element-wise ops. Arithmetic is fp32 throughout; bf16 is only what is stored.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "gpt/bf16_kernels_cuda.h"
#include "gpt/kernels_cuda.cuh"

namespace tierzero::gpt::cuda::bf16k {
namespace {

__device__ inline float F(bf16 v) { return __bfloat162float(v); }
__device__ inline bf16 B(float v) { return __float2bfloat16_rn(v); }

#define TZ_GRID_STRIDE(i, n)                                                \
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < (n); \
       i += int64_t{gridDim.x} * blockDim.x)

// Grids of at most this many blocks: grid-stride loops cover the rest.
unsigned Grid(int64_t n) {
  const unsigned b = Blocks(n);
  return b > 65535u * 4u ? 65535u * 4u : b;
}

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

__device__ inline float Gelu(float x) {
  return 0.5f * x * (1.0f + tanhf(kGeluK * (x + kGeluC * x * x * x)));
}
__device__ inline float GeluGrad(float x) {
  const float t = tanhf(kGeluK * (x + kGeluC * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluK * (1.0f + 3.0f * kGeluC * x * x);
}

__global__ void GeluForwardKernel(const bf16* x, bf16* y, int64_t n) {
  TZ_GRID_STRIDE(i, n) y[i] = B(Gelu(F(x[i])));
}
__global__ void GeluBackwardKernel(const bf16* dy, const bf16* x, bf16* dx, int64_t n) {
  TZ_GRID_STRIDE(i, n) dx[i] = B(F(dy[i]) * GeluGrad(F(x[i])));
}
__global__ void AddKernel(const bf16* a, const bf16* b, bf16* y, int64_t n) {
  TZ_GRID_STRIDE(i, n) y[i] = B(F(a[i]) + F(b[i]));
}
__global__ void AddInPlaceKernel(bf16* y, const bf16* a, int64_t n) {
  TZ_GRID_STRIDE(i, n) y[i] = B(F(y[i]) + F(a[i]));
}

// ---- LayerNorm: a warp per row ---------------------------------------------------------------

__global__ void LayerNormForwardKernel(const bf16* x, const bf16* gamma, const bf16* beta, bf16* y,
                                       float* mean, float* rstd, int64_t rows, int64_t cols) {
  const int64_t r = blockIdx.x * int64_t{blockDim.x / kWarp} + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const bf16* xr = x + r * cols;
  float s = 0;
  for (int64_t j = lane; j < cols; j += kWarp) s += F(xr[j]);
  const float mu = WarpSum(s) / static_cast<float>(cols);
  float v = 0;
  for (int64_t j = lane; j < cols; j += kWarp) {
    const float d = F(xr[j]) - mu;
    v += d * d;
  }
  const float rs = rsqrtf(WarpSum(v) / static_cast<float>(cols) + 1e-5f);
  bf16* yr = y + r * cols;
  for (int64_t j = lane; j < cols; j += kWarp)
    yr[j] = B((F(xr[j]) - mu) * rs * F(gamma[j]) + F(beta[j]));
  if (lane == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
}

__global__ void LayerNormBackwardRowsKernel(const bf16* dy, const bf16* x, const bf16* gamma,
                                            const float* mean, const float* rstd, bf16* dx,
                                            int64_t rows, int64_t cols, const bf16* dres) {
  const int64_t r = blockIdx.x * int64_t{blockDim.x / kWarp} + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const bf16* dyr = dy + r * cols;
  const bf16* xr = x + r * cols;
  const float mu = mean[r], rs = rstd[r];
  float sg = 0, sgx = 0;
  for (int64_t j = lane; j < cols; j += kWarp) {
    const float g = F(dyr[j]) * F(gamma[j]);
    sg += g;
    sgx += g * (F(xr[j]) - mu) * rs;
  }
  sg = WarpSum(sg) / static_cast<float>(cols);
  sgx = WarpSum(sgx) / static_cast<float>(cols);
  bf16* dxr = dx + r * cols;
  const bf16* dresr = dres != nullptr ? dres + r * cols : nullptr;
  for (int64_t j = lane; j < cols; j += kWarp) {
    const float xhat = (F(xr[j]) - mu) * rs;
    const float g = rs * (F(dyr[j]) * F(gamma[j]) - sg - xhat * sgx);
    dxr[j] = B(dresr != nullptr ? F(dresr[j]) + g : g);
  }
}

// Note [Vectorised row kernels]
// With rows of a multiple of 8 elements, 16-byte aligned, and at most 2048 wide (the GPT's norms),
// a lane moves 8 bf16 in one 16-byte access and keeps its part of the row in registers: vector i
// of the row on lane i % 32, so the warp's accesses stay contiguous. The row is read from memory
// once, where the scalar kernels above read it once per pass (2-byte accesses, three passes). The
// sums are taken in another order than theirs (each lane's 8 elements first), within fp32
// rounding of them, and fixed, so a run still repeats bit for bit.
__device__ inline void Load8(const bf16* p, float* f) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 t = __bfloat1622float2(h[k]);
    f[2 * k] = t.x;
    f[2 * k + 1] = t.y;
  }
}
__device__ inline void Store8(bf16* p, const float* f) {
  uint4 u;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}

// kVecs: the most 8-element vectors a lane holds (cols <= kVecs * 256).
template <int kVecs>
__global__ void LayerNormForwardVecKernel(const bf16* x, const bf16* gamma, const bf16* beta,
                                          bf16* y, float* mean, float* rstd, int64_t rows,
                                          int64_t cols) {
  const int64_t r = blockIdx.x * int64_t{blockDim.x / kWarp} + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const int64_t nv = cols / 8;
  const bf16* xr = x + r * cols;
  float v[kVecs][8];
  float s = 0;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t c = lane + int64_t{i} * kWarp;
    if (c < nv) {
      Load8(xr + 8 * c, v[i]);
#pragma unroll
      for (int k = 0; k < 8; ++k) s += v[i][k];
    }
  }
  const float mu = WarpSum(s) / static_cast<float>(cols);
  float q = 0;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    if (lane + int64_t{i} * kWarp < nv) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float d = v[i][k] - mu;
        q += d * d;
      }
    }
  }
  const float rs = rsqrtf(WarpSum(q) / static_cast<float>(cols) + 1e-5f);
  bf16* yr = y + r * cols;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t c = lane + int64_t{i} * kWarp;
    if (c < nv) {
      float g[8], b[8], o[8];
      Load8(gamma + 8 * c, g);
      Load8(beta + 8 * c, b);
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] = (v[i][k] - mu) * rs * g[k] + b[k];
      Store8(yr + 8 * c, o);
    }
  }
  if (lane == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
}

// Backward reads the row twice (the sums, then dx), the second time from cache: holding dy * gamma
// and x-hat in registers would take 154 of them at 2048 columns (one block an SM).
template <int kVecs>
__global__ void LayerNormBackwardRowsVecKernel(const bf16* dy, const bf16* x, const bf16* gamma,
                                               const float* mean, const float* rstd, bf16* dx,
                                               int64_t rows, int64_t cols, const bf16* dres) {
  const int64_t r = blockIdx.x * int64_t{blockDim.x / kWarp} + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const int64_t nv = cols / 8;
  const float mu = mean[r], rs = rstd[r];
  const bf16* dyr = dy + r * cols;
  const bf16* xr = x + r * cols;
  float sg = 0, sgx = 0;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t c = lane + int64_t{i} * kWarp;
    if (c < nv) {
      float d[8], xv[8], w[8];
      Load8(dyr + 8 * c, d);
      Load8(xr + 8 * c, xv);
      Load8(gamma + 8 * c, w);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float g = d[k] * w[k];
        sg += g;
        sgx += g * (xv[k] - mu) * rs;
      }
    }
  }
  sg = WarpSum(sg) / static_cast<float>(cols);
  sgx = WarpSum(sgx) / static_cast<float>(cols);
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t c = lane + int64_t{i} * kWarp;
    if (c < nv) {
      float d[8], xv[8], w[8], o[8];
      Load8(dyr + 8 * c, d);
      Load8(xr + 8 * c, xv);
      Load8(gamma + 8 * c, w);
      if (dres != nullptr) {
        Load8(dres + r * cols + 8 * c, o);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = 0.0f;
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] += rs * (d[k] * w[k] - sg - (xv[k] - mu) * rs * sgx);
      Store8(dx + r * cols + 8 * c, o);
    }
  }
}

// The vectors a lane holds for rows of `cols` (1, 2, 4 or 8), or 0 where the vectorised kernels
// do not apply (Note [Vectorised row kernels]).
int RowVecs(int64_t cols, std::initializer_list<const void*> ptrs) {
  if (cols % 8 != 0 || cols > 8 * 256) return 0;
  for (const void* p : ptrs)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 0;
  const int64_t per_lane = (cols / 8 + kWarp - 1) / kWarp;
  return per_lane <= 1 ? 1 : per_lane <= 2 ? 2 : per_lane <= 4 ? 4 : 8;
}

// Column sums in two passes (as the fp32 kernels: gpt/ops_cuda.cu): each block sums a slab of
// rows for its columns into partial[slab][column], then one thread per column adds the slabs in
// order.
struct Slabs {
  int64_t rows, count;
};
Slabs ColumnSlabs(int64_t rows) {
  const int64_t per = std::max<int64_t>(128, (rows + 65534) / 65535);
  return {per, rows == 0 ? 1 : (rows + per - 1) / per};
}

// Slab partials of dgamma (rows [0, slabs) of partial) and dbeta (rows [slabs, 2 slabs)).
__global__ void LayerNormColumnPartialsKernel(const bf16* dy, const bf16* x, const float* mean,
                                              const float* rstd, float* partial, int64_t rows,
                                              int64_t cols, int64_t slab) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = blockIdx.y * slab, r1 = min(rows, r0 + slab);
  float ag = 0, ab = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const float d = F(dy[r * cols + c]);
    ag += d * (F(x[r * cols + c]) - mean[r]) * rstd[r];
    ab += d;
  }
  partial[blockIdx.y * cols + c] = ag;
  partial[(gridDim.y + blockIdx.y) * cols + c] = ab;
}

__global__ void ColumnPartialsKernel(const bf16* m, float* partial, int64_t rows, int64_t cols,
                                     int64_t slab) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = blockIdx.y * slab, r1 = min(rows, r0 + slab);
  float a = 0;
  for (int64_t r = r0; r < r1; ++r) a += F(m[r * cols + c]);
  partial[blockIdx.y * cols + c] = a;
}

// out[c] = (add ? out[c] : 0) + sum of partial[0..slabs)[c], in order (out may be null).
__global__ void ColumnTotalsKernel(const float* partial, int64_t slabs, int64_t cols, bf16* out,
                                   bool add) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= cols || out == nullptr) return;
  float a = add ? F(out[c]) : 0.0f;
  for (int64_t s = 0; s < slabs; ++s) a += partial[s * cols + c];
  out[c] = B(a);
}

// ---- the Llama family: RMSNorm (a warp per row), rotary embeddings, SwiGLU ------------------

__global__ void RmsNormForwardKernel(const bf16* x, const bf16* w, bf16* y, float* rstd,
                                     int64_t rows, int64_t cols, float eps) {
  const int64_t r = blockIdx.x * int64_t{blockDim.x / kWarp} + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const bf16* xr = x + r * cols;
  float ss = 0;
  for (int64_t j = lane; j < cols; j += kWarp) ss += F(xr[j]) * F(xr[j]);
  const float rs = rsqrtf(WarpSum(ss) / static_cast<float>(cols) + eps);
  bf16* yr = y + r * cols;
  for (int64_t j = lane; j < cols; j += kWarp) yr[j] = B(F(w[j]) * (F(xr[j]) * rs));
  if (lane == 0) rstd[r] = rs;
}

__global__ void RmsNormBackwardRowsKernel(const bf16* dy, const bf16* x, const bf16* w,
                                          const float* rstd, bf16* dx, int64_t rows, int64_t cols,
                                          const bf16* dres) {
  const int64_t r = blockIdx.x * int64_t{blockDim.x / kWarp} + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const bf16* dyr = dy + r * cols;
  const bf16* xr = x + r * cols;
  const float rs = rstd[r];
  float dot = 0;
  for (int64_t j = lane; j < cols; j += kWarp) dot += F(dyr[j]) * F(w[j]) * F(xr[j]) * rs;
  dot = WarpSum(dot) / static_cast<float>(cols);
  bf16* dxr = dx + r * cols;
  const bf16* dresr = dres != nullptr ? dres + r * cols : nullptr;
  for (int64_t j = lane; j < cols; j += kWarp) {
    const float g = rs * (F(dyr[j]) * F(w[j]) - F(xr[j]) * rs * dot);
    dxr[j] = B(dresr != nullptr ? F(dresr[j]) + g : g);
  }
}

__global__ void RmsNormColumnPartialsKernel(const bf16* dy, const bf16* x, const float* rstd,
                                            float* partial, int64_t rows, int64_t cols,
                                            int64_t slab) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = blockIdx.y * slab, r1 = min(rows, r0 + slab);
  float a = 0;
  for (int64_t r = r0; r < r1; ++r) a += F(dy[r * cols + c]) * F(x[r * cols + c]) * rstd[r];
  partial[blockIdx.y * cols + c] = a;
}

// One thread per (row, head, j < head_dim / 2): the pair (j, j + head_dim / 2) rotated.
__global__ void RopeKernel(bf16* x, int64_t rows, int64_t seq, int64_t heads, int64_t hd,
                           int64_t ld, gpt::Rope rope, float sign) {
  const int64_t half = hd / 2;
  TZ_GRID_STRIDE(i, rows * heads * half) {
    const int64_t j = i % half, h = (i / half) % heads, r = i / (half * heads);
    const float a = static_cast<float>(r % seq) * RopeInverseFrequency<float>(rope, j, hd);
    float sn, cs;
    sincosf(a, &sn, &cs);
    bf16* v = x + r * ld + h * hd;
    const float x1 = F(v[j]), x2 = F(v[j + half]);
    v[j] = B(x1 * cs - sign * x2 * sn);
    v[j + half] = B(x2 * cs + sign * x1 * sn);
  }
}

__global__ void SwigluForwardKernel(const bf16* g, const bf16* u, bf16* h, int64_t n) {
  TZ_GRID_STRIDE(i, n) {
    const float gv = F(g[i]);
    h[i] = B(gv / (1.0f + __expf(-gv)) * F(u[i]));
  }
}
__global__ void SwigluBackwardKernel(const bf16* dh, const bf16* g, const bf16* u, bf16* dg,
                                     bf16* du, int64_t n) {
  TZ_GRID_STRIDE(i, n) {
    const float gv = F(g[i]), uv = F(u[i]), d = F(dh[i]);
    const float sig = 1.0f / (1.0f + __expf(-gv));
    dg[i] = B(d * uv * sig * (1.0f + gv * (1.0f - sig)));
    du[i] = B(d * gv * sig);
  }
}

// ---- embeddings --------------------------------------------------------------------------------

__global__ void EmbeddingForwardKernel(const int32_t* tokens, const bf16* wte, const bf16* wpe,
                                       bf16* x, int64_t rows, int64_t seq, int64_t channels) {
  TZ_GRID_STRIDE(i, rows * channels) {
    const int64_t r = i / channels, c = i % channels;
    float v = F(wte[int64_t{tokens[r]} * channels + c]);
    if (wpe != nullptr) v += F(wpe[(r % seq) * channels + c]);
    x[i] = B(v);
  }
}

__global__ void EmbeddingTableKernel(const bf16* dx, const int32_t* order, const int32_t* starts,
                                     const int32_t* group_token, int64_t groups, bf16* dwte,
                                     bool add, int64_t channels) {
  TZ_GRID_STRIDE(i, groups * channels) {
    const int64_t g = i / channels, c = i % channels;
    float s = 0;
    for (int32_t k = starts[g]; k < starts[g + 1]; ++k)
      s += F(dx[int64_t{order[k]} * channels + c]);
    bf16* dst = dwte + int64_t{group_token[g]} * channels + c;
    *dst = B(add ? F(*dst) + s : s);
  }
}

__global__ void PositionKernel(const bf16* dx, bf16* dwpe, bool add, int64_t batch, int64_t seq,
                               int64_t channels) {
  TZ_GRID_STRIDE(i, seq * channels) {
    const int64_t t = i / channels, c = i % channels;
    float s = add ? F(dwpe[i]) : 0.0f;
    for (int64_t b = 0; b < batch; ++b) s += F(dx[(b * seq + t) * channels + c]);
    dwpe[i] = B(s);
  }
}

// ---- the classifier ----------------------------------------------------------------------------

constexpr int kRowThreads = 256;

// The block's sum of v, the same in every thread (a fixed tree: deterministic).
__device__ float BlockSum(float v, float* sh) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  v = WarpSum(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < kRowThreads / kWarp ? sh[lane] : 0.0f;
    t = WarpSum(t);
    if (lane == 0) sh[kRowThreads / kWarp] = t;
  }
  __syncthreads();
  const float total = sh[kRowThreads / kWarp];
  __syncthreads();
  return total;
}

// (max, first index of it) over the block.
__device__ void BlockArgMax(float& mx, int64_t& best, float* shv, int64_t* shi) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const float om = __shfl_xor_sync(0xffffffffu, mx, o);
    const int64_t ob = __shfl_xor_sync(0xffffffffu, best, o);
    if (om > mx || (om == mx && ob < best)) {
      mx = om;
      best = ob;
    }
  }
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) {
    shv[warp] = mx;
    shi[warp] = best;
  }
  __syncthreads();
  mx = shv[0];
  best = shi[0];
  for (int w = 1; w < kRowThreads / kWarp; ++w) {
    if (shv[w] > mx || (shv[w] == mx && shi[w] < best)) {
      mx = shv[w];
      best = shi[w];
    }
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kRowThreads)
    CrossEntropyKernel(const bf16* logits, const int32_t* targets, const float* mask,
                       const float* count, bf16* dlogits, int32_t* argmax, double* row_loss,
                       int64_t vocab, float scale) {
  __shared__ float shv[kRowThreads / kWarp + 1];
  __shared__ int64_t shi[kRowThreads / kWarp];
  const int64_t r = blockIdx.x;
  const bf16* l = logits + r * vocab;
  float mx = -INFINITY;
  int64_t best = vocab;
  for (int64_t j = threadIdx.x; j < vocab; j += kRowThreads) {
    const float v = F(l[j]);
    if (v > mx || (v == mx && j < best)) {
      mx = v;
      best = j;
    }
  }
  BlockArgMax(mx, best, shv, shi);
  if (best >= vocab) best = 0;  // no finite maximum (every logit -inf or NaN): the first index
  float s = 0;
  for (int64_t j = threadIdx.x; j < vocab; j += kRowThreads) s += __expf(F(l[j]) - mx);
  const float lse = mx + logf(BlockSum(s, shv));
  const float m = mask[r];
  const int64_t target = targets[r];
  if (threadIdx.x == 0) {
    if (argmax != nullptr) argmax[r] = static_cast<int32_t>(best);
    row_loss[r] = static_cast<double>(m) * (static_cast<double>(lse) - F(l[target]));
  }
  if (dlogits == nullptr) return;
  const float n = *count;
  const float w = n > 0 ? scale * m / n : 0.0f;
  bf16* d = dlogits + r * vocab;
  for (int64_t j = threadIdx.x; j < vocab; j += kRowThreads)
    d[j] = B(w * (__expf(F(l[j]) - lse) - (j == target ? 1.0f : 0.0f)));
}

__global__ void MaskCountKernel(const float* mask, int64_t rows, float* count) {
  __shared__ float sh[kRowThreads / kWarp + 1];
  float s = 0;
  for (int64_t i = threadIdx.x; i < rows; i += kRowThreads) s += mask[i];
  const float total = BlockSum(s, sh);
  if (threadIdx.x == 0) *count = total;
}

// One block: thread i sums rows i, i + 256, ... in order, then a fixed tree over the threads
// (a fixed order, so deterministic; not the rows' order).
__global__ void MeanLossKernel(const double* row_loss, const float* count, int64_t rows,
                               double* loss) {
  __shared__ double sh[kRowThreads];
  double s = 0;
  for (int64_t i = threadIdx.x; i < rows; i += kRowThreads) s += row_loss[i];
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int half = kRowThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) sh[threadIdx.x] += sh[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) *loss = *count > 0 ? sh[0] / static_cast<double>(*count) : 0.0;
}

}  // namespace

cudaError_t LayerNormForward(const bf16* x, const bf16* gamma, const bf16* beta, bf16* y,
                             float* mean, float* rstd, int64_t rows, int64_t cols,
                             cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  switch (RowVecs(cols, {x, gamma, beta, y})) {
#define TZ_LN_FWD(V)                                                                            \
  case V:                                                                                       \
    LayerNormForwardVecKernel<V>                                                                \
        <<<WarpBlocks(rows), kThreads, 0, stream>>>(x, gamma, beta, y, mean, rstd, rows, cols); \
    break;
    TZ_LN_FWD(1)
    TZ_LN_FWD(2)
    TZ_LN_FWD(4)
    TZ_LN_FWD(8)
#undef TZ_LN_FWD
    default:
      LayerNormForwardKernel<<<WarpBlocks(rows), kThreads, 0, stream>>>(x, gamma, beta, y, mean,
                                                                        rstd, rows, cols);
  }
  return cudaGetLastError();
}

int64_t LayerNormPartialFloats(int64_t rows, int64_t cols) {
  return 2 * ColumnSlabs(rows).count * cols;
}

cudaError_t LayerNormBackward(const bf16* dy, const bf16* x, const bf16* gamma, const float* mean,
                              const float* rstd, bf16* dx, bf16* dgamma, bool dgamma_add,
                              bf16* dbeta, bool dbeta_add, float* partial, int64_t rows,
                              int64_t cols, cudaStream_t stream, const bf16* dres) {
  if (rows == 0) return cudaSuccess;
  switch (RowVecs(cols, {dy, x, gamma, dx, dres})) {
#define TZ_LN_BWD(V)                                                              \
  case V:                                                                         \
    LayerNormBackwardRowsVecKernel<V><<<WarpBlocks(rows), kThreads, 0, stream>>>( \
        dy, x, gamma, mean, rstd, dx, rows, cols, dres);                          \
    break;
    TZ_LN_BWD(1)
    TZ_LN_BWD(2)
    TZ_LN_BWD(4)
    TZ_LN_BWD(8)
#undef TZ_LN_BWD
    default:
      LayerNormBackwardRowsKernel<<<WarpBlocks(rows), kThreads, 0, stream>>>(
          dy, x, gamma, mean, rstd, dx, rows, cols, dres);
  }
  const Slabs sl = ColumnSlabs(rows);
  LayerNormColumnPartialsKernel<<<dim3(Blocks(cols), static_cast<unsigned>(sl.count)), kThreads, 0,
                                  stream>>>(dy, x, mean, rstd, partial, rows, cols, sl.rows);
  ColumnTotalsKernel<<<Blocks(cols), kThreads, 0, stream>>>(partial, sl.count, cols, dgamma,
                                                            dgamma_add);
  ColumnTotalsKernel<<<Blocks(cols), kThreads, 0, stream>>>(partial + sl.count * cols, sl.count,
                                                            cols, dbeta, dbeta_add);
  return cudaGetLastError();
}

cudaError_t RmsNormForward(const bf16* x, const bf16* w, bf16* y, float* rstd, int64_t rows,
                           int64_t cols, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  RmsNormForwardKernel<<<WarpBlocks(rows), kThreads, 0, stream>>>(x, w, y, rstd, rows, cols, eps);
  return cudaGetLastError();
}

cudaError_t RmsNormBackward(const bf16* dy, const bf16* x, const bf16* w, const float* rstd,
                            bf16* dx, bf16* dw, bool dw_add, float* partial, int64_t rows,
                            int64_t cols, cudaStream_t stream, const bf16* dres) {
  if (rows == 0) return cudaSuccess;
  RmsNormBackwardRowsKernel<<<WarpBlocks(rows), kThreads, 0, stream>>>(dy, x, w, rstd, dx, rows,
                                                                       cols, dres);
  const Slabs sl = ColumnSlabs(rows);
  RmsNormColumnPartialsKernel<<<dim3(Blocks(cols), static_cast<unsigned>(sl.count)), kThreads, 0,
                                stream>>>(dy, x, rstd, partial, rows, cols, sl.rows);
  ColumnTotalsKernel<<<Blocks(cols), kThreads, 0, stream>>>(partial, sl.count, cols, dw, dw_add);
  return cudaGetLastError();
}

cudaError_t Rope(bf16* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t ld,
                 const gpt::Rope& rope, float sign, cudaStream_t stream) {
  const int64_t n = batch * seq * heads * (head_dim / 2);
  if (n == 0) return cudaSuccess;
  RopeKernel<<<Grid(n), kThreads, 0, stream>>>(x, batch * seq, seq, heads, head_dim, ld, rope,
                                               sign);
  return cudaGetLastError();
}

cudaError_t SwigluForward(const bf16* g, const bf16* u, bf16* h, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  SwigluForwardKernel<<<Grid(n), kThreads, 0, stream>>>(g, u, h, n);
  return cudaGetLastError();
}

cudaError_t SwigluBackward(const bf16* dh, const bf16* g, const bf16* u, bf16* dg, bf16* du,
                           int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  SwigluBackwardKernel<<<Grid(n), kThreads, 0, stream>>>(dh, g, u, dg, du, n);
  return cudaGetLastError();
}

int64_t ColumnPartialFloats(int64_t rows, int64_t cols) { return ColumnSlabs(rows).count * cols; }

cudaError_t ColumnSums(const bf16* m, bf16* out, bool add, float* partial, int64_t rows,
                       int64_t cols, cudaStream_t stream) {
  const Slabs sl = ColumnSlabs(rows);
  ColumnPartialsKernel<<<dim3(Blocks(cols), static_cast<unsigned>(sl.count)), kThreads, 0,
                         stream>>>(m, partial, rows, cols, sl.rows);
  ColumnTotalsKernel<<<Blocks(cols), kThreads, 0, stream>>>(partial, sl.count, cols, out, add);
  return cudaGetLastError();
}

cudaError_t GeluForward(const bf16* x, bf16* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  GeluForwardKernel<<<Grid(n), kThreads, 0, stream>>>(x, y, n);
  return cudaGetLastError();
}
cudaError_t GeluBackward(const bf16* dy, const bf16* x, bf16* dx, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  GeluBackwardKernel<<<Grid(n), kThreads, 0, stream>>>(dy, x, dx, n);
  return cudaGetLastError();
}
cudaError_t Add(const bf16* a, const bf16* b, bf16* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  AddKernel<<<Grid(n), kThreads, 0, stream>>>(a, b, y, n);
  return cudaGetLastError();
}
cudaError_t AddInPlace(bf16* y, const bf16* a, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  AddInPlaceKernel<<<Grid(n), kThreads, 0, stream>>>(y, a, n);
  return cudaGetLastError();
}

cudaError_t EmbeddingForward(const int32_t* tokens, const bf16* wte, const bf16* wpe, bf16* x,
                             int64_t rows, int64_t seq, int64_t channels, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  EmbeddingForwardKernel<<<Grid(rows * channels), kThreads, 0, stream>>>(tokens, wte, wpe, x, rows,
                                                                         seq, channels);
  return cudaGetLastError();
}

cudaError_t EmbeddingTableBackward(const bf16* dx, const int32_t* order, const int32_t* starts,
                                   const int32_t* group_token, int64_t groups, bf16* dwte, bool add,
                                   int64_t channels, cudaStream_t stream) {
  if (groups == 0) return cudaSuccess;
  EmbeddingTableKernel<<<Grid(groups * channels), kThreads, 0, stream>>>(
      dx, order, starts, group_token, groups, dwte, add, channels);
  return cudaGetLastError();
}

cudaError_t PositionBackward(const bf16* dx, bf16* dwpe, bool add, int64_t batch, int64_t seq,
                             int64_t channels, cudaStream_t stream) {
  if (seq == 0) return cudaSuccess;
  PositionKernel<<<Grid(seq * channels), kThreads, 0, stream>>>(dx, dwpe, add, batch, seq,
                                                                channels);
  return cudaGetLastError();
}

cudaError_t MaskCount(const float* mask, int64_t rows, float* count, cudaStream_t stream) {
  MaskCountKernel<<<1, kRowThreads, 0, stream>>>(mask, rows, count);
  return cudaGetLastError();
}

cudaError_t CrossEntropy(const bf16* logits, const int32_t* targets, const float* mask,
                         const float* count, bf16* dlogits, int32_t* argmax, double* row_loss,
                         int64_t rows, int64_t vocab, float scale, cudaStream_t stream) {
  for (int64_t r0 = 0; r0 < rows; r0 += 2147483647) {  // grid x's limit
    const int64_t n = rows - r0 < 2147483647 ? rows - r0 : 2147483647;
    CrossEntropyKernel<<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(
        logits + r0 * vocab, targets + r0, mask + r0, count,
        dlogits != nullptr ? dlogits + r0 * vocab : nullptr,
        argmax != nullptr ? argmax + r0 : nullptr, row_loss + r0, vocab, scale);
  }
  return cudaGetLastError();
}

cudaError_t MeanLoss(const double* row_loss, const float* count, int64_t rows, double* loss,
                     cudaStream_t stream) {
  MeanLossKernel<<<1, kRowThreads, 0, stream>>>(row_loss, count, rows, loss);
  return cudaGetLastError();
}

}  // namespace tierzero::gpt::cuda::bf16k
