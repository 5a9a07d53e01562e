// AVX-512 conversions. Compiled with -mavx512f/bw/vl/dq; reached only through
// ConvertKernelsFor() after the CPU check. Streaming stores as in Note [Streaming stores]
// (convert_avx2.cc); rounding to bf16 as in core/bf16_round_simd.h (Note [BF16 rounding without
// VCVTNEPS2BF16]).
#include <immintrin.h>

#include "core/bf16_round_simd.h"
#include "core/convert_internal.h"

namespace tierzero::internal {
namespace {

template <bool kStream>
inline void Store512(void* dst, __m512i v) {
  if constexpr (kStream) {
    _mm512_stream_si512(static_cast<__m512i*>(dst), v);
  } else {
    _mm512_storeu_si512(dst, v);
  }
}

template <typename Out>
size_t HeadForAlignment(const Out* dst) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst);
  if (a % sizeof(Out) != 0) return SIZE_MAX;
  return ((64 - a % 64) % 64) / sizeof(Out);
}

// Blocks of 32 elements (64 bytes of 16-bit output, 128 bytes of fp32 output).
template <typename In, typename Out, typename Body, typename Scalar>
void Drive(const In* src, Out* dst, size_t n, Body body, Scalar scalar) {
  size_t i = 0;
  const bool big = n * sizeof(Out) >= StreamingStoreThresholdBytes();
  const size_t head = big ? HeadForAlignment(dst) : SIZE_MAX;
  if (head != SIZE_MAX && head < n) {
    for (; i < head; ++i) scalar(i);
    for (; i + 32 <= n; i += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(src + i) + kPrefetchBytes, _MM_HINT_T0);
      body.template operator()<true>(i);
    }
    _mm_sfence();
  } else {
    for (; i + 32 <= n; i += 32) body.template operator()<false>(i);
  }
  for (; i < n; ++i) scalar(i);
}

void F32ToBF16(const float* src, uint16_t* dst, size_t n) {
  Drive(
      src, dst, n,
      [&]<bool kStream>(size_t i) {
        const __m256i lo = RoundToBF16(_mm512_loadu_si512(src + i));
        const __m256i hi = RoundToBF16(_mm512_loadu_si512(src + i + 16));
        Store512<kStream>(dst + i, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
      },
      [&](size_t i) { dst[i] = F32ToBF16Scalar(src[i]); });
}

void F32ToF16(const float* src, uint16_t* dst, size_t n) {
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  Drive(
      src, dst, n,
      [&]<bool kStream>(size_t i) {
        const __m256i lo = _mm512_cvtps_ph(_mm512_loadu_ps(src + i), kRne);
        const __m256i hi = _mm512_cvtps_ph(_mm512_loadu_ps(src + i + 16), kRne);
        Store512<kStream>(dst + i, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
      },
      [&](size_t i) { dst[i] = F32ToF16Scalar(src[i]); });
}

void BF16ToF32(const uint16_t* src, float* dst, size_t n) {
  Drive(
      src, dst, n,
      [&]<bool kStream>(size_t i) {
        const __m512i h = _mm512_loadu_si512(src + i);
        const __m512i lo = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16);
        const __m512i hi =
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16);
        Store512<kStream>(dst + i, lo);
        Store512<kStream>(dst + i + 16, hi);
      },
      [&](size_t i) { dst[i] = BF16ToF32Scalar(src[i]); });
}

void F16ToF32(const uint16_t* src, float* dst, size_t n) {
  Drive(
      src, dst, n,
      [&]<bool kStream>(size_t i) {
        const __m512i h = _mm512_loadu_si512(src + i);
        Store512<kStream>(dst + i, _mm512_castps_si512(_mm512_cvtph_ps(_mm512_castsi512_si256(h))));
        Store512<kStream>(dst + i + 16,
                          _mm512_castps_si512(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1))));
      },
      [&](size_t i) { dst[i] = F16ToF32Scalar(src[i]); });
}

}  // namespace

const ConvertKernels kConvertAvx512 = {F32ToBF16, BF16ToF32, F32ToF16, F16ToF32};

}  // namespace tierzero::internal
