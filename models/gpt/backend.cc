#include "gpt/backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpt/ops.h"
#include "tierzero/convert.h"
#include "tierzero/engine.h"

namespace tierzero::gpt {

#ifdef TZ_GPT_CUDA
// backend_cuda.cc: the CUDA ops (gpt/ops_cuda.h) behind this interface, fp32 activations.
StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(Engine& engine, const BackendSpec& spec);
// backend_cuda_bf16.cc: bf16 activations.
StatusOr<std::unique_ptr<Backend>> CreateCudaBf16Backend(Engine& engine, const BackendSpec& spec);
#endif

namespace {

// Note [Activation types]: fp32 views of one op's buffers. An fp32 buffer is its own view; any
// other is widened into scratch (inputs) or computed into scratch and rounded into place when
// the views end (outputs). The scratch is the CPU backend's own host memory, outside the
// engine's activation accounting: it exists only while one op runs.
class Fp32Views {
 public:
  Fp32Views() = default;
  Fp32Views(const Fp32Views&) = delete;
  Fp32Views& operator=(const Fp32Views&) = delete;
  ~Fp32Views() {
    for (Output& o : outs_)
      (void)CastElements(o.buf.data(), DType::kF32, o.dst, o.type, o.buf.size());
  }
  const float* In(const void* p, DType type, int64_t n) {
    if (p == nullptr || type == DType::kF32) return static_cast<const float*>(p);
    ins_.emplace_back(static_cast<size_t>(n));
    (void)CastElements(p, type, ins_.back().data(), DType::kF32, static_cast<size_t>(n));
    return ins_.back().data();
  }
  // An output every element of which the op writes.
  float* Out(void* p, DType type, int64_t n) {
    if (p == nullptr || type == DType::kF32) return static_cast<float*>(p);
    outs_.push_back({p, type, std::vector<float>(static_cast<size_t>(n))});
    return outs_.back().buf.data();
  }
  // An output the op adds into.
  float* InOut(void* p, DType type, int64_t n) {
    float* f = Out(p, type, n);
    if (f != p) (void)CastElements(p, type, f, DType::kF32, static_cast<size_t>(n));
    return f;
  }
  // A parameter's gradient (the ops add into theirs): added to in place, or written from zeros
  // in scratch when the views end, after the op has read the weight it may replace.
  float* Grad(GradOut g, DType type, int64_t n) {
    if (g.p == nullptr) return nullptr;
    if (g.add) return InOut(g.p, type, n);
    outs_.push_back({g.p, type, std::vector<float>(static_cast<size_t>(n))});
    return outs_.back().buf.data();
  }

 private:
  struct Output {
    void* dst;
    DType type;
    std::vector<float> buf;
  };
  std::vector<std::vector<float>> ins_;
  std::vector<Output> outs_;  // a vector's buffer does not move when the vector grows
};

// The CPU ops (gpt/ops.h, fp32) in any activation and weight types.
class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const BackendSpec& spec)
      : Backend(spec), a_(spec.activations), w_(spec.weights) {}

