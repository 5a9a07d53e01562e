// This machine's rates cache for `tierzero plan` (docs/plan.md): where it is, reading it, and
// writing it only over a cache (Note [A rates cache is written over only when it is one]).
#pragma once

#include <optional>
#include <string>

#include "tierzero/plan.h"

namespace tierzero::app {

// The names a calibration gives the rates it caches (Calibrate; the communicator's alone under
// mpirun): what marks a rates file as a cache tierzero may write over.
inline constexpr const char* kCachedCpu = "this machine (calibrated)";
inline constexpr const char* kCachedGpu = "this machine's GPU (calibrated)";
inline constexpr const char* kCachedComm = "this machine's communicator (calibrated)";

// This machine's rates for runs on its simulated device, or on its GPU (rates-gpu.json): each
// calibrated on the device it describes (Note [Calibrated on the device that runs]).
std::string RatesCachePath(bool gpu);

// The cached rates, when the cache holds readable ones.
std::optional<MachineRates> CachedRates(const std::string& cache);

// Writes `r` to the cache, or says why not (the path names a file that is not a cache).
void CacheRates(const std::string& cache, const MachineRates& r);

}  // namespace tierzero::app
