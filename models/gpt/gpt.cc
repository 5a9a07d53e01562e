#include "gpt/gpt.h"

#include <cmath>
#include <cstring>
#include <string>

#include "gpt/backend.h"

namespace tierzero::gpt {
namespace {

// A scope's parameters widened to fp32 in one activation buffer.
struct Widened {
  ActivationBuffer buf;
  std::vector<float*> ptr;
};

StatusOr<Widened> Widen(Engine& e, Backend& k, const ParamScope& scope,
                        const std::vector<ParamId>& ids) {
  uint64_t total = 0;
  for (ParamId p : ids) total += static_cast<uint64_t>(e.numel(p));
  Widened w;
  TZ_ASSIGN_OR_RETURN(w.buf, e.AllocateActivation(total * 4));
  float* at = w.buf.as<float>();
  for (ParamId p : ids) {
    const auto n = static_cast<size_t>(e.numel(p));
    TZ_RETURN_IF_ERROR(k.Widen(scope.data(p), e.compute_dtype(), at, static_cast<int64_t>(n)));
    w.ptr.push_back(at);
    at += n;
  }
  return w;
}

// Zeroed fp32 gradients for `ids`, laid out like Widen.
StatusOr<Widened> ZeroGrads(Engine& e, Backend& k, const std::vector<ParamId>& ids) {
  uint64_t total = 0;
  for (ParamId p : ids) total += static_cast<uint64_t>(e.numel(p));
  Widened w;
  TZ_ASSIGN_OR_RETURN(w.buf, e.AllocateActivation(total * 4));
  k.Zero(w.buf.data(), total * 4);
  float* at = w.buf.as<float>();
  for (ParamId p : ids) {
    w.ptr.push_back(at);
    at += e.numel(p);
  }
  return w;
}

// Writes (first backward use) or adds (later uses) fp32 gradients into the engine's buffers.
Status PutGrad(Engine& e, Backend& k, const ParamScope& scope, ParamId p, const float* g,
               bool add) {
  const int64_t n = e.numel(p);
  void* dst = scope.grad(p);
  if (dst == nullptr) return InternalError("no gradient buffer for parameter " + e.param(p).name);
  if (!add) return k.Narrow(g, dst, e.compute_dtype(), n);
  TZ_ASSIGN_OR_RETURN(ActivationBuffer tmp, e.AllocateActivation(static_cast<uint64_t>(n) * 4));
  TZ_RETURN_IF_ERROR(k.Widen(dst, e.compute_dtype(), tmp.as<float>(), n));
  k.AddInPlace(tmp.as<float>(), g, n);
  return k.Narrow(tmp.as<float>(), dst, e.compute_dtype(), n);
}

StatusOr<ActivationBuffer> Floats(Engine& e, int64_t n) {
  return e.AllocateActivation(static_cast<uint64_t>(n) * 4);
}

// A block's parameter gradients, each in fp32 only from the op that computes it until it is
// written to the engine (so a block never holds all of them at once).
class GradSink {
 public:
  GradSink(Engine& e, Backend& k, const ParamScope& scope, const std::vector<ParamId>& ids)
      : e_(e), k_(k), scope_(scope), ids_(ids), bufs_(ids.size()) {}
  // Zeroed fp32 gradients of parameters i and j.
  Status Open(size_t i, size_t j) {
    for (size_t k : {i, j}) {
      TZ_ASSIGN_OR_RETURN(bufs_[k],
                          e_.AllocateActivation(static_cast<uint64_t>(e_.numel(ids_[k])) * 4));
      k_.Zero(bufs_[k].data(), bufs_[k].bytes());
    }
    return Status::OK();
  }
  float* operator[](size_t i) const { return bufs_[i].as<float>(); }
  // Writes gradients i and j (first backward use) and frees them.
  Status Close(size_t i, size_t j) {
    for (size_t k : {i, j}) {
      TZ_RETURN_IF_ERROR(PutGrad(e_, k_, scope_, ids_[k], bufs_[k].as<float>(), /*add=*/false));
      bufs_[k].Reset();
    }
    return Status::OK();
  }

