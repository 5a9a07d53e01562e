// Gpt::DeriveTrace: the training iteration's trace, derived from the configuration without
// running it (`tierzero plan`). It walks Gpt::Run's Acquires and activation allocations in the
// same order with the same sizes, so the bytes equal what the engine records in a warm-up
// iteration (tests/gpt/gpt_trace_test.cc compares them with a recorded trace); keep the two in
// step when Run changes.
#include <algorithm>

#include "gpt/backend.h"
#include "gpt/gpt.h"

namespace tierzero::gpt {
namespace {

// Activation bytes in use as Run allocates and frees them, and the moments as they begin.
class Ledger {
 public:
  void Alloc(uint64_t bytes) {
    cur_ += bytes;
    if (!moments_.empty())
      moments_.back().activation_peak = std::max(moments_.back().activation_peak, cur_);
  }
  void Free(uint64_t bytes) { cur_ -= bytes; }
  TraceMoment& Begin(std::vector<ParamId> params, bool backward) {
    TraceMoment m;
    m.params = std::move(params);
    m.backward = backward;
    m.activation_bytes = m.activation_peak = cur_;
    moments_.push_back(std::move(m));
    return moments_.back();
  }
  // Work in the current moment (for a machine given by its rates).
  void Work(double flops, double bytes) {
    moments_.back().flops += flops;
    moments_.back().memory_bytes += bytes;
  }
  std::vector<TraceMoment> Take() { return std::move(moments_); }