  void LinearForward(const void* x, const void* w, const void* bias, void* y, int64_t rows,
                     int64_t in, int64_t out, WeightLayout layout) override {
    Fp32Views v;
    const float* xf = v.In(x, a_, rows * in);
    const float* wf = v.In(w, w_, in * out);
    const float* bf = v.In(bias, w_, out);
    float* yf = v.Out(y, a_, rows * out);
    if (layout == WeightLayout::kInOut)
      cpu::LinearForward(xf, wf, bf, yf, rows, in, out);
    else
      cpu::LinearForwardOutIn(xf, wf, bf, yf, rows, in, out);
  }
  void LinearBackward(const void* dy, const void* x, const void* w, void* dx, GradOut dw,
                      GradOut dbias, int64_t rows, int64_t in, int64_t out,
                      WeightLayout layout) override {
    Fp32Views v;
    const float* dyf = v.In(dy, a_, rows * out);
    const float* xf = v.In(x, a_, rows * in);
    const float* wf = v.In(w, w_, in * out);
    float* dxf = v.Out(dx, a_, rows * in);
    float* dwf = v.Grad(dw, w_, in * out);
    float* dbf = v.Grad(dbias, w_, out);
    if (layout == WeightLayout::kInOut)
      cpu::LinearBackward(dyf, xf, wf, dxf, dwf, dbf, rows, in, out);
    else
      cpu::LinearBackwardOutIn(dyf, xf, wf, dxf, dwf, dbf, rows, in, out);
  }
  void LayerNormForward(const void* x, const void* gamma, const void* beta, void* y, float* mean,
                        float* rstd, int64_t rows, int64_t cols) override {
    Fp32Views v;
    cpu::LayerNormForward(v.In(x, a_, rows * cols), v.In(gamma, w_, cols), v.In(beta, w_, cols),
                          v.Out(y, a_, rows * cols), mean, rstd, rows, cols);
  }
  void LayerNormBackward(const void* dy, const void* x, const void* gamma, const float* mean,
                         const float* rstd, void* dx, GradOut dgamma, GradOut dbeta, int64_t rows,
                         int64_t cols) override {
    Fp32Views v;
    cpu::LayerNormBackward(v.In(dy, a_, rows * cols), v.In(x, a_, rows * cols),
                           v.In(gamma, w_, cols), mean, rstd, v.Out(dx, a_, rows * cols),
                           v.Grad(dgamma, w_, cols), v.Grad(dbeta, w_, cols), rows, cols);
  }
  void GeluForward(const void* x, void* y, int64_t n) override {
    Fp32Views v;
    cpu::GeluForward(v.In(x, a_, n), v.Out(y, a_, n), n);
  }
  void GeluBackward(const void* dy, const void* x, void* dx, int64_t n) override {
    Fp32Views v;
    const float* dyf = v.In(dy, a_, n);  // dx may be dy: read both before writing
    const float* xf = v.In(x, a_, n);
    cpu::GeluBackward(dyf, xf, v.Out(dx, a_, n), n);
  }
  void RmsNormForward(const void* x, const void* w, void* y, float* rstd, int64_t rows,
                      int64_t cols, double eps) override {
    Fp32Views v;
    cpu::RmsNormForward(v.In(x, a_, rows * cols), v.In(w, w_, cols), v.Out(y, a_, rows * cols),
                        rstd, rows, cols, eps);
  }
  void RmsNormBackward(const void* dy, const void* x, const void* w, const float* rstd, void* dx,
                       GradOut dw, int64_t rows, int64_t cols) override {
    Fp32Views v;
    cpu::RmsNormBackward(v.In(dy, a_, rows * cols), v.In(x, a_, rows * cols), v.In(w, w_, cols),
                         rstd, v.Out(dx, a_, rows * cols), v.Grad(dw, w_, cols), rows, cols);
  }
  void RopeForward(void* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t ld,
                   const Rope& rope) override {
    Fp32Views v;
    cpu::RopeForward(v.InOut(x, a_, batch * seq * ld), batch, seq, heads, head_dim, ld, rope);
  }
  void RopeBackward(void* dx, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim,
                    int64_t ld, const Rope& rope) override {
    Fp32Views v;
    cpu::RopeBackward(v.InOut(dx, a_, batch * seq * ld), batch, seq, heads, head_dim, ld, rope);
  }
  void SwigluForward(const void* g, const void* u, void* h, int64_t n) override {
    Fp32Views v;
    const float* gf = v.In(g, a_, n);
    const float* uf = v.In(u, a_, n);
    cpu::SwigluForward(gf, uf, v.Out(h, a_, n), n);
  }
  void SwigluBackward(const void* dh, const void* g, const void* u, void* dg, void* du,
                      int64_t n) override {
    Fp32Views v;
    const float* dhf = v.In(dh, a_, n);  // dh may be dg or du: read everything first
    const float* gf = v.In(g, a_, n);
    const float* uf = v.In(u, a_, n);
    cpu::SwigluBackward(dhf, gf, uf, v.Out(dg, a_, n), v.Out(du, a_, n), n);
  }
  void AttentionForward(const void* q, const void* k, const void* v, void* out, void* probs,
                        const AttnDims& d) override {
    Fp32Views w;
    const int64_t rows = d.batch * d.seq;
    const Qkv in = Inputs(w, q, k, v, d);
    cpu::AttentionForward(in.q, in.k, in.v, w.Out(out, a_, rows * d.heads * d.head_dim),
                          w.Out(probs, a_, d.batch * d.heads * d.seq * d.seq), Shape(d));
  }
  void AttentionBackward(const void* dout, const void* q, const void* k, const void* v,
                         const void* /*out*/, const void* probs, void* dq, void* dk, void* dv,
                         const AttnDims& d) override {
    Fp32Views w;
    const int64_t rows = d.batch * d.seq;
    const Qkv in = Inputs(w, q, k, v, d);
    float *gq, *gk, *gv;
    if (Fused(q, k, v, d)) {  // one row span: every element of it is written
      gq = w.Out(dq, a_, rows * d.ld_q);
      gk = gq + d.heads * d.head_dim;
      gv = gk + d.kv_heads * d.head_dim;
    } else {
      gq = w.Out(dq, a_, Elems(d.ld_q, d.heads, d));
      gk = w.Out(dk, a_, Elems(d.ld_k, d.kv_heads, d));
      gv = w.Out(dv, a_, Elems(d.ld_v, d.kv_heads, d));
    }
    cpu::AttentionBackward(w.In(dout, a_, rows * d.heads * d.head_dim), in.q, in.k, in.v,
                           w.In(probs, a_, d.batch * d.heads * d.seq * d.seq), gq, gk, gv,
                           Shape(d));
  }
  void EmbeddingForward(const int32_t* tokens, const void* wte, const void* wpe, void* x,
                        int64_t batch, int64_t seq, int64_t channels) override {
    Fp32Views v;
    // Only the rows the tokens name are read: widen the table once per op all the same (this
    // path is the tests' bf16 plumbing, not a fast one).
    cpu::EmbeddingForward(tokens, v.In(wte, w_, vocab_rows(tokens, batch * seq) * channels),
                          v.In(wpe, w_, seq * channels), v.Out(x, a_, batch * seq * channels),
                          batch, seq, channels);
  }
  void EmbeddingBackward(const int32_t* tokens, const int32_t* /*host_tokens*/, const void* dx,
                         GradOut dwte, int64_t vocab, GradOut dwpe, int64_t batch, int64_t seq,
                         int64_t channels) override {
    Fp32Views v;
    // Added to: only the rows the tokens name change; written: every row.
    const int64_t rows = dwte.add ? vocab_rows(tokens, batch * seq) : vocab;
    cpu::EmbeddingBackward(tokens, v.In(dx, a_, batch * seq * channels),
                           v.Grad(dwte, w_, rows * channels), v.Grad(dwpe, w_, seq * channels),
                           batch, seq, channels);
  }
  Status CrossEntropy(const void* logits, const int32_t* targets, const float* mask, void* dlogits,
                      int32_t* argmax, int64_t rows, int64_t vocab, double scale) override {
    Fp32Views v;
    loss_ = cpu::CrossEntropy(v.In(logits, a_, rows * vocab), targets, mask,
                              v.Out(dlogits, a_, rows * vocab), argmax, rows, vocab, scale);
    return Status::OK();
  }
  StatusOr<double> Loss() override { return loss_; }
  void Add(const void* a, const void* b, void* y, int64_t n) override {
    Fp32Views v;
    const float* af = v.In(a, a_, n);
    const float* bf = v.In(b, a_, n);
    cpu::Add(af, bf, v.Out(y, a_, n), n);
  }
  void AddInPlace(void* y, const void* a, int64_t n) override {
    Fp32Views v;
    const float* af = v.In(a, a_, n);
    cpu::AddInPlace(v.InOut(y, a_, n), af, n);
  }
  Status Cast(const void* src, DType src_type, void* dst, DType dst_type, int64_t n,
              bool add) override {
    if (!add) return CastElements(src, src_type, dst, dst_type, static_cast<size_t>(n));
    // dst = round(widen(dst) + widen(src)), a block at a time.
    constexpr int64_t kBlock = 4096;
    std::vector<float> d(kBlock), s(kBlock);
    const size_t db = DTypeBytes(dst_type, 1), sb = DTypeBytes(src_type, 1);
    for (int64_t i = 0; i < n; i += kBlock) {
      const size_t m = static_cast<size_t>(std::min(kBlock, n - i));
      char* dp = static_cast<char*>(dst) + static_cast<size_t>(i) * db;
      const char* sp = static_cast<const char*>(src) + static_cast<size_t>(i) * sb;
      TZ_RETURN_IF_ERROR(CastElements(dp, dst_type, d.data(), DType::kF32, m));
      TZ_RETURN_IF_ERROR(CastElements(sp, src_type, s.data(), DType::kF32, m));
      for (size_t j = 0; j < m; ++j) d[j] += s[j];
      TZ_RETURN_IF_ERROR(CastElements(d.data(), DType::kF32, dp, dst_type, m));
    }
    return Status::OK();
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

 private:
  // Rows of the token table an op touches: up to the largest token (the table's own row count
  // is not the op's to know; the tokens were checked against the vocabulary).
  static int64_t vocab_rows(const int32_t* tokens, int64_t n) {
    int32_t top = 0;
    for (int64_t i = 0; i < n; ++i) top = std::max(top, tokens[i]);
    return int64_t{top} + 1;
  }

  static cpu::AttnShape Shape(const AttnDims& d) {
    return {d.batch, d.seq, d.heads, d.kv_heads, d.head_dim, d.ld_q, d.ld_k, d.ld_v};
  }
  // GPT-2's fused rows: q, k, v interleaved in one matrix of ld_q-wide rows.
  bool Fused(const void* q, const void* k, const void* v, const AttnDims& d) const {
    const size_t e = DTypeBytes(a_, 1);
    return d.ld_q == d.ld_k && d.ld_k == d.ld_v &&
           static_cast<const char*>(k) == static_cast<const char*>(q) + d.heads * d.head_dim * e &&
           static_cast<const char*>(v) ==
               static_cast<const char*>(k) + d.kv_heads * d.head_dim * e &&
           d.ld_q == (d.heads + 2 * d.kv_heads) * d.head_dim;
  }
  // Elements a matrix of `heads` heads spans: every row ld apart, the last one its heads.
  static int64_t Elems(int64_t ld, int64_t heads, const AttnDims& d) {
    return (d.batch * d.seq - 1) * ld + heads * d.head_dim;
  }
  struct Qkv {
    const float *q, *k, *v;
  };
  // fp32 views of q, k, v: the fused rows as one (their views must not overlap), else each.
  Qkv Inputs(Fp32Views& w, const void* q, const void* k, const void* v, const AttnDims& d) const {
    if (Fused(q, k, v, d)) {
      const float* f = w.In(q, a_, d.batch * d.seq * d.ld_q);
      return {f, f + d.heads * d.head_dim, f + (d.heads + d.kv_heads) * d.head_dim};
    }
    return {w.In(q, a_, Elems(d.ld_q, d.heads, d)), w.In(k, a_, Elems(d.ld_k, d.kv_heads, d)),
            w.In(v, a_, Elems(d.ld_v, d.kv_heads, d))};
  }

  DType a_, w_;
  double loss_ = 0;
};

}  // namespace