 private:
  Engine& e_;
  Backend& k_;
  const ParamScope& scope_;
  const std::vector<ParamId>& ids_;
  std::vector<ActivationBuffer> bufs_;
};

}  // namespace

Status ValidateGptConfig(const GptConfig& c) {
  auto bad = [](const char* field, int v, const char* range) {
    return InvalidArgumentError(std::string("model field '") + field + "' is " + std::to_string(v) +
                                "; accepted: " + range);
  };
  if (c.vocab < 2 || c.vocab > (1 << 20)) return bad("vocab", c.vocab, "2..1048576");
  if (c.seq_len < 1 || c.seq_len > 65536) return bad("seq_len", c.seq_len, "1..65536");
  if (c.d_model < 1 || c.d_model > 65536) return bad("d_model", c.d_model, "1..65536");
  if (c.n_layer < 1 || c.n_layer > 4096) return bad("n_layer", c.n_layer, "1..4096");
  if (c.n_head < 1 || c.d_model % c.n_head != 0)
    return bad("n_head", c.n_head, "a divisor of d_model");
  return Status::OK();
}

StatusOr<std::unique_ptr<Gpt>> Gpt::Create(Engine& engine, const GptConfig& config) {
  TZ_RETURN_IF_ERROR(ValidateGptConfig(config));
  std::unique_ptr<Gpt> g(new Gpt(engine, config));
  const int64_t C = config.d_model, V = config.vocab, L = config.n_layer;
  uint64_t seed = config.seed * 1000003;
  const float proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(L));
  auto reg = [&](const std::string& name, std::vector<int64_t> shape, Initializer init,
                 bool decay) -> StatusOr<ParamId> {
    TZ_ASSIGN_OR_RETURN(ParamId p,
                        engine.RegisterParam({name, std::move(shape), std::move(init), decay}));
    g->num_params_ += engine.numel(p);
    return p;
  };
  TZ_ASSIGN_OR_RETURN(g->wte_, reg("wte", {V, C}, InitNormal(0.02f, ++seed), true));
  TZ_ASSIGN_OR_RETURN(g->wpe_, reg("wpe", {config.seq_len, C}, InitNormal(0.02f, ++seed), true));
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    Block b{};
    TZ_ASSIGN_OR_RETURN(b.ln1_w, reg(p + "ln_1.weight", {C}, InitConstant(1), false));
    TZ_ASSIGN_OR_RETURN(b.ln1_b, reg(p + "ln_1.bias", {C}, InitConstant(0), false));
    TZ_ASSIGN_OR_RETURN(b.attn_w,
                        reg(p + "attn.c_attn.weight", {C, 3 * C}, InitNormal(0.02f, ++seed), true));
    TZ_ASSIGN_OR_RETURN(b.attn_b, reg(p + "attn.c_attn.bias", {3 * C}, InitConstant(0), false));
    TZ_ASSIGN_OR_RETURN(b.proj_w,
                        reg(p + "attn.c_proj.weight", {C, C}, InitNormal(proj_std, ++seed), true));
    TZ_ASSIGN_OR_RETURN(b.proj_b, reg(p + "attn.c_proj.bias", {C}, InitConstant(0), false));
    TZ_ASSIGN_OR_RETURN(b.ln2_w, reg(p + "ln_2.weight", {C}, InitConstant(1), false));
    TZ_ASSIGN_OR_RETURN(b.ln2_b, reg(p + "ln_2.bias", {C}, InitConstant(0), false));
    TZ_ASSIGN_OR_RETURN(b.fc_w,
                        reg(p + "mlp.c_fc.weight", {C, 4 * C}, InitNormal(0.02f, ++seed), true));
    TZ_ASSIGN_OR_RETURN(b.fc_b, reg(p + "mlp.c_fc.bias", {4 * C}, InitConstant(0), false));
    TZ_ASSIGN_OR_RETURN(
        b.fc2_w, reg(p + "mlp.c_proj.weight", {4 * C, C}, InitNormal(proj_std, ++seed), true));
    TZ_ASSIGN_OR_RETURN(b.fc2_b, reg(p + "mlp.c_proj.bias", {C}, InitConstant(0), false));
    g->blocks_.push_back(b);
  }
  TZ_ASSIGN_OR_RETURN(g->lnf_w_, reg("ln_f.weight", {C}, InitConstant(1), false));
  TZ_ASSIGN_OR_RETURN(g->lnf_b_, reg("ln_f.bias", {C}, InitConstant(0), false));
  return g;
}

Gpt::Gpt(Engine& engine, const GptConfig& config) : engine_(engine), cfg_(config) {}
Gpt::~Gpt() = default;

