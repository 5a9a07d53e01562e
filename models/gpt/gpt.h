// The transformer family trained through tierzero's public API (include/tierzero/engine.h)
// only: GPT-2 and Llama as configurations of one model (GptConfig::arch and its switches).
//
// GPT-2: token and learned position embeddings; pre-LayerNorm blocks (eps 1e-5) of causal
// multi-head self-attention (one fused q/k/v projection) and a 4x-wide GELU (tanh) MLP, biases
// everywhere, each added to the residual stream; a final LayerNorm; the LM head tied to the token
// embedding. Parameter names follow Hugging Face's GPT-2 checkpoints without their
// "transformer." prefix ("h.3.attn.c_attn.weight"; Conv1D layout, in x out).
//
// Llama (Llama 2/3, Mistral, Qwen 2 without biases): no position embeddings but rotary ones on
// q and k (rope_theta; HF's rotate_half); pre-RMSNorm blocks (norm_eps) of grouped-query
// attention (n_kv_head key/value heads; separate q, k, v, o projections, biases on them with
// attention_bias) and a SwiGLU MLP (down(silu(gate(x)) up(x)), d_ff wide, no biases); a final
// RMSNorm; an LM head of its own unless tie_embeddings. Names and layouts are HF's
// LlamaForCausalLM's ("model.layers.3.self_attn.q_proj.weight", nn.Linear: out x in).
//
// Initialisation: weights N(0, 0.02) (GPT-2's residual output projections N(0, 0.02 /
// sqrt(2 L))), biases 0, norm weights 1.
//
// Compute (gpt/backend.h, Note [Activation types]): parameters arrive in the engine's compute
// dtype; activations are fp32 (the CPU's reference) or bf16 (a GPU's, and the CPU's test of it),
// allocated through the engine, so the plan sees them. With activation checkpointing a block
// keeps only its input in forward and recomputes the rest in backward.
//
// Acquire order per micro-batch: {embeddings}, each block, {final norm, head} (forward), then
// {final norm, head} (backward), each block in reverse, {embeddings} (backward): 2 L + 4
// moments. GPT-2's embeddings are {wte, wpe} and its head wte; Llama's {embed_tokens} and
// lm_head (or embed_tokens when tied).
//
// Thread-safety: one thread drives a Gpt (the engine's).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gpt/backend.h"
#include "tierzero/engine.h"

namespace tierzero::gpt {

// The architecture: its layout, its names and what the switches may say (ValidateGptConfig).
enum class Arch : uint8_t { kGpt2, kLlama };
// "gpt2", "llama".
const char* ArchName(Arch a);

struct GptConfig {
  Arch arch = Arch::kGpt2;
  int vocab = 256;
  int seq_len = 16;  // the training context (windows of seq_len tokens)
  // Positions the model knows: GPT-2's position embeddings (rows), Llama's
  // max_position_embeddings; 0: seq_len. seq_len may not exceed it.
  int max_positions = 0;
  int d_model = 128;
  int n_layer = 4;
  int n_head = 4;
  // Llama's switches (GPT-2 takes only their GPT-2 values: 0, 0, true, true, 1e-5).
  int n_kv_head = 0;            // key/value heads, a divisor of n_head; 0: n_head
  int d_ff = 0;                 // the MLP's width; 0: 4 d_model (GPT-2), 8/3 d_model to 32s (Llama)
  bool tie_embeddings = true;   // the LM head is the token embedding
  bool attention_bias = true;   // biases on q, k, v, o (GPT-2: every bias)
  double rope_theta = 10000.0;  // Llama
  // Llama 3's frequency scaling (gpt/rope.h; rope_scaling "llama3"); factor 0: none.
  double rope_factor = 0, rope_low_freq_factor = 1, rope_high_freq_factor = 4;
  int rope_original_positions = 8192;
  double norm_eps = 1e-5;
  bool activation_checkpointing = false;
  Activations activations = Activations::kAuto;
  uint64_t seed = 1;  // initialisation
  // The special tokens' ids of a Hugging Face model's config.json (bos_token_id, eos_token_id,
  // pad_token_id: each an id or a list of ids), as a compact JSON object; "" none. Not the model's
  // shape: carried from --init-from DIR to `export --format hf` (Note [Special tokens carried]).
  std::string token_ids;

