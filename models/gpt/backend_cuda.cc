// The CUDA ops (gpt/ops_cuda.h) behind the GPT's Backend (gpt/backend.h): fp32 activations,
// fp32 weights widened from the chunks' copies, products on the tensor cores for bf16
// parameters (Note [bf16 products around fp32 activations]).
#include <memory>
#include <string>

#include "gpt/backend.h"
#include "gpt/backend_cuda_base.h"
#include "gpt/ops_cuda.h"
#include "tierzero/engine.h"

namespace tierzero::gpt {
namespace {

class CudaFp32Backend final : public CudaBackendBase {
 public:
  CudaFp32Backend(const BackendSpec& spec, std::unique_ptr<cuda::CudaOps> ops)
      : CudaBackendBase(spec, std::move(ops)) {}

  void LinearForward(const void* x, const void* w, const void* bias, void* y, int64_t rows,
                     int64_t in, int64_t out, WeightLayout layout) override {
    if (layout == WeightLayout::kInOut)
      ops_->LinearForward(F(x), F(w), F(bias), F(y), rows, in, out);
    else
      ops_->LinearForwardOutIn(F(x), F(w), F(bias), F(y), rows, in, out);
  }
  void LinearBackward(const void* dy, const void* x, const void* w, void* dx, GradOut dw,
                      GradOut dbias, int64_t rows, int64_t in, int64_t out,
                      WeightLayout layout) override {
    float* dwf = Start(dw, in * out);
    float* dbf = Start(dbias, out);
    if (layout == WeightLayout::kInOut)
      ops_->LinearBackward(F(dy), F(x), F(w), F(dx), dwf, dbf, rows, in, out);
    else
      ops_->LinearBackwardOutIn(F(dy), F(x), F(w), F(dx), dwf, dbf, rows, in, out);
  }
  void LayerNormForward(const void* x, const void* gamma, const void* beta, void* y, float* mean,
                        float* rstd, int64_t rows, int64_t cols) override {
    ops_->LayerNormForward(F(x), F(gamma), F(beta), F(y), mean, rstd, rows, cols);
  }
  void LayerNormBackward(const void* dy, const void* x, const void* gamma, const float* mean,
                         const float* rstd, void* dx, GradOut dgamma, GradOut dbeta, int64_t rows,
                         int64_t cols) override {
    float* dg = Start(dgamma, cols);
    float* db = Start(dbeta, cols);
    ops_->LayerNormBackward(F(dy), F(x), F(gamma), mean, rstd, F(dx), dg, db, rows, cols);
  }
  void GeluForward(const void* x, void* y, int64_t n) override { ops_->GeluForward(F(x), F(y), n); }
  void GeluBackward(const void* dy, const void* x, void* dx, int64_t n) override {
    ops_->GeluBackward(F(dy), F(x), F(dx), n);
  }
  // The Llama family's ops have no fp32 CUDA kernels: bf16 activations (the GPU's default) run
  // them.
  void RmsNormForward(const void*, const void*, void*, float*, int64_t, int64_t, double) override {
    Owed("RMSNorm");
  }
  void RmsNormBackward(const void*, const void*, const void*, const float*, void*, GradOut, int64_t,
                       int64_t) override {
    Owed("RMSNorm");
  }
  void RopeForward(void*, int64_t, int64_t, int64_t, int64_t, int64_t, const Rope&) override {
    Owed("rotary embeddings");
  }
  void RopeBackward(void*, int64_t, int64_t, int64_t, int64_t, int64_t, const Rope&) override {
    Owed("rotary embeddings");
  }
  void SwigluForward(const void*, const void*, void*, int64_t) override { Owed("SwiGLU"); }
  void SwigluBackward(const void*, const void*, const void*, void*, void*, int64_t) override {
    Owed("SwiGLU");
  }
  void AttentionForward(const void* q, const void* k, const void* v, void* out, void* state,
                        const AttnDims& d) override {
    if (!FusedLayout(q, k, v, d)) return;
    ops_->AttentionForward(F(q), F(out), F(state), d.batch, d.seq, d.heads * d.head_dim, d.heads);
  }
  void AttentionBackward(const void* dout, const void* q, const void* k, const void* v,
                         const void* out, const void* state, void* dq, void* dk, void* dv,
                         const AttnDims& d) override {
    if (!FusedLayout(q, k, v, d) || !FusedLayout(dq, dk, dv, d)) return;
    ops_->AttentionBackward(F(dout), F(q), F(out), F(state), F(dq), d.batch, d.seq,
                            d.heads * d.head_dim, d.heads);
  }
  void EmbeddingForward(const int32_t* tokens, const void* wte, const void* wpe, void* x,
                        int64_t batch, int64_t seq, int64_t channels) override {
    ops_->EmbeddingForward(tokens, F(wte), F(wpe), F(x), batch, seq, channels);
  }
  void EmbeddingBackward(const int32_t* tokens, const int32_t* /*host_tokens*/, const void* dx,
                         GradOut dwte, int64_t vocab, GradOut dwpe, int64_t batch, int64_t seq,
                         int64_t channels) override {
    float* dt = Start(dwte, vocab * channels);
    float* dp = Start(dwpe, seq * channels);
    ops_->EmbeddingBackward(tokens, F(dx), dt, dp, batch, seq, channels);
  }
  Status CrossEntropy(const void* logits, const int32_t* targets, const float* mask, void* dlogits,
                      int32_t* argmax, int64_t rows, int64_t vocab, double scale) override {
    // CudaOps waits for the loss (the fp32 path's one host round trip inside an iteration).
    TZ_ASSIGN_OR_RETURN(loss_, ops_->CrossEntropy(F(logits), targets, mask, F(dlogits), argmax,
                                                  rows, vocab, scale));
    return Status::OK();
  }
  StatusOr<double> Loss() override { return loss_; }
  void Add(const void* a, const void* b, void* y, int64_t n) override {
    ops_->Add(F(a), F(b), F(y), n);
  }
  void AddInPlace(void* y, const void* a, int64_t n) override { ops_->AddInPlace(F(y), F(a), n); }

