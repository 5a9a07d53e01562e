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

}  // namespace tierzero::internal
