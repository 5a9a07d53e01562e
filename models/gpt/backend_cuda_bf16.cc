// The GPT's bf16 backend on a GPU (Note [Activation types] in gpt/backend.h): bf16 activations
// and weights (the chunks' own bf16 parameters), gradients written straight into the engine's
// buffers; products through cuBLASLt with their epilogues (bias, bias + GELU, GELU's derivative,
// the bias gradients: gpt/lt_matmul.h), attention through cuDNN or the fused kernels on bf16
// (gpt/attention_cuda_bf16.h), the rest as the kernels of gpt/bf16_kernels_cuda.h. CudaOps does
// the conversions and copies. No widening, rounding or bias pass is left between the products,
// and nothing waits for the GPU inside an iteration but Loss() at its end (and, in the first
// iteration, the attention check of each shape: Note [cuDNN checked against the fused kernels]).
//
// Layouts. The model's matrices are row-major; cuBLASLt's column-major view of a row-major
// r x c matrix is its transpose (c x r, leading dimension c). So y = x W (rows x out) is, column-
// major, y^T = W^T x^T: A = W, B = x, m = out, n = rows, k = in, and the bias runs along m as
// cuBLASLt's epilogues want it. Each product below says which.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "gpt/attention_cuda_bf16.h"
#include "gpt/backend.h"
#include "gpt/backend_cuda_base.h"
#include "gpt/bf16_kernels_cuda.h"
#include "gpt/flash_attention_cuda.h"
#include "gpt/lt_matmul.h"
#include "gpt/ops_cuda.h"
#include "gpt/scratch_cuda.h"
#include "tierzero/engine.h"

namespace tierzero::gpt {
namespace {

using bf16 = __nv_bfloat16;
namespace k16 = cuda::bf16k;

template <typename T>
using Scratch = cuda::Scratch<T>;

class CudaBf16Backend final : public CudaBackendBase {
 public:
  CudaBf16Backend(const BackendSpec& spec, cudaStream_t stream, std::unique_ptr<cuda::CudaOps> ops,
                  std::unique_ptr<cuda::LtMatmul> lt,
                  std::unique_ptr<cuda::Bf16Attention> attention)
      : CudaBackendBase(spec, std::move(ops)),
        stream_(stream),
        lt_(std::move(lt)),
        attention_(std::move(attention)) {}
  ~CudaBf16Backend() override {
    if (pinned_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaFreeHost(pinned_);
    }
    if (pinned_copied_ != nullptr) cudaEventDestroy(pinned_copied_);
  }