double Gpt::flops_per_token() const {
  const double C = cfg_.d_model, L = cfg_.n_layer, V = cfg_.vocab, T = cfg_.seq_len;
  const double matmul_params = L * 12 * C * C + V * C;
  // Attention scores and weighted sum: 2 x 2 x T x C per layer forward (causal: half of it).
  return 6 * matmul_params + 6 * L * T * C;
}

// A block's activations kept from forward for backward (all fp32, rows = batch x seq).
struct Gpt::Saved {
  ActivationBuffer x;  // block input (kept with checkpointing too)
  ActivationBuffer ln1, mean1, rstd1, qkv, probs, att, x2, ln2, mean2, rstd2, h, gelu;
};

namespace {

struct Dims {
  int64_t B, T, C, H, rows;
};

// Forward of one block from s.x into y; fills the saved activations.
template <typename Saved>
Status BlockForward(Engine& e, Backend& k, const Dims& d, const std::vector<float*>& P, Saved& s,
                    float* y) {
  const int64_t R = d.rows, C = d.C;
  TZ_ASSIGN_OR_RETURN(s.ln1, Floats(e, R * C));
  TZ_ASSIGN_OR_RETURN(s.mean1, Floats(e, R));
  TZ_ASSIGN_OR_RETURN(s.rstd1, Floats(e, R));
  TZ_ASSIGN_OR_RETURN(s.qkv, Floats(e, R * 3 * C));
  TZ_ASSIGN_OR_RETURN(s.probs,
                      Floats(e, AttentionStateFloats(k.fused_attention(C / d.H), d.B, d.T, d.H)));
  TZ_ASSIGN_OR_RETURN(s.att, Floats(e, R * C));
  TZ_ASSIGN_OR_RETURN(s.x2, Floats(e, R * C));
  TZ_ASSIGN_OR_RETURN(s.ln2, Floats(e, R * C));
  TZ_ASSIGN_OR_RETURN(s.mean2, Floats(e, R));
  TZ_ASSIGN_OR_RETURN(s.rstd2, Floats(e, R));
  TZ_ASSIGN_OR_RETURN(s.h, Floats(e, R * 4 * C));
  TZ_ASSIGN_OR_RETURN(s.gelu, Floats(e, R * 4 * C));
  const float* x = s.x.template as<float>();
  k.LayerNormForward(x, P[0], P[1], s.ln1.template as<float>(), s.mean1.template as<float>(),
                     s.rstd1.template as<float>(), R, C);
  k.LinearForward(s.ln1.template as<float>(), P[2], P[3], s.qkv.template as<float>(), R, C, 3 * C);
  k.AttentionForward(s.qkv.template as<float>(), s.att.template as<float>(),
                     s.probs.template as<float>(), d.B, d.T, C, d.H);
  {
    TZ_ASSIGN_OR_RETURN(ActivationBuffer a, Floats(e, R * C));
    k.LinearForward(s.att.template as<float>(), P[4], P[5], a.as<float>(), R, C, C);
    k.Add(x, a.as<float>(), s.x2.template as<float>(), R * C);
  }
  k.LayerNormForward(s.x2.template as<float>(), P[6], P[7], s.ln2.template as<float>(),
                     s.mean2.template as<float>(), s.rstd2.template as<float>(), R, C);
  k.LinearForward(s.ln2.template as<float>(), P[8], P[9], s.h.template as<float>(), R, C, 4 * C);
  k.GeluForward(s.h.template as<float>(), s.gelu.template as<float>(), R * 4 * C);
  {
    TZ_ASSIGN_OR_RETURN(ActivationBuffer m, Floats(e, R * C));
    k.LinearForward(s.gelu.template as<float>(), P[10], P[11], m.as<float>(), R, 4 * C, C);
    k.Add(s.x2.template as<float>(), m.as<float>(), y, R * C);
  }
  return Status::OK();
}

// Backward of one block: dy in, dx out (written), parameter gradients added into G.
template <typename Saved>
Status BlockBackward(Engine& e, Backend& k, const Dims& d, const std::vector<float*>& P,
                     GradSink& G, Saved& s, const float* dy, float* dx) {
  const int64_t R = d.rows, C = d.C;
  TZ_ASSIGN_OR_RETURN(ActivationBuffer dx2, Floats(e, R * C));
  k.Copy(dx2.data(), dy, static_cast<uint64_t>(R * C) * 4);
  {
    TZ_ASSIGN_OR_RETURN(ActivationBuffer dg, Floats(e, R * 4 * C));
    TZ_RETURN_IF_ERROR(G.Open(10, 11));
    k.LinearBackward(dy, s.gelu.template as<float>(), P[10], dg.as<float>(), G[10], G[11], R, 4 * C,
                     C);
    s.gelu.Reset();
    TZ_RETURN_IF_ERROR(G.Close(10, 11));
    k.GeluBackward(dg.as<float>(), s.h.template as<float>(), dg.as<float>(), R * 4 * C);
    s.h.Reset();
    TZ_ASSIGN_OR_RETURN(ActivationBuffer dln2, Floats(e, R * C));
    TZ_RETURN_IF_ERROR(G.Open(8, 9));
    k.LinearBackward(dg.as<float>(), s.ln2.template as<float>(), P[8], dln2.as<float>(), G[8], G[9],
                     R, C, 4 * C);
    dg.Reset();
    TZ_RETURN_IF_ERROR(G.Close(8, 9));
    TZ_ASSIGN_OR_RETURN(ActivationBuffer t, Floats(e, R * C));
    TZ_RETURN_IF_ERROR(G.Open(6, 7));
    k.LayerNormBackward(dln2.as<float>(), s.x2.template as<float>(), P[6],
                        s.mean2.template as<float>(), s.rstd2.template as<float>(), t.as<float>(),
                        G[6], G[7], R, C);
    TZ_RETURN_IF_ERROR(G.Close(6, 7));
    k.AddInPlace(dx2.as<float>(), t.as<float>(), R * C);
  }
  {
    TZ_ASSIGN_OR_RETURN(ActivationBuffer datt, Floats(e, R * C));
    TZ_RETURN_IF_ERROR(G.Open(4, 5));
    k.LinearBackward(dx2.as<float>(), s.att.template as<float>(), P[4], datt.as<float>(), G[4],
                     G[5], R, C, C);
    TZ_ASSIGN_OR_RETURN(ActivationBuffer dqkv, Floats(e, R * 3 * C));
    k.AttentionBackward(datt.as<float>(), s.qkv.template as<float>(), s.att.template as<float>(),
                        s.probs.template as<float>(), dqkv.as<float>(), d.B, d.T, C, d.H);
    datt.Reset();
    TZ_RETURN_IF_ERROR(G.Close(4, 5));
    TZ_ASSIGN_OR_RETURN(ActivationBuffer dln1, Floats(e, R * C));
    TZ_RETURN_IF_ERROR(G.Open(2, 3));
    k.LinearBackward(dqkv.as<float>(), s.ln1.template as<float>(), P[2], dln1.as<float>(), G[2],
                     G[3], R, C, 3 * C);
    dqkv.Reset();
    TZ_RETURN_IF_ERROR(G.Close(2, 3));
    TZ_RETURN_IF_ERROR(G.Open(0, 1));
    k.LayerNormBackward(dln1.as<float>(), s.x.template as<float>(), P[0],
                        s.mean1.template as<float>(), s.rstd1.template as<float>(), dx, G[0], G[1],
                        R, C);
    TZ_RETURN_IF_ERROR(G.Close(0, 1));
    k.AddInPlace(dx, dx2.as<float>(), R * C);
  }
  return Status::OK();
}

}  // namespace

