// The cuBLAS functions the GPT's CUDA ops call, bound at run time (Note [cuBLAS loaded on first
// use] in gpt/cublas_api.cc). Included only by the CUDA ops' own files.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <string>

#include "tierzero/status.h"

namespace tierzero::gpt::cuda {

struct CublasApi {
  cublasStatus_t (*Create)(cublasHandle_t*);
  cublasStatus_t (*Destroy)(cublasHandle_t);
  cublasStatus_t (*SetStream)(cublasHandle_t, cudaStream_t);
  cublasStatus_t (*SetMathMode)(cublasHandle_t, cublasMath_t);
  cublasStatus_t (*Sgemm)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                          const float*, const float*, int, const float*, int, const float*, float*,
                          int);
  // Mixed precision (gpt/tensor_core_cuda.h): bf16 operands, fp32 accumulation and output.
  cublasStatus_t (*GemmStridedBatchedEx)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int,
                                         int, int, const void*, const void*, cudaDataType, int,
                                         long long, const void*, cudaDataType, int, long long,
                                         const void*, void*, cudaDataType, int, long long, int,
                                         cublasComputeType_t, cublasGemmAlgo_t);
};

// dlopen of a CUDA library by soname: the loader path first (the binary's run path names the
// toolkit it was built with), then that toolkit's directory itself. Null when neither opens;
// `tried` then says what each attempt answered.
void* OpenCudaLibrary(const std::string& soname, std::string* tried);
// Binds `fn` to the library's symbol `name`; false when it lacks it.
template <typename F>
bool Bind(void* lib, const char* name, F*& fn) {
  fn = reinterpret_cast<F*>(dlsym(lib, name));
  return fn != nullptr;
}

// The process's cuBLAS, opened on the first call; Unavailable (saying what to install) when the
// library or one of its functions is missing.
StatusOr<const CublasApi*> LoadCublas();

}  // namespace tierzero::gpt::cuda
