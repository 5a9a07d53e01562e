// The cuDNN functions the GPT's attention calls (gpt/cudnn_attention.h), bound at run time as
// cuBLAS is (Note [cuBLAS loaded on first use] in gpt/cublas_api.cc): a machine without cuDNN
// still runs, on the fused attention kernels. cuDNN's header gives the types only.
#pragma once

#include <cuda_runtime.h>
#include <cudnn_graph.h>

#include <cstddef>
#include <string>

#include "tierzero/status.h"

namespace tierzero::gpt::cuda {

struct CudnnApi {
  size_t (*GetVersion)();
  cudnnStatus_t (*Create)(cudnnHandle_t*);
  cudnnStatus_t (*Destroy)(cudnnHandle_t);
  cudnnStatus_t (*SetStream)(cudnnHandle_t, cudaStream_t);
  const char* (*GetErrorString)(cudnnStatus_t);
  void (*GetLastErrorString)(char*, size_t);
  cudnnStatus_t (*CreateDescriptor)(cudnnBackendDescriptorType_t, cudnnBackendDescriptor_t*);
  cudnnStatus_t (*DestroyDescriptor)(cudnnBackendDescriptor_t);
  cudnnStatus_t (*SetAttribute)(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t,
                                cudnnBackendAttributeType_t, int64_t, const void*);
  cudnnStatus_t (*GetAttribute)(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t,
                                cudnnBackendAttributeType_t, int64_t, int64_t*, void*);
  cudnnStatus_t (*Finalize)(cudnnBackendDescriptor_t);
  cudnnStatus_t (*Execute)(cudnnHandle_t, cudnnBackendDescriptor_t, cudnnBackendDescriptor_t);
  size_t version = 0;  // as cudnnGetVersion: major * 10000 + minor * 100 + patch
  std::string path;    // where it was loaded from

  // "CUDNN_STATUS_...: <cuDNN's last error message>".
  std::string Describe(cudnnStatus_t s) const;
};

// The process's cuDNN (libcudnn.so.9, or TZ_CUDNN_LIBRARY), opened on the first call;
// Unavailable (saying what to install) when it is missing, lacks a function, or is older than
// 9.0.
StatusOr<const CudnnApi*> LoadCudnn();

}  // namespace tierzero::gpt::cuda