  int head_dim() const { return d_model / n_head; }
  int positions() const { return max_positions > 0 ? max_positions : seq_len; }
  Rope rope() const {
    return {rope_theta, rope_factor, rope_low_freq_factor, rope_high_freq_factor,
            static_cast<double>(rope_original_positions)};
  }
  int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int ffn() const {
    if (d_ff > 0) return d_ff;
    return arch == Arch::kGpt2 ? 4 * d_model : (8 * d_model / 3 + 31) / 32 * 32;
  }
  // The products' parameters of one block: q, k, v, o, and the MLP's two (GELU) or three
  // (SwiGLU) matrices.
  double block_matmul_params() const {
    const double C = d_model, KV = static_cast<double>(kv_heads()) * head_dim(), F = ffn();
    return arch == Arch::kGpt2 ? 4 * C * C + 2 * C * F : 2 * C * C + 2 * C * KV + 3 * C * F;
  }
};

// Every matrix dimension a multiple of 8 (vocab, width, MLP width, key/value width): what a GPU's
// bf16 products take (ChooseBackend).
bool BackendAligned(const GptConfig& c);

// "GPT-2" or "Llama" (with its key/value heads when grouped: "Llama (GQA 8 of 32 heads)").
const char* ModelName(const GptConfig& c);

// A Llama-shaped config: RMSNorm, rotary embeddings, SwiGLU, untied head, no biases (the rest as
// `c`, n_kv_head and d_ff as given there).
GptConfig AsLlama(GptConfig c);

// InvalidArgument naming the field: every size >= 1, d_model divisible by n_head. `key_of`,
// when given, names a field as its reader knows it (a model directory's config.json key), in
// `file`: the subject `FILE: "KEY" (model.FIELD)`, and the fields a range names by their keys
// too. An empty key: the field's own name ("model field 'n_head'").
Status ValidateGptConfig(const GptConfig& config,
                         const std::function<std::string(const char*)>& key_of = nullptr,
                         const std::string& file = "");

// A micro-batch: batch x seq tokens, the target of every position, and a 0/1 loss mask.
struct Batch {
  int batch = 0;
  int seq = 0;
  std::vector<int32_t> tokens, targets;
  std::vector<float> mask;
};

// A block's parameters; -1 where the architecture has none. `all` in registration order.
struct BlockParams {
  ParamId norm1_w = -1, norm1_b = -1, norm2_w = -1, norm2_b = -1;
  ParamId qkv_w = -1, qkv_b = -1;  // GPT-2's fused projection
  ParamId q_w = -1, q_b = -1, k_w = -1, k_b = -1, v_w = -1, v_b = -1;
  ParamId o_w = -1, o_b = -1;
  ParamId fc_w = -1, fc_b = -1, proj_w = -1, proj_b = -1;  // GPT-2's MLP
  ParamId gate_w = -1, up_w = -1, down_w = -1;             // SwiGLU
  std::vector<ParamId> all;
};

class Backend;

class Gpt {
 public:
  ~Gpt();
  // Registers the parameters with `engine` (before its Finalize).
  static StatusOr<std::unique_ptr<Gpt>> Create(Engine& engine, const GptConfig& config);

  // One training micro-batch (an engine training iteration): forward, loss, backward; the
  // gradients go to the engine. Returns the mean loss over masked positions. The first call
  // picks the backend for the engine's device (Unsupported for a GPU in a build without CUDA).
  StatusOr<double> ForwardBackward(const Batch& batch);
  // Forward only (an evaluation iteration): the mean loss, and the argmax token of every
  // position when `predictions` is not null.
  StatusOr<double> Evaluate(const Batch& batch, std::vector<int32_t>* predictions);

  // The training iteration's trace for micro-batches of `batch` rows of the full context,
  // derived from the configuration without running (Engine::Plan's input; gpt_trace.cc): each
  // moment's parameters, activation bytes and peak as the engine would record them, and its
  // work (FLOPs, bytes) for a machine given by its rates. Its compute_seconds are 0.
  StatusOr<WarmupTrace> DeriveTrace(int batch) const;

  const GptConfig& config() const { return cfg_; }
  // How it computes on the engine's device (after Finalize), in words: "bf16 activations
  // (cuBLASLt products with fused epilogues; cuDNN 9.19.0 fused attention)", "fp32 activations
  // (the CPU's reference ops)", ...; after the first iteration, which attention ran.
  std::string ComputeSummary() const;
  // The activations' type it computes in on the engine's device (after Finalize):
  // model.activations with "auto" resolved (fp32 where the choice fails: its error comes at the
  // first iteration).
  DType ActivationsType() const;
  int64_t num_params() const { return num_params_; }
  // Training FLOPs per token (forward + backward): 6 x matmul parameters + attention.
  double flops_per_token() const;

 private:
  Gpt(Engine& engine, const GptConfig& config);
  StatusOr<double> Run(const Batch& batch, bool train, std::vector<int32_t>* predictions);

  Engine& engine_;
  GptConfig cfg_;
  std::unique_ptr<Backend> backend_;
  // wte_: the token embedding; wpe_: GPT-2's positions; head_: the LM head (wte_ when tied).
  ParamId wte_ = -1, wpe_ = -1, lnf_w_ = -1, lnf_b_ = -1, head_ = -1;
  std::vector<BlockParams> blocks_;
  int64_t num_params_ = 0;
};

}  // namespace tierzero::gpt
