// tierzero/devices.h: the devices the engine can use, probed.
#include "tierzero/devices.h"

#include "core/cpu_features.h"
#include "offload/cuda_device.h"
#include "offload/host_sim_device.h"

namespace tierzero {

StatusOr<DeviceListing> ListDevices() {
  DeviceListing out;
  const CpuFeatures& f = GetCpuFeatures();
  out.cpu = {.detected = DetectedSimdLevel(),
             .active = ActiveSimdLevel(),
             .avx2 = f.avx2,
             .avx512 = f.avx512,
             .avx512_bf16 = f.avx512_bf16};
  const int gpus = CudaDeviceCount();
  for (int i = 0; i < gpus; ++i) {
    CudaDeviceOptions options;
    options.ordinal = i;
    options.capacity_bytes = 64 << 20;  // a small probe slab
    GpuInfo& g = out.gpus.emplace_back();
    g.ordinal = i;
    auto device = CreateCudaDevice(options);
    if (device.ok()) {
      g.name = (*device)->info().name;
    } else {
      g.problem = device.status().ToString();
    }
  }
  if (gpus == 0) out.no_gpu_reason = std::string(CreateCudaDevice({}).status().message());
  auto sim = CreateHostSimDevice(HostSimOptions{});
  if (!sim.ok()) return sim.status();
  out.host_sim_default_capacity = (*sim)->info().capacity_bytes;
  return out;
}

int GpuCount() { return CudaDeviceCount(); }

uint64_t GpuFreeBytes(int ordinal) { return CudaFreeBytes(ordinal); }

}  // namespace tierzero
