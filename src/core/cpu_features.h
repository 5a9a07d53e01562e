// Run-time CPU feature detection and the SIMD level that kernels dispatch on.
//
// SIMD code lives in translation units compiled with their own flags (cmake/TzHelpers.cmake,
// tz_simd_sources); nothing else is built with -mavx*, so the binaries run on any x86-64. Each
// kernel family keeps one table of function pointers per level and picks the table for
// ActiveSimdLevel() (ggml's "best backend by score").
#pragma once

#include <string_view>

#include "core/status.h"
#include "core/tunable.h"
#include "tierzero/simd.h"  // SimdLevel, ActiveSimdLevel, SimdLevelName

namespace tierzero {

struct CpuFeatures {
  bool avx2 = false;    // with FMA and F16C, which every AVX2 CPU we target has
  bool avx512 = false;  // F, BW, VL, DQ
  bool avx512_bf16 = false;
};

// What this CPU and OS support (XSAVE state enabled for the registers included).
const CpuFeatures& GetCpuFeatures();
// The best level this CPU supports.
SimdLevel DetectedSimdLevel();
// True when this CPU can run code of `level`.
bool SimdLevelSupported(SimdLevel level);

// Accepts "scalar", "avx2", "avx512"; "auto" is handled by the tunable.
StatusOr<SimdLevel> ParseSimdLevel(std::string_view name);

// The tunable behind ActiveSimdLevel(), exposed so tests can force each path.
extern Tunable<std::string> kSimdTunable;

}  // namespace tierzero
