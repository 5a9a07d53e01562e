// A GPT-2 model trained through tierzero's public API (include/tierzero/engine.h) only.
//
// Architecture (GPT-2): token and learned position embeddings; pre-LayerNorm blocks (eps 1e-5)
// of causal multi-head self-attention and a 4x-wide GELU (tanh) MLP, each added to the residual
// stream; a final LayerNorm; the LM head tied to the token embedding. Initialisation: weights
// N(0, 0.02), the residual output projections (attn.c_proj, mlp.c_proj) N(0, 0.02 / sqrt(2 L)),
// biases 0, LayerNorm weight 1 and bias 0. Parameter names follow the Hugging Face GPT-2
// checkpoints ("h.3.attn.c_attn.weight"; Conv1D layout, in x out).
//
// Compute. Parameters arrive in the engine's compute dtype (bf16 by default) and are widened to
// fp32 for the kernels (gpt/backend.h: the CPU ops of gpt/ops.h on the simulated device, the
// CUDA ops of gpt/ops_cuda.h on a GPU); gradients are computed in fp32 and rounded to the
// compute dtype when written.
// Activations are fp32 and allocated through the engine, so the plan sees them. With activation
// checkpointing a block keeps only its input in forward and recomputes the rest in backward.
//
// Acquire order per micro-batch: {wte, wpe}, each block, {ln_f, wte} (forward), then
// {ln_f, wte} (backward), each block in reverse, {wte, wpe} (backward): 2 L + 4 moments.
//
// On a GPU every op is enqueued on the engine's compute stream; the CUDA path is checked op by
// op against the CPU (tests/gpt/ops_cuda_test.cc, on a GPU).
//
// Thread-safety: one thread drives a Gpt (the engine's).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "gpt/backend.h"
#include "tierzero/engine.h"

namespace tierzero::gpt {

struct GptConfig {
  int vocab = 256;
  int seq_len = 16;  // context length (position embeddings)
  int d_model = 128;
  int n_layer = 4;
  int n_head = 4;
  bool activation_checkpointing = false;
  Activations activations = Activations::kAuto;
  uint64_t seed = 1;  // initialisation
};

// InvalidArgument naming the field: every size >= 1, d_model divisible by n_head.
Status ValidateGptConfig(const GptConfig& config);

// A micro-batch: batch x seq tokens, the target of every position, and a 0/1 loss mask.
struct Batch {
  int batch = 0;
  int seq = 0;
  std::vector<int32_t> tokens, targets;
  std::vector<float> mask;
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
  int64_t num_params() const { return num_params_; }
  // Training FLOPs per token (forward + backward): 6 x matmul parameters + attention.
  double flops_per_token() const;

 private:
  struct Block {
    ParamId ln1_w, ln1_b, attn_w, attn_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fc2_w, fc2_b;
    std::vector<ParamId> all() const {
      return {ln1_w, ln1_b, attn_w, attn_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fc2_w, fc2_b};
    }
  };
  struct Saved;
  Gpt(Engine& engine, const GptConfig& config);
  StatusOr<double> Run(const Batch& batch, bool train, std::vector<int32_t>* predictions);

  Engine& engine_;
  GptConfig cfg_;
  std::unique_ptr<Backend> backend_;
  ParamId wte_ = -1, wpe_ = -1, lnf_w_ = -1, lnf_b_ = -1;
  std::vector<Block> blocks_;
  int64_t num_params_ = 0;
};

}  // namespace tierzero::gpt
