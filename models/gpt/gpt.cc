#include "gpt/gpt.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "gpt/backend.h"
#include "gpt/gpt_block.h"

namespace tierzero::gpt {
namespace {

// The ids that are not -1.
std::vector<ParamId> Ids(std::initializer_list<ParamId> ids) {
  std::vector<ParamId> v;
  for (ParamId p : ids)
    if (p >= 0) v.push_back(p);
  return v;
}

}  // namespace

const char* ArchName(Arch a) { return a == Arch::kGpt2 ? "gpt2" : "llama"; }

bool BackendAligned(const GptConfig& c) {
  const int64_t kv = int64_t{c.kv_heads()} * c.head_dim();
  return c.vocab % 8 == 0 && c.d_model % 8 == 0 && c.ffn() % 8 == 0 && kv % 8 == 0;
}

const char* ModelName(const GptConfig& c) {
  if (c.arch == Arch::kGpt2) return "GPT-2";
  return c.kv_heads() < c.n_head ? "Llama (grouped-query)" : "Llama";
}

GptConfig AsLlama(GptConfig c) {
  c.arch = Arch::kLlama;
  c.tie_embeddings = false;
  c.attention_bias = false;
  if (c.rope_theta <= 0) c.rope_theta = 10000.0;
  return c;
}

Status ValidateGptConfig(const GptConfig& c, const std::function<std::string(const char*)>& key_of,
                         const std::string& file) {
  // A field as its reader knows it: in a range, its key alone; as the subject, with the file.
  auto ref = [&](const char* field) {
    const std::string key = key_of ? key_of(field) : std::string();
    return key.empty() ? std::string(field) : key;
  };
  auto bad = [&](const char* field, const std::string& v, const std::string& range) {
    const std::string key = key_of ? key_of(field) : std::string();
    return InvalidArgumentError((key.empty() ? std::string("model field '") + field + "'"
                                             : file + ": \"" + key + "\" (model." + field + ")") +
                                " is " + v + "; accepted: " + range);
  };
  auto num = [](double v) {
    char s[32];
    std::snprintf(s, sizeof s, "%.6g", v);  // (not %f: 1e300 is 301 digits)
    return std::string(s);
  };
  if (c.vocab < 2 || c.vocab > (1 << 20))
    return bad("vocab", std::to_string(c.vocab), "2..1048576");
  if (c.seq_len < 1 || c.seq_len > 65536)
    return bad("seq_len", std::to_string(c.seq_len), "1..65536");
  if (c.max_positions < 0 || c.max_positions > (1 << 22) ||
      (c.max_positions > 0 && c.max_positions < c.seq_len))
    return bad("max_positions", std::to_string(c.max_positions),
               "0 (seq_len) or seq_len..4194304 (the context may not exceed the positions the "
               "model knows)");
  if (c.d_model < 1 || c.d_model > 65536)
    return bad("d_model", std::to_string(c.d_model), "1..65536");
  if (c.n_layer < 1 || c.n_layer > 4096)
    return bad("n_layer", std::to_string(c.n_layer), "1..4096");
  if (c.n_head < 1 || c.d_model % c.n_head != 0)
    return bad("n_head", std::to_string(c.n_head), "a divisor of " + ref("d_model"));
  if (c.n_kv_head < 0 || (c.n_kv_head > 0 && c.n_head % c.n_kv_head != 0))
    return bad("n_kv_head", std::to_string(c.n_kv_head),
               (key_of ? "" : "0 (n_head) or ") + ("a divisor of " + ref("n_head")));
  if (c.d_ff < 0 || c.d_ff > (1 << 20))
    return bad("d_ff", std::to_string(c.d_ff), "0 (the architecture's default) or 1..1048576");
  if (!(c.norm_eps > 0 && c.norm_eps <= 1)) return bad("norm_eps", num(c.norm_eps), "(0, 1]");
  // The rotary fields' ranges whatever the architecture: GPT-2 does not read them, but they are
  // the run's config all the same (its report, its checkpoint), whose readers refuse absurd
  // values (a rope_theta of 1e19 trained a whole run, then failed writing its report).
  if (!(c.rope_theta > 1 && c.rope_theta <= 1e12))
    return bad("rope_theta", num(c.rope_theta), "(1, 1e12]");
  // (A factor a float keeps as 0, or whose inverse frequencies overflow one, made every
  // gradient infinite: every step skipped, exit 0. Hunt 50.)
  if (!(c.rope_factor == 0 || (c.rope_factor >= 1e-6 && c.rope_factor <= 1e6)))
    return bad("rope_factor", num(c.rope_factor), "0 (no scaling) or [1e-6, 1e6]");
  if (!(c.rope_low_freq_factor > 0 && c.rope_low_freq_factor <= 1e6))
    return bad("rope_low_freq_factor", num(c.rope_low_freq_factor), "(0, 1e6]");
  if (!(c.rope_high_freq_factor > 0 && c.rope_high_freq_factor <= 1e6))
    return bad("rope_high_freq_factor", num(c.rope_high_freq_factor), "(0, 1e6]");
  if (c.arch == Arch::kGpt2) {
    // GPT-2 is one layout: what its Hugging Face checkpoints hold.
    if (c.n_kv_head != 0 && c.n_kv_head != c.n_head)
      return bad("n_kv_head", std::to_string(c.n_kv_head),
                 ref("n_head") + (key_of ? "" : " or 0") +
                     " for arch \"gpt2\" (grouped-query attention is Llama's)");
    if (c.d_ff != 0 && c.d_ff != 4 * c.d_model)
      return bad("d_ff", std::to_string(c.d_ff),
                 "4 " + ref("d_model") + (key_of ? "" : " or 0") + " for arch \"gpt2\"");
    if (!c.tie_embeddings) return bad("tie_embeddings", "false", "true for arch \"gpt2\"");
    if (!c.attention_bias) return bad("attention_bias", "false", "true for arch \"gpt2\"");
    if (c.norm_eps != 1e-5) return bad("norm_eps", num(c.norm_eps), "1e-5 for arch \"gpt2\"");
  } else {
    if (c.head_dim() % 2 != 0)
      return bad("n_head", std::to_string(c.n_head),
                 "a divisor of " + ref("d_model") +
                     " leaving even heads (rotary embeddings rotate pairs)");
    if (c.rope_factor > 0 &&
        !(c.rope_low_freq_factor > 0 && c.rope_high_freq_factor > c.rope_low_freq_factor &&
          c.rope_original_positions > 0))
      return bad("rope_high_freq_factor", num(c.rope_high_freq_factor),
                 "above " + ref("rope_low_freq_factor") + " (> 0), with " +
                     ref("rope_original_positions") + " > 0");
  }
  return Status::OK();
}

StatusOr<std::unique_ptr<Gpt>> Gpt::Create(Engine& engine, const GptConfig& config) {
  TZ_RETURN_IF_ERROR(ValidateGptConfig(config));
  if (config.arch != Arch::kGpt2) {
    // Refused here, before a parameter is registered: the GPU's fp32 ops are GPT-2's alone.
    TZ_ASSIGN_OR_RETURN(
        const BackendSpec spec,
        ChooseBackend(engine, config.activations, config.head_dim(), BackendAligned(config)));
    if (spec.gpu && spec.activations != DType::kBF16)
      return UnsupportedError(
          std::string(ModelName(config)) +
          " on a GPU runs with bf16 activations: give --dtype bf16 (and --activations auto or "
          "bf16); the GPU's fp32 ops have no RMSNorm, rotary or SwiGLU kernels. fp32 runs on "
          "--device host");
  }
  std::unique_ptr<Gpt> g(new Gpt(engine, config));
  const int64_t C = config.d_model, V = config.vocab, L = config.n_layer, F = config.ffn();
  const int64_t KV = int64_t{config.kv_heads()} * config.head_dim();
  uint64_t seed = config.seed * 1000003;
  const float proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(L));
  auto reg = [&](const std::string& name, std::vector<int64_t> shape, Initializer init,
                 bool decay) -> StatusOr<ParamId> {
    TZ_ASSIGN_OR_RETURN(ParamId p,
                        engine.RegisterParam({name, std::move(shape), std::move(init), decay}));
    g->num_params_ += engine.numel(p);
    return p;
  };
  auto normal = [&](float std) { return InitNormal(std, ++seed); };
  if (config.arch == Arch::kGpt2) {
    TZ_ASSIGN_OR_RETURN(g->wte_, reg("wte", {V, C}, normal(0.02f), true));
    TZ_ASSIGN_OR_RETURN(g->wpe_, reg("wpe", {config.positions(), C}, normal(0.02f), true));
    for (int64_t l = 0; l < L; ++l) {
      const std::string p = "h." + std::to_string(l) + ".";
      BlockParams b;
      TZ_ASSIGN_OR_RETURN(b.norm1_w, reg(p + "ln_1.weight", {C}, InitConstant(1), false));
      TZ_ASSIGN_OR_RETURN(b.norm1_b, reg(p + "ln_1.bias", {C}, InitConstant(0), false));
      TZ_ASSIGN_OR_RETURN(b.qkv_w, reg(p + "attn.c_attn.weight", {C, 3 * C}, normal(0.02f), true));
      TZ_ASSIGN_OR_RETURN(b.qkv_b, reg(p + "attn.c_attn.bias", {3 * C}, InitConstant(0), false));
      TZ_ASSIGN_OR_RETURN(b.o_w, reg(p + "attn.c_proj.weight", {C, C}, normal(proj_std), true));
      TZ_ASSIGN_OR_RETURN(b.o_b, reg(p + "attn.c_proj.bias", {C}, InitConstant(0), false));
      TZ_ASSIGN_OR_RETURN(b.norm2_w, reg(p + "ln_2.weight", {C}, InitConstant(1), false));
      TZ_ASSIGN_OR_RETURN(b.norm2_b, reg(p + "ln_2.bias", {C}, InitConstant(0), false));
      TZ_ASSIGN_OR_RETURN(b.fc_w, reg(p + "mlp.c_fc.weight", {C, F}, normal(0.02f), true));
      TZ_ASSIGN_OR_RETURN(b.fc_b, reg(p + "mlp.c_fc.bias", {F}, InitConstant(0), false));
      TZ_ASSIGN_OR_RETURN(b.proj_w, reg(p + "mlp.c_proj.weight", {F, C}, normal(proj_std), true));
      TZ_ASSIGN_OR_RETURN(b.proj_b, reg(p + "mlp.c_proj.bias", {C}, InitConstant(0), false));
      b.all = Ids({b.norm1_w, b.norm1_b, b.qkv_w, b.qkv_b, b.o_w, b.o_b, b.norm2_w, b.norm2_b,
                   b.fc_w, b.fc_b, b.proj_w, b.proj_b});
      g->blocks_.push_back(std::move(b));
    }
    TZ_ASSIGN_OR_RETURN(g->lnf_w_, reg("ln_f.weight", {C}, InitConstant(1), false));
    TZ_ASSIGN_OR_RETURN(g->lnf_b_, reg("ln_f.bias", {C}, InitConstant(0), false));
    g->head_ = g->wte_;
    return g;
  }
  // Llama, in the order of Hugging Face's LlamaForCausalLM state dict.
  TZ_ASSIGN_OR_RETURN(g->wte_, reg("model.embed_tokens.weight", {V, C}, normal(0.02f), true));
  const bool bias = config.attention_bias;
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    BlockParams b;
    auto proj = [&](const char* name, int64_t out, int64_t in, ParamId* w, ParamId* bb) -> Status {
      TZ_ASSIGN_OR_RETURN(*w, reg(p + name + ".weight", {out, in}, normal(0.02f), true));
      if (bb != nullptr && bias) {
        TZ_ASSIGN_OR_RETURN(*bb, reg(p + name + ".bias", {out}, InitConstant(0), false));
      }
      return Status::OK();
    };
    TZ_RETURN_IF_ERROR(proj("self_attn.q_proj", C, C, &b.q_w, &b.q_b));
    TZ_RETURN_IF_ERROR(proj("self_attn.k_proj", KV, C, &b.k_w, &b.k_b));
    TZ_RETURN_IF_ERROR(proj("self_attn.v_proj", KV, C, &b.v_w, &b.v_b));
    TZ_RETURN_IF_ERROR(proj("self_attn.o_proj", C, C, &b.o_w, &b.o_b));
    TZ_RETURN_IF_ERROR(proj("mlp.gate_proj", F, C, &b.gate_w, nullptr));
    TZ_RETURN_IF_ERROR(proj("mlp.up_proj", F, C, &b.up_w, nullptr));
    TZ_RETURN_IF_ERROR(proj("mlp.down_proj", C, F, &b.down_w, nullptr));
    TZ_ASSIGN_OR_RETURN(b.norm1_w, reg(p + "input_layernorm.weight", {C}, InitConstant(1), false));
    TZ_ASSIGN_OR_RETURN(b.norm2_w,
                        reg(p + "post_attention_layernorm.weight", {C}, InitConstant(1), false));
    b.all = Ids({b.q_w, b.q_b, b.k_w, b.k_b, b.v_w, b.v_b, b.o_w, b.o_b, b.gate_w, b.up_w, b.down_w,
                 b.norm1_w, b.norm2_w});
    g->blocks_.push_back(std::move(b));
  }
  TZ_ASSIGN_OR_RETURN(g->lnf_w_, reg("model.norm.weight", {C}, InitConstant(1), false));
  if (config.tie_embeddings) {
    g->head_ = g->wte_;
  } else {
    TZ_ASSIGN_OR_RETURN(g->head_, reg("lm_head.weight", {V, C}, normal(0.02f), true));
  }
  return g;
}