  void LinearForward(const void* x, const void* w, const void* bias, void* y, int64_t rows,
                     int64_t in, int64_t out, WeightLayout layout) override {
    cuda::LtProduct p = Forward(x, w, y, rows, in, out, layout);
    p.epilogue = bias != nullptr ? cuda::Epilogue::kBias : cuda::Epilogue::kNone;
    p.bias = const_cast<void*>(bias);
    Run(p);
  }
  void LinearGeluForward(const void* x, const void* w, const void* bias, void* pre, void* y,
                         int64_t rows, int64_t in, int64_t out, WeightLayout layout) override {
    cuda::LtProduct p = Forward(x, w, y, rows, in, out, layout);
    p.epilogue = bias != nullptr ? cuda::Epilogue::kGeluAuxBias : cuda::Epilogue::kGeluAux;
    p.bias = const_cast<void*>(bias);
    p.aux = pre;
    p.aux_ld = out;
    Run(p);
  }
  void LinearBackward(const void* dy, const void* x, const void* w, void* dx, GradOut dw,
                      GradOut dbias, int64_t rows, int64_t in, int64_t out,
                      WeightLayout layout) override {
    if (dx != nullptr) Run(InputGrad(dy, w, dx, rows, in, out, layout));
    WeightGrad(dy, x, dw, dbias, rows, in, out, layout);
  }
  void LinearBackwardGelu(const void* dy, const void* x, const void* w, const void* pre, void* dx,
                          GradOut dw, GradOut dbias, int64_t rows, int64_t in, int64_t out,
                          WeightLayout layout) override {
    cuda::LtProduct p = InputGrad(dy, w, dx, rows, in, out, layout);
    p.epilogue = cuda::Epilogue::kDGelu;
    p.aux = const_cast<void*>(pre);
    p.aux_ld = in;
    Run(p);  // dx before dW: dW's buffer may be the weight itself
    WeightGrad(dy, x, dw, dbias, rows, in, out, layout);
  }
  void LayerNormForward(const void* x, const void* gamma, const void* beta, void* y, float* mean,
                        float* rstd, int64_t rows, int64_t cols) override {
    Check(k16::LayerNormForward(H(x), H(gamma), H(beta), H(y), mean, rstd, rows, cols, stream_),
          "LayerNormForward");
  }
  void LayerNormBackward(const void* dy, const void* x, const void* gamma, const float* mean,
                         const float* rstd, void* dx, GradOut dgamma, GradOut dbeta, int64_t rows,
                         int64_t cols) override {
    LayerNormBackwardResidual(dy, x, gamma, mean, rstd, nullptr, dx, dgamma, dbeta, rows, cols);
  }
  // The residual's gradient added in the norm's row kernel (Note [The residual stream's
  // additions]).
  void LayerNormBackwardResidual(const void* dy, const void* x, const void* gamma,
                                 const float* mean, const float* rstd, const void* dresidual,
                                 void* dx, GradOut dgamma, GradOut dbeta, int64_t rows,
                                 int64_t cols) override {
    float* partial = partial_.Get(k16::LayerNormPartialFloats(rows, cols), stream_, &error_);
    if (partial == nullptr) return;
    Check(k16::LayerNormBackward(H(dy), H(x), H(gamma), mean, rstd, H(dx), H(dgamma.p), dgamma.add,
                                 H(dbeta.p), dbeta.add, partial, rows, cols, stream_, H(dresidual)),
          "LayerNormBackward");
  }
  // The residual added by cuBLASLt as C (beta 1), with the bias epilogue.
  void LinearResidualForward(const void* x, const void* w, const void* bias, const void* residual,
                             void* y, int64_t rows, int64_t in, int64_t out,
                             WeightLayout layout) override {
    cuda::LtProduct p = Forward(x, w, y, rows, in, out, layout);
    p.epilogue = bias != nullptr ? cuda::Epilogue::kBias : cuda::Epilogue::kNone;
    p.bias = const_cast<void*>(bias);
    p.c = residual;
    p.beta = 1.0f;
    Run(p);
  }
  void GeluForward(const void* x, void* y, int64_t n) override {
    Check(k16::GeluForward(H(x), H(y), n, stream_), "GeluForward");
  }
  void GeluBackward(const void* dy, const void* x, void* dx, int64_t n) override {
    Check(k16::GeluBackward(H(dy), H(x), H(dx), n, stream_), "GeluBackward");
  }
  void RmsNormForward(const void* x, const void* w, void* y, float* rstd, int64_t rows,
                      int64_t cols, double eps) override {
    Check(k16::RmsNormForward(H(x), H(w), H(y), rstd, rows, cols, static_cast<float>(eps), stream_),
          "RmsNormForward");
  }
  void RmsNormBackward(const void* dy, const void* x, const void* w, const float* rstd, void* dx,
                       GradOut dw, int64_t rows, int64_t cols) override {
    RmsNormBackwardResidual(dy, x, w, rstd, nullptr, dx, dw, rows, cols);
  }
  void RmsNormBackwardResidual(const void* dy, const void* x, const void* w, const float* rstd,
                               const void* dresidual, void* dx, GradOut dw, int64_t rows,
                               int64_t cols) override {
    float* partial = partial_.Get(k16::ColumnPartialFloats(rows, cols), stream_, &error_);
    if (partial == nullptr) return;
    Check(k16::RmsNormBackward(H(dy), H(x), H(w), rstd, H(dx), H(dw.p), dw.add, partial, rows, cols,
                               stream_, H(dresidual)),
          "RmsNormBackward");
  }
  void RopeForward(void* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t ld,
                   const Rope& rope) override {
    Check(k16::Rope(H(x), batch, seq, heads, head_dim, ld, rope, 1.0f, stream_), "Rope");
  }
  void RopeBackward(void* dx, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim,
                    int64_t ld, const Rope& rope) override {
    Check(k16::Rope(H(dx), batch, seq, heads, head_dim, ld, rope, -1.0f, stream_),
          "Rope (backward)");
  }
  void SwigluForward(const void* g, const void* u, void* h, int64_t n) override {
    Check(k16::SwigluForward(H(g), H(u), H(h), n, stream_), "SwigluForward");
  }
  void SwigluBackward(const void* dh, const void* g, const void* u, void* dg, void* du,
                      int64_t n) override {
    Check(k16::SwigluBackward(H(dh), H(g), H(u), H(dg), H(du), n, stream_), "SwigluBackward");
  }
  // Note [Which attention runs] (gpt/attention_cuda_bf16.cc).
  void AttentionForward(const void* q, const void* k, const void* v, void* out, void* state,
                        const AttnDims& d) override {
    if (!HeadWidth(d.head_dim)) return;
    SetError(attention_->Forward(H(q), H(k), H(v), H(out), static_cast<float*>(state), Flash(d)));
  }
  void AttentionBackward(const void* dout, const void* q, const void* k, const void* v,
                         const void* out, const void* state, void* dq, void* dk, void* dv,
                         const AttnDims& d) override {
    if (!HeadWidth(d.head_dim)) return;
    SetError(attention_->Backward(H(dout), H(q), H(k), H(v), H(out),
                                  static_cast<const float*>(state), H(dq), H(dk), H(dv), Flash(d)));
  }
  std::string AttentionSummary() const override { return attention_->Summary(); }
  void EmbeddingForward(const int32_t* tokens, const void* wte, const void* wpe, void* x,
                        int64_t batch, int64_t seq, int64_t channels) override {
    Check(k16::EmbeddingForward(tokens, H(wte), H(wpe), H(x), batch * seq, seq, channels, stream_),
          "EmbeddingForward");
  }
  void EmbeddingBackward(const int32_t* /*tokens*/, const int32_t* host_tokens, const void* dx,
                         GradOut dwte, int64_t vocab, GradOut dwpe, int64_t batch, int64_t seq,
                         int64_t channels) override {
    const int64_t rows = batch * seq;
    if (dwte.p != nullptr) {
      // The rows grouped by token, in batch order within a group (Note on determinism in
      // gpt/bf16_kernels_cuda.h): order (rows), starts (groups + 1), tokens (groups), in pinned
      // memory so the upload does not wait for the stream.
      std::vector<int32_t> order(static_cast<size_t>(rows));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t b) { return host_tokens[a] < host_tokens[b]; });
      std::vector<int32_t> starts, group_token;
      for (int64_t i = 0; i < rows; ++i) {
        const int32_t t = host_tokens[order[static_cast<size_t>(i)]];
        if (group_token.empty() || group_token.back() != t) {
          group_token.push_back(t);
          starts.push_back(static_cast<int32_t>(i));
        }
      }
      starts.push_back(static_cast<int32_t>(rows));
      const int64_t groups = static_cast<int64_t>(group_token.size());
      const int64_t ints = rows + 2 * groups + 1;
      int32_t* host = Pinned(ints);
      int32_t* dev = csr_.Get(ints, stream_, &error_);
      if (host == nullptr || dev == nullptr) return;
      // The last upload from this buffer is done before it is rewritten.
      if (pinned_copied_ != nullptr)
        Check(cudaEventSynchronize(pinned_copied_), "cudaEventSynchronize");
      std::copy(order.begin(), order.end(), host);
      std::copy(starts.begin(), starts.end(), host + rows);
      std::copy(group_token.begin(), group_token.end(), host + rows + groups + 1);
      Check(cudaMemcpyAsync(dev, host, sizeof(int32_t) * ints, cudaMemcpyHostToDevice, stream_),
            "cudaMemcpyAsync (embedding groups)");
      if (pinned_copied_ == nullptr)
        Check(cudaEventCreateWithFlags(&pinned_copied_, cudaEventDisableTiming), "cudaEventCreate");
      if (pinned_copied_ != nullptr)
        Check(cudaEventRecord(pinned_copied_, stream_), "cudaEventRecord");
      if (!dwte.add) ops_->Zero(dwte.p, sizeof(bf16) * static_cast<uint64_t>(vocab * channels));
      Check(k16::EmbeddingTableBackward(H(dx), dev, dev + rows, dev + rows + groups + 1, groups,
                                        H(dwte.p), dwte.add, channels, stream_),
            "EmbeddingTableBackward");
    }
    if (dwpe.p != nullptr)
      Check(k16::PositionBackward(H(dx), H(dwpe.p), dwpe.add, batch, seq, channels, stream_),
            "PositionBackward");
  }
  Status CrossEntropy(const void* logits, const int32_t* targets, const float* mask, void* dlogits,
                      int32_t* argmax, int64_t rows, int64_t vocab, double scale) override {
    // count (one float), the mean loss (one double), then each row's loss.
    double* sums = sums_.Get(rows + 2, stream_, &error_);
    if (sums == nullptr) return error_;
    float* count = reinterpret_cast<float*>(sums);
    double* loss = sums + 1;
    Check(k16::MaskCount(mask, rows, count, stream_), "MaskCount");
    Check(k16::CrossEntropy(H(logits), targets, mask, count, H(dlogits), argmax, sums + 2, rows,
                            vocab, static_cast<float>(scale), stream_),
          "CrossEntropy");
    Check(k16::MeanLoss(sums + 2, count, rows, loss, stream_), "MeanLoss");
    loss_ = loss;
    return status();
  }
  StatusOr<double> Loss() override {
    if (loss_ == nullptr) return FailedPreconditionError("no loss was computed in this iteration");
    double v = 0;
    Check(cudaMemcpyAsync(&v, loss_, sizeof(v), cudaMemcpyDeviceToHost, stream_),
          "cudaMemcpyAsync (loss)");
    Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    loss_ = nullptr;  // read once: the next iteration computes its own
    TZ_RETURN_IF_ERROR(status());
    return v;
  }
  void Add(const void* a, const void* b, void* y, int64_t n) override {
    Check(k16::Add(H(a), H(b), H(y), n, stream_), "Add");
  }
  void AddInPlace(void* y, const void* a, int64_t n) override {
    Check(k16::AddInPlace(H(y), H(a), n, stream_), "AddInPlace");
  }

