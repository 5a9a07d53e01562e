// What the GPT's two CUDA backends share (backend_cuda.cc: fp32 activations;
// backend_cuda_bf16.cc: bf16): the CudaOps that converts and copies, and the first error.
// C++ only (CudaOps' header is CUDA-free).
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "gpt/backend.h"
#include "gpt/ops_cuda.h"

namespace tierzero::gpt {

class CudaBackendBase : public Backend {
 public:
  CudaBackendBase(const BackendSpec& spec, std::unique_ptr<cuda::CudaOps> ops)
      : Backend(spec), ops_(std::move(ops)) {}

  Status Cast(const void* src, DType src_type, void* dst, DType dst_type, int64_t n,
              bool add) override {
    const auto* f = static_cast<const float*>(src);
    if (src_type == DType::kF32 && add) return ops_->Accumulate(f, dst, dst_type, n);
    if (src_type == DType::kF32) return ops_->Narrow(f, dst, dst_type, n);
    if (dst_type == DType::kF32 && !add)
      return ops_->Widen(src, src_type, static_cast<float*>(dst), n);
    return InvalidArgumentError("the GPT's CUDA backend casts only to or from fp32");
  }
  void Zero(void* dst, uint64_t bytes) override { ops_->Zero(dst, bytes); }
  void Copy(void* dst, const void* src, uint64_t bytes) override { ops_->Copy(dst, src, bytes); }
  Status Upload(void* dst, const void* host, uint64_t bytes) override {
    return ops_->Upload(dst, host, bytes);
  }
  Status Download(void* host, const void* src, uint64_t bytes) override {
    return ops_->Download(host, src, bytes);
  }
  Status status() const override {
    if (!error_.ok()) return error_;
    return ops_->status();
  }

 protected:
  // Keeps the first error (the ops go on being enqueued; status() reports it).
  void SetError(Status s) {
    if (error_.ok() && !s.ok()) error_ = std::move(s);
  }

  std::unique_ptr<cuda::CudaOps> ops_;
  Status error_;
};

}  // namespace tierzero::gpt
