// GPT operations on the CPU, forward and backward (models/gpt).
//
// Every op is a template over the element type: float is what training runs (matrix products
// through oneDNN's sgemm, elementwise loops vectorised by the compiler, rows split over oneTBB),
// double is what the tests run against central finite differences (products by plain loops).
// Layouts are row-major. "rows" is batch x sequence. Backward ops write (=) their input
// gradients and add (+=) into parameter gradients, so a caller zeroes parameter gradients once
// and can accumulate over uses.
//
// Determinism: every output element is written by one task in a fixed order (reductions over
// rows, such as bias and LayerNorm parameter gradients, run per column), so results do not
// depend on how oneTBB splits the work; with a fixed thread count sgemm is deterministic too.
// The same inputs therefore give bit-identical outputs run to run.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>

#include "gpt/rope.h"

namespace tierzero::gpt::cpu {

// C = alpha * op(A) * op(B) + beta * C, op(X) = X or X^T; A is M x K after op, B is K x N.
template <typename T>
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

// y[r] = x[r] W + bias; x: rows x in, W: in x out, y: rows x out. bias may be null.
template <typename T>
void LinearForward(const T* x, const T* w, const T* bias, T* y, int64_t rows, int64_t in,
                   int64_t out);
// dx = dy W^T (written); dw += x^T dy; dbias += column sums of dy (dbias may be null).
template <typename T>
void LinearBackward(const T* dy, const T* x, const T* w, T* dx, T* dw, T* dbias, int64_t rows,
                    int64_t in, int64_t out);

// The same with W stored out x in (nn.Linear's layout; the LM head's tied embedding):
// y[r] = x[r] W^T + bias; dx = dy W (written); dw += dy^T x; dbias += column sums of dy.
template <typename T>
void LinearForwardOutIn(const T* x, const T* w, const T* bias, T* y, int64_t rows, int64_t in,
                        int64_t out);
template <typename T>
void LinearBackwardOutIn(const T* dy, const T* x, const T* w, T* dx, T* dw, T* dbias, int64_t rows,
                         int64_t in, int64_t out);

// LayerNorm over the last dimension (eps 1e-5); mean and rstd (rows) are saved for backward.
template <typename T>
void LayerNormForward(const T* x, const T* gamma, const T* beta, T* y, T* mean, T* rstd,
                      int64_t rows, int64_t cols);
// dx written; dgamma, dbeta added.
template <typename T>
void LayerNormBackward(const T* dy, const T* x, const T* gamma, const T* mean, const T* rstd, T* dx,
                       T* dgamma, T* dbeta, int64_t rows, int64_t cols);

// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <typename T>
void GeluForward(const T* x, T* y, int64_t n);
// dx = dy * gelu'(x) (written).
template <typename T>
void GeluBackward(const T* dy, const T* x, T* dx, int64_t n);

// Causal multi-head self-attention on qkv (batch x seq x 3C: q, k, v, heads of C/heads each).
// out: batch x seq x C (heads concatenated); probs: batch x heads x seq x seq (saved).
template <typename T>
void AttentionForward(const T* qkv, T* out, T* probs, int64_t batch, int64_t seq, int64_t channels,
                      int64_t heads);
// dqkv written.
template <typename T>
void AttentionBackward(const T* dout, const T* qkv, const T* probs, T* dqkv, int64_t batch,
                       int64_t seq, int64_t channels, int64_t heads);

// The general form: q rows of heads x head_dim, k and v rows of kv_heads x head_dim (grouped-
// query attention: query head h reads key/value head h / (heads / kv_heads)), each matrix's rows
// ld apart (GPT-2's fused rows: q, k, v at offsets 0, C, 2C, ld 3C). out rows heads x head_dim,
// contiguous; probs batch x heads x seq x seq. Backward writes dq, dk, dv (strided as q, k, v).
struct AttnShape {
  int64_t batch, seq, heads, kv_heads, head_dim, ld_q, ld_k, ld_v;
};
template <typename T>
void AttentionForward(const T* q, const T* k, const T* v, T* out, T* probs, const AttnShape& s);
template <typename T>
void AttentionBackward(const T* dout, const T* q, const T* k, const T* v, const T* probs, T* dq,
                       T* dk, T* dv, const AttnShape& s);

// RMSNorm over the last dimension, as Hugging Face's Llama: y = w x / sqrt(mean(x^2) + eps);
// rstd (rows) saved. Backward writes dx and adds into dw.
template <typename T>
void RmsNormForward(const T* x, const T* w, T* y, T* rstd, int64_t rows, int64_t cols, double eps);
template <typename T>
void RmsNormBackward(const T* dy, const T* x, const T* w, const T* rstd, T* dx, T* dw, int64_t rows,
                     int64_t cols);

// Rotary position embeddings as Hugging Face's Llama applies them (rotate_half): for each head of
// x (rows of batch x seq, `heads` heads of head_dim, rows ld apart, in place) and j < head_dim/2,
// with a = t inv_freq[j], inv_freq[j] as RopeInverseFrequency (gpt/rope.h, in T):
// x[j] <- x[j] cos a - x[j + hd/2] sin a, x[j + hd/2] <- x[j + hd/2] cos a + x[j] sin a.
// Backward applies the inverse rotation to the gradient, in place.
template <typename T>
void RopeForward(T* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t ld,
                 const Rope& rope);
template <typename T>
void RopeBackward(T* dx, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t ld,
                  const Rope& rope);

// SwiGLU's gate: h = silu(g) u (silu(g) = g sigmoid(g)); backward writes dg and du.
template <typename T>
void SwigluForward(const T* g, const T* u, T* h, int64_t n);
template <typename T>
void SwigluBackward(const T* dh, const T* g, const T* u, T* dg, T* du, int64_t n);

// x[b, t] = wte[tokens[b, t]] + wpe[t] (wpe may be null: no learned positions).
template <typename T>
void EmbeddingForward(const int32_t* tokens, const T* wte, const T* wpe, T* x, int64_t batch,
                      int64_t seq, int64_t channels);
// dwte[token] += dx, dwpe[t] += dx (dwpe may be null; serial over rows: deterministic).
template <typename T>
void EmbeddingBackward(const int32_t* tokens, const T* dx, T* dwte, T* dwpe, int64_t batch,
                       int64_t seq, int64_t channels);

// Softmax cross-entropy over `vocab` logits per row, weighted by mask (0 or 1): returns
// sum(mask * -log p[target]) / sum(mask) (0 when the mask is empty), writes
// dlogits = scale * mask * (p - onehot) / sum(mask) when dlogits is not null, and the argmax per
// row into `argmax` when not null.
template <typename T>
double CrossEntropy(const T* logits, const int32_t* targets, const float* mask, T* dlogits,
                    int32_t* argmax, int64_t rows, int64_t vocab, double scale);

// y = a + b (elementwise), and y += a.
template <typename T>
void Add(const T* a, const T* b, T* y, int64_t n);
template <typename T>
void AddInPlace(T* y, const T* a, int64_t n);

}  // namespace tierzero::gpt::cpu
