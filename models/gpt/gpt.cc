#include "gpt/gpt.h"

#include <cmath>
#include <cstring>
#include <string>

#include "gpt/backend.h"

namespace tierzero::gpt {
namespace {

// A scope's parameters as the ops read them (Note [Activation types] in gpt/backend.h): the
// chunks' own copies, or widened into one activation buffer.
struct Weights {
  ActivationBuffer buf;
  std::vector<const void*> ptr;
};

StatusOr<Weights> Prepare(Engine& e, Backend& k, const ParamScope& scope,
                          const std::vector<ParamId>& ids) {
  const BackendSpec& spec = k.spec();
  Weights w;
  if (!spec.widen_params()) {
    for (ParamId p : ids) w.ptr.push_back(scope.data(p));
    return w;
  }
  uint64_t total = 0;
  for (ParamId p : ids) total += spec.weight_bytes(e.numel(p));
  TZ_ASSIGN_OR_RETURN(w.buf, e.AllocateActivation(total));
  char* at = static_cast<char*>(w.buf.data());
  for (ParamId p : ids) {
    const int64_t n = e.numel(p);
    TZ_RETURN_IF_ERROR(k.Cast(scope.data(p), e.compute_dtype(), at, spec.weights, n, false));
    w.ptr.push_back(at);
    at += spec.weight_bytes(n);
  }
  return w;
}

// Where an op puts a parameter's gradient: the engine's buffer itself (grads_in_place; written
// at the parameter's first backward use, added to at later ones), or a zeroed buffer in the
// weights' type the op adds into and Put writes (first use) or adds (later uses) into the
// engine's.
class Grad {
 public:
  static StatusOr<Grad> Open(Engine& e, Backend& k, const ParamScope& scope, ParamId p,
                             bool add) {
    Grad g;
    g.p_ = p;
    g.add_ = add;
    g.dst_ = scope.grad(p);
    if (g.dst_ == nullptr)
      return InternalError("no gradient buffer for parameter " + e.param(p).name);
    if (k.spec().grads_in_place) return g;
    TZ_ASSIGN_OR_RETURN(g.buf_, e.AllocateActivation(k.spec().weight_bytes(e.numel(p))));
    k.Zero(g.buf_.data(), g.buf_.bytes());
    return g;
  }
  GradOut out() const {
    return buf_.bytes() == 0 ? GradOut{dst_, add_} : GradOut{buf_.data(), true};
  }
  // Hands the gradient to the engine and frees the buffer.
  Status Put(Engine& e, Backend& k) {
    if (buf_.bytes() == 0) return Status::OK();
    TZ_RETURN_IF_ERROR(
        k.Cast(buf_.data(), k.spec().weights, dst_, e.compute_dtype(), e.numel(p_), add_));
    buf_.Reset();
    return Status::OK();
  }

 private:
  ParamId p_ = -1;
  bool add_ = false;
  void* dst_ = nullptr;
  ActivationBuffer buf_;
};

// n activations (the spec's type) and n fp32 values.
StatusOr<ActivationBuffer> Acts(Engine& e, const Backend& k, int64_t n) {
  return e.AllocateActivation(k.spec().act_bytes(n));
}
StatusOr<ActivationBuffer> Floats(Engine& e, int64_t n) {
  return e.AllocateActivation(static_cast<uint64_t>(n) * 4);
}

// A block's parameter gradients, each open only from the op that computes it until it is
// written to the engine (so a block never holds all of them at once).
class GradSink {
 public:
  GradSink(Engine& e, Backend& k, const ParamScope& scope, const std::vector<ParamId>& ids)
      : e_(e), k_(k), scope_(scope), ids_(ids), grads_(ids.size()) {}
  // Gradients of parameters i and j (their first backward use).
  Status Open(size_t i, size_t j) {
    for (size_t k : {i, j}) {
      TZ_ASSIGN_OR_RETURN(grads_[k], Grad::Open(e_, k_, scope_, ids_[k], /*add=*/false));
    }
    return Status::OK();
  }
  GradOut operator[](size_t i) const { return grads_[i].out(); }
  // Writes gradients i and j and frees them.
  Status Close(size_t i, size_t j) {
    for (size_t k : {i, j}) TZ_RETURN_IF_ERROR(grads_[k].Put(e_, k_));
    return Status::OK();
  }

