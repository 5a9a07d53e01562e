// Causal attention on the CPU (gpt/ops.h): multi-head and grouped-query, q, k and v each a
// strided matrix (GPT-2's fused [q | k | v] rows are one layout of it).
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "gpt/ops.h"
#include "gpt/ops_internal.h"
#include "gpt/vec_kernels.h"

namespace tierzero::gpt::cpu {
namespace {

using detail::SgemmOnThisThread;

// Query head h reads key/value head h / group.
int64_t Group(const AttnShape& s) { return s.heads / s.kv_heads; }

// Attention by loops over the causal triangle: the fp64 reference, and fp32 on short rows
// (Note [Attention as matrix products]).
template <typename T>
void AttentionForwardLoops(const T* qm, const T* km, const T* vm, T* out, T* probs,
                           const AttnShape& s) {
  const int64_t hd = s.head_dim, seq = s.seq, oc = s.heads * hd;
  const T scale = T(1) / std::sqrt(static_cast<T>(hd));
  ParallelRows(s.batch * s.heads, seq * seq * hd, [&](int64_t bh) {
    const int64_t b = bh / s.heads, h = bh % s.heads, kvh = h / Group(s);
    T* p = probs + bh * seq * seq;
    for (int64_t t = 0; t < seq; ++t) {
      const T* q = qm + (b * seq + t) * s.ld_q + h * hd;
      T* pr = p + t * seq;
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t u = 0; u <= t; ++u) {
        const T* k = km + (b * seq + u) * s.ld_k + kvh * hd;
        T dot = 0;
        for (int64_t d = 0; d < hd; ++d) dot += q[d] * k[d];
        pr[u] = dot * scale;
        mx = std::max(mx, pr[u]);
      }
      T sum = 0;
      for (int64_t u = 0; u <= t; ++u) {
        pr[u] = std::exp(pr[u] - mx);
        sum += pr[u];
      }
      const T inv = T(1) / sum;
      for (int64_t u = 0; u <= t; ++u) pr[u] *= inv;
      for (int64_t u = t + 1; u < seq; ++u) pr[u] = 0;
      T* o = out + (b * seq + t) * oc + h * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] = 0;
      for (int64_t u = 0; u <= t; ++u) {
        const T* v = vm + (b * seq + u) * s.ld_v + kvh * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] += pr[u] * v[d];
      }
    }
  });
}

// One task per (batch, key/value head): its query heads in order add into its dk and dv.
template <typename T>
void AttentionBackwardLoops(const T* dout, const T* qm, const T* km, const T* vm, const T* probs,
                            T* dqm, T* dkm, T* dvm, const AttnShape& s) {
  const int64_t hd = s.head_dim, seq = s.seq, oc = s.heads * hd, group = Group(s);
  const T scale = T(1) / std::sqrt(static_cast<T>(hd));
  ParallelRows(s.batch * s.kv_heads, group * seq * seq * hd, [&](int64_t bkv) {
    const int64_t b = bkv / s.kv_heads, kvh = bkv % s.kv_heads;
    for (int64_t t = 0; t < seq; ++t) {
      T* dk = dkm + (b * seq + t) * s.ld_k + kvh * hd;
      T* dv = dvm + (b * seq + t) * s.ld_v + kvh * hd;
      for (int64_t i = 0; i < hd; ++i) dk[i] = dv[i] = 0;
    }
    std::vector<T> dp(static_cast<size_t>(seq));
    for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
      const T* p = probs + (b * s.heads + h) * seq * seq;
      for (int64_t t = 0; t < seq; ++t) {
        T* dq = dqm + (b * seq + t) * s.ld_q + h * hd;
        for (int64_t i = 0; i < hd; ++i) dq[i] = 0;
      }
      for (int64_t t = 0; t < seq; ++t) {
        const T* pr = p + t * seq;
        const T* dor = dout + (b * seq + t) * oc + h * hd;
        T dot_pd = 0;
        for (int64_t u = 0; u <= t; ++u) {
          const T* v = vm + (b * seq + u) * s.ld_v + kvh * hd;
          T* dv = dvm + (b * seq + u) * s.ld_v + kvh * hd;
          T acc = 0;
          for (int64_t d = 0; d < hd; ++d) {
            acc += dor[d] * v[d];
            dv[d] += pr[u] * dor[d];
          }
          dp[static_cast<size_t>(u)] = acc;
          dot_pd += pr[u] * acc;
        }
        const T* q = qm + (b * seq + t) * s.ld_q + h * hd;
        T* dq = dqm + (b * seq + t) * s.ld_q + h * hd;
        for (int64_t u = 0; u <= t; ++u) {
          const T ds = pr[u] * (dp[static_cast<size_t>(u)] - dot_pd) * scale;
          const T* k = km + (b * seq + u) * s.ld_k + kvh * hd;
          T* dk = dkm + (b * seq + u) * s.ld_k + kvh * hd;
          for (int64_t d = 0; d < hd; ++d) {
            dq[d] += ds * k[d];
            dk[d] += ds * q[d];
          }
        }
      }
    }
  });
}

