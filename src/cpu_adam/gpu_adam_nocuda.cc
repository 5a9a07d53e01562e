#include "cpu_adam/gpu_adam.h"

namespace tierzero {

bool GpuAdamBuilt() { return false; }

Status GpuAdamStepAsync(const AdamConfig&, const AdamStepOptions&, const AdamBuffers&, void*) {
  return UnavailableError("this build has no CUDA: GPU Adam is not available");
}

}  // namespace tierzero