 private:
  static const float* F(const void* p) { return static_cast<const float*>(p); }
  // The CUDA ops add into parameter gradients: a written one starts from zeros (the weights
  // here are widened copies, never the gradient's buffer).
  float* Start(GradOut g, int64_t n) {
    if (g.p != nullptr && !g.add) ops_->Zero(g.p, 4 * static_cast<uint64_t>(n));
    return F(g.p);
  }
  static float* F(void* p) { return static_cast<float*>(p); }

  void Owed(const char* what) {
    SetError(UnsupportedError(std::string(what) +
                              " has no fp32 CUDA kernel: run with --activations bf16"));
  }
  bool FusedLayout(const void* q, const void* k, const void* v, const AttnDims& d) {
    const int64_t c = d.heads * d.head_dim;
    if (d.kv_heads == d.heads && d.ld_q == 3 * c && d.ld_k == 3 * c && d.ld_v == 3 * c &&
        F(k) == F(q) + c && F(v) == F(q) + 2 * c)
      return true;
    Owed("grouped-query attention (separate q, k, v)");
    return false;
  }

  double loss_ = 0;
};

}  // namespace

StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(Engine& engine, const BackendSpec& spec) {
  if (spec.activations != DType::kF32 || spec.weights != DType::kF32 || spec.grads_in_place)
    return UnsupportedError("the GPT's CUDA backend takes fp32 activations and weights");
  // bf16 compute: the products on the tensor cores (Note [bf16 products around fp32
  // activations]); fp32 and fp16 keep exact fp32 products.
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<cuda::CudaOps> ops,
                      cuda::CudaOps::Create(engine.compute_stream(), spec.params == DType::kBF16,
                                            spec.fused_attention_wanted));
  return std::unique_ptr<Backend>(new CudaFp32Backend(spec, std::move(ops)));
}

}  // namespace tierzero::gpt