 private:
  static const bf16* H(const void* p) { return static_cast<const bf16*>(p); }
  static bf16* H(void* p) { return static_cast<bf16*>(p); }

  void Check(cudaError_t e, const char* what) {
    if (e != cudaSuccess && error_.ok())
      error_ = InternalError(std::string(what) + ": " + cudaGetErrorString(e));
  }
  void Run(const cuda::LtProduct& p) {
    if (!error_.ok()) return;
    Status s = lt_->Run(p);
    if (!s.ok()) error_ = std::move(s);
  }
  bool HeadWidth(int64_t hd) {
    if (FusedAttentionHeadWidth(hd)) return true;
    if (error_.ok())
      error_ = UnsupportedError(
          "bf16 activations on a GPU take attention heads 32, 64, 96 or 128 "
          "wide (the fused kernels'); this model's are " +
          std::to_string(hd) + ": run with --activations fp32");
    return false;
  }
  static cuda::FlashShape Flash(const AttnDims& d) {
    return {d.batch, d.seq,  d.heads, d.kv_heads,          d.head_dim,
            d.ld_q,  d.ld_k, d.ld_v,  d.heads * d.head_dim};
  }
  int32_t* Pinned(int64_t n) {
    if (n > pinned_have_) {
      if (pinned_ != nullptr) {
        Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
        cudaFreeHost(pinned_);
        pinned_ = nullptr;
        pinned_have_ = 0;
      }
      if (cudaMallocHost(reinterpret_cast<void**>(&pinned_), sizeof(int32_t) * n) != cudaSuccess) {
        cudaGetLastError();
        pinned_ = nullptr;
        if (error_.ok()) error_ = OutOfMemoryError("pinned host memory for the embedding groups");
        return nullptr;
      }
      pinned_have_ = n;
    }
    return pinned_;
  }

