// The Llama family's CPU ops (gpt/ops.h): RMSNorm, rotary position embeddings, SwiGLU. Written
// from Hugging Face's LlamaRMSNorm, LlamaRotaryEmbedding / apply_rotary_pos_emb and LlamaMLP.
// Deterministic as the other CPU ops: every output element written by one task in a fixed order.
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "gpt/ops.h"
#include "gpt/ops_internal.h"
#include "gpt/vec_kernels.h"

namespace tierzero::gpt::cpu {
namespace {

// Rotates each head of x by +angle (sign 1) or -angle (sign -1).
template <typename T>
void Rotate(T* x, int64_t batch, int64_t seq, int64_t heads, int64_t hd, int64_t ld,
            const Rope& rope, T sign) {
  const int64_t half = hd / 2;
  std::vector<T> inv(static_cast<size_t>(half));
  for (int64_t j = 0; j < half; ++j)
    inv[static_cast<size_t>(j)] = RopeInverseFrequency<T>(rope, j, hd);
  std::vector<T> cs(static_cast<size_t>(seq * half)), sn(cs.size());
  for (int64_t t = 0; t < seq; ++t) {
    for (int64_t j = 0; j < half; ++j) {
      const T a = static_cast<T>(t) * inv[static_cast<size_t>(j)];
      cs[static_cast<size_t>(t * half + j)] = std::cos(a);
      sn[static_cast<size_t>(t * half + j)] = std::sin(a);
    }
  }
  ParallelRows(batch * seq, heads * hd, [&](int64_t r) {
    const int64_t t = r % seq;
    const T* c = cs.data() + t * half;
    const T* s = sn.data() + t * half;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + r * ld + h * hd;
      for (int64_t j = 0; j < half; ++j) {
        const T x1 = v[j], x2 = v[j + half];
        v[j] = x1 * c[j] - sign * x2 * s[j];
        v[j + half] = x2 * c[j] + sign * x1 * s[j];
      }
    }
  });
}

// RMSNorm's weight gradient: dw += sum over rows of dy x rstd, per block of 64 columns, rows in
// order (the same bits on any thread count).
template <typename T>
void RmsNormWeightGrad(const T* dy, const T* x, const T* rstd, T* dw, int64_t rows, int64_t cols) {
  constexpr int64_t kBlock = 64;
  tbb::parallel_for(int64_t{0}, (cols + kBlock - 1) / kBlock, [&](int64_t blk) {
    const int64_t c0 = blk * kBlock, c1 = std::min(cols, c0 + kBlock);
    T acc[kBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const T* dyr = dy + r * cols;
      const T* xr = x + r * cols;
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += dyr[c] * xr[c] * rstd[r];
    }
    for (int64_t c = c0; c < c1; ++c) dw[c] += acc[c - c0];
  });
}

}  // namespace

template <typename T>
void RmsNormForward(const T* x, const T* w, T* y, T* rstd, int64_t rows, int64_t cols, double eps) {
  ParallelRows(rows, cols, [&](int64_t r) {
    const T* xr = x + r * cols;
    T ss = 0;
    for (int64_t j = 0; j < cols; ++j) ss += xr[j] * xr[j];
    const T rs = T(1) / std::sqrt(ss / static_cast<T>(cols) + static_cast<T>(eps));
    T* yr = y + r * cols;
    for (int64_t j = 0; j < cols; ++j) yr[j] = w[j] * (xr[j] * rs);
    rstd[r] = rs;
  });
}

template <typename T>
void RmsNormBackward(const T* dy, const T* x, const T* w, const T* rstd, T* dx, T* dw, int64_t rows,
                     int64_t cols) {
  ParallelRows(rows, cols, [&](int64_t r) {
    const T* dyr = dy + r * cols;
    const T* xr = x + r * cols;
    const T rs = rstd[r];
    T dot = 0;  // mean of (dy w) . xhat
    for (int64_t j = 0; j < cols; ++j) dot += dyr[j] * w[j] * xr[j] * rs;
    dot /= static_cast<T>(cols);
    T* dxr = dx + r * cols;
    for (int64_t j = 0; j < cols; ++j) dxr[j] = rs * (dyr[j] * w[j] - xr[j] * rs * dot);
  });
  RmsNormWeightGrad(dy, x, rstd, dw, rows, cols);
}

template <typename T>
void RopeForward(T* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t ld,
                 const Rope& rope) {
  Rotate(x, batch, seq, heads, head_dim, ld, rope, T(1));
}

template <typename T>
void RopeBackward(T* dx, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t ld,
                  const Rope& rope) {
  Rotate(dx, batch, seq, heads, head_dim, ld, rope, T(-1));
}