 private:
  uint64_t cur_ = 0;
  std::vector<TraceMoment> moments_;
};

}  // namespace

StatusOr<WarmupTrace> Gpt::DeriveTrace(int batch) const {
  if (batch < 1) return InvalidArgumentError("a trace needs a batch of at least one row");
  const uint64_t B = static_cast<uint64_t>(batch), T = static_cast<uint64_t>(cfg_.seq_len),
                 C = static_cast<uint64_t>(cfg_.d_model), H = static_cast<uint64_t>(cfg_.n_head),
                 V = static_cast<uint64_t>(cfg_.vocab), F = static_cast<uint64_t>(cfg_.ffn()),
                 KV = static_cast<uint64_t>(cfg_.kv_heads()) *
                      static_cast<uint64_t>(cfg_.head_dim());
  const uint64_t R = B * T;
  const bool gpt2 = cfg_.arch == Arch::kGpt2;
  // The backend Run will use (Note [Activation types] in gpt/backend.h) sets the bytes: a(n)
  // activations, f(n) fp32 values, w(n) widened weights (none when the ops read the chunks'
  // copies), g(n) gradient buffers (none when the ops add into the engine's).
  TZ_ASSIGN_OR_RETURN(const BackendSpec spec, ChooseBackend(engine_, cfg_.activations,
                                                            cfg_.head_dim(), BackendAligned(cfg_)));
  const uint64_t attn_state = DeviceAllocationBytes(
      spec.attention_state_bytes(static_cast<int64_t>(B), static_cast<int64_t>(T),
                                 static_cast<int64_t>(H), static_cast<int64_t>(C / H)));
  const bool ckpt = cfg_.activation_checkpointing;
  // Each is one allocation's bytes as the device takes them (DeviceAllocationBytes).
  auto a = [&](uint64_t n) {
    return DeviceAllocationBytes(spec.act_bytes(static_cast<int64_t>(n)));
  };
  auto f = [](uint64_t n) { return DeviceAllocationBytes(4 * n); };
  auto w = [&](uint64_t n) {
    return spec.widen_params() ? DeviceAllocationBytes(spec.weight_bytes(static_cast<int64_t>(n)))
                               : uint64_t{0};
  };
  auto g = [&](uint64_t n) {
    return spec.grads_in_place ? uint64_t{0}
                               : DeviceAllocationBytes(spec.weight_bytes(static_cast<int64_t>(n)));
  };
  auto numel = [&](const std::vector<ParamId>& ids) {
    uint64_t n = 0;
    for (ParamId p : ids) n += static_cast<uint64_t>(engine_.numel(p));
    return n;
  };
  auto ids_of = [](std::initializer_list<ParamId> l) {
    std::vector<ParamId> v;
    for (ParamId p : l)
      if (p >= 0) v.push_back(p);
    return v;
  };
  const BlockParams none;
  const BlockParams& b0 = blocks_.empty() ? none : blocks_[0];
  const uint64_t block_numel = numel(b0.all);
  // Gradient buffers of parameters p and q of a block (-1: none), as GradSink opens them.
  auto gp = [&](ParamId p, ParamId q = -1) {
    uint64_t n = 0;
    for (ParamId x : {p, q})
      if (x >= 0) n += g(static_cast<uint64_t>(engine_.numel(x)));
    return n;
  };
  const double dR = static_cast<double>(R), dC = static_cast<double>(C),
               dF = static_cast<double>(F), dKV = static_cast<double>(KV);
  // A block's forward: its products (2 R x their parameters) and attention (4 B T^2 C), and the
  // bytes its kernels touch (about every activation written once and read once).
  const double block_matmul =
      gpt2 ? 4 * dC * dC + 2 * dC * dF : 2 * dC * dC + 2 * dC * dKV + 3 * dC * dF;
  const double block_fwd_flops = 2 * dR * block_matmul + 4.0 * static_cast<double>(B * T * T * C);
  const double block_fwd_bytes = 2.0 * static_cast<double>(a(8 * R * C + 3 * R * F) + attn_state);
  Ledger L;
  // What a block saves (BlockForward's allocations in order; no temporaries: Note [The residual
  // stream's additions]).
  const std::vector<uint64_t> saved_list =
      gpt2 ? std::vector<uint64_t>{a(R * C), f(R),     f(R), a(R * 3 * C), attn_state, a(R * C),
                                   a(R * C), a(R * C), f(R), f(R),         a(R * F),   a(R * F)}
           : std::vector<uint64_t>{a(R * C),   f(R),     a(R * C), a(R * KV), a(R * KV),
                                   attn_state, a(R * C), a(R * C), a(R * C),  f(R),
                                   a(R * F),   a(R * F), a(R * F)};
  uint64_t saved_bytes = 0;  // what `s = BlockActivations{}` frees besides x
  for (uint64_t b : saved_list) saved_bytes += b;
  auto block_forward = [&]() {
    for (uint64_t b : saved_list) L.Alloc(b);
  };
  // The batch: tokens, targets, mask.
  for (int i = 0; i < 3; ++i) L.Alloc(f(R));
  L.Alloc(a(R * C));  // saved[0].x
  const std::vector<ParamId> embeddings = ids_of({wte_, wpe_});
  {
    L.Begin(embeddings, false);
    L.Alloc(w(numel(embeddings)));
    L.Work(0, static_cast<double>(w(numel(embeddings)) + a(R * C)));
    L.Free(w(numel(embeddings)));
  }
  for (size_t l = 0; l < blocks_.size(); ++l) {
    L.Begin(blocks_[l].all, false);
    L.Alloc(w(block_numel));
    L.Alloc(a(R * C));  // saved[l + 1].x
    block_forward();
    L.Work(block_fwd_flops, block_fwd_bytes);
    if (ckpt) L.Free(saved_bytes);  // keeps only the block's input
    L.Free(w(block_numel));
  }
  // Final norm, LM head and loss: lnf, (meanf,) rstdf, dlogits; then the head's moment.
  L.Alloc(a(R * C));
  if (gpt2) L.Alloc(f(R));
  L.Alloc(f(R));
  L.Alloc(a(R * V));
  const std::vector<ParamId> head = ids_of({lnf_w_, lnf_b_, head_});
  {
    L.Begin(head, false);
    L.Alloc(w(numel(head)));
    L.Alloc(a(R * V));  // logits
    L.Work(2 * dR * dC * static_cast<double>(V), 4.0 * static_cast<double>(a(R * V)));
    L.Free(a(R * V));
    L.Free(w(numel(head)));
  }
  L.Alloc(a(R * C));  // dx
  {
    L.Begin(head, true);
    L.Alloc(w(numel(head)));                                                     // widened
    for (ParamId p : head) L.Alloc(g(static_cast<uint64_t>(engine_.numel(p))));  // gradients
    L.Alloc(a(R * C));                                                           // dlnf
    L.Work(4 * dR * dC * static_cast<double>(V), 2.0 * static_cast<double>(a(R * V)));
    L.Free(a(R * V));         // dlogits
    L.Free(a(R * C));         // the last block's output
    uint64_t head_grads = 0;  // one buffer a parameter
    for (ParamId p : head) head_grads += g(static_cast<uint64_t>(engine_.numel(p)));
    L.Free(a(R * C) + w(numel(head)) + head_grads);
  }
  // The saved activations the backward frees as it goes (so not at its end): GPT-2's GELU
  // input and output, Llama's gate, up and product.
  const uint64_t mlp_saved = gpt2 ? 2 * a(R * F) : 3 * a(R * F);
  for (size_t l = blocks_.size(); l-- > 0;) {
    const BlockParams& bp = blocks_[l];
    L.Begin(bp.all, true);
    L.Alloc(w(block_numel));
    if (ckpt) {
      L.Alloc(a(R * C));  // y
      block_forward();
      L.Free(a(R * C));
      L.Work(block_fwd_flops, block_fwd_bytes);
    }
    L.Alloc(a(R * C));  // dx_in
    // BlockBackward.
    L.Alloc(a(R * C));  // dx2
    if (gpt2) {
      L.Alloc(a(R * F));  // dg
      L.Alloc(gp(bp.proj_w, bp.proj_b));
      L.Free(a(R * F));  // GELU's output
      L.Free(gp(bp.proj_w, bp.proj_b));
      L.Free(a(R * F));   // GELU's input
      L.Alloc(a(R * C));  // dn2
      L.Alloc(gp(bp.fc_w, bp.fc_b));
      L.Free(a(R * F));  // dg
      L.Free(gp(bp.fc_w, bp.fc_b));
    } else {
      L.Alloc(a(R * F));  // dglu
      L.Alloc(gp(bp.down_w));
      L.Free(a(R * F));  // glu
      L.Free(gp(bp.down_w));
      L.Alloc(a(R * F));     // du
      L.Free(2 * a(R * F));  // gate, up
      L.Alloc(a(R * C));     // dn2
      L.Alloc(gp(bp.gate_w));
      L.Free(gp(bp.gate_w));
      L.Free(a(R * F));   // dglu
      L.Alloc(a(R * C));  // tmp
      L.Alloc(gp(bp.up_w));
      L.Free(gp(bp.up_w));
      L.Free(a(R * F));  // du
      L.Free(a(R * C));  // tmp
    }
    L.Alloc(gp(bp.norm2_w, bp.norm2_b));
    L.Free(gp(bp.norm2_w, bp.norm2_b));
    L.Free(a(R * C));   // dn2
    L.Alloc(a(R * C));  // datt
    L.Alloc(gp(bp.o_w, bp.o_b));
    if (gpt2) {
      L.Alloc(a(R * 3 * C));  // dqkv
    } else {
      L.Alloc(a(R * C));   // dq
      L.Alloc(a(R * KV));  // dk
      L.Alloc(a(R * KV));  // dv
    }
    L.Free(a(R * C));  // datt
    L.Free(gp(bp.o_w, bp.o_b));
    L.Alloc(a(R * C));  // dn1
    if (gpt2) {
      L.Alloc(gp(bp.qkv_w, bp.qkv_b));
      L.Free(a(R * 3 * C));  // dqkv
      L.Free(gp(bp.qkv_w, bp.qkv_b));
    } else {
      L.Alloc(gp(bp.q_w, bp.q_b));
      L.Free(gp(bp.q_w, bp.q_b));
      L.Free(a(R * C));   // dq
      L.Alloc(a(R * C));  // tmp
      L.Alloc(gp(bp.k_w, bp.k_b));
      L.Free(gp(bp.k_w, bp.k_b));
      L.Free(a(R * KV));  // dk
      L.Alloc(gp(bp.v_w, bp.v_b));
      L.Free(gp(bp.v_w, bp.v_b));
      L.Free(a(R * KV));  // dv
      L.Free(a(R * C));   // tmp
    }
    L.Alloc(gp(bp.norm1_w, bp.norm1_b));
    L.Free(gp(bp.norm1_w, bp.norm1_b));
    L.Free(a(R * C));  // dn1
    L.Free(a(R * C));  // dx2
    L.Work(2 * block_fwd_flops, 2 * block_fwd_bytes);
    // The block's saved activations but the MLP's (freed above), its input, the old dx, then
    // the widened weights.
    L.Free(saved_bytes - mlp_saved + a(R * C));
    L.Free(a(R * C));
    L.Free(w(block_numel));
  }
  {
    L.Begin(embeddings, true);
    const uint64_t grads = g(static_cast<uint64_t>(engine_.numel(wte_))) +
                           (wpe_ >= 0 ? g(static_cast<uint64_t>(engine_.numel(wpe_))) : 0);
    L.Alloc(grads);  // gradients
    L.Work(0, 3.0 * static_cast<double>(4 * numel(embeddings)));
    L.Free(grads);
  }
  WarmupTrace t;
  for (int p = 0; p < engine_.num_params(); ++p) {
    const ParamSpec& s = engine_.param(p);
    t.params.push_back({s.name, s.shape, s.weight_decay});
  }
  t.moments = L.Take();
  t.source = "derived from the GPT's configuration (batch " + std::to_string(batch) + ")";
  return t;
}

}  // namespace tierzero::gpt
