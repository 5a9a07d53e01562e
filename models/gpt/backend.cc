#include "gpt/backend.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "gpt/ops.h"
#include "tierzero/convert.h"
#include "tierzero/engine.h"
#ifdef TZ_GPT_CUDA
#include "gpt/ops_cuda.h"
#endif

namespace tierzero::gpt {
namespace {

class CpuBackend final : public Backend {
 public:
  void Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
            int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) override {
    cpu::Gemm<float>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  void LinearForward(const float* x, const float* w, const float* bias, float* y, int64_t rows,
                     int64_t in, int64_t out) override {
    cpu::LinearForward(x, w, bias, y, rows, in, out);
  }
  void LinearBackward(const float* dy, const float* x, const float* w, float* dx, float* dw,
                      float* dbias, int64_t rows, int64_t in, int64_t out) override {
    cpu::LinearBackward(dy, x, w, dx, dw, dbias, rows, in, out);
  }
  void LayerNormForward(const float* x, const float* gamma, const float* beta, float* y,
                        float* mean, float* rstd, int64_t rows, int64_t cols) override {
    cpu::LayerNormForward(x, gamma, beta, y, mean, rstd, rows, cols);
  }
  void LayerNormBackward(const float* dy, const float* x, const float* gamma, const float* mean,
                         const float* rstd, float* dx, float* dgamma, float* dbeta, int64_t rows,
                         int64_t cols) override {
    cpu::LayerNormBackward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, rows, cols);
  }
  void GeluForward(const float* x, float* y, int64_t n) override { cpu::GeluForward(x, y, n); }
  void GeluBackward(const float* dy, const float* x, float* dx, int64_t n) override {
    cpu::GeluBackward(dy, x, dx, n);
  }
  bool fused_attention(int64_t) const override { return false; }
  void AttentionForward(const float* qkv, float* out, float* probs, int64_t batch, int64_t seq,
                        int64_t channels, int64_t heads) override {
    cpu::AttentionForward(qkv, out, probs, batch, seq, channels, heads);
  }
  void AttentionBackward(const float* dout, const float* qkv, const float* /*out*/,
                         const float* probs, float* dqkv, int64_t batch, int64_t seq,
                         int64_t channels, int64_t heads) override {
    cpu::AttentionBackward(dout, qkv, probs, dqkv, batch, seq, channels, heads);
  }
  void EmbeddingForward(const int32_t* tokens, const float* wte, const float* wpe, float* x,
                        int64_t batch, int64_t seq, int64_t channels) override {
    cpu::EmbeddingForward(tokens, wte, wpe, x, batch, seq, channels);
  }
  void EmbeddingBackward(const int32_t* tokens, const float* dx, float* dwte, float* dwpe,
                         int64_t batch, int64_t seq, int64_t channels) override {
    cpu::EmbeddingBackward(tokens, dx, dwte, dwpe, batch, seq, channels);
  }
  StatusOr<double> CrossEntropy(const float* logits, const int32_t* targets, const float* mask,
                                float* dlogits, int32_t* argmax, int64_t rows, int64_t vocab,
                                double scale) override {
    return cpu::CrossEntropy(logits, targets, mask, dlogits, argmax, rows, vocab, scale);
  }
  void Add(const float* a, const float* b, float* y, int64_t n) override { cpu::Add(a, b, y, n); }
  void AddInPlace(float* y, const float* a, int64_t n) override { cpu::AddInPlace(y, a, n); }
  Status Widen(const void* src, DType src_type, float* dst, int64_t n) override {
    return CastElements(src, src_type, dst, DType::kF32, static_cast<size_t>(n));
  }
  Status Narrow(const float* src, void* dst, DType dst_type, int64_t n) override {
    return CastElements(src, DType::kF32, dst, dst_type, static_cast<size_t>(n));
  }
  void Zero(void* dst, uint64_t bytes) override { std::memset(dst, 0, bytes); }
  void Copy(void* dst, const void* src, uint64_t bytes) override { std::memcpy(dst, src, bytes); }
  Status Upload(void* dst, const void* host, uint64_t bytes) override {
    std::memcpy(dst, host, bytes);
    return Status::OK();
  }
  Status Download(void* host, const void* src, uint64_t bytes) override {
    std::memcpy(host, src, bytes);
    return Status::OK();
  }
  Status status() const override { return Status::OK(); }
};

}  // namespace

bool FusedAttentionWanted() {
#ifdef TZ_GPT_CUDA
  const char* env = std::getenv("TZ_GPT_FUSED_ATTENTION");
  if (env == nullptr) return true;
  const std::string v = env;
  return !(v == "0" || v == "off" || v == "false");
#else
  return false;
#endif
}

bool FusedAttention(bool tensor_cores, int64_t head_dim) {
  return tensor_cores && FusedAttentionHeadWidth(head_dim) && FusedAttentionWanted();
}

StatusOr<std::unique_ptr<Backend>> Backend::Create(Engine& engine) {
  if (engine.host_compute()) return std::unique_ptr<Backend>(new CpuBackend());
#ifdef TZ_GPT_CUDA
  // bf16 compute: the products on the tensor cores (Note [bf16 products around fp32
  // activations]); fp32 and fp16 keep exact fp32 products.
  TZ_ASSIGN_OR_RETURN(
      std::unique_ptr<cuda::CudaOps> ops,
      cuda::CudaOps::Create(engine.compute_stream(), engine.compute_dtype() == DType::kBF16,
                            FusedAttentionWanted()));
  return std::unique_ptr<Backend>(std::move(ops));
#else
  return UnsupportedError(
      "this build has no CUDA: the GPT runs on the simulated device only (device 'host')");
#endif
}

}  // namespace tierzero::gpt
