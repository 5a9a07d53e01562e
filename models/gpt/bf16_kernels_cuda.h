// The GPT's element-wise kernels for bf16 activations on a GPU (Note [Activation types] in
// gpt/backend.h): bf16 in and out, fp32 arithmetic, fp32 statistics. The products are cuBLASLt's
// (gpt/lt_matmul.h) and attention the fused kernels (gpt/flash_attention_cuda.h); these are the
// rest of the bf16 backend (gpt/backend_cuda_bf16.cc). Each launcher enqueues on `stream` and
// returns the launch error, if any.
//
// Determinism: every output element is written by one thread in a fixed order (column sums over
// fixed slabs of rows, then the slabs in order; an embedding row's gradient summed over its
// occurrences in batch order), so a run repeats bit for bit.
//
// Included by CUDA and C++ files (cuda_bf16.h compiles in both).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gpt/rope.h"

namespace tierzero::gpt::cuda::bf16k {

using bf16 = __nv_bfloat16;

// LayerNorm (eps 1e-5) of each row: y, and mean and rstd in fp32.
cudaError_t LayerNormForward(const bf16* x, const bf16* gamma, const bf16* beta, bf16* y,
                             float* mean, float* rstd, int64_t rows, int64_t cols,
                             cudaStream_t stream);
// dx (written: with `dres`, dres + the norm's backward, summed in fp32 and rounded once); dgamma
// and dbeta written or, with `add`, added to (each may be null). `partial` is scratch of
// LayerNormPartialFloats(rows, cols) floats.
int64_t LayerNormPartialFloats(int64_t rows, int64_t cols);
cudaError_t LayerNormBackward(const bf16* dy, const bf16* x, const bf16* gamma, const float* mean,
                              const float* rstd, bf16* dx, bf16* dgamma, bool dgamma_add,
                              bf16* dbeta, bool dbeta_add, float* partial, int64_t rows,
                              int64_t cols, cudaStream_t stream, const bf16* dres = nullptr);

// RMSNorm (Llama's, eps given): y and rstd (fp32); backward writes dx (plus `dres`, as
// LayerNormBackward) and writes (or, with `add`, adds to) dw; `partial` as ColumnPartialFloats.
cudaError_t RmsNormForward(const bf16* x, const bf16* w, bf16* y, float* rstd, int64_t rows,
                           int64_t cols, float eps, cudaStream_t stream);
cudaError_t RmsNormBackward(const bf16* dy, const bf16* x, const bf16* w, const float* rstd,
                            bf16* dx, bf16* dw, bool dw_add, float* partial, int64_t rows,
                            int64_t cols, cudaStream_t stream, const bf16* dres = nullptr);
// Rotary embeddings in place on the heads of x (rows ld apart); sign -1 rotates back (backward).
// The angles as Hugging Face computes them in fp32 (cpu::RopeForward).
cudaError_t Rope(bf16* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t ld,
                 const gpt::Rope& rope, float sign, cudaStream_t stream);
// h = silu(g) u; backward writes dg and du.
cudaError_t SwigluForward(const bf16* g, const bf16* u, bf16* h, int64_t n, cudaStream_t stream);
cudaError_t SwigluBackward(const bf16* dh, const bf16* g, const bf16* u, bf16* dg, bf16* du,
                           int64_t n, cudaStream_t stream);

// out[c] = (add ? out[c] : 0) + the sum over rows of m[r, c]; `partial` as ColumnPartialFloats.
int64_t ColumnPartialFloats(int64_t rows, int64_t cols);
cudaError_t ColumnSums(const bf16* m, bf16* out, bool add, float* partial, int64_t rows,
                       int64_t cols, cudaStream_t stream);

// GELU (tanh) and its backward (dx may be dy).
cudaError_t GeluForward(const bf16* x, bf16* y, int64_t n, cudaStream_t stream);
cudaError_t GeluBackward(const bf16* dy, const bf16* x, bf16* dx, int64_t n, cudaStream_t stream);
// y = a + b; y += a.
cudaError_t Add(const bf16* a, const bf16* b, bf16* y, int64_t n, cudaStream_t stream);
cudaError_t AddInPlace(bf16* y, const bf16* a, int64_t n, cudaStream_t stream);

// x[b, t] = wte[tokens[b, t]] + wpe[t] (wpe may be null).
cudaError_t EmbeddingForward(const int32_t* tokens, const bf16* wte, const bf16* wpe, bf16* x,
                             int64_t rows, int64_t seq, int64_t channels, cudaStream_t stream);
// The token table's gradient without contention: `order` (rows entries) lists the rows grouped
// by token, `starts` (groups + 1 entries) where each group begins in it, `group_token` each
// group's token; one thread per (group, column) sums its rows in order in fp32 and writes (or,
// with `add`, adds to) the table's row once. A written table is zeroed first by the caller.
cudaError_t EmbeddingTableBackward(const bf16* dx, const int32_t* order, const int32_t* starts,
                                   const int32_t* group_token, int64_t groups, bf16* dwte, bool add,
                                   int64_t channels, cudaStream_t stream);
// dwpe[t] = (add ? dwpe[t] : 0) + the sum over the batch of dx[b, t], b in order.
cudaError_t PositionBackward(const bf16* dx, bf16* dwpe, bool add, int64_t batch, int64_t seq,
                             int64_t channels, cudaStream_t stream);

// A block per row of bf16 logits: row_loss[r] = mask[r] (logsumexp - logit[target]) in double,
// dlogits (may be null) = scale mask (softmax - onehot) / count, argmax (may be null) the first
// index of the maximum; count (one float on the device) = the mask's sum, from MaskCount.
cudaError_t MaskCount(const float* mask, int64_t rows, float* count, cudaStream_t stream);
cudaError_t CrossEntropy(const bf16* logits, const int32_t* targets, const float* mask,
                         const float* count, bf16* dlogits, int32_t* argmax, double* row_loss,
                         int64_t rows, int64_t vocab, float scale, cudaStream_t stream);
// *loss = the sum of row_loss / count (0 when the mask is empty), summed in a fixed order.
cudaError_t MeanLoss(const double* row_loss, const float* count, int64_t rows, double* loss,
                     cudaStream_t stream);

}  // namespace tierzero::gpt::cuda::bf16k
