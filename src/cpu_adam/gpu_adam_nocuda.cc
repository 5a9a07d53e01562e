#include "cpu_adam/gpu_adam.h"

namespace tierzero {

bool GpuAdamBuilt() { return false; }

Status GpuAdamStepAsync(const AdamConfig&, const AdamStepOptions&, const AdamBuffers&, void*) {
  return UnavailableError("this build has no CUDA: GPU Adam is not available");
}

Status GpuSumSquaresAsync(const void*, DType, size_t, double*, int, void*) {
  return UnavailableError("this build has no CUDA: no GPU sum of squares");
}

}  // namespace tierzero