void Backend::LinearGeluForward(const void* x, const void* w, const void* bias, void* pre, void* y,
                                int64_t rows, int64_t in, int64_t out, WeightLayout layout) {
  LinearForward(x, w, bias, pre, rows, in, out, layout);
  GeluForward(pre, y, rows * out);
}

void Backend::LinearBackwardGelu(const void* dy, const void* x, const void* w, const void* pre,
                                 void* dx, GradOut dw, GradOut dbias, int64_t rows, int64_t in,
                                 int64_t out, WeightLayout layout) {
  LinearBackward(dy, x, w, dx, dw, dbias, rows, in, out, layout);
  GeluBackward(dx, pre, dx, rows * in);
}

// Note [The residual stream's additions]
// A block adds into its residual stream twice forward (after the attention's and the MLP's output
// projections) and twice backward (the norms' input gradients into the stream's gradient). As
// separate passes each reads two activations and writes one, about 4% of the 1.21B GPT's step on
// an H100 with a copy of the incoming gradient besides. So the ops come in fused forms: the
// forward sum is the projection's product with the residual as cuBLASLt's C (beta 1: the product,
// bias and residual summed in fp32 and rounded once), the backward sums are written by the norms'
// row kernels. By default (the CPU, the fp32 GPU backend) they are the ops in turn: the product
// rounded, then the sum, which is what the block computed before, bit for bit (IEEE addition
// commutes).
void Backend::LinearResidualForward(const void* x, const void* w, const void* bias,
                                    const void* residual, void* y, int64_t rows, int64_t in,
                                    int64_t out, WeightLayout layout) {
  LinearForward(x, w, bias, y, rows, in, out, layout);
  AddInPlace(y, residual, rows * out);
}

