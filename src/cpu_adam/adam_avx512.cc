// AVX-512 Adam kernels, in two flavours: kAdamAvx512 (AVX-512 F/BW/VL/DQ) and kAdamAvx512Bf16,
// which converts the bf16 output with AVX512-BF16's VCVTNEPS2BF16 (one instruction instead of
// the integer rounding; it flushes fp32 denormal inputs to zero, documented in cpu_adam.h).
// Compiled with -mavx512f/bw/vl/dq/bf16 (cmake tz_simd_sources); the BF16 flavour is selected
// only on CPUs that report AVX512_BF16.
#include <immintrin.h>

#include "cpu_adam/adam_impl.h"

namespace tierzero::internal {
namespace {

template <bool kNativeBf16>
struct Avx512 {
  using F = __m512;
  using D = __m512d;
  using I = __m512i;
  static constexpr size_t kLanes = 16;

  static I Set1I(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static I Iota(uint32_t base) {
    return _mm512_add_epi32(
        Set1I(base), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  static I Add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I Sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I And(I a, I b) { return _mm512_and_si512(a, b); }
  static I Or(I a, I b) { return _mm512_or_si512(a, b); }
  static I Xor(I a, I b) { return _mm512_xor_si512(a, b); }
  static I MulLo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I Max32(I a, I b) { return _mm512_max_epi32(a, b); }
  static I Min32(I a, I b) { return _mm512_min_epi32(a, b); }
  template <int n>
  static I Srli(I x) {
    return _mm512_srli_epi32(x, n);
  }
  template <int n>
  static I Slli(I x) {
    return _mm512_slli_epi32(x, n);
  }
  static I AsI(F x) { return _mm512_castps_si512(x); }
  static F AsF(I x) { return _mm512_castsi512_ps(x); }
  static I KeepNonZero(I mask, I x) {
    return _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(mask, mask), x);
  }
  static F Abs(F x) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), Set1I(0x7FFFFFFFu)));
  }
  static F Max(F a, F b) { return _mm512_max_ps(a, b); }
  static float ReduceMax(F x) { return _mm512_reduce_max_ps(x); }
  static I LoadU8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void StoreU8(uint8_t* p, I x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }
  static void StoreU16(uint16_t* p, I x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x));
  }

  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F Set1(float x) { return _mm512_set1_ps(x); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }

  static F LoadGrad(const void* g, DType t, size_t i) {
    const auto* h = reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i);
    switch (t) {
      case DType::kBF16:
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(h)), 16));
      case DType::kF16:
        return _mm512_cvtph_ps(_mm256_loadu_si256(h));
      default:
        return _mm512_loadu_ps(static_cast<const float*>(g) + i);
    }
  }

  static void StoreOut(void* out, DType t, size_t i, F p) {
    auto* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i);
    if (t == DType::kBF16) {
      if constexpr (kNativeBf16) {
        _mm256_storeu_si256(dst, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
      } else {
        const __m512i x = _mm512_castps_si512(p);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
        const __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)), lsb), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
        const __m512i q = _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40));
        _mm256_storeu_si256(dst, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, q)));
      }
    } else {
      _mm256_storeu_si256(dst, _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }

  static bool AnyNonFinite(F a, F b, F c, F d) {
    const __m512i exp = _mm512_set1_epi32(0x7F800000);
    auto bad = [&](F x) {
      return _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), exp), exp);
    };
    return (bad(a) | bad(b) | bad(c) | bad(d)) != 0;
  }

  static D ZeroD() { return _mm512_setzero_pd(); }
  static void AccumulateSquares(F g, D& acc0, D& acc1) {
    const D lo = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
    const D hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1)));
    acc0 = _mm512_fmadd_pd(lo, lo, acc0);
    acc1 = _mm512_fmadd_pd(hi, hi, acc1);
  }
  static double ReduceD(D a, D b) {
    alignas(64) double t[8];
    _mm512_store_pd(t, _mm512_add_pd(a, b));
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
  }
};

}  // namespace

const AdamKernels kAdamAvx512 = MakeAdamKernels<Avx512<false>>();
const AdamKernels kAdamAvx512Bf16 = MakeAdamKernels<Avx512<true>>();

}  // namespace tierzero::internal
