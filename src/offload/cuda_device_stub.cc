// The build without CUDA (see cuda_device.h): no devices, and a clear reason.
#include "offload/cuda_device.h"

namespace tierzero {

int CudaDeviceCount() { return 0; }

uint64_t CudaFreeBytes(int) { return 0; }

StatusOr<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions&) {
  return UnavailableError(
      "tierzero was built without CUDA (nvcc was not found at configure time); use the host "
      "device or rebuild with the CUDA Toolkit installed");
}

}  // namespace tierzero