 private:
  Engine& e_;
  Backend& k_;
  const ParamScope& scope_;
  const std::vector<ParamId>& ids_;
  std::vector<Grad> grads_;
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

// A block's activations kept from forward for backward (rows = batch x seq): activations in
// the backend's type, LayerNorm statistics in fp32, attention's state as the backend keeps it.
struct Gpt::Saved {
  ActivationBuffer x;  // block input (kept with checkpointing too)
  ActivationBuffer ln1, mean1, rstd1, qkv, probs, att, x2, ln2, mean2, rstd2, h, gelu;
};

namespace {

struct Dims {
  int64_t B, T, C, H, rows;
};

// The activation `elems` elements into p.
void* At(const Backend& k, void* p, int64_t elems) {
  return static_cast<char*>(p) + k.spec().act_bytes(elems);
}
// GPT-2's attention: q, k, v interleaved in rows of 3C.
AttnDims FusedAttn(const Backend&, const Dims& d, const void*) {
  return {d.B, d.T, d.H, d.H, d.C / d.H, 3 * d.C, 3 * d.C, 3 * d.C};
}

// Forward of one block from s.x into y; fills the saved activations.
template <typename Saved>
Status BlockForward(Engine& e, Backend& k, const Dims& d, const std::vector<const void*>& P,
                    Saved& s, void* y) {
  const int64_t R = d.rows, C = d.C;
  constexpr WeightLayout kW = WeightLayout::kInOut;  // GPT-2's Conv1D weights
  TZ_ASSIGN_OR_RETURN(s.ln1, Acts(e, k, R * C));
  TZ_ASSIGN_OR_RETURN(s.mean1, Floats(e, R));
  TZ_ASSIGN_OR_RETURN(s.rstd1, Floats(e, R));
  TZ_ASSIGN_OR_RETURN(s.qkv, Acts(e, k, R * 3 * C));
  TZ_ASSIGN_OR_RETURN(s.probs,
                      e.AllocateActivation(k.spec().attention_state_bytes(d.B, d.T, d.H, C / d.H)));
  TZ_ASSIGN_OR_RETURN(s.att, Acts(e, k, R * C));
  TZ_ASSIGN_OR_RETURN(s.x2, Acts(e, k, R * C));
  TZ_ASSIGN_OR_RETURN(s.ln2, Acts(e, k, R * C));
  TZ_ASSIGN_OR_RETURN(s.mean2, Floats(e, R));
  TZ_ASSIGN_OR_RETURN(s.rstd2, Floats(e, R));
  TZ_ASSIGN_OR_RETURN(s.h, Acts(e, k, R * 4 * C));
  TZ_ASSIGN_OR_RETURN(s.gelu, Acts(e, k, R * 4 * C));
  const void* x = s.x.data();
  k.LayerNormForward(x, P[0], P[1], s.ln1.data(), s.mean1.template as<float>(),
                     s.rstd1.template as<float>(), R, C);
  k.LinearForward(s.ln1.data(), P[2], P[3], s.qkv.data(), R, C, 3 * C, kW);
  const AttnDims ad = FusedAttn(k, d, s.qkv.data());
  k.AttentionForward(s.qkv.data(), At(k, s.qkv.data(), C), At(k, s.qkv.data(), 2 * C), s.att.data(),
                     s.probs.data(), ad);
  {
    TZ_ASSIGN_OR_RETURN(ActivationBuffer a, Acts(e, k, R * C));
    k.LinearForward(s.att.data(), P[4], P[5], a.data(), R, C, C, kW);
    k.Add(x, a.data(), s.x2.data(), R * C);
  }
  k.LayerNormForward(s.x2.data(), P[6], P[7], s.ln2.data(), s.mean2.template as<float>(),
                     s.rstd2.template as<float>(), R, C);
  k.LinearGeluForward(s.ln2.data(), P[8], P[9], s.h.data(), s.gelu.data(), R, C, 4 * C, kW);
  {
    TZ_ASSIGN_OR_RETURN(ActivationBuffer m, Acts(e, k, R * C));
    k.LinearForward(s.gelu.data(), P[10], P[11], m.data(), R, 4 * C, C, kW);
    k.Add(s.x2.data(), m.data(), y, R * C);
  }
  return Status::OK();
}

// Backward of one block: dy in, dx out (written), parameter gradients through G.
template <typename Saved>
Status BlockBackward(Engine& e, Backend& k, const Dims& d, const std::vector<const void*>& P,
                     GradSink& G, Saved& s, const void* dy, void* dx) {
  const int64_t R = d.rows, C = d.C;
  constexpr WeightLayout kW = WeightLayout::kInOut;
  TZ_ASSIGN_OR_RETURN(ActivationBuffer dx2, Acts(e, k, R * C));
  k.Copy(dx2.data(), dy, k.spec().act_bytes(R * C));
  {
    TZ_ASSIGN_OR_RETURN(ActivationBuffer dg, Acts(e, k, R * 4 * C));
    TZ_RETURN_IF_ERROR(G.Open(10, 11));
    k.LinearBackwardGelu(dy, s.gelu.data(), P[10], s.h.data(), dg.data(), G[10], G[11], R, 4 * C,
                         C, kW);
    s.gelu.Reset();
    TZ_RETURN_IF_ERROR(G.Close(10, 11));
    s.h.Reset();
    TZ_ASSIGN_OR_RETURN(ActivationBuffer dln2, Acts(e, k, R * C));
    TZ_RETURN_IF_ERROR(G.Open(8, 9));
    k.LinearBackward(dg.data(), s.ln2.data(), P[8], dln2.data(), G[8], G[9], R, C, 4 * C, kW);
    dg.Reset();
    TZ_RETURN_IF_ERROR(G.Close(8, 9));
    TZ_ASSIGN_OR_RETURN(ActivationBuffer t, Acts(e, k, R * C));
    TZ_RETURN_IF_ERROR(G.Open(6, 7));
    k.LayerNormBackward(dln2.data(), s.x2.data(), P[6], s.mean2.template as<float>(),
                        s.rstd2.template as<float>(), t.data(), G[6], G[7], R, C);
    TZ_RETURN_IF_ERROR(G.Close(6, 7));
    k.AddInPlace(dx2.data(), t.data(), R * C);
  }
  {
    TZ_ASSIGN_OR_RETURN(ActivationBuffer datt, Acts(e, k, R * C));
    TZ_RETURN_IF_ERROR(G.Open(4, 5));
    k.LinearBackward(dx2.data(), s.att.data(), P[4], datt.data(), G[4], G[5], R, C, C, kW);
    TZ_ASSIGN_OR_RETURN(ActivationBuffer dqkv, Acts(e, k, R * 3 * C));
    k.AttentionBackward(datt.data(), s.qkv.data(), At(k, s.qkv.data(), C), At(k, s.qkv.data(), 2 * C),
                        s.att.data(), s.probs.data(), dqkv.data(), At(k, dqkv.data(), C),
                        At(k, dqkv.data(), 2 * C), FusedAttn(k, d, s.qkv.data()));
    datt.Reset();
    TZ_RETURN_IF_ERROR(G.Close(4, 5));
    TZ_ASSIGN_OR_RETURN(ActivationBuffer dln1, Acts(e, k, R * C));
    TZ_RETURN_IF_ERROR(G.Open(2, 3));
    k.LinearBackward(dqkv.data(), s.ln1.data(), P[2], dln1.data(), G[2], G[3], R, C, 3 * C, kW);
    dqkv.Reset();
    TZ_RETURN_IF_ERROR(G.Close(2, 3));
    TZ_RETURN_IF_ERROR(G.Open(0, 1));
    k.LayerNormBackward(dln1.data(), s.x.data(), P[0], s.mean1.template as<float>(),
                        s.rstd1.template as<float>(), dx, G[0], G[1], R, C);
    TZ_RETURN_IF_ERROR(G.Close(0, 1));
    k.AddInPlace(dx, dx2.data(), R * C);
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
    TZ_ASSIGN_OR_RETURN(BackendSpec spec, ChooseBackend(engine_, cfg_.activations, cfg_.d_model / cfg_.n_head));
    TZ_ASSIGN_OR_RETURN(backend_, Backend::Create(engine_, spec));
  }
  Backend& k = *backend_;
  constexpr WeightLayout kHead = WeightLayout::kOutIn;  // the LM head: wte, vocab x width
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
    TZ_ASSIGN_OR_RETURN(saved[0].x, Acts(engine_, k, R * C));
    {
      const std::vector<ParamId> ids = {wte_, wpe_};
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(ids, Phase::kForward));
      TZ_ASSIGN_OR_RETURN(Weights P, Prepare(engine_, k, scope, ids));
      k.EmbeddingForward(tokens.as<int32_t>(), P.ptr[0], P.ptr[1], saved[0].x.data(), d.B, d.T, C);
    }
    for (int64_t l = 0; l < L; ++l) {
      const std::vector<ParamId> ids = blocks_[static_cast<size_t>(l)].all();
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(ids, Phase::kForward));
      TZ_ASSIGN_OR_RETURN(Weights P, Prepare(engine_, k, scope, ids));
      Saved& s = saved[static_cast<size_t>(l)];
      TZ_ASSIGN_OR_RETURN(saved[static_cast<size_t>(l) + 1].x, Acts(engine_, k, R * C));
      TZ_RETURN_IF_ERROR(
          BlockForward(engine_, k, d, P.ptr, s, saved[static_cast<size_t>(l) + 1].x.data()));
      if (cfg_.activation_checkpointing || !train) {
        ActivationBuffer keep = std::move(s.x);
        s = Saved{};
        if (train) s.x = std::move(keep);
      }
    }
    // Final LayerNorm, LM head and loss; dlogits right away (forward moment).
    ActivationBuffer lnf, meanf, rstdf, dlogits;
    TZ_ASSIGN_OR_RETURN(lnf, Acts(engine_, k, R * C));
    TZ_ASSIGN_OR_RETURN(meanf, Floats(engine_, R));
    TZ_ASSIGN_OR_RETURN(rstdf, Floats(engine_, R));
    if (train) {
      TZ_ASSIGN_OR_RETURN(dlogits, Acts(engine_, k, R * V));
    }
    {
      const std::vector<ParamId> ids = {lnf_w_, lnf_b_, wte_};
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(ids, Phase::kForward));
      TZ_ASSIGN_OR_RETURN(Weights P, Prepare(engine_, k, scope, ids));
      k.LayerNormForward(saved[static_cast<size_t>(L)].x.data(), P.ptr[0], P.ptr[1], lnf.data(),
                         meanf.as<float>(), rstdf.as<float>(), R, C);
      TZ_ASSIGN_OR_RETURN(ActivationBuffer logits, Acts(engine_, k, R * V));
      k.LinearForward(lnf.data(), P.ptr[2], nullptr, logits.data(), R, C, V, kHead);
      TZ_RETURN_IF_ERROR(k.CrossEntropy(logits.data(), targets.as<int32_t>(), mask.as<float>(),
                                        train ? dlogits.data() : nullptr, argmax.as<int32_t>(), R,
                                        V, engine_.loss_scale()));
      if (predictions != nullptr) {
        predictions->resize(rows);
        TZ_RETURN_IF_ERROR(k.Download(predictions->data(), argmax.data(), rows * 4));
      }
    }
    if (!train) {
      TZ_ASSIGN_OR_RETURN(loss, k.Loss());
      return k.status();
    }

