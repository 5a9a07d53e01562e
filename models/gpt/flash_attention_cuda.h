// Fused causal attention on bf16 tensor cores (Note [Fused causal attention], in
// flash_attention_cuda.cu): the GPT's attention as three kernels that never write the T x T score
// matrix. Forward keeps each row's log-sum-exp (batch x heads x seq floats) in place of the
// probabilities; backward recomputes the probabilities from it. The contracts are
// CudaOps::AttentionForward/Backward's (fp32 in and out, qkv rows [q | k | v] of 3C, heads of
// C / H; or bf16 in and out for the bf16 backend) with `state` the log-sum-exps (fp32), within bf16
// rounding of the CPU ops (tests/gpt/ops_cuda_test.cc); every output element is written by one
// thread in a fixed order, so a run repeats bit for bit. Included only by CUDA files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tierzero::gpt::cuda {

// Head widths: FusedAttentionHeadWidth (gpt/backend.h); others return cudaErrorInvalidValue.
// out (B x T x C) and lse (B x H x T) from qkv (B x T x 3C). Returns the launch error, if any.
cudaError_t FusedAttentionForward(const float* qkv, float* out, float* lse, int64_t batch,
                                  int64_t seq, int64_t channels, int64_t heads,
                                  cudaStream_t stream);
cudaError_t FusedAttentionForward(const __nv_bfloat16* qkv, __nv_bfloat16* out, float* lse,
                                  int64_t batch, int64_t seq, int64_t channels, int64_t heads,
                                  cudaStream_t stream);

// dqkv (written) from dout, qkv and the forward's out and lse; `rowdot` is scratch of
// B x H x T floats (each query row's dout . out).
cudaError_t FusedAttentionBackward(const float* dout, const float* qkv, const float* out,
                                   const float* lse, float* rowdot, float* dqkv, int64_t batch,
                                   int64_t seq, int64_t channels, int64_t heads,
                                   cudaStream_t stream);
cudaError_t FusedAttentionBackward(const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                   const __nv_bfloat16* out, const float* lse, float* rowdot,
                                   __nv_bfloat16* dqkv, int64_t batch, int64_t seq,
                                   int64_t channels, int64_t heads, cudaStream_t stream);

// The general form (bf16): q rows of heads x head_dim and k, v rows of kv_heads x head_dim,
// each ld elements apart (grouped-query attention: query head h reads key/value head
// h / (heads / kv_heads)); out and dout rows of heads x head_dim, ld_o apart; lse B x H x T.
// Backward writes dq, dk, dv strided as q, k, v (each key/value head's gradient summed over its
// query heads in order: no atomics). Every matrix 16-byte aligned, every row stride a multiple
// of 8 elements.
struct FlashShape {
  int64_t batch, seq, heads, kv_heads, head_dim, ld_q, ld_k, ld_v, ld_o;
};
cudaError_t FlashAttentionForward(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                  const __nv_bfloat16* v, __nv_bfloat16* out, float* lse,
                                  const FlashShape& s, cudaStream_t stream);
cudaError_t FlashAttentionBackward(const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                   const __nv_bfloat16* k, const __nv_bfloat16* v,
                                   const __nv_bfloat16* out, const float* lse, float* rowdot,
                                   __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                                   const FlashShape& s, cudaStream_t stream);

}  // namespace tierzero::gpt::cuda
