// The bf16 backend's causal attention (Note [Which attention runs] in gpt/attention_cuda_bf16.cc):
// cuDNN's fused attention (gpt/cudnn_attention.h) for each shape it has a plan for and whose
// first results agree with the fused kernels' (gpt/flash_attention_cuda.h), the kernels
// elsewhere. The contracts are FlashAttentionForward/Backward's. Included only by files built
// with the CUDA runtime's headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "gpt/flash_attention_cuda.h"
#include "gpt/scratch_cuda.h"
#include "tierzero/status.h"

namespace tierzero::gpt::cuda {

class CudnnAttention;

class Bf16Attention {
 public:
  // On `stream`, as TZ_GPT_ATTENTION picks (auto, cudnn, cudnn-fast, kernels): InvalidArgument
  // for another value, and an error when it insists on cuDNN and cuDNN cannot run.
  static StatusOr<std::unique_ptr<Bf16Attention>> Create(cudaStream_t stream);
  ~Bf16Attention();
  Bf16Attention(const Bf16Attention&) = delete;
  Bf16Attention& operator=(const Bf16Attention&) = delete;

  // Enqueued on the stream. An error is a launch failure, a device too full for the kernels'
  // scratch, or (TZ_GPT_ATTENTION cudnn or cudnn-fast) cuDNN refusing or disagreeing.
  Status Forward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                 __nv_bfloat16* out, float* lse, const FlashShape& s);
  Status Backward(const __nv_bfloat16* dout, const __nv_bfloat16* q, const __nv_bfloat16* k,
                  const __nv_bfloat16* v, const __nv_bfloat16* out, const float* lse,
                  __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const FlashShape& s);
  // Which attention ran and why, in words (Backend::AttentionSummary).
  std::string Summary() const;

 private:
  friend class Bf16AttentionCheckTest;  // tests/gpt/cudnn_attention_test.cc
  enum class Choice : uint8_t { kAuto, kCudnn, kCudnnFast, kKernels };
  // A shape's attention, decided at its first use.
  struct Use {
    bool cudnn = false;
    bool forward_checked = false, backward_checked = false;
  };
  Bf16Attention(cudaStream_t stream, Choice choice, std::unique_ptr<CudnnAttention> cudnn,
                std::string no_cudnn);
  // The shape's Use, planning cuDNN's at its first use: an error only when TZ_GPT_ATTENTION
  // insists on cuDNN and it refuses the shape.
  StatusOr<Use*> Choose(const FlashShape& s);
  // `use` leaves cuDNN for the kernels, for `why` (auto), or `why` is the error (cudnn,
  // cudnn-fast).
  Status LeaveCudnn(Use& use, const Status& why);
  // Note [cuDNN checked against the fused kernels]: the kernels' results beside cuDNN's just
  // written; where they disagree, the kernels' replace them and the shape leaves cuDNN.
  Status CheckForward(Use& use, const __nv_bfloat16* q, const __nv_bfloat16* k,
                      const __nv_bfloat16* v, __nv_bfloat16* out, float* lse, const FlashShape& s);
  Status CheckBackward(Use& use, const __nv_bfloat16* dout, const __nv_bfloat16* q,
                       const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* out,
                       const float* lse, __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                       const FlashShape& s);
  Status KernelsForward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                        __nv_bfloat16* out, float* lse, const FlashShape& s);
  Status KernelsBackward(const __nv_bfloat16* dout, const __nv_bfloat16* q, const __nv_bfloat16* k,
                         const __nv_bfloat16* v, const __nv_bfloat16* out, const float* lse,
                         __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                         const FlashShape& s);

  cudaStream_t stream_;
  Choice choice_;
  std::unique_ptr<CudnnAttention> cudnn_;  // null: the fused kernels throughout
  std::string no_cudnn_;                   // why cuDNN is not used at all
  std::string left_;                       // the first reason a shape left cuDNN
  std::string unchecked_;                  // why a check could not run, when one could not
  std::map<
      std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>,
      Use>
      shapes_;
  int cudnn_shapes_ = 0, kernel_shapes_ = 0;
  double plan_seconds_ = 0;  // building cuDNN's plans (their engines compile at the first use)
  double worst_forward_ = 0, worst_backward_ = 0;  // the checks' largest relative differences
  bool forward_checks_ = false, backward_checks_ = false;
  Scratch<float> rowdot_;
};

}  // namespace tierzero::gpt::cuda
