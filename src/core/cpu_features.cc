#include "core/cpu_features.h"

#include <cpuid.h>

#include <atomic>
#include <string>

#include "core/logging.h"

namespace tierzero {

TZ_TUNABLE_CHOICE(kSimdTunable, "TZ_SIMD", "auto",
                  "SIMD level for CPU kernels: auto, scalar, avx2 or avx512", "auto", "scalar",
                  "avx2", "avx512");

namespace {

uint64_t ReadXcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuFeatures Detect() {
  CpuFeatures f;
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = ecx & bit_OSXSAVE;
  const bool fma = ecx & bit_FMA;
  const bool f16c = ecx & bit_F16C;
  const bool avx = ecx & bit_AVX;
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = ReadXcr0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;
  const bool zmm_state = (xcr0 & 0xE6) == 0xE6;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return f;
  f.avx2 = ymm_state && fma && f16c && (ebx & bit_AVX2);
  f.avx512 = f.avx2 && zmm_state && (ebx & bit_AVX512F) && (ebx & bit_AVX512BW) &&
             (ebx & bit_AVX512VL) && (ebx & bit_AVX512DQ);
  unsigned eax1, ebx1, ecx1, edx1;
  if (f.avx512 && __get_cpuid_count(7, 1, &eax1, &ebx1, &ecx1, &edx1)) {
    f.avx512_bf16 = eax1 & (1u << 5);
  }
  return f;
}

}  // namespace

SimdLevel ResolveSimdLevel();

const CpuFeatures& GetCpuFeatures() {
  static const CpuFeatures features = Detect();
  return features;
}

bool SimdLevelSupported(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar:
      return true;
    case SimdLevel::kAvx2:
      return GetCpuFeatures().avx2;
    case SimdLevel::kAvx512:
      return GetCpuFeatures().avx512;
  }
  return false;
}

SimdLevel DetectedSimdLevel() {
  if (GetCpuFeatures().avx512) return SimdLevel::kAvx512;
  if (GetCpuFeatures().avx2) return SimdLevel::kAvx2;
  return SimdLevel::kScalar;
}

std::string_view SimdLevelName(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar:
      return "scalar";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kAvx512:
      return "avx512";
  }
  return "unknown";
}

StatusOr<SimdLevel> ParseSimdLevel(std::string_view name) {
  if (name == "scalar") return SimdLevel::kScalar;
  if (name == "avx2") return SimdLevel::kAvx2;
  if (name == "avx512") return SimdLevel::kAvx512;
  return InvalidArgumentError("unknown SIMD level '" + std::string(name) +
                              "'; expected auto, scalar, avx2 or avx512");
}

SimdLevel ActiveSimdLevel() {
  // Resolved once per Set/Reset of the tunable: conversions call this on every buffer.
  static std::atomic<uint64_t> cached_generation{0};
  static std::atomic<int> cached_level{0};
  const uint64_t generation = kSimdTunable.generation();
  if (cached_generation.load(std::memory_order_acquire) == generation) {
    return static_cast<SimdLevel>(cached_level.load(std::memory_order_relaxed));
  }
  const SimdLevel level = ResolveSimdLevel();
  cached_level.store(static_cast<int>(level), std::memory_order_relaxed);
  cached_generation.store(generation, std::memory_order_release);
  return level;
}

SimdLevel ResolveSimdLevel() {
  const std::string forced = kSimdTunable.Get();
  if (forced.empty() || forced == "auto") return DetectedSimdLevel();
  auto level = ParseSimdLevel(forced);
  if (!level.ok()) {
    TZ_LOG_ONCE(kWarn, kCore) << "TZ_SIMD: " << level.status().message();
    return DetectedSimdLevel();
  }
  if (!SimdLevelSupported(*level)) {
    TZ_LOG_ONCE(kWarn, kCore) << "TZ_SIMD=" << forced << " is not supported by this CPU; using "
                              << SimdLevelName(DetectedSimdLevel());
    return DetectedSimdLevel();
  }
  return *level;
}

}  // namespace tierzero