void Backend::LayerNormBackwardResidual(const void* dy, const void* x, const void* gamma,
                                        const float* mean, const float* rstd, const void* dresidual,
                                        void* dx, GradOut dgamma, GradOut dbeta, int64_t rows,
                                        int64_t cols) {
  LayerNormBackward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, rows, cols);
  AddInPlace(dx, dresidual, rows * cols);
}

void Backend::RmsNormBackwardResidual(const void* dy, const void* x, const void* w,
                                      const float* rstd, const void* dresidual, void* dx,
                                      GradOut dw, int64_t rows, int64_t cols) {
  RmsNormBackward(dy, x, w, rstd, dx, dw, rows, cols);
  AddInPlace(dx, dresidual, rows * cols);
}

const char* ActivationsName(Activations a) {
  switch (a) {
    case Activations::kAuto:
      return "auto";
    case Activations::kF32:
      return "fp32";
    case Activations::kBF16:
      return "bf16";
  }
  return "?";
}

StatusOr<std::string> AttentionChoice() {
  const char* env = std::getenv("TZ_GPT_ATTENTION");
  const std::string v = env != nullptr ? env : "";
  if (v.empty() || v == "auto") return std::string("auto");
  if (v == "cudnn" || v == "cudnn-fast") return v;
  if (v == "kernels" || v == "fused") return std::string("kernels");
  return InvalidArgumentError("TZ_GPT_ATTENTION is \"" + v +
                              "\"; it takes auto, cudnn, cudnn-fast or kernels");
}