// GPT-2's fused rows: q, k, v at column offsets 0, C, 2C of 3C-wide rows.
AttnShape FusedShape(int64_t batch, int64_t seq, int64_t channels, int64_t heads) {
  return {batch, seq, heads, heads, channels / heads, 3 * channels, 3 * channels, 3 * channels};
}

}  // namespace

template <typename T>
void AttentionForward(const T* q, const T* k, const T* v, T* out, T* probs, const AttnShape& s) {
  AttentionForwardLoops(q, k, v, out, probs, s);
}

template <typename T>
void AttentionBackward(const T* dout, const T* q, const T* k, const T* v, const T* probs, T* dq,
                       T* dk, T* dv, const AttnShape& s) {
  AttentionBackwardLoops(dout, q, k, v, probs, dq, dk, dv, s);
}

// Note [Attention as matrix products]
// In fp32 each (batch, head) pair's attention is products of its strided slices of q, k and v
// (forward: S = Q K^T, O = P V; backward: dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q), each
// one single-threaded sgemm on the calling thread, with the pairs spread over oneTBB (in
// backward, the (batch, key/value head) pairs: a group's query heads add into its dK and dV in
// order). The products cover the whole seq x seq square although the mask zeroes half of it:
// sgemm's rate on the full square beats loops over the triangle by far (the loops were about a
// fifth of a 128-token step). The causal softmax and its backward run on each row's triangle
// part (Note [Softmax rows in sixteen partial sums], vec_kernels.h); the probabilities above the
// diagonal are stored as exact zeros, so the products add nothing from them. For short rows
// (the default's 9 tokens) sgemm's per-call cost exceeds the loops' work, so below
// kAttentionGemmMinSeq tokens the loops (the generic versions above) run instead.
constexpr int64_t kAttentionGemmMinSeq = 16;

template <>
void AttentionForward<float>(const float* qm, const float* km, const float* vm, float* out,
                             float* probs, const AttnShape& s) {
  if (s.seq < kAttentionGemmMinSeq) {
    AttentionForwardLoops(qm, km, vm, out, probs, s);
    return;
  }
  const int64_t hd = s.head_dim, seq = s.seq, oc = s.heads * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const internal::VectorKernels& vk = internal::ActiveVectorKernels();
  tbb::parallel_for(int64_t{0}, s.batch * s.heads, [&](int64_t bh) {
    const int64_t b = bh / s.heads, h = bh % s.heads, kvh = h / Group(s);
    const float* q = qm + b * seq * s.ld_q + h * hd;
    const float* k = km + b * seq * s.ld_k + kvh * hd;
    const float* v = vm + b * seq * s.ld_v + kvh * hd;
    float* p = probs + bh * seq * seq;
    SgemmOnThisThread(false, true, seq, seq, hd, scale, q, s.ld_q, k, s.ld_k, 0.0f, p, seq);
    for (int64_t t = 0; t < seq; ++t) {
      float* pr = p + t * seq;
      vk.softmax_forward(pr, t + 1);
      std::fill(pr + t + 1, pr + seq, 0.0f);
    }
    SgemmOnThisThread(false, false, seq, hd, seq, 1.0f, p, seq, v, s.ld_v, 0.0f,
                      out + b * seq * oc + h * hd, oc);
  });
}

