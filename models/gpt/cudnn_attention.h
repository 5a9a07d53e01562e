// Causal attention through cuDNN's fused scaled-dot-product attention (Note [Attention through
// cuDNN] in gpt/cudnn_attention.cc): the contracts of FlashAttentionForward/Backward
// (gpt/flash_attention_cuda.h), bf16 in and out, the log-sum-exps (natural log, of the scaled
// scores) as the state, so the two forwards and the two backwards are interchangeable. cuDNN is
// loaded at run time (gpt/cudnn_api.h); a machine without it runs the fused kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <string_view>

#include "gpt/flash_attention_cuda.h"
#include "tierzero/status.h"

namespace tierzero::gpt::cuda {

class CudnnAttention {
 public:
  // Unavailable when cuDNN cannot be loaded or is older than 9.0, or has no handle (no GPU).
  // Runs on `stream`. `deterministic`: a backward that repeats bit for bit (Note [Attention
  // through cuDNN]).
  static StatusOr<std::unique_ptr<CudnnAttention>> Create(cudaStream_t stream,
                                                          bool deterministic = true);
  ~CudnnAttention();

  // Builds (once per shape) the forward's and the backward's execution plans: an error saying
  // what cuDNN refused when it has none for the shape. Forward and Backward call it.
  Status Prepare(const FlashShape& s);
  Status Forward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                 __nv_bfloat16* out, float* lse, const FlashShape& s);
  Status Backward(const __nv_bfloat16* dout, const __nv_bfloat16* q, const __nv_bfloat16* k,
                  const __nv_bfloat16* v, const __nv_bfloat16* out, const float* lse,
                  __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const FlashShape& s);
  // "cuDNN 9.19.0".
  std::string Version() const;

 private:
  struct Impl;
  explicit CudnnAttention(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Builds the forward (or backward) graph's tensors, operations and operation graph for `s` and
// finalises each, as far as the host goes without a GPU (no handle: no plan): what the tests
// here can check of the graph. With `device_json` (a device's properties as cuDNN 9.8+ reads
// them), also asks cuDNN's heuristics for that device: an error unless one of its engines takes
// the graph (Note [cuDNN's engines asked without a GPU] in gpt/cudnn_graph.cc). Unavailable when
// cuDNN cannot be loaded.
Status BuildAttentionOperationsOnHost(const FlashShape& s, bool backward, bool deterministic = true,
                                      std::string_view device_json = {});

}  // namespace tierzero::gpt::cuda
