// Where the GPT computes: the CPU ops (gpt/ops.h) on the simulated device, or the CUDA ops
// (gpt/ops_cuda.h) on a GPU. gpt.cc is written once against this interface; every pointer is
// the engine's device memory (host memory on the simulated device), every call ordered on the
// engine's compute stream. The CPU backend is the reference the equivalence tests pin down:
// it calls exactly what gpt.cc called before the interface existed.
#pragma once

#include <cstdint>
#include <memory>

#include "tierzero/status.h"
#include "tierzero/types.h"

namespace tierzero {
class Engine;
}

namespace tierzero::gpt {

// Head widths the fused attention kernels take (gpt/flash_attention_cuda.h).
inline bool FusedAttentionHeadWidth(int64_t head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128;
}
// Whether the fused kernels are wanted: yes unless TZ_GPT_FUSED_ATTENTION is 0, off or false
// (then the batched products run, for comparison). Always false in a build without CUDA.
bool FusedAttentionWanted();
// Whether a backend runs attention fused (Note [Fused causal attention]): on a GPU with bf16
// products (`tensor_cores`), heads of a supported width, and wanted.
bool FusedAttention(bool tensor_cores, int64_t head_dim);
// Floats attention keeps from forward for backward: each row's log-sum-exp (B x H x T) when
// fused, else the probabilities (B x H x T x T).
inline int64_t AttentionStateFloats(bool fused, int64_t batch, int64_t seq, int64_t heads) {
  return fused ? batch * heads * seq : batch * heads * seq * seq;
}

// C++17 and CUDA-free: gpt/ops_cuda.h implements it (the CUDA backend is CudaOps itself).
class Backend {
 public:
  // The CPU backend when engine.host_compute(), else the CUDA one, CudaOps on the engine's compute
  // stream (Unsupported in a build without CUDA).
  static StatusOr<std::unique_ptr<Backend>> Create(Engine& engine);
  virtual ~Backend() = default;

  virtual void Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                    int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                    int64_t ldc) = 0;
  virtual void LinearForward(const float* x, const float* w, const float* bias, float* y,
                             int64_t rows, int64_t in, int64_t out) = 0;
  virtual void LinearBackward(const float* dy, const float* x, const float* w, float* dx, float* dw,
                              float* dbias, int64_t rows, int64_t in, int64_t out) = 0;
  virtual void LayerNormForward(const float* x, const float* gamma, const float* beta, float* y,
                                float* mean, float* rstd, int64_t rows, int64_t cols) = 0;
  virtual void LayerNormBackward(const float* dy, const float* x, const float* gamma,
                                 const float* mean, const float* rstd, float* dx, float* dgamma,
                                 float* dbeta, int64_t rows, int64_t cols) = 0;
  virtual void GeluForward(const float* x, float* y, int64_t n) = 0;
  virtual void GeluBackward(const float* dy, const float* x, float* dx, int64_t n) = 0;
  // Attention writes `out` and its state for backward: AttentionStateFloats(fused_attention(),
  // ...) floats, the probabilities (gpt/ops.h) or, fused, each row's log-sum-exp. Backward reads
  // the forward's out and state.
  virtual bool fused_attention(int64_t head_dim) const = 0;
  virtual void AttentionForward(const float* qkv, float* out, float* state, int64_t batch,
                                int64_t seq, int64_t channels, int64_t heads) = 0;
  virtual void AttentionBackward(const float* dout, const float* qkv, const float* out,
                                 const float* state, float* dqkv, int64_t batch, int64_t seq,
                                 int64_t channels, int64_t heads) = 0;
  virtual void EmbeddingForward(const int32_t* tokens, const float* wte, const float* wpe, float* x,
                                int64_t batch, int64_t seq, int64_t channels) = 0;
  virtual void EmbeddingBackward(const int32_t* tokens, const float* dx, float* dwte, float* dwpe,
                                 int64_t batch, int64_t seq, int64_t channels) = 0;
  virtual StatusOr<double> CrossEntropy(const float* logits, const int32_t* targets,
                                        const float* mask, float* dlogits, int32_t* argmax,
                                        int64_t rows, int64_t vocab, double scale) = 0;
  virtual void Add(const float* a, const float* b, float* y, int64_t n) = 0;
  virtual void AddInPlace(float* y, const float* a, int64_t n) = 0;
  virtual Status Widen(const void* src, DType src_type, float* dst, int64_t n) = 0;
  virtual Status Narrow(const float* src, void* dst, DType dst_type, int64_t n) = 0;
  virtual void Zero(void* dst, uint64_t bytes) = 0;
  virtual void Copy(void* dst, const void* src, uint64_t bytes) = 0;
  virtual Status Upload(void* dst, const void* host, uint64_t bytes) = 0;
  virtual Status Download(void* host, const void* src, uint64_t bytes) = 0;
  // The first asynchronous error (CUDA); OK on the CPU.
  virtual Status status() const = 0;
};

}  // namespace tierzero::gpt
