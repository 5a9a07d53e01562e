// Per-level conversion tables, defined in convert_{scalar,avx2,avx512}.cc. Only convert.cc
// may reference the SIMD tables, and only after checking the CPU supports them.
#pragma once

#include "core/convert.h"

namespace tierzero::internal {

extern const ConvertKernels kConvertScalar;
extern const ConvertKernels kConvertAvx2;
extern const ConvertKernels kConvertAvx512;

// Stores of at least this many output bytes use non-temporal stores on the SIMD paths; see
// Note [Streaming stores] in convert_avx2.cc.
size_t StreamingStoreThresholdBytes();

// How far ahead of the loads the streaming loops prefetch. On a single core the hardware
// prefetcher alone leaves read bandwidth on the table for these read-heavy passes (measured in
// bench/RESULTS.md: fp32 -> bf16 at 64M elements went from 0.71-0.79 to 0.83 of memcpy).
inline constexpr size_t kPrefetchBytes = 2048;

}  // namespace tierzero::internal
