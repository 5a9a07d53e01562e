// CudaOps' state (gpt/ops_cuda.h), shared by its two files: ops_cuda.cu (the ops) and
// ops_cuda_memory.cu (conversions and copies). CUDA-only.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "gpt/cublas_api.h"
#include "gpt/ops_cuda.h"
#include "gpt/tensor_core_cuda.h"

namespace tierzero::gpt::cuda {

struct CudaOps::Impl {
  const CublasApi* cublas = nullptr;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  Status first_error;
  float* dsum = nullptr;  // attention row dots: batch x heads x seq
  int64_t dsum_elems = 0;
  float* partial = nullptr;  // column sums' slab partials
  int64_t partial_elems = 0;
  double* row_loss = nullptr;  // cross-entropy, per row
  int64_t row_loss_elems = 0;
  std::vector<double> host_loss;
  std::vector<float> host_mask;
  std::unique_ptr<TensorCoreOps> tc;  // products on bf16 tensor cores, when asked for
  bool fused_attention = false;       // with tc: the fused attention kernels where they apply

  void Check(cudaError_t e, const char* what) {
    if (e != cudaSuccess && first_error.ok())
      first_error = InternalError(std::string(what) + ": " + cudaGetErrorString(e));
  }
  void CheckLaunch(const char* what) { Check(cudaGetLastError(), what); }
  void CheckBlas(cublasStatus_t s, const char* what) {
    if (s != CUBLAS_STATUS_SUCCESS && first_error.ok())
      first_error = InternalError(std::string(what) + ": cuBLAS status " + std::to_string(s));
  }
  template <typename T>
  T* Grow(T*& buf, int64_t& have, int64_t need) {
    if (need > have) {
      if (buf != nullptr) Check(cudaFreeAsync(buf, stream), "cudaFreeAsync");
      buf = nullptr;
      Check(cudaMallocAsync(reinterpret_cast<void**>(&buf), sizeof(T) * need, stream),
            "cudaMallocAsync (GPT op workspace)");
      have = buf != nullptr ? need : 0;
    }
    return buf;
  }
};

}  // namespace tierzero::gpt::cuda
