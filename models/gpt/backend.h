// Where the GPT computes, and in which element types (Note [Activation types]).
//
// gpt.cc is written once against Backend: the CPU ops (gpt/ops.h) on the simulated device, or
// the CUDA ops on a GPU. Every pointer is the engine's device memory (host memory on the
// simulated device), every call ordered on the engine's compute stream. The CPU backend with
// fp32 activations is the reference the equivalence tests pin down: it computes exactly what
// gpt.cc computed before the interface carried types.
//
// C++17 and CUDA-free (backend_cuda.cc adapts gpt/ops_cuda.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpt/rope.h"
#include "tierzero/status.h"
#include "tierzero/tunables.h"
#include "tierzero/types.h"

namespace tierzero {
class Engine;
}

namespace tierzero::gpt {

// Note [Activation types]
// A backend is fixed by a BackendSpec before it exists (Gpt::DeriveTrace sizes the plan's trace
// from the same spec, without running). Three element types meet in the ops:
// - `params`: parameters and their gradients as the engine hands them over (its compute dtype).
// - `weights`: what the ops read parameters as and accumulate parameter gradients in. When it is
//   the params type, the ops read the chunk's own copy and (with `grads_in_place`) add into the
//   engine's gradient buffer, zeroed at its first use: no widening or narrowing pass. Otherwise
//   (bf16 parameters into fp32 ops) each scope's parameters are widened into an activation
//   buffer and the gradients accumulate in fp32 buffers that are rounded once when written.
// - `activations`: every activation and activation gradient (the residual stream, norms'
//   outputs, q/k/v, attention's output, the MLP's hidden layer, logits and their gradient).
//   What needs fp32 stays fp32 whatever this is: LayerNorm/RMSNorm statistics, attention's
//   log-sum-exps, the loss and every reduction's accumulator. The ops compute in fp32 and store
//   in this type (round to nearest even).
// The CPU computes with fp32 activations (the reference); bf16 activations on the CPU store
// every activation in bf16 and compute each op in fp32 from the widened inputs, so the tests
// here run every path a GPU's bf16 backend takes, buffer for buffer.

// Head widths the fused attention kernels take (gpt/flash_attention_cuda.h).
inline bool FusedAttentionHeadWidth(int64_t head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128;
}
// Whether the fused kernels are wanted: yes unless TZ_GPT_FUSED_ATTENTION is 0, off or false
// (then the batched products run, for comparison); InvalidArgument for a value that is neither
// (1, on, true or unset: yes). Always false in a build without CUDA.
StatusOr<bool> FusedAttentionWanted();
// TZ_GPT_ATTENTION, the bf16 backend's attention: "auto" (unset), "cudnn", "cudnn-fast" or
// "kernels" ("fused" is "kernels"); InvalidArgument naming what it takes for another value.
StatusOr<std::string> AttentionChoice();

// Note [The GPT's own tunables]
// The GPT reads its settings from the environment as the library's tunables are read
// (TZ_GPT_FUSED_ATTENTION, TZ_GPT_ATTENTION, TZ_CUDNN_LIBRARY), but the library's registry is not
// a public header a model includes: they were missing from `tierzero tunables`, and a value
// that cannot be used was found only when the backend was chosen, after the run's set-up, and
// ended it with status 1 where a bad TZ_* ends a command with 2 before it starts (hunt 51). The
// CLI lists these beside the library's and checks them with them.
std::vector<TunableInfo> GptTunables();
Status ValidateGptTunables();

// The type the model's activations are stored in (Note [Activation types]): "auto" is bf16 on a
// GPU with bf16 parameters and heads the fused attention takes, else fp32 (the CPU's reference).
enum class Activations : uint8_t { kAuto, kF32, kBF16 };
// "auto", "fp32", "bf16".
const char* ActivationsName(Activations a);

struct BackendSpec {
  bool gpu = false;
  DType params = DType::kF32;
  DType weights = DType::kF32;
  DType activations = DType::kF32;
  bool grads_in_place = false;
  // Attention fused (Note [Fused causal attention]): keeps each row's log-sum-exp (fp32) for
  // backward; otherwise the probabilities (in the activation type).
  bool fused_attention_wanted = false;