template <>
void AttentionBackward<float>(const float* dout, const float* qm, const float* km, const float* vm,
                              const float* probs, float* dqm, float* dkm, float* dvm,
                              const AttnShape& s) {
  if (s.seq < kAttentionGemmMinSeq) {
    AttentionBackwardLoops(dout, qm, km, vm, probs, dqm, dkm, dvm, s);
    return;
  }
  const int64_t hd = s.head_dim, seq = s.seq, oc = s.heads * hd, group = Group(s);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const internal::VectorKernels& vk = internal::ActiveVectorKernels();
  tbb::parallel_for(int64_t{0}, s.batch * s.kv_heads, [&](int64_t bkv) {
    // dS for this pair; one buffer per thread, grown once.
    thread_local std::vector<float> ds_buffer;
    ds_buffer.resize(static_cast<size_t>(seq * seq));
    float* ds = ds_buffer.data();
    const int64_t b = bkv / s.kv_heads, kvh = bkv % s.kv_heads;
    const float* k = km + b * seq * s.ld_k + kvh * hd;
    const float* v = vm + b * seq * s.ld_v + kvh * hd;
    float* dk = dkm + b * seq * s.ld_k + kvh * hd;
    float* dv = dvm + b * seq * s.ld_v + kvh * hd;
    for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
      const float beta = h == kvh * group ? 0.0f : 1.0f;  // the group's first head writes
      const float* q = qm + b * seq * s.ld_q + h * hd;
      float* dq = dqm + b * seq * s.ld_q + h * hd;
      const float* p = probs + (b * s.heads + h) * seq * seq;
      const float* dor = dout + b * seq * oc + h * hd;
      SgemmOnThisThread(true, false, seq, hd, seq, 1.0f, p, seq, dor, oc, beta, dv, s.ld_v);
      SgemmOnThisThread(false, true, seq, seq, hd, 1.0f, dor, oc, v, s.ld_v, 0.0f, ds, seq);
      for (int64_t t = 0; t < seq; ++t) {
        float* dsr = ds + t * seq;
        vk.softmax_backward(p + t * seq, dsr, t + 1, scale);
        std::fill(dsr + t + 1, dsr + seq, 0.0f);
      }
      SgemmOnThisThread(false, false, seq, hd, seq, 1.0f, ds, seq, k, s.ld_k, 0.0f, dq, s.ld_q);
      SgemmOnThisThread(true, false, seq, hd, seq, 1.0f, ds, seq, q, s.ld_q, beta, dk, s.ld_k);
    }
  });
}

template <typename T>
void AttentionForward(const T* qkv, T* out, T* probs, int64_t batch, int64_t seq, int64_t channels,
                      int64_t heads) {
  AttentionForward<T>(qkv, qkv + channels, qkv + 2 * channels, out, probs,
                      FusedShape(batch, seq, channels, heads));
}

template <typename T>
void AttentionBackward(const T* dout, const T* qkv, const T* probs, T* dqkv, int64_t batch,
                       int64_t seq, int64_t channels, int64_t heads) {
  AttentionBackward<T>(dout, qkv, qkv + channels, qkv + 2 * channels, probs, dqkv, dqkv + channels,
                       dqkv + 2 * channels, FusedShape(batch, seq, channels, heads));
}

#define TZ_INSTANTIATE(T)                                                                          \
  template void AttentionForward<T>(const T*, T*, T*, int64_t, int64_t, int64_t, int64_t);         \
  template void AttentionBackward<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t,  \
                                     int64_t);                                                     \
  template void AttentionForward<T>(const T*, const T*, const T*, T*, T*, const AttnShape&);       \
  template void AttentionBackward<T>(const T*, const T*, const T*, const T*, const T*, T*, T*, T*, \
                                     const AttnShape&);

TZ_INSTANTIATE(float)
TZ_INSTANTIATE(double)
#undef TZ_INSTANTIATE

}  // namespace tierzero::gpt::cpu