  // y (rows x out) = x W: column-major y^T = W^T x^T (see the file's comment).
  static cuda::LtProduct Forward(const void* x, const void* w, void* y, int64_t rows, int64_t in,
                                 int64_t out, WeightLayout layout) {
    cuda::LtProduct p;
    p.m = out;
    p.n = rows;
    p.k = in;
    p.a = w;  // in x out row-major is out x in column-major: op = N; out x in row-major: T
    p.trans_a = layout == WeightLayout::kOutIn;
    p.lda = layout == WeightLayout::kOutIn ? in : out;
    p.b = x;
    p.ldb = in;
    p.d = y;
    p.ldd = out;
    return p;
  }
  // dx (rows x in) = dy W^T: column-major dx^T = W dy^T, m = in, n = rows, k = out.
  static cuda::LtProduct InputGrad(const void* dy, const void* w, void* dx, int64_t rows,
                                   int64_t in, int64_t out, WeightLayout layout) {
    cuda::LtProduct p;
    p.m = in;
    p.n = rows;
    p.k = out;
    p.a = w;
    p.trans_a = layout == WeightLayout::kInOut;
    p.lda = layout == WeightLayout::kInOut ? out : in;
    p.b = dy;
    p.ldb = out;
    p.d = dx;
    p.ldd = in;
    return p;
  }
  // dW (in W's layout) and the bias gradient, from its epilogue where it is written.
  void WeightGrad(const void* dy, const void* x, GradOut dw, GradOut dbias, int64_t rows,
                  int64_t in, int64_t out, WeightLayout layout) {
    cuda::LtProduct p;
    const bool fuse_bias = dbias.p != nullptr && !dbias.add;
    if (layout == WeightLayout::kInOut) {
      // dW (in x out row-major = out x in column-major) = dy^T x: m = out, n = in, k = rows;
      // A = dy^T's column-major view (out x rows), B = x (stored in x rows, transposed).
      p.m = out;
      p.n = in;
      p.a = dy;
      p.lda = out;
      p.b = x;
      p.trans_b = true;
      p.ldb = in;
      p.ldd = out;
      p.epilogue = fuse_bias ? cuda::Epilogue::kBGradA : cuda::Epilogue::kNone;
    } else {
      // dW (out x in row-major = in x out column-major) = x^T dy: m = in, n = out, k = rows.
      p.m = in;
      p.n = out;
      p.a = x;
      p.lda = in;
      p.b = dy;
      p.trans_b = true;
      p.ldb = out;
      p.ldd = in;
      p.epilogue = fuse_bias ? cuda::Epilogue::kBGradB : cuda::Epilogue::kNone;
    }
    p.k = rows;
    p.d = dw.p;
    p.beta = dw.add ? 1.0f : 0.0f;
    p.bias = fuse_bias ? dbias.p : nullptr;
    // A bias-gradient epilogue cuBLASLt has no algorithm for runs as the plain product and a
    // column sum.
    bool separate_bias = dbias.p != nullptr && dbias.add;
    if (fuse_bias) {
      auto ok = lt_->Supported(p);
      if (!ok.ok()) return SetError(ok.status());
      if (!*ok) {
        p.epilogue = cuda::Epilogue::kNone;
        p.bias = nullptr;
        separate_bias = true;
      }
    }
    Run(p);
    if (separate_bias) {
      float* partial = partial_.Get(k16::ColumnPartialFloats(rows, out), stream_, &error_);
      if (partial == nullptr) return;
      Check(k16::ColumnSums(H(dy), H(dbias.p), dbias.add, partial, rows, out, stream_),
            "ColumnSums");
    }
  }

