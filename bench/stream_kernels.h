#pragma once

#include <cstddef>
#include <cstdint>

namespace tierzero::bench {

// See stream_avx2.cc. REQUIRES: the CPU supports AVX2 (callers check SimdLevelSupported).
void StreamLikeAdamAvx2(float* p, float* m, float* v, const void* grad, bool grad_bf16,
                        uint16_t* out, size_t n);

}  // namespace tierzero::bench