  bool fused_attention(int64_t head_dim) const {
    return fused_attention_wanted && FusedAttentionHeadWidth(head_dim);
  }
  bool widen_params() const { return weights != params; }
  uint64_t act_bytes(int64_t n) const { return DTypeBytes(activations, static_cast<size_t>(n)); }
  uint64_t weight_bytes(int64_t n) const { return DTypeBytes(weights, static_cast<size_t>(n)); }
  // What attention keeps from forward for backward.
  uint64_t attention_state_bytes(int64_t batch, int64_t seq, int64_t heads,
                                 int64_t head_dim) const {
    // (heads: the query heads; grouped-query attention keeps as much as multi-head)
    return fused_attention(head_dim) ? 4 * static_cast<uint64_t>(batch * heads * seq)
                                     : act_bytes(batch * heads * seq * seq);
  }
};

// The spec for a model on `engine` (its device and compute dtype): InvalidArgument for
// activations the device cannot store.
// `aligned`: every matrix dimension a multiple of 8 (what cuBLASLt's bf16 algorithms take;
// "auto" picks bf16 on a GPU only then, so the addition default's 62-token vocabulary runs the
// fp32 path).
StatusOr<BackendSpec> ChooseBackend(const Engine& engine, Activations activations, int64_t head_dim,
                                    bool aligned);

// A weight matrix's layout: in x out (GPT-2's Conv1D) or out x in (nn.Linear: Llama's
// projections, and the LM head as the tied token embedding, vocab x width).
enum class WeightLayout : uint8_t { kInOut, kOutIn };

// Attention's operands (as cpu::AttnShape): q rows of heads x head_dim, k and v rows of
// kv_heads x head_dim (grouped-query: query head h reads key/value head h / (heads / kv_heads)),
// each matrix's rows ld apart; out rows heads x head_dim, contiguous. GPT-2's fused [q | k | v]
// rows are q, q + C, q + 2C with ld 3C.
struct AttnDims {
  int64_t batch, seq, heads, kv_heads, head_dim, ld_q, ld_k, ld_v;
};

// A parameter's gradient as an op produces it: written (the parameter's first backward use in
// the iteration: the buffer may hold the weight itself, which the op finishes reading first) or
// added to (later uses, as a tied embedding's). In spec().weights.
struct GradOut {
  void* p = nullptr;
  bool add = false;
};

// Pointer types by role (Note [Activation types]): `act` pointers hold spec().activations,
// `wt` pointers spec().weights, float pointers fp32 always. Backward ops write (=) activation
// gradients; parameter gradients go as their GradOut says.
class Backend {
 public:
  // The CPU backend when the spec is not a GPU's, else the CUDA one on the engine's compute
  // stream (Unsupported in a build without CUDA).
  static StatusOr<std::unique_ptr<Backend>> Create(Engine& engine, const BackendSpec& spec);
  explicit Backend(const BackendSpec& spec) : spec_(spec) {}
  virtual ~Backend() = default;
  const BackendSpec& spec() const { return spec_; }