// Note [The GPT's own tunables] (backend.h)
std::vector<TunableInfo> GptTunables() {
  auto env = [](const char* name, const char* dflt) {
    const char* e = std::getenv(name);
    return std::string(e != nullptr && *e != '\0' ? e : dflt);
  };
  return {
      {"TZ_GPT_FUSED_ATTENTION", env("TZ_GPT_FUSED_ATTENTION", "1"), "1",
       "fp32 activations on a GPU: 1 runs attention in the fused kernels, 0 as batched products "
       "(for comparison)"},
      {"TZ_GPT_ATTENTION", env("TZ_GPT_ATTENTION", "auto"), "auto",
       "bf16 activations on a GPU: auto (cuDNN's fused attention where it loads and agrees, else "
       "the kernels), cudnn, cudnn-fast (dQ by atomics: not repeatable) or kernels"},
      {"TZ_CUDNN_LIBRARY", env("TZ_CUDNN_LIBRARY", "libcudnn.so.9"), "libcudnn.so.9",
       "the cuDNN library loaded at run time for the attention (a file name on the loader path, "
       "or a path)"}};
}

Status ValidateGptTunables() {
  std::string problems;
  for (const Status& s : {FusedAttentionWanted().status(), AttentionChoice().status()})
    if (!s.ok()) problems += (problems.empty() ? "" : "; ") + std::string(s.message());
  if (problems.empty()) return Status::OK();
  return InvalidArgumentError(problems);
}

