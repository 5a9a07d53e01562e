// The cuBLASLt functions the bf16 backend's products call (gpt/lt_matmul.h), bound at run time
// as cuBLAS is (Note [cuBLAS loaded on first use] in gpt/cublas_api.cc).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "tierzero/status.h"

namespace tierzero::gpt::cuda {

struct CublasLtApi {
  cublasStatus_t (*Create)(cublasLtHandle_t*);
  cublasStatus_t (*Destroy)(cublasLtHandle_t);
  cublasStatus_t (*MatmulDescCreate)(cublasLtMatmulDesc_t*, cublasComputeType_t, cudaDataType_t);
  cublasStatus_t (*MatmulDescDestroy)(cublasLtMatmulDesc_t);
  cublasStatus_t (*MatmulDescSetAttribute)(cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t,
                                           const void*, size_t);
  cublasStatus_t (*MatrixLayoutCreate)(cublasLtMatrixLayout_t*, cudaDataType, uint64_t, uint64_t,
                                       int64_t);
  cublasStatus_t (*MatrixLayoutDestroy)(cublasLtMatrixLayout_t);
  cublasStatus_t (*PreferenceCreate)(cublasLtMatmulPreference_t*);
  cublasStatus_t (*PreferenceDestroy)(cublasLtMatmulPreference_t);
  cublasStatus_t (*PreferenceSetAttribute)(cublasLtMatmulPreference_t,
                                           cublasLtMatmulPreferenceAttributes_t, const void*,
                                           size_t);
  cublasStatus_t (*AlgoGetHeuristic)(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t,
                                     cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                     cublasLtMatrixLayout_t, cublasLtMatmulPreference_t, int,
                                     cublasLtMatmulHeuristicResult_t*, int*);
  cublasStatus_t (*Matmul)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void*, const void*,
                           cublasLtMatrixLayout_t, const void*, cublasLtMatrixLayout_t, const void*,
                           const void*, cublasLtMatrixLayout_t, void*, cublasLtMatrixLayout_t,
                           const cublasLtMatmulAlgo_t*, void*, size_t, cudaStream_t);
};

// The process's cuBLASLt, opened on the first call; Unavailable (saying what to install) when
// the library or one of its functions is missing.
StatusOr<const CublasLtApi*> LoadCublasLt();

}  // namespace tierzero::gpt::cuda