Gpt::Gpt(Engine& engine, const GptConfig& config) : engine_(engine), cfg_(config) {}
Gpt::~Gpt() = default;

double Gpt::flops_per_token() const {
  const double C = cfg_.d_model, L = cfg_.n_layer, V = cfg_.vocab, T = cfg_.seq_len;
  // The blocks' products, then the LM head (the token embedding's lookup is not a product).
  const double matmul_params = L * cfg_.block_matmul_params() + V * C;
  // Attention scores and weighted sum: 2 x 2 x T x C per layer forward (causal: half of it).
  return 6 * matmul_params + 6 * L * T * C;
}

DType Gpt::ActivationsType() const {
  auto spec = ChooseBackend(engine_, cfg_.activations, cfg_.head_dim(), BackendAligned(cfg_));
  return spec.ok() ? spec->activations : DType::kF32;
}

std::string Gpt::ComputeSummary() const {
  auto spec = ChooseBackend(engine_, cfg_.activations, cfg_.head_dim(), BackendAligned(cfg_));
  if (!spec.ok()) return spec.status().ToString();
  const bool fused = spec->fused_attention(cfg_.head_dim());
  if (!spec->gpu)
    return spec->activations == DType::kBF16
               ? "bf16 activations (stored bf16, computed fp32 on the CPU)"
               : "fp32 activations (the CPU's reference ops)";
  if (spec->activations == DType::kBF16) {
    // Which attention is the backend's to say once it exists (Note [Which attention runs]).
    const std::string attention =
        backend_ != nullptr ? backend_->AttentionSummary()
                            : "cuDNN's fused attention where it loads and has a plan, else the "
                              "fused attention kernels";
    return "bf16 activations (cuBLASLt products with fused epilogues; " + attention + ")";
  }
  return std::string("fp32 activations (") +
         (spec->params == DType::kBF16 ? "bf16 products on the tensor cores" : "fp32 products") +
         (fused ? ", fused attention)" : ", attention as batched products)");
}

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
    TZ_ASSIGN_OR_RETURN(BackendSpec spec, ChooseBackend(engine_, cfg_.activations, cfg_.head_dim(),
                                                        BackendAligned(cfg_)));
    TZ_ASSIGN_OR_RETURN(backend_, Backend::Create(engine_, spec));
  }
  Backend& k = *backend_;
  constexpr WeightLayout kHead = WeightLayout::kOutIn;  // the LM head: vocab x width
  const bool gpt2 = cfg_.arch == Arch::kGpt2;
  const std::vector<ParamId> embeddings = Ids({wte_, wpe_}), head = Ids({lnf_w_, lnf_b_, head_});
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
    std::vector<BlockActivations> saved(static_cast<size_t>(L) + 1);
    TZ_ASSIGN_OR_RETURN(saved[0].x, Acts(engine_, k, R * C));
    {
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(embeddings, Phase::kForward));
      TZ_ASSIGN_OR_RETURN(Weights P, Prepare(engine_, k, scope, embeddings));
      k.EmbeddingForward(tokens.as<int32_t>(), P(wte_), P(wpe_), saved[0].x.data(), d.B, d.T, C);
    }
    for (int64_t l = 0; l < L; ++l) {
      const BlockParams& bp = blocks_[static_cast<size_t>(l)];
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(bp.all, Phase::kForward));
      TZ_ASSIGN_OR_RETURN(Weights P, Prepare(engine_, k, scope, bp.all));
      BlockActivations& s = saved[static_cast<size_t>(l)];
      TZ_ASSIGN_OR_RETURN(saved[static_cast<size_t>(l) + 1].x, Acts(engine_, k, R * C));
      TZ_RETURN_IF_ERROR(
          BlockForward(engine_, k, cfg_, d, bp, P, s, saved[static_cast<size_t>(l) + 1].x.data()));
      if (cfg_.activation_checkpointing || !train) {
        ActivationBuffer keep = std::move(s.x);
        s = BlockActivations{};
        if (train) s.x = std::move(keep);
      }
    }
    // Final norm, LM head and loss; dlogits right away (forward moment).
    ActivationBuffer lnf, meanf, rstdf, dlogits;
    TZ_ASSIGN_OR_RETURN(lnf, Acts(engine_, k, R * C));
    if (gpt2) {
      TZ_ASSIGN_OR_RETURN(meanf, Floats(engine_, R));
    }
    TZ_ASSIGN_OR_RETURN(rstdf, Floats(engine_, R));
    if (train) {
      TZ_ASSIGN_OR_RETURN(dlogits, Acts(engine_, k, R * V));
    }
    {
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(head, Phase::kForward));
      TZ_ASSIGN_OR_RETURN(Weights P, Prepare(engine_, k, scope, head));
      if (gpt2)
        k.LayerNormForward(saved[static_cast<size_t>(L)].x.data(), P(lnf_w_), P(lnf_b_), lnf.data(),
                           meanf.as<float>(), rstdf.as<float>(), R, C);
      else
        k.RmsNormForward(saved[static_cast<size_t>(L)].x.data(), P(lnf_w_), lnf.data(),
                         rstdf.as<float>(), R, C, cfg_.norm_eps);
      TZ_ASSIGN_OR_RETURN(ActivationBuffer logits, Acts(engine_, k, R * V));
      k.LinearForward(lnf.data(), P(head_), nullptr, logits.data(), R, C, V, kHead);
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
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(head, Phase::kBackward));
      TZ_ASSIGN_OR_RETURN(Weights P, Prepare(engine_, k, scope, head));
      std::vector<Grad> G;
      for (ParamId p : head) {
        TZ_ASSIGN_OR_RETURN(Grad g, Grad::Open(engine_, k, scope, p, /*add=*/false));
        G.push_back(std::move(g));
      }
      const GradOut g_head = G.back().out(), g_norm = G[0].out();
      TZ_ASSIGN_OR_RETURN(ActivationBuffer dlnf, Acts(engine_, k, R * C));
      k.LinearBackward(dlogits.data(), lnf.data(), P(head_), dlnf.data(), g_head, GradOut{}, R, C,
                       V, kHead);
      dlogits.Reset();
      if (gpt2)
        k.LayerNormBackward(dlnf.data(), saved[static_cast<size_t>(L)].x.data(), P(lnf_w_),
                            meanf.as<float>(), rstdf.as<float>(), dx.data(), g_norm, G[1].out(), R,
                            C);
      else
        k.RmsNormBackward(dlnf.data(), saved[static_cast<size_t>(L)].x.data(), P(lnf_w_),
                          rstdf.as<float>(), dx.data(), g_norm, R, C);
      saved[static_cast<size_t>(L)].x.Reset();
      for (Grad& g : G) TZ_RETURN_IF_ERROR(g.Put(engine_, k));
    }
    for (int64_t l = L - 1; l >= 0; --l) {
      const BlockParams& bp = blocks_[static_cast<size_t>(l)];
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(bp.all, Phase::kBackward));
      TZ_ASSIGN_OR_RETURN(Weights P, Prepare(engine_, k, scope, bp.all));
      BlockActivations& s = saved[static_cast<size_t>(l)];
      if (cfg_.activation_checkpointing) {
        TZ_ASSIGN_OR_RETURN(ActivationBuffer y, Acts(engine_, k, R * C));
        TZ_RETURN_IF_ERROR(BlockForward(engine_, k, cfg_, d, bp, P, s, y.data()));
      }
      GradSink G(engine_, k, scope);
      TZ_ASSIGN_OR_RETURN(ActivationBuffer dx_in, Acts(engine_, k, R * C));
      TZ_RETURN_IF_ERROR(BlockBackward(engine_, k, cfg_, d, bp, P, G, s, dx.data(), dx_in.data()));
      s = BlockActivations{};
      dx = std::move(dx_in);
    }
    {
      TZ_ASSIGN_OR_RETURN(ParamScope scope, engine_.Acquire(embeddings, Phase::kBackward));
      // A tied table's second backward use (the LM head wrote first) adds.
      TZ_ASSIGN_OR_RETURN(Grad gwte, Grad::Open(engine_, k, scope, wte_, /*add=*/head_ == wte_));
      Grad gwpe;
      if (wpe_ >= 0) {
        TZ_ASSIGN_OR_RETURN(gwpe, Grad::Open(engine_, k, scope, wpe_, /*add=*/false));
      }
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
    // The first error is the one to report; a failure to end the iteration comes after it, and
    // only when it says something new (a sticky engine error fails both the same way).
    const std::string first(st.message());
    std::string then(end.message());
    if (end.ok() || first.find(then) != std::string::npos) return st;
    // The same cause at the end of both (an update behind the forward that failed: the gather
    // says so, the engine's sticky error adds what to do): the cause is said once.
    size_t common = 0;
    while (common < first.size() && common < then.size() &&
           first[first.size() - 1 - common] == then[then.size() - 1 - common])
      ++common;
    if (common >= 32 && common < then.size()) {
      // Cut where a cause begins (after a ": "), never inside a word.
      const size_t from = then.size() - common;
      const size_t at = then.find(": ", from >= 2 ? from - 2 : 0);
      if (at != std::string::npos && at + 2 < then.size()) then.resize(at);
    }
    return Status(st.code(), first + "; then ending the iteration: " + then);
  }
  TZ_RETURN_IF_ERROR(engine_.EndIteration());
  return loss;
}

}  // namespace tierzero::gpt
