#pragma once

#include <cstddef>
#include <cstdint>

namespace tierzero::bench {

// See stream_avx2.cc. REQUIRES: the CPU supports AVX2 (callers check SimdLevelSupported).
void StreamLikeAdamAvx2(float* p, float* m, float* v, const void* grad, bool grad_bf16,
                        uint16_t* out, size_t n);

// The same for compressed moments: `moment_bytes` (2: bf16, 1: 8-bit codes) per element of m and
// v read and written in place, and with 8-bit codes one float scale per 64 elements of each read
// and written. REQUIRES: AVX2; n a multiple of 64 for 8-bit codes.
void StreamLikeAdamStatesAvx2(float* p, void* m, void* v, float* m_scale, float* v_scale,
                              const uint16_t* grad, uint16_t* out, size_t n, int moment_bytes);

}  // namespace tierzero::bench
