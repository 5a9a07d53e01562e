// AVX2 + F16C conversions. Compiled with -mavx2 -mfma -mf16c; reached only through
// ConvertKernelsFor() after the CPU check.
//
// Note [Streaming stores]
// A conversion over a buffer much larger than the caches is bound by memory bandwidth. Ordinary
// stores first read each destination line into the cache (read-for-ownership), so an fp32 ->
// bf16 pass moves 4 (read) + 2 (RFO) + 2 (write) = 8 bytes per element where 6 are needed, and
// memcpy, which glibc performs with non-temporal stores at these sizes, would look 33% faster
// per byte. Above a threshold (TZ_CONVERT_STREAMING_BYTES of output, default 8 MiB: well past
// the last-level cache share of one core) we align the destination with a scalar head and use
// non-temporal stores; below it the output is likely to be read again soon, so it stays cached.
#include <immintrin.h>

#include "core/bf16_round_simd.h"
#include "core/convert_internal.h"

namespace tierzero::internal {
namespace {

// 16 floats from src -> 16 bf16 (core/bf16_round_simd.h).
inline __m256i SixteenToBF16(const float* src) {
  return PackBF16(_mm256_loadu_ps(src), _mm256_loadu_ps(src + 8));
}

inline __m256i SixteenToF16(const float* src) {
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m128i lo = _mm256_cvtps_ph(_mm256_loadu_ps(src), kRne);
  const __m128i hi = _mm256_cvtps_ph(_mm256_loadu_ps(src + 8), kRne);
  return _mm256_set_m128i(hi, lo);
}

template <bool kStream>
inline void Store256(void* dst, __m256i v) {
  if constexpr (kStream) {
    _mm256_stream_si256(static_cast<__m256i*>(dst), v);
  } else {
    _mm256_storeu_si256(static_cast<__m256i*>(dst), v);
  }
}

// Elements to convert with scalar code before `dst` is 32-byte aligned, or SIZE_MAX when the
// destination can never be aligned (element size does not divide its misalignment).
template <typename Out>
size_t HeadForAlignment(const Out* dst) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst);
  if (a % sizeof(Out) != 0) return SIZE_MAX;
  return ((32 - a % 32) % 32) / sizeof(Out);
}

// Runs `body(i)` for blocks of 16 elements from `start`, with a scalar `tail(i)` for the rest,
// choosing streaming stores when the output is large and alignable.
template <typename In, typename Out, typename Body, typename Scalar>
void Drive(const In* src, Out* dst, size_t n, Body body, Scalar scalar) {
  size_t i = 0;
  const bool big = n * sizeof(Out) >= StreamingStoreThresholdBytes();
  const size_t head = big ? HeadForAlignment(dst) : SIZE_MAX;
  if (head != SIZE_MAX && head < n) {
    for (; i < head; ++i) scalar(i);
    for (; i + 16 <= n; i += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(src + i) + kPrefetchBytes, _MM_HINT_T0);
      body.template operator()<true>(i);
    }
    _mm_sfence();
  } else {
    for (; i + 16 <= n; i += 16) body.template operator()<false>(i);
  }
  for (; i < n; ++i) scalar(i);
}

void F32ToBF16(const float* src, uint16_t* dst, size_t n) {
  Drive(
      src, dst, n,
      [&]<bool kStream>(size_t i) { Store256<kStream>(dst + i, SixteenToBF16(src + i)); },
      [&](size_t i) { dst[i] = F32ToBF16Scalar(src[i]); });
}

void F32ToF16(const float* src, uint16_t* dst, size_t n) {
  Drive(
      src, dst, n,
      [&]<bool kStream>(size_t i) { Store256<kStream>(dst + i, SixteenToF16(src + i)); },
      [&](size_t i) { dst[i] = F32ToF16Scalar(src[i]); });
}

void BF16ToF32(const uint16_t* src, float* dst, size_t n) {
  Drive(
      src, dst, n,
      [&]<bool kStream>(size_t i) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
        const __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16);
        const __m256i hi =
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16);
        Store256<kStream>(dst + i, lo);
        Store256<kStream>(dst + i + 8, hi);
      },
      [&](size_t i) { dst[i] = BF16ToF32Scalar(src[i]); });
}

void F16ToF32(const uint16_t* src, float* dst, size_t n) {
  Drive(
      src, dst, n,
      [&]<bool kStream>(size_t i) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
        Store256<kStream>(dst + i, _mm256_castps_si256(_mm256_cvtph_ps(_mm256_castsi256_si128(h))));
        Store256<kStream>(dst + i + 8,
                          _mm256_castps_si256(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))));
      },
      [&](size_t i) { dst[i] = F16ToF32Scalar(src[i]); });
}

}  // namespace

const ConvertKernels kConvertAvx2 = {F32ToBF16, BF16ToF32, F32ToF16, F16ToF32};

}  // namespace tierzero::internal