    // Backward.
    ActivationBuffer dx;
    TZ_ASSIGN_OR_RETURN(dx, Acts(engine_, k, R * C));
    {
      const std::vector<ParamId> ids = {lnf_w_, lnf_b_, wte_};
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(ids, Phase::kBackward));
      TZ_ASSIGN_OR_RETURN(Weights P, Prepare(engine_, k, scope, ids));
      std::vector<Grad> G;
      for (ParamId p : ids) {
        TZ_ASSIGN_OR_RETURN(Grad g, Grad::Open(engine_, k, scope, p, /*add=*/false));
        G.push_back(std::move(g));
      }
      TZ_ASSIGN_OR_RETURN(ActivationBuffer dlnf, Acts(engine_, k, R * C));
      k.LinearBackward(dlogits.data(), lnf.data(), P.ptr[2], dlnf.data(), G[2].out(), GradOut{}, R,
                       C, V, kHead);
      dlogits.Reset();
      k.LayerNormBackward(dlnf.data(), saved[static_cast<size_t>(L)].x.data(), P.ptr[0],
                          meanf.as<float>(), rstdf.as<float>(), dx.data(), G[0].out(), G[1].out(),
                          R, C);
      saved[static_cast<size_t>(L)].x.Reset();
      for (Grad& g : G) TZ_RETURN_IF_ERROR(g.Put(engine_, k));
    }
    for (int64_t l = L - 1; l >= 0; --l) {
      const std::vector<ParamId> ids = blocks_[static_cast<size_t>(l)].all();
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(ids, Phase::kBackward));
      TZ_ASSIGN_OR_RETURN(Weights P, Prepare(engine_, k, scope, ids));
      Saved& s = saved[static_cast<size_t>(l)];
      if (cfg_.activation_checkpointing) {
        TZ_ASSIGN_OR_RETURN(ActivationBuffer y, Acts(engine_, k, R * C));
        TZ_RETURN_IF_ERROR(BlockForward(engine_, k, d, P.ptr, s, y.data()));
      }
      GradSink G(engine_, k, scope, ids);
      TZ_ASSIGN_OR_RETURN(ActivationBuffer dx_in, Acts(engine_, k, R * C));
      TZ_RETURN_IF_ERROR(BlockBackward(engine_, k, d, P.ptr, G, s, dx.data(), dx_in.data()));
      s = Saved{};
      dx = std::move(dx_in);
    }
    {
      const std::vector<ParamId> ids = {wte_, wpe_};
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(ids, Phase::kBackward));
      // wte's second backward use (the LM head wrote first) adds.
      TZ_ASSIGN_OR_RETURN(Grad gwte, Grad::Open(engine_, k, scope, wte_, /*add=*/true));
      TZ_ASSIGN_OR_RETURN(Grad gwpe, Grad::Open(engine_, k, scope, wpe_, /*add=*/false));
      k.EmbeddingBackward(tokens.as<int32_t>(), batch.tokens.data(), dx.data(), gwte.out(), V,
                          gwpe.out(), d.B, d.T, C);
      TZ_RETURN_IF_ERROR(gwte.Put(engine_, k));
      TZ_RETURN_IF_ERROR(gwpe.Put(engine_, k));
    }
    // The loss, once the whole iteration is enqueued.
    TZ_ASSIGN_OR_RETURN(loss, k.Loss());
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