template <typename T>
void SwigluForward(const T* g, const T* u, T* h, int64_t n) {
  ParallelRows((n + 4095) / 4096, 4096, [&](int64_t blk) {
    const int64_t e = std::min(n, (blk + 1) * 4096);
    for (int64_t i = blk * 4096; i < e; ++i) {
      const T sig = T(1) / (T(1) + std::exp(-g[i]));
      h[i] = g[i] * sig * u[i];
    }
  });
}

template <typename T>
void SwigluBackward(const T* dh, const T* g, const T* u, T* dg, T* du, int64_t n) {
  ParallelRows((n + 4095) / 4096, 4096, [&](int64_t blk) {
    const int64_t e = std::min(n, (blk + 1) * 4096);
    for (int64_t i = blk * 4096; i < e; ++i) {
      const T sig = T(1) / (T(1) + std::exp(-g[i]));
      const T silu = g[i] * sig;
      const T d = dh[i];  // dh may be dg or du
      const T uu = u[i];
      dg[i] = d * uu * sig * (T(1) + g[i] * (T(1) - sig));
      du[i] = d * silu;
    }
  });
}

// fp32: Note [SwiGLU and RMSNorm through the same kernels] (vec_kernels.h); the generic versions
// above are the fp64 reference the tests compare with.
template <>
void RmsNormForward<float>(const float* x, const float* w, float* y, float* rstd, int64_t rows,
                           int64_t cols, double eps) {
  const internal::VectorKernels& k = internal::ActiveVectorKernels();
  ParallelRows(rows, cols, [&](int64_t r) {
    const float* xr = x + r * cols;
    const float ss = k.dot(xr, xr, cols);
    const float rs = 1.0f / std::sqrt(ss / static_cast<float>(cols) + static_cast<float>(eps));
    float* yr = y + r * cols;
    for (int64_t j = 0; j < cols; ++j) yr[j] = w[j] * (xr[j] * rs);
    rstd[r] = rs;
  });
}

template <>
void RmsNormBackward<float>(const float* dy, const float* x, const float* w, const float* rstd,
                            float* dx, float* dw, int64_t rows, int64_t cols) {
  const internal::VectorKernels& k = internal::ActiveVectorKernels();
  ParallelRows(rows, cols, [&](int64_t r) {
    const float* dyr = dy + r * cols;
    const float* xr = x + r * cols;
    const float rs = rstd[r];
    // The mean of (dy w) . xhat, dy w in a scratch row of this thread's.
    thread_local std::vector<float> dyw;
    dyw.resize(static_cast<size_t>(cols));
    for (int64_t j = 0; j < cols; ++j) dyw[static_cast<size_t>(j)] = dyr[j] * w[j];
    const float dot = k.dot(dyw.data(), xr, cols) * rs / static_cast<float>(cols);
    float* dxr = dx + r * cols;
    for (int64_t j = 0; j < cols; ++j)
      dxr[j] = rs * (dyw[static_cast<size_t>(j)] - xr[j] * rs * dot);
  });
  RmsNormWeightGrad(dy, x, rstd, dw, rows, cols);
}

template <>
void SwigluForward<float>(const float* g, const float* u, float* h, int64_t n) {
  const internal::VectorKernels& k = internal::ActiveVectorKernels();
  ParallelRows((n + 4095) / 4096, 4096, [&](int64_t blk) {
    const int64_t b = blk * 4096, e = std::min(n, b + 4096);
    k.swiglu_forward(g + b, u + b, h + b, e - b);
  });
}

template <>
void SwigluBackward<float>(const float* dh, const float* g, const float* u, float* dg, float* du,
                           int64_t n) {
  const internal::VectorKernels& k = internal::ActiveVectorKernels();
  ParallelRows((n + 4095) / 4096, 4096, [&](int64_t blk) {
    const int64_t b = blk * 4096, e = std::min(n, b + 4096);
    k.swiglu_backward(dh + b, g + b, u + b, dg + b, du + b, e - b);
  });
}

#define TZ_INSTANTIATE(T)                                                                      \
  template void RmsNormForward<T>(const T*, const T*, T*, T*, int64_t, int64_t, double);       \
  template void RmsNormBackward<T>(const T*, const T*, const T*, const T*, T*, T*, int64_t,    \
                                   int64_t);                                                   \
  template void RopeForward<T>(T*, int64_t, int64_t, int64_t, int64_t, int64_t, const Rope&);  \
  template void RopeBackward<T>(T*, int64_t, int64_t, int64_t, int64_t, int64_t, const Rope&); \
  template void SwigluForward<T>(const T*, const T*, T*, int64_t);                             \
  template void SwigluBackward<T>(const T*, const T*, const T*, T*, T*, int64_t);

TZ_INSTANTIATE(float)
TZ_INSTANTIATE(double)
#undef TZ_INSTANTIATE

}  // namespace tierzero::gpt::cpu
