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
                 V = static_cast<uint64_t>(cfg_.vocab);
  const uint64_t R = B * T;
  // The backend Run will use (Note [Activation types] in gpt/backend.h) sets the bytes: a(n)
  // activations, f(n) fp32 values, w(n) widened weights (none when the ops read the chunks'
  // copies), g(n) gradient buffers (none when the ops add into the engine's).
  TZ_ASSIGN_OR_RETURN(const BackendSpec spec, ChooseBackend(engine_, cfg_.activations, cfg_.d_model / cfg_.n_head));
  const uint64_t attn_state =
      spec.attention_state_bytes(static_cast<int64_t>(B), static_cast<int64_t>(T),
                                 static_cast<int64_t>(H), static_cast<int64_t>(C / H));
  const bool ckpt = cfg_.activation_checkpointing;
  auto a = [&](uint64_t n) { return spec.act_bytes(static_cast<int64_t>(n)); };
  auto f = [](uint64_t n) { return 4 * n; };
  auto w = [&](uint64_t n) {
    return spec.widen_params() ? spec.weight_bytes(static_cast<int64_t>(n)) : uint64_t{0};
  };
  auto g = [&](uint64_t n) {
    return spec.grads_in_place ? uint64_t{0} : spec.weight_bytes(static_cast<int64_t>(n));
  };
  auto numel = [&](const std::vector<ParamId>& ids) {
    uint64_t n = 0;
    for (ParamId p : ids) n += static_cast<uint64_t>(engine_.numel(p));
    return n;
  };
  const std::vector<ParamId> block0 = blocks_.empty() ? std::vector<ParamId>{} : blocks_[0].all();
  const uint64_t block_numel = numel(block0);
  const double dR = static_cast<double>(R), dC = static_cast<double>(C);
  // A block's forward: four matmuls (2 R C (3C + C + 4C + 4C)) and attention (4 B T^2 C), and
  // the bytes its kernels touch (about every activation written once and read once).
  const double block_fwd_flops = 24 * dR * dC * dC + 4.0 * static_cast<double>(B * T * T * C);
  const double block_fwd_bytes = 2.0 * static_cast<double>(a(16 * R * C) + attn_state);
  Ledger L;
  // A block's forward allocations (BlockForward).
  auto block_forward = [&]() {
    // ln1, mean1, rstd1, qkv, probs, att, x2, ln2, mean2, rstd2, h, gelu; then two temporaries.
    for (uint64_t b : {a(R * C), f(R), f(R), a(R * 3 * C), attn_state, a(R * C), a(R * C),
                       a(R * C), f(R), f(R), a(R * 4 * C), a(R * 4 * C)})
      L.Alloc(b);
    L.Alloc(a(R * C));
    L.Free(a(R * C));
    L.Alloc(a(R * C));
    L.Free(a(R * C));
  };
  const uint64_t saved_bytes = a(R * C) * 4 + f(R) * 4 + a(R * 3 * C) + attn_state +
                               a(R * 4 * C) * 2;  // what `s = Saved{}` frees besides x
  // Gradients opened a pair at a time (GradSink): parameters i and j of a block.
  auto grad_pair = [&](size_t i, size_t j) {
    return g(static_cast<uint64_t>(engine_.numel(block0[i]))) +
           g(static_cast<uint64_t>(engine_.numel(block0[j])));
  };
  // The batch: tokens, targets, mask.
  for (int i = 0; i < 3; ++i) L.Alloc(4 * R);
  L.Alloc(a(R * C));  // saved[0].x
  {
    const std::vector<ParamId> ids = {wte_, wpe_};
    L.Begin(ids, false);
    L.Alloc(w(numel(ids)));
    L.Work(0, static_cast<double>(w(numel(ids)) + a(R * C)));
    L.Free(w(numel(ids)));
  }
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const std::vector<ParamId> ids = blocks_[l].all();
    L.Begin(ids, false);
    L.Alloc(w(block_numel));
    L.Alloc(a(R * C));  // saved[l + 1].x
    block_forward();
    L.Work(block_fwd_flops, block_fwd_bytes);
    if (ckpt) L.Free(saved_bytes);  // keeps only the block's input
    L.Free(w(block_numel));
  }
  // Final LayerNorm, LM head and loss: lnf, meanf, rstdf, dlogits; then the head's moment.
  for (uint64_t b : {a(R * C), f(R), f(R), a(R * V)}) L.Alloc(b);
  const std::vector<ParamId> head = {lnf_w_, lnf_b_, wte_};
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
    L.Alloc(w(numel(head)));  // widened
    for (ParamId p : head) L.Alloc(g(static_cast<uint64_t>(engine_.numel(p))));  // gradients
    L.Alloc(a(R * C));                                                            // dlnf
    L.Work(4 * dR * dC * static_cast<double>(V), 2.0 * static_cast<double>(a(R * V)));
    L.Free(a(R * V));  // dlogits
    L.Free(a(R * C));  // the last block's output
    L.Free(a(R * C) + w(numel(head)) + g(numel(head)));
  }
  for (size_t l = blocks_.size(); l-- > 0;) {
    const std::vector<ParamId> ids = blocks_[l].all();
    L.Begin(ids, true);
    L.Alloc(w(block_numel));
    if (ckpt) {
      L.Alloc(a(R * C));  // y
      block_forward();
      L.Free(a(R * C));
      L.Work(block_fwd_flops, block_fwd_bytes);
    }
    L.Alloc(a(R * C));  // dx_in
    // BlockBackward.
    L.Alloc(a(R * C));      // dx2
    L.Alloc(a(R * 4 * C));  // dg
    L.Alloc(grad_pair(10, 11));
    L.Free(a(R * 4 * C));  // gelu
    L.Free(grad_pair(10, 11));
    L.Free(a(R * 4 * C));  // h
    L.Alloc(a(R * C));     // dln2
    L.Alloc(grad_pair(8, 9));
    L.Free(a(R * 4 * C));  // dg
    L.Free(grad_pair(8, 9));
    L.Alloc(a(R * C));  // t
    L.Alloc(grad_pair(6, 7));
    L.Free(grad_pair(6, 7));
    L.Free(2 * a(R * C));  // t, dln2
    L.Alloc(a(R * C));     // datt
    L.Alloc(grad_pair(4, 5));
    L.Alloc(a(R * 3 * C));  // dqkv
    L.Free(a(R * C));       // datt
    L.Free(grad_pair(4, 5));
    L.Alloc(a(R * C));  // dln1
    L.Alloc(grad_pair(2, 3));
    L.Free(a(R * 3 * C));  // dqkv
    L.Free(grad_pair(2, 3));
    L.Alloc(grad_pair(0, 1));
    L.Free(grad_pair(0, 1));
    L.Free(a(R * C));  // dln1
    L.Free(a(R * C));  // dx2
    L.Work(2 * block_fwd_flops, 2 * block_fwd_bytes);
    // The block's saved activations but h and gelu (freed above), its input, the old dx, then
    // the widened weights.
    L.Free(saved_bytes - 2 * a(R * 4 * C) + a(R * C));
    L.Free(a(R * C));
    L.Free(w(block_numel));
  }
  {
    const std::vector<ParamId> ids = {wte_, wpe_};
    L.Begin(ids, true);
    L.Alloc(g(numel(ids)));  // gradients
    L.Work(0, 3.0 * static_cast<double>(4 * numel(ids)));
    L.Free(g(numel(ids)));
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