StatusOr<bool> FusedAttentionWanted() {
  const char* env = std::getenv("TZ_GPT_FUSED_ATTENTION");
  const std::string v = env != nullptr ? env : "";
  bool wanted = true;
  if (v == "0" || v == "off" || v == "false")
    wanted = false;
  else if (!(v.empty() || v == "1" || v == "on" || v == "true"))
    return InvalidArgumentError("TZ_GPT_FUSED_ATTENTION is \"" + v +
                                "\"; it takes 1, on or true (the default), or 0, off or false");
#ifdef TZ_GPT_CUDA
  return wanted;
#else
  return false;
#endif
}

StatusOr<BackendSpec> ChooseBackend(const Engine& engine, Activations activations, int64_t head_dim,
                                    bool aligned) {
  BackendSpec s;
  s.gpu = !engine.host_compute();
  s.params = engine.compute_dtype();
  // "auto": bf16 where the GPU's bf16 backend runs (bf16 parameters, heads the fused attention
  // takes), else the fp32 reference.
  const bool gpu_bf16 = s.gpu && s.params == DType::kBF16 && FusedAttentionHeadWidth(head_dim);
  // TZ_GPT_FUSED_ATTENTION=0 (attention as batched products, for comparison) applies to fp32
  // activations, whose attention it chooses: "auto" then picks them; the bf16 backend's
  // attention is fused always (TZ_GPT_ATTENTION picks which).
  TZ_ASSIGN_OR_RETURN(const bool fused, FusedAttentionWanted());
  const bool fused_off = std::getenv("TZ_GPT_FUSED_ATTENTION") != nullptr && !fused && s.gpu;
  Activations want = activations;
  if (want == Activations::kAuto)
    want = gpu_bf16 && aligned && !fused_off ? Activations::kBF16 : Activations::kF32;
  if (want == Activations::kBF16 && fused_off)
    return UnsupportedError(
        "TZ_GPT_FUSED_ATTENTION=0 runs attention as batched products, which fp32 activations "
        "do; model.activations \"bf16\" always runs fused attention (TZ_GPT_ATTENTION picks "
        "cuDNN's or the kernels): use model.activations \"fp32\" or \"auto\", or unset it");
  if (want == Activations::kF32) {
    // fp32 activations: fp32 ops on widened parameters, gradients in fp32 until written (the
    // reference, as before the interface carried types). On a GPU the products of bf16
    // parameters run on the tensor cores, where the fused attention kernels apply (Note [bf16
    // products around fp32 activations]).
    s.activations = DType::kF32;
    s.weights = DType::kF32;
    s.grads_in_place = false;
    s.fused_attention_wanted = s.gpu && s.params == DType::kBF16 && fused;
    return s;
  }
  if (s.gpu && !gpu_bf16)
    return UnsupportedError(
        "model.activations \"bf16\" on a GPU needs bf16 parameters (engine.compute_dtype "
        "\"bf16\") and attention heads 32, 64, 96 or 128 wide (these are " +
        std::string(DTypeName(s.params)) + " and " + std::to_string(head_dim) +
        "); use \"fp32\" or \"auto\"");
  s.activations = DType::kBF16;
  s.weights = s.params;
  s.grads_in_place = true;
  // The GPU's bf16 attention is the fused kernels (log-sum-exps kept); the CPU's keeps the
  // probabilities.
  s.fused_attention_wanted = s.gpu;
  return s;
}

StatusOr<std::unique_ptr<Backend>> Backend::Create(Engine& engine, const BackendSpec& spec) {
  if (!spec.gpu) return std::unique_ptr<Backend>(new CpuBackend(spec));
#ifdef TZ_GPT_CUDA
  if (spec.activations == DType::kBF16) return CreateCudaBf16Backend(engine, spec);
  return CreateCudaBackend(engine, spec);
#else
  (void)engine;
  return UnsupportedError(
      "this build has no CUDA: the GPT runs on the simulated device only (device 'host')");
#endif
}

}  // namespace tierzero::gpt
