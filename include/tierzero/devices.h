// What the engine can run on here: the CPU's SIMD level (CPU Adam, conversions), the GPUs CUDA
// sees, and the simulated device that stands in for one (EngineConfig::device).
// `tierzero devices` prints this.
//
// Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tierzero/simd.h"
#include "tierzero/status.h"

namespace tierzero {

struct CpuInfo {
  SimdLevel detected = SimdLevel::kScalar;  // the best level this CPU supports
  SimdLevel active = SimdLevel::kScalar;    // the level kernels use (TZ_SIMD may lower it)
  bool avx2 = false, avx512 = false, avx512_bf16 = false;
};

struct GpuInfo {
  int ordinal = 0;
  std::string name;     // empty when unusable
  std::string problem;  // why the engine cannot use it; empty when usable
};

struct DeviceListing {
  CpuInfo cpu;
  std::vector<GpuInfo> gpus;  // each probed with a small slab
  std::string no_gpu_reason;  // when there is none: no driver, no device, built without CUDA
  uint64_t host_sim_default_capacity = 0;
};

// Probes every GPU (creating a device on each) and the simulated device. An error only when the
// simulated device cannot be created (host memory).
StatusOr<DeviceListing> ListDevices();

// GPUs CUDA sees (0 without a driver, a device, or a build with CUDA), and the free memory of one
// (0 when it is not there). Neither creates a device.
int GpuCount();
uint64_t GpuFreeBytes(int ordinal);

}  // namespace tierzero