  // y = x W (+ bias); x: rows x in (act), W (wt) in `layout`, bias (wt, may be null), y: act.
  virtual void LinearForward(const void* x, const void* w, const void* bias, void* y, int64_t rows,
                             int64_t in, int64_t out, WeightLayout layout) = 0;
  // dx = dy W^T (written; may be null); dw = x^T dy in W's layout; dbias = column sums of dy
  // (dbias.p may be null).
  virtual void LinearBackward(const void* dy, const void* x, const void* w, void* dx, GradOut dw,
                              GradOut dbias, int64_t rows, int64_t in, int64_t out,
                              WeightLayout layout) = 0;
  // pre = x W + bias and y = GELU(pre) (both act, kept for backward), and backward through
  // both: dx = (dy W^T) GELU'(pre), where x = GELU(pre) is this layer's input. One product with
  // its epilogue on a GPU; the two ops in turn by default.
  virtual void LinearGeluForward(const void* x, const void* w, const void* bias, void* pre, void* y,
                                 int64_t rows, int64_t in, int64_t out, WeightLayout layout);
  virtual void LinearBackwardGelu(const void* dy, const void* x, const void* w, const void* pre,
                                  void* dx, GradOut dw, GradOut dbias, int64_t rows, int64_t in,
                                  int64_t out, WeightLayout layout);
  // The residual stream's two sums and their gradients, each fused with the op beside it where a
  // device can (Note [The residual stream's additions]; by default the ops in turn, which is the
  // CPU's arithmetic bit for bit): y = x W + bias + residual (y must not alias x or residual);
  // dx = dresidual + the norm's backward (dx must not alias dy, x or dresidual).
  virtual void LinearResidualForward(const void* x, const void* w, const void* bias,
                                     const void* residual, void* y, int64_t rows, int64_t in,
                                     int64_t out, WeightLayout layout);
  virtual void LayerNormBackwardResidual(const void* dy, const void* x, const void* gamma,
                                         const float* mean, const float* rstd,
                                         const void* dresidual, void* dx, GradOut dgamma,
                                         GradOut dbeta, int64_t rows, int64_t cols);
  virtual void RmsNormBackwardResidual(const void* dy, const void* x, const void* w,
                                       const float* rstd, const void* dresidual, void* dx,
                                       GradOut dw, int64_t rows, int64_t cols);
  // LayerNorm over the last dimension (eps 1e-5): x, y act; gamma, beta wt; mean, rstd fp32.
  virtual void LayerNormForward(const void* x, const void* gamma, const void* beta, void* y,
                                float* mean, float* rstd, int64_t rows, int64_t cols) = 0;
  virtual void LayerNormBackward(const void* dy, const void* x, const void* gamma,
                                 const float* mean, const float* rstd, void* dx, GradOut dgamma,
                                 GradOut dbeta, int64_t rows, int64_t cols) = 0;
  virtual void GeluForward(const void* x, void* y, int64_t n) = 0;
  virtual void GeluBackward(const void* dy, const void* x, void* dx, int64_t n) = 0;
  // RMSNorm (Llama's): x, y act; w wt; rstd fp32. Backward writes dx.
  virtual void RmsNormForward(const void* x, const void* w, void* y, float* rstd, int64_t rows,
                              int64_t cols, double eps) = 0;
  virtual void RmsNormBackward(const void* dy, const void* x, const void* w, const float* rstd,
                               void* dx, GradOut dw, int64_t rows, int64_t cols) = 0;
  // Rotary embeddings on the heads of x (act, rows ld apart), in place; backward on dx.
  virtual void RopeForward(void* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim,
                           int64_t ld, const Rope& rope) = 0;
  virtual void RopeBackward(void* dx, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim,
                            int64_t ld, const Rope& rope) = 0;
  // h = silu(g) u; backward writes dg, du (act).
  virtual void SwigluForward(const void* g, const void* u, void* h, int64_t n) = 0;
  virtual void SwigluBackward(const void* dh, const void* g, const void* u, void* dg, void* du,
                              int64_t n) = 0;
  // Causal attention of q, k, v (act) into out (act), keeping `state`
  // (spec().attention_state_bytes) for backward, which reads the forward's out and state and
  // writes dq, dk, dv (strided as q, k, v).
  virtual void AttentionForward(const void* q, const void* k, const void* v, void* out, void* state,
                                const AttnDims& d) = 0;
  virtual void AttentionBackward(const void* dout, const void* q, const void* k, const void* v,
                                 const void* out, const void* state, void* dq, void* dk, void* dv,
                                 const AttnDims& d) = 0;
  // x (act) = wte[token] + wpe[t] (wt); backward: the gradients of the table's rows the
  // tokens name and of wpe (a written dwte is zero in the other rows). `host_tokens` are the
  // same tokens in host memory (a GPU groups the rows by token there).
  virtual void EmbeddingForward(const int32_t* tokens, const void* wte, const void* wpe, void* x,
                                int64_t batch, int64_t seq, int64_t channels) = 0;
  virtual void EmbeddingBackward(const int32_t* tokens, const int32_t* host_tokens, const void* dx,
                                 GradOut dwte, int64_t vocab, GradOut dwpe, int64_t batch,
                                 int64_t seq, int64_t channels) = 0;
  // As cpu::CrossEntropy: logits and dlogits (may be null) act; the loss, summed in double, is
  // Loss()'s, which waits for it: a GPU's iteration goes on without a host round trip.
  virtual Status CrossEntropy(const void* logits, const int32_t* targets, const float* mask,
                              void* dlogits, int32_t* argmax, int64_t rows, int64_t vocab,
                              double scale) = 0;
  virtual StatusOr<double> Loss() = 0;
  // y = a + b, y += a (act).
  virtual void Add(const void* a, const void* b, void* y, int64_t n) = 0;
  virtual void AddInPlace(void* y, const void* a, int64_t n) = 0;
  // Elements between fp32, bf16 and fp16 (round to nearest even); dst += src when `add` (in
  // fp32, then rounded). InvalidArgument for other types.
  virtual Status Cast(const void* src, DType src_type, void* dst, DType dst_type, int64_t n,
                      bool add) = 0;
  virtual void Zero(void* dst, uint64_t bytes) = 0;
  virtual void Copy(void* dst, const void* src, uint64_t bytes) = 0;
  // Host <-> device copies; they wait for the stream.
  virtual Status Upload(void* dst, const void* host, uint64_t bytes) = 0;
  virtual Status Download(void* host, const void* src, uint64_t bytes) = 0;
  // The first asynchronous error (CUDA); OK on the CPU.
  virtual Status status() const = 0;
  // Which attention ran, in words, once it has ("cuDNN 9.19.0 fused attention", "the fused
  // attention kernels (cuDNN: why not)"); empty where there is one choice (the CPU's ops).
  virtual std::string AttentionSummary() const { return {}; }

 private:
  BackendSpec spec_;
};

}  // namespace tierzero::gpt
