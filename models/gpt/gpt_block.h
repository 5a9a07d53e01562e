// A transformer block's forward and backward (gpt_block.cc) and the helpers Gpt::Run shares with
// it: parameters in the form the ops read, parameter gradients as the ops produce them,
// activation buffers. Internal to models/gpt.
#pragma once

#include <cstdint>
#include <vector>

#include "gpt/backend.h"
#include "gpt/gpt.h"
#include "tierzero/engine.h"

namespace tierzero::gpt {

// A scope's parameters as the ops read them (Note [Activation types] in gpt/backend.h): the
// chunks' own copies, or widened into one activation buffer.
struct Weights {
  ActivationBuffer buf;
  std::vector<ParamId> ids;
  std::vector<const void*> ptr;
  // p's pointer; nullptr for -1 (a parameter the architecture has none of).
  const void* operator()(ParamId p) const;
};
StatusOr<Weights> Prepare(Engine& e, Backend& k, const ParamScope& scope,
                          const std::vector<ParamId>& ids);

// Where an op puts a parameter's gradient: the engine's buffer itself (grads_in_place; written
// at the parameter's first backward use, added to at later ones), or a zeroed buffer in the
// weights' type the op adds into and Put writes (first use) or adds (later uses) into the
// engine's.
class Grad {
 public:
  static StatusOr<Grad> Open(Engine& e, Backend& k, const ParamScope& scope, ParamId p, bool add);
  GradOut out() const;
  // Hands the gradient to the engine and frees the buffer.
  Status Put(Engine& e, Backend& k);

 private:
  ParamId p_ = -1;
  bool add_ = false;
  void* dst_ = nullptr;
  ActivationBuffer buf_;
};

// A block's parameter gradients, each open only from the op that computes it until it is
// written to the engine (so a block never holds all of them at once). -1 ids are skipped.
class GradSink {
 public:
  GradSink(Engine& e, Backend& k, const ParamScope& scope) : e_(e), k_(k), scope_(scope) {}
  Status Open(ParamId a, ParamId b = -1);
  GradOut operator()(ParamId p) const;
  Status Close(ParamId a, ParamId b = -1);

 private:
  Engine& e_;
  Backend& k_;
  const ParamScope& scope_;
  std::vector<std::pair<ParamId, Grad>> open_;
};

// n activations (the backend's type) and n fp32 values.
StatusOr<ActivationBuffer> Acts(Engine& e, const Backend& k, int64_t n);
StatusOr<ActivationBuffer> Floats(Engine& e, int64_t n);
// The activation `elems` elements into p.
void* At(const Backend& k, void* p, int64_t elems);

struct Dims {
  int64_t B, T, C, H, rows;
};

// A block's activations kept from forward for backward (rows = batch x seq): activations in the
// backend's type, norm statistics in fp32, attention's state as the backend keeps it. GPT-2's
// qkv holds its fused rows (k, v empty); h and mlp are GELU's input and output (GPT-2) or the
// gate and up projections (SwiGLU), glu silu(gate) up.
struct BlockActivations {
  ActivationBuffer x;  // block input (kept with checkpointing too)
  ActivationBuffer n1, mean1, rstd1, qkv, k, v, probs, att, x2, n2, mean2, rstd2, h, mlp, glu;
};

// Forward of one block from s.x into y; fills the saved activations.
Status BlockForward(Engine& e, Backend& k, const GptConfig& c, const Dims& d, const BlockParams& bp,
                    const Weights& P, BlockActivations& s, void* y);
// Backward of one block: dy in, dx out (written), parameter gradients through G.
Status BlockBackward(Engine& e, Backend& k, const GptConfig& c, const Dims& d,
                     const BlockParams& bp, const Weights& P, GradSink& G, BlockActivations& s,
                     const void* dy, void* dx);

}  // namespace tierzero::gpt
