// GPT operations on a CUDA device, forward and backward: the same ops, layouts and contracts as
// gpt/ops.h (cpu::), in fp32 on device pointers, ordered on one stream. Products go through
// cuBLAS (fp32, no TF32; or bf16 tensor cores, see Create), everything else through the kernels
// in ops_cuda.cu. tests/gpt checks
// each op against the CPU one on random inputs of awkward sizes (on a GPU; skipped without).
//
// Determinism as on the CPU: every output element is written by one thread in a fixed order
// (the column reductions for bias and LayerNorm gradients sum fixed slabs of rows, then the slabs
// in order; embedding gradients run per column over rows;
// attention's key and value gradients per key position), so a run repeats bit for bit.
//
// This header is C++17 and CUDA-free (the stream is a void*), so C++20 code can include it.
// backend_cuda.cc puts CudaOps behind the GPT's Backend interface (gpt/backend.h), with fp32
// activations.
// Thread-safety: a CudaOps belongs to one thread; its calls enqueue on its stream.
#pragma once

#include <cstdint>
#include <memory>

#include "gpt/backend.h"
#include "tierzero/status.h"
#include "tierzero/types.h"

namespace tierzero::gpt::cuda {

class CudaOps final {
 public:
  // stream: a cudaStream_t (the engine's compute_stream()). Unavailable without a GPU.
  // tensor_cores: products (Gemm, the Linear ops, attention) with bf16 operands on the tensor
  // cores, fp32 accumulation (gpt/tensor_core_cuda.h), within bf16 rounding of the fp32 ops;
  // otherwise fp32 products without TF32, within fp32 rounding of the CPU's.
  // fused_attention: with tensor_cores, attention of supported head widths as the fused kernels
  // (gpt/flash_attention_cuda.h; state = log-sum-exps), else the batched products.
  static StatusOr<std::unique_ptr<CudaOps>> Create(void* stream, bool tensor_cores = false,
                                                   bool fused_attention = false);
  ~CudaOps();
  CudaOps(const CudaOps&) = delete;
  CudaOps& operator=(const CudaOps&) = delete;

  // C = alpha op(A) op(B) + beta C, row-major, as cpu::Gemm.
  void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
            const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
            int64_t ldc);
  void LinearForward(const float* x, const float* w, const float* bias, float* y, int64_t rows,
                     int64_t in, int64_t out);
  void LinearBackward(const float* dy, const float* x, const float* w, float* dx, float* dw,
                      float* dbias, int64_t rows, int64_t in, int64_t out);
  // As cpu::LinearForwardOutIn / LinearBackwardOutIn (W stored out x in).
  void LinearForwardOutIn(const float* x, const float* w, const float* bias, float* y, int64_t rows,
                          int64_t in, int64_t out);
  void LinearBackwardOutIn(const float* dy, const float* x, const float* w, float* dx, float* dw,
                           float* dbias, int64_t rows, int64_t in, int64_t out);
  void LayerNormForward(const float* x, const float* gamma, const float* beta, float* y,
                        float* mean, float* rstd, int64_t rows, int64_t cols);
  void LayerNormBackward(const float* dy, const float* x, const float* gamma, const float* mean,
                         const float* rstd, float* dx, float* dgamma, float* dbeta, int64_t rows,
                         int64_t cols);
  void GeluForward(const float* x, float* y, int64_t n);
  void GeluBackward(const float* dy, const float* x, float* dx, int64_t n);
  bool fused_attention(int64_t head_dim) const;
  void AttentionForward(const float* qkv, float* out, float* state, int64_t batch, int64_t seq,
                        int64_t channels, int64_t heads);
  void AttentionBackward(const float* dout, const float* qkv, const float* out, const float* state,
                         float* dqkv, int64_t batch, int64_t seq, int64_t channels, int64_t heads);
  void EmbeddingForward(const int32_t* tokens, const float* wte, const float* wpe, float* x,
                        int64_t batch, int64_t seq, int64_t channels);
  void EmbeddingBackward(const int32_t* tokens, const float* dx, float* dwte, float* dwpe,
                         int64_t batch, int64_t seq, int64_t channels);
  // As cpu::CrossEntropy (targets, mask and argmax on the device); waits for the stream and
  // returns the loss, summed on the host in double in row order.
  StatusOr<double> CrossEntropy(const float* logits, const int32_t* targets, const float* mask,
                                float* dlogits, int32_t* argmax, int64_t rows, int64_t vocab,
                                double scale);
  void Add(const float* a, const float* b, float* y, int64_t n);
  void AddInPlace(float* y, const float* a, int64_t n);
  // fp32 <-> bf16/fp16 (round to nearest even), for parameters and gradients in the compute
  // dtype. InvalidArgument for other types.
  Status Widen(const void* src, DType src_type, float* dst, int64_t n);
  Status Narrow(const float* src, void* dst, DType dst_type, int64_t n);
  // dst = round(widen(dst) + src) for dst in fp32, bf16 or fp16.
  Status Accumulate(const float* src, void* dst, DType dst_type, int64_t n);

  // Stream-ordered memory operations on device memory; Upload and Download copy from and to
  // host memory and wait for the stream.
  void Zero(void* dst, uint64_t bytes);
  void Copy(void* dst, const void* src, uint64_t bytes);
  Status Upload(void* dst, const void* host, uint64_t bytes);
  Status Download(void* host, const void* src, uint64_t bytes);

  // The first CUDA or cuBLAS error since Create (launches are checked as they are enqueued).
  Status status() const;

 private:
  CudaOps() = default;
  void ColumnSums(const float* m, float* out, int64_t rows, int64_t cols);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tierzero::gpt::cuda