  cudaStream_t stream_;
  std::unique_ptr<cuda::LtMatmul> lt_;
  std::unique_ptr<cuda::Bf16Attention> attention_;
  Scratch<float> partial_;
  Scratch<double> sums_;
  Scratch<int32_t> csr_;
  int32_t* pinned_ = nullptr;
  cudaEvent_t pinned_copied_ = nullptr;  // the last upload from pinned_
  int64_t pinned_have_ = 0;
  double* loss_ = nullptr;
};

}  // namespace

StatusOr<std::unique_ptr<Backend>> CreateCudaBf16Backend(Engine& engine, const BackendSpec& spec) {
  if (spec.activations != DType::kBF16 || spec.weights != DType::kBF16 || !spec.grads_in_place)
    return UnsupportedError("the GPT's bf16 CUDA backend takes bf16 activations and weights");
  auto stream = static_cast<cudaStream_t>(engine.compute_stream());
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<cuda::CudaOps> ops,
                      cuda::CudaOps::Create(stream, /*tensor_cores=*/true,
                                            /*fused_attention=*/true));
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<cuda::LtMatmul> lt, cuda::LtMatmul::Create(stream));
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<cuda::Bf16Attention> attention,
                      cuda::Bf16Attention::Create(stream));
  return std::unique_ptr<Backend>(
      new CudaBf16Backend(spec, stream, std::move(ops), std::move(lt), std::move(attention)));
}

}  // namespace tierzero::gpt
