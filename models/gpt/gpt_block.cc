// A transformer block, GPT-2's or Llama's (gpt_block.h). Read top to bottom each function is the
// block's memory trace: every activation allocated and freed where the engine sees it (the plan
// is made from that order; Gpt::DeriveTrace, gpt_trace.cc, walks the same order).
#include "gpt/gpt_block.h"

#include <string>

namespace tierzero::gpt {

const void* Weights::operator()(ParamId p) const {
  if (p < 0) return nullptr;
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] == p) return ptr[i];
  return nullptr;
}

StatusOr<Weights> Prepare(Engine& e, Backend& k, const ParamScope& scope,
                          const std::vector<ParamId>& ids) {
  const BackendSpec& spec = k.spec();
  Weights w;
  w.ids = ids;
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

StatusOr<Grad> Grad::Open(Engine& e, Backend& k, const ParamScope& scope, ParamId p, bool add) {
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

GradOut Grad::out() const {
  return buf_.bytes() == 0 ? GradOut{dst_, add_} : GradOut{buf_.data(), true};
}

Status Grad::Put(Engine& e, Backend& k) {
  if (buf_.bytes() == 0) return Status::OK();
  TZ_RETURN_IF_ERROR(
      k.Cast(buf_.data(), k.spec().weights, dst_, e.compute_dtype(), e.numel(p_), add_));
  buf_.Reset();
  return Status::OK();
}

Status GradSink::Open(ParamId a, ParamId b) {
  for (ParamId p : {a, b}) {
    if (p < 0) continue;
    TZ_ASSIGN_OR_RETURN(Grad g, Grad::Open(e_, k_, scope_, p, /*add=*/false));
    open_.emplace_back(p, std::move(g));
  }
  return Status::OK();
}

GradOut GradSink::operator()(ParamId p) const {
  for (const auto& [id, g] : open_)
    if (id == p) return g.out();
  return GradOut{};
}

Status GradSink::Close(ParamId a, ParamId b) {
  for (ParamId p : {a, b}) {
    if (p < 0) continue;
    for (size_t i = 0; i < open_.size(); ++i) {
      if (open_[i].first != p) continue;
      TZ_RETURN_IF_ERROR(open_[i].second.Put(e_, k_));
      open_.erase(open_.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
  }
  return Status::OK();
}

StatusOr<ActivationBuffer> Acts(Engine& e, const Backend& k, int64_t n) {
  return e.AllocateActivation(k.spec().act_bytes(n));
}
StatusOr<ActivationBuffer> Floats(Engine& e, int64_t n) {
  return e.AllocateActivation(static_cast<uint64_t>(n) * 4);
}
void* At(const Backend& k, void* p, int64_t elems) {
  return static_cast<char*>(p) + k.spec().act_bytes(elems);
}

namespace {

bool Gpt2(const GptConfig& c) { return c.arch == Arch::kGpt2; }

// The weights' layout: GPT-2's Conv1D (in x out), Llama's nn.Linear (out x in).
WeightLayout Layout(const GptConfig& c) {
  return Gpt2(c) ? WeightLayout::kInOut : WeightLayout::kOutIn;
}

// Attention's operands: GPT-2's fused rows, or Llama's q, k, v.
AttnDims Attn(const GptConfig& c, const Dims& d) {
  const int64_t hd = c.head_dim(), kv = c.kv_heads();
  if (Gpt2(c)) return {d.B, d.T, d.H, d.H, hd, 3 * d.C, 3 * d.C, 3 * d.C};
  return {d.B, d.T, d.H, kv, hd, d.C, kv * hd, kv * hd};
}

}  // namespace

Status BlockForward(Engine& e, Backend& k, const GptConfig& c, const Dims& d, const BlockParams& bp,
                    const Weights& P, BlockActivations& s, void* y) {
  const int64_t R = d.rows, C = d.C, F = c.ffn(), KV = int64_t{c.kv_heads()} * c.head_dim();
  const bool gpt2 = Gpt2(c);
  const WeightLayout L = Layout(c);
  TZ_ASSIGN_OR_RETURN(s.n1, Acts(e, k, R * C));
  if (gpt2) {
    TZ_ASSIGN_OR_RETURN(s.mean1, Floats(e, R));
  }
  TZ_ASSIGN_OR_RETURN(s.rstd1, Floats(e, R));
  if (gpt2) {
    TZ_ASSIGN_OR_RETURN(s.qkv, Acts(e, k, R * 3 * C));
  } else {
    TZ_ASSIGN_OR_RETURN(s.qkv, Acts(e, k, R * C));
    TZ_ASSIGN_OR_RETURN(s.k, Acts(e, k, R * KV));
    TZ_ASSIGN_OR_RETURN(s.v, Acts(e, k, R * KV));
  }
  TZ_ASSIGN_OR_RETURN(s.probs,
                      e.AllocateActivation(k.spec().attention_state_bytes(d.B, d.T, d.H, C / d.H)));
  TZ_ASSIGN_OR_RETURN(s.att, Acts(e, k, R * C));
  TZ_ASSIGN_OR_RETURN(s.x2, Acts(e, k, R * C));
  TZ_ASSIGN_OR_RETURN(s.n2, Acts(e, k, R * C));
  if (gpt2) {
    TZ_ASSIGN_OR_RETURN(s.mean2, Floats(e, R));
  }
  TZ_ASSIGN_OR_RETURN(s.rstd2, Floats(e, R));
  TZ_ASSIGN_OR_RETURN(s.h, Acts(e, k, R * F));
  TZ_ASSIGN_OR_RETURN(s.mlp, Acts(e, k, R * F));
  if (!gpt2) {
    TZ_ASSIGN_OR_RETURN(s.glu, Acts(e, k, R * F));
  }
  const void* x = s.x.data();
  // Attention.
  if (gpt2) {
    k.LayerNormForward(x, P(bp.norm1_w), P(bp.norm1_b), s.n1.data(), s.mean1.as<float>(),
                       s.rstd1.as<float>(), R, C);
    k.LinearForward(s.n1.data(), P(bp.qkv_w), P(bp.qkv_b), s.qkv.data(), R, C, 3 * C, L);
  } else {
    k.RmsNormForward(x, P(bp.norm1_w), s.n1.data(), s.rstd1.as<float>(), R, C, c.norm_eps);
    k.LinearForward(s.n1.data(), P(bp.q_w), P(bp.q_b), s.qkv.data(), R, C, C, L);
    k.LinearForward(s.n1.data(), P(bp.k_w), P(bp.k_b), s.k.data(), R, C, KV, L);
    k.LinearForward(s.n1.data(), P(bp.v_w), P(bp.v_b), s.v.data(), R, C, KV, L);
    k.RopeForward(s.qkv.data(), d.B, d.T, d.H, c.head_dim(), C, c.rope());
    k.RopeForward(s.k.data(), d.B, d.T, c.kv_heads(), c.head_dim(), KV, c.rope());
  }
  void* q = s.qkv.data();
  const void* kk = gpt2 ? At(k, q, C) : s.k.data();
  const void* vv = gpt2 ? At(k, q, 2 * C) : s.v.data();
  k.AttentionForward(q, kk, vv, s.att.data(), s.probs.data(), Attn(c, d));
  // x2 = x + the output projection (Note [The residual stream's additions]).
  k.LinearResidualForward(s.att.data(), P(bp.o_w), P(bp.o_b), x, s.x2.data(), R, C, C, L);
  // MLP.
  if (gpt2) {
    k.LayerNormForward(s.x2.data(), P(bp.norm2_w), P(bp.norm2_b), s.n2.data(), s.mean2.as<float>(),
                       s.rstd2.as<float>(), R, C);
    k.LinearGeluForward(s.n2.data(), P(bp.fc_w), P(bp.fc_b), s.h.data(), s.mlp.data(), R, C, F, L);
  } else {
    k.RmsNormForward(s.x2.data(), P(bp.norm2_w), s.n2.data(), s.rstd2.as<float>(), R, C,
                     c.norm_eps);
    k.LinearForward(s.n2.data(), P(bp.gate_w), nullptr, s.h.data(), R, C, F, L);
    k.LinearForward(s.n2.data(), P(bp.up_w), nullptr, s.mlp.data(), R, C, F, L);
    k.SwigluForward(s.h.data(), s.mlp.data(), s.glu.data(), R * F);
  }
  // y = x2 + the MLP's output projection.
  if (gpt2)
    k.LinearResidualForward(s.mlp.data(), P(bp.proj_w), P(bp.proj_b), s.x2.data(), y, R, F, C, L);
  else
    k.LinearResidualForward(s.glu.data(), P(bp.down_w), nullptr, s.x2.data(), y, R, F, C, L);
  return Status::OK();
}

Status BlockBackward(Engine& e, Backend& k, const GptConfig& c, const Dims& d,
                     const BlockParams& bp, const Weights& P, GradSink& G, BlockActivations& s,
                     const void* dy, void* dx) {
  const int64_t R = d.rows, C = d.C, F = c.ffn(), KV = int64_t{c.kv_heads()} * c.head_dim();
  const bool gpt2 = Gpt2(c);
  const WeightLayout L = Layout(c);
  // The residual stream's gradient between the two sub-blocks: dy + the MLP's norm's backward
  // (Note [The residual stream's additions]).
  TZ_ASSIGN_OR_RETURN(ActivationBuffer dx2, Acts(e, k, R * C));
  // MLP.
  if (gpt2) {
    TZ_ASSIGN_OR_RETURN(ActivationBuffer dg, Acts(e, k, R * F));
    TZ_RETURN_IF_ERROR(G.Open(bp.proj_w, bp.proj_b));
    k.LinearBackwardGelu(dy, s.mlp.data(), P(bp.proj_w), s.h.data(), dg.data(), G(bp.proj_w),
                         G(bp.proj_b), R, F, C, L);
    s.mlp.Reset();
    TZ_RETURN_IF_ERROR(G.Close(bp.proj_w, bp.proj_b));
    s.h.Reset();
    TZ_ASSIGN_OR_RETURN(ActivationBuffer dn2, Acts(e, k, R * C));
    TZ_RETURN_IF_ERROR(G.Open(bp.fc_w, bp.fc_b));
    k.LinearBackward(dg.data(), s.n2.data(), P(bp.fc_w), dn2.data(), G(bp.fc_w), G(bp.fc_b), R, C,
                     F, L);
    dg.Reset();
    TZ_RETURN_IF_ERROR(G.Close(bp.fc_w, bp.fc_b));
    TZ_RETURN_IF_ERROR(G.Open(bp.norm2_w, bp.norm2_b));
    k.LayerNormBackwardResidual(dn2.data(), s.x2.data(), P(bp.norm2_w), s.mean2.as<float>(),
                                s.rstd2.as<float>(), dy, dx2.data(), G(bp.norm2_w), G(bp.norm2_b),
                                R, C);
    TZ_RETURN_IF_ERROR(G.Close(bp.norm2_w, bp.norm2_b));
  } else {
    TZ_ASSIGN_OR_RETURN(ActivationBuffer dglu, Acts(e, k, R * F));
    TZ_RETURN_IF_ERROR(G.Open(bp.down_w));
    k.LinearBackward(dy, s.glu.data(), P(bp.down_w), dglu.data(), G(bp.down_w), GradOut{}, R, F, C,
                     L);
    s.glu.Reset();
    TZ_RETURN_IF_ERROR(G.Close(bp.down_w));
    TZ_ASSIGN_OR_RETURN(ActivationBuffer du, Acts(e, k, R * F));
    // dglu becomes the gate's gradient in place.
    k.SwigluBackward(dglu.data(), s.h.data(), s.mlp.data(), dglu.data(), du.data(), R * F);
    s.h.Reset();
    s.mlp.Reset();
    TZ_ASSIGN_OR_RETURN(ActivationBuffer dn2, Acts(e, k, R * C));
    TZ_RETURN_IF_ERROR(G.Open(bp.gate_w));
    k.LinearBackward(dglu.data(), s.n2.data(), P(bp.gate_w), dn2.data(), G(bp.gate_w), GradOut{}, R,
                     C, F, L);
    TZ_RETURN_IF_ERROR(G.Close(bp.gate_w));
    dglu.Reset();
    {
      TZ_ASSIGN_OR_RETURN(ActivationBuffer tmp, Acts(e, k, R * C));
      TZ_RETURN_IF_ERROR(G.Open(bp.up_w));
      k.LinearBackward(du.data(), s.n2.data(), P(bp.up_w), tmp.data(), G(bp.up_w), GradOut{}, R, C,
                       F, L);
      TZ_RETURN_IF_ERROR(G.Close(bp.up_w));
      du.Reset();
      k.AddInPlace(dn2.data(), tmp.data(), R * C);
    }
    TZ_RETURN_IF_ERROR(G.Open(bp.norm2_w));
    k.RmsNormBackwardResidual(dn2.data(), s.x2.data(), P(bp.norm2_w), s.rstd2.as<float>(), dy,
                              dx2.data(), G(bp.norm2_w), R, C);
    TZ_RETURN_IF_ERROR(G.Close(bp.norm2_w));
  }
  // Attention.
  {
    TZ_ASSIGN_OR_RETURN(ActivationBuffer datt, Acts(e, k, R * C));
    TZ_RETURN_IF_ERROR(G.Open(bp.o_w, bp.o_b));
    k.LinearBackward(dx2.data(), s.att.data(), P(bp.o_w), datt.data(), G(bp.o_w), G(bp.o_b), R, C,
                     C, L);
    const AttnDims ad = Attn(c, d);
    void* q = s.qkv.data();
    const void* kk = gpt2 ? At(k, q, C) : s.k.data();
    const void* vv = gpt2 ? At(k, q, 2 * C) : s.v.data();
    ActivationBuffer dq, dk, dv;
    if (gpt2) {
      TZ_ASSIGN_OR_RETURN(dq, Acts(e, k, R * 3 * C));
    } else {
      TZ_ASSIGN_OR_RETURN(dq, Acts(e, k, R * C));
      TZ_ASSIGN_OR_RETURN(dk, Acts(e, k, R * KV));
      TZ_ASSIGN_OR_RETURN(dv, Acts(e, k, R * KV));
    }
    void* gq = dq.data();
    void* gk = gpt2 ? At(k, gq, C) : dk.data();
    void* gv = gpt2 ? At(k, gq, 2 * C) : dv.data();
    k.AttentionBackward(datt.data(), q, kk, vv, s.att.data(), s.probs.data(), gq, gk, gv, ad);
    datt.Reset();
    TZ_RETURN_IF_ERROR(G.Close(bp.o_w, bp.o_b));
    TZ_ASSIGN_OR_RETURN(ActivationBuffer dn1, Acts(e, k, R * C));
    if (gpt2) {
      TZ_RETURN_IF_ERROR(G.Open(bp.qkv_w, bp.qkv_b));
      k.LinearBackward(gq, s.n1.data(), P(bp.qkv_w), dn1.data(), G(bp.qkv_w), G(bp.qkv_b), R, C,
                       3 * C, L);
      dq.Reset();
      TZ_RETURN_IF_ERROR(G.Close(bp.qkv_w, bp.qkv_b));
      TZ_RETURN_IF_ERROR(G.Open(bp.norm1_w, bp.norm1_b));
      k.LayerNormBackwardResidual(dn1.data(), s.x.data(), P(bp.norm1_w), s.mean1.as<float>(),
                                  s.rstd1.as<float>(), dx2.data(), dx, G(bp.norm1_w), G(bp.norm1_b),
                                  R, C);
      TZ_RETURN_IF_ERROR(G.Close(bp.norm1_w, bp.norm1_b));
    } else {
      k.RopeBackward(gq, d.B, d.T, d.H, c.head_dim(), C, c.rope());
      k.RopeBackward(gk, d.B, d.T, c.kv_heads(), c.head_dim(), KV, c.rope());
      TZ_RETURN_IF_ERROR(G.Open(bp.q_w, bp.q_b));
      k.LinearBackward(gq, s.n1.data(), P(bp.q_w), dn1.data(), G(bp.q_w), G(bp.q_b), R, C, C, L);
      TZ_RETURN_IF_ERROR(G.Close(bp.q_w, bp.q_b));
      dq.Reset();
      {
        TZ_ASSIGN_OR_RETURN(ActivationBuffer tmp, Acts(e, k, R * C));
        TZ_RETURN_IF_ERROR(G.Open(bp.k_w, bp.k_b));
        k.LinearBackward(gk, s.n1.data(), P(bp.k_w), tmp.data(), G(bp.k_w), G(bp.k_b), R, C, KV, L);
        TZ_RETURN_IF_ERROR(G.Close(bp.k_w, bp.k_b));
        dk.Reset();
        k.AddInPlace(dn1.data(), tmp.data(), R * C);
        TZ_RETURN_IF_ERROR(G.Open(bp.v_w, bp.v_b));
        k.LinearBackward(gv, s.n1.data(), P(bp.v_w), tmp.data(), G(bp.v_w), G(bp.v_b), R, C, KV, L);
        TZ_RETURN_IF_ERROR(G.Close(bp.v_w, bp.v_b));
        dv.Reset();
        k.AddInPlace(dn1.data(), tmp.data(), R * C);
      }
      TZ_RETURN_IF_ERROR(G.Open(bp.norm1_w));
      k.RmsNormBackwardResidual(dn1.data(), s.x.data(), P(bp.norm1_w), s.rstd1.as<float>(),
                                dx2.data(), dx, G(bp.norm1_w), R, C);
      TZ_RETURN_IF_ERROR(G.Close(bp.norm1_w));
    }
  }
  return Status::OK();
}

}  // namespace tierzero::gpt