StatusOr<double> Gpt::ForwardBackward(const Batch& batch) { return Run(batch, true, nullptr); }

StatusOr<double> Gpt::Evaluate(const Batch& batch, std::vector<int32_t>* predictions) {
  return Run(batch, false, predictions);
}

// One function of about 150 lines on purpose: read top to bottom it is the iteration's memory
// trace, every activation allocated and freed where the engine sees it (the plan is made from
// that order), forward then backward; split, the lifetimes would hide in helpers' scopes.
StatusOr<double> Gpt::Run(const Batch& batch, bool train, std::vector<int32_t>* predictions) {
  const Dims d{batch.batch, batch.seq, cfg_.d_model, cfg_.n_head,
               static_cast<int64_t>(batch.batch) * batch.seq};
  if (d.B < 1 || d.T < 1 || d.T > cfg_.seq_len)
    return InvalidArgumentError("batch of " + std::to_string(d.B) + " x " + std::to_string(d.T) +
                                " tokens; the model's context is " + std::to_string(cfg_.seq_len));
  const size_t rows = static_cast<size_t>(d.rows);
  if (batch.tokens.size() != rows || batch.targets.size() != rows || batch.mask.size() != rows)
    return InvalidArgumentError("batch arrays do not hold batch x seq elements");
  for (size_t i = 0; i < rows; ++i) {
    if (batch.tokens[i] < 0 || batch.tokens[i] >= cfg_.vocab || batch.targets[i] < 0 ||
        batch.targets[i] >= cfg_.vocab)
      return InvalidArgumentError("token " + std::to_string(batch.tokens[i]) +
                                  " outside the vocabulary of " + std::to_string(cfg_.vocab));
  }
  const int64_t R = d.rows, C = d.C, V = cfg_.vocab, L = cfg_.n_layer;
  if (backend_ == nullptr) {
    // The engine knows its device after Finalize.
    TZ_ASSIGN_OR_RETURN(backend_, Backend::Create(engine_));
  }
  Backend& k = *backend_;
  TZ_RETURN_IF_ERROR(engine_.BeginIteration(train));
  // On any error the iteration is aborted (its scopes are released first, by scope order): the
  // engine stays usable, the partial gradients are dropped, and the error is what the caller
  // sees.
  double loss = 0;
  Status st = [&]() -> Status {
    // The batch in device memory (tokens, targets, mask; the predicted tokens when asked).
    TZ_ASSIGN_OR_RETURN(ActivationBuffer tokens, engine_.AllocateActivation(rows * 4));
    TZ_ASSIGN_OR_RETURN(ActivationBuffer targets, engine_.AllocateActivation(rows * 4));
    TZ_ASSIGN_OR_RETURN(ActivationBuffer mask, engine_.AllocateActivation(rows * 4));
    ActivationBuffer argmax;
    if (predictions != nullptr) {
      TZ_ASSIGN_OR_RETURN(argmax, engine_.AllocateActivation(rows * 4));
    }
    TZ_RETURN_IF_ERROR(k.Upload(tokens.data(), batch.tokens.data(), rows * 4));
    TZ_RETURN_IF_ERROR(k.Upload(targets.data(), batch.targets.data(), rows * 4));
    TZ_RETURN_IF_ERROR(k.Upload(mask.data(), batch.mask.data(), rows * 4));
    std::vector<Saved> saved(static_cast<size_t>(L) + 1);
    TZ_ASSIGN_OR_RETURN(saved[0].x, Floats(engine_, R * C));
    {
      const std::vector<ParamId> ids = {wte_, wpe_};
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(ids, Phase::kForward));
      TZ_ASSIGN_OR_RETURN(Widened P, Widen(engine_, k, scope, ids));
      k.EmbeddingForward(tokens.as<int32_t>(), P.ptr[0], P.ptr[1], saved[0].x.as<float>(), d.B, d.T,
                         C);
    }
    for (int64_t l = 0; l < L; ++l) {
      const std::vector<ParamId> ids = blocks_[static_cast<size_t>(l)].all();
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(ids, Phase::kForward));
      TZ_ASSIGN_OR_RETURN(Widened P, Widen(engine_, k, scope, ids));
      Saved& s = saved[static_cast<size_t>(l)];
      TZ_ASSIGN_OR_RETURN(saved[static_cast<size_t>(l) + 1].x, Floats(engine_, R * C));
      TZ_RETURN_IF_ERROR(
          BlockForward(engine_, k, d, P.ptr, s, saved[static_cast<size_t>(l) + 1].x.as<float>()));
      if (cfg_.activation_checkpointing || !train) {
        ActivationBuffer keep = std::move(s.x);
        s = Saved{};
        if (train) s.x = std::move(keep);
      }
    }
    // Final LayerNorm, LM head and loss; dlogits right away (forward moment).
    ActivationBuffer lnf, meanf, rstdf, dlogits;
    TZ_ASSIGN_OR_RETURN(lnf, Floats(engine_, R * C));
    TZ_ASSIGN_OR_RETURN(meanf, Floats(engine_, R));
    TZ_ASSIGN_OR_RETURN(rstdf, Floats(engine_, R));
    if (train) {
      TZ_ASSIGN_OR_RETURN(dlogits, Floats(engine_, R * V));
    }
    {
      const std::vector<ParamId> ids = {lnf_w_, lnf_b_, wte_};
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(ids, Phase::kForward));
      TZ_ASSIGN_OR_RETURN(Widened P, Widen(engine_, k, scope, ids));
      k.LayerNormForward(saved[static_cast<size_t>(L)].x.as<float>(), P.ptr[0], P.ptr[1],
                         lnf.as<float>(), meanf.as<float>(), rstdf.as<float>(), R, C);
      TZ_ASSIGN_OR_RETURN(ActivationBuffer logits, Floats(engine_, R * V));
      k.Gemm(false, true, R, V, C, 1.0f, lnf.as<float>(), C, P.ptr[2], C, 0.0f, logits.as<float>(),
             V);
      TZ_ASSIGN_OR_RETURN(
          loss, k.CrossEntropy(logits.as<float>(), targets.as<int32_t>(), mask.as<float>(),
                               train ? dlogits.as<float>() : nullptr, argmax.as<int32_t>(), R, V,
                               engine_.loss_scale()));
      if (predictions != nullptr) {
        predictions->resize(rows);
        TZ_RETURN_IF_ERROR(k.Download(predictions->data(), argmax.data(), rows * 4));
      }
    }
    if (!train) return k.status();

    // Backward.
    ActivationBuffer dx;
    TZ_ASSIGN_OR_RETURN(dx, Floats(engine_, R * C));
    {
      const std::vector<ParamId> ids = {lnf_w_, lnf_b_, wte_};
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(ids, Phase::kBackward));
      TZ_ASSIGN_OR_RETURN(Widened P, Widen(engine_, k, scope, ids));
      TZ_ASSIGN_OR_RETURN(Widened G, ZeroGrads(engine_, k, ids));
      TZ_ASSIGN_OR_RETURN(ActivationBuffer dlnf, Floats(engine_, R * C));
      k.Gemm(false, false, R, C, V, 1.0f, dlogits.as<float>(), V, P.ptr[2], C, 0.0f,
             dlnf.as<float>(), C);
      k.Gemm(true, false, V, C, R, 1.0f, dlogits.as<float>(), V, lnf.as<float>(), C, 0.0f, G.ptr[2],
             C);
      dlogits.Reset();
      k.LayerNormBackward(dlnf.as<float>(), saved[static_cast<size_t>(L)].x.as<float>(), P.ptr[0],
                          meanf.as<float>(), rstdf.as<float>(), dx.as<float>(), G.ptr[0], G.ptr[1],
                          R, C);
      saved[static_cast<size_t>(L)].x.Reset();
      for (size_t i = 0; i < ids.size(); ++i)
        TZ_RETURN_IF_ERROR(PutGrad(engine_, k, scope, ids[i], G.ptr[i], /*add=*/false));
    }
    for (int64_t l = L - 1; l >= 0; --l) {
      const std::vector<ParamId> ids = blocks_[static_cast<size_t>(l)].all();
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(ids, Phase::kBackward));
      TZ_ASSIGN_OR_RETURN(Widened P, Widen(engine_, k, scope, ids));
      Saved& s = saved[static_cast<size_t>(l)];
      if (cfg_.activation_checkpointing) {
        TZ_ASSIGN_OR_RETURN(ActivationBuffer y, Floats(engine_, R * C));
        TZ_RETURN_IF_ERROR(BlockForward(engine_, k, d, P.ptr, s, y.as<float>()));
      }
      GradSink G(engine_, k, scope, ids);
      TZ_ASSIGN_OR_RETURN(ActivationBuffer dx_in, Floats(engine_, R * C));
      TZ_RETURN_IF_ERROR(
          BlockBackward(engine_, k, d, P.ptr, G, s, dx.as<float>(), dx_in.as<float>()));
      s = Saved{};
      dx = std::move(dx_in);
    }
    {
      const std::vector<ParamId> ids = {wte_, wpe_};
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(ids, Phase::kBackward));
      TZ_ASSIGN_OR_RETURN(Widened G, ZeroGrads(engine_, k, ids));
      k.EmbeddingBackward(tokens.as<int32_t>(), dx.as<float>(), G.ptr[0], G.ptr[1], d.B, d.T, C);
      // wte's second backward use (the LM head wrote first) adds.
      TZ_RETURN_IF_ERROR(PutGrad(engine_, k, scope, wte_, G.ptr[0], /*add=*/true));
      TZ_RETURN_IF_ERROR(PutGrad(engine_, k, scope, wpe_, G.ptr[1], /*add=*/false));
    }
    return k.status();
  }();
  if (!st.ok()) {
    Status end = engine_.AbortIteration();
    // The first error is the one to report; a failure to end the iteration comes second.
    return end.ok() ? st
                    : std::move(st).WithContext("then ending the iteration: " + end.ToString());
  }
  TZ_RETURN_IF_ERROR(engine_.EndIteration());
  return loss;
}

}  // namespace tierzero::gpt
