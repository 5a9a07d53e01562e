// The instruction-set level of the library's CPU kernels (CPU Adam, conversions, the GPT's
// element-wise ops), public so that code built on the engine can follow the same choice.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <string_view>

namespace tierzero {

enum class SimdLevel : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The level kernels use: TZ_SIMD (auto|scalar|avx2|avx512) when set and supported, else the best
// this CPU supports. Forcing a level the CPU lacks logs a warning and falls back to the best one.
SimdLevel ActiveSimdLevel();

// "scalar", "avx2" or "avx512".
std::string_view SimdLevelName(SimdLevel level);

}  // namespace tierzero
