// The build without CUDA: the GPU entry points report that they are absent.
#include "kernels/cast.h"

namespace tierzero::kernels {

bool CudaKernelsBuilt() { return false; }

Status CastCudaAsync(const void*, DType, void*, DType, size_t, void*) {
  return UnavailableError("tierzero was built without CUDA (nvcc not found at configure time)");
}

Status AccumulateCudaAsync(float*, const void*, DType, size_t, void*) {
  return UnavailableError("tierzero was built without CUDA (nvcc not found at configure time)");
}

}  // namespace tierzero::kernels
