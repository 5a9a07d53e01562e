// fp32 -> bf16 rounding in SIMD registers, shared by the conversions (convert_avx2.cc,
// convert_avx512.cc) and the quantization kernels that round in registers (kernels/quantize_*):
// one definition, so every path rounds exactly as Convert does. Include only from translation
// units compiled for the ISA (the sections are guarded by its macro); the helpers are `static
// inline` (Note [Internal linkage for helpers of SIMD files] in core/convert.h).
//
// Note [BF16 rounding without VCVTNEPS2BF16]
// AVX512-BF16's VCVTNEPS2BF16 rounds to nearest even but treats denormal inputs as zero and
// flushes denormal results, so it would disagree with the scalar reference (and with what a GPU
// produces) on tiny values. The conversion is bound by memory bandwidth, so the integer
// rounding below costs nothing measurable and keeps every path bit-identical.
#pragma once

#include <immintrin.h>

namespace tierzero::internal {

#if defined(__AVX2__)
// Round-to-nearest-even of the high halves, as 32-bit lanes holding the bf16 in the low 16 bits.
// NaN lanes come out wrong here (rounding can carry a NaN into Inf); QuietNanToBF16 patches them.
static inline __m256i RoundToBF16NoNan(__m256i x) {
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), lsb),
                           16);
}

static inline __m256i QuietNanToBF16(__m256i x, __m256i rounded) {
  const __m256i is_nan = _mm256_castps_si256(
      _mm256_cmp_ps(_mm256_castsi256_ps(x), _mm256_castsi256_ps(x), _CMP_UNORD_Q));
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x0040));
  return _mm256_blendv_epi8(rounded, nan, is_nan);
}

// 16 floats (fa: the first 8), none of them NaN, -> 16 bf16 in one 256-bit vector, in order.
static inline __m256i PackBF16NoNan(__m256 fa, __m256 fb) {
  const __m256i a = RoundToBF16NoNan(_mm256_castps_si256(fa));
  const __m256i b = RoundToBF16NoNan(_mm256_castps_si256(fb));
  // packus interleaves 128-bit lanes: [a0-3 b0-3 | a4-7 b4-7]; restore the order.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
}

// 16 floats (fa: the first 8) -> 16 bf16 in one 256-bit vector, in order. NaNs are rare, so
// they are detected for the whole block with one compare and patched only when present.
static inline __m256i PackBF16(__m256 fa, __m256 fb) {
  const __m256i xa = _mm256_castps_si256(fa);
  const __m256i xb = _mm256_castps_si256(fb);
  __m256i a = RoundToBF16NoNan(xa);
  __m256i b = RoundToBF16NoNan(xb);
  const __m256 any_nan =
      _mm256_or_ps(_mm256_cmp_ps(fa, fa, _CMP_UNORD_Q), _mm256_cmp_ps(fb, fb, _CMP_UNORD_Q));
  if (__builtin_expect(!_mm256_testz_ps(any_nan, any_nan), 0)) {
    a = QuietNanToBF16(xa, a);
    b = QuietNanToBF16(xb, b);
  }
  // packus interleaves 128-bit lanes: [a0-3 b0-3 | a4-7 b4-7]; restore the order.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
}
#endif

#if defined(__AVX512F__)
// 16 floats (as bits) -> 16 bf16, rounded to nearest even, NaN kept quiet.
static inline __m256i RoundToBF16(__m512i x) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(x, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x0040));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan));
}
#endif

}  // namespace tierzero::internal
