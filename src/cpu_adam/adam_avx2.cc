// AVX2 + FMA + F16C Adam kernels. Compiled with -mavx2 -mfma -mf16c (cmake tz_simd_sources).
#include <immintrin.h>

#include "cpu_adam/adam_impl.h"

namespace tierzero::internal {
namespace {

struct Avx2 {
  using F = __m256;
  using D = __m256d;
  using I = __m256i;
  static constexpr size_t kLanes = 8;

  static I Set1I(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static I Iota(uint32_t base) {
    return _mm256_add_epi32(Set1I(base), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static I Add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I Sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I And(I a, I b) { return _mm256_and_si256(a, b); }
  static I Or(I a, I b) { return _mm256_or_si256(a, b); }
  static I Xor(I a, I b) { return _mm256_xor_si256(a, b); }
  static I MulLo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I Max32(I a, I b) { return _mm256_max_epi32(a, b); }
  static I Min32(I a, I b) { return _mm256_min_epi32(a, b); }
  template <int n>
  static I Srli(I x) {
    return _mm256_srli_epi32(x, n);
  }
  template <int n>
  static I Slli(I x) {
    return _mm256_slli_epi32(x, n);
  }
  static I AsI(F x) { return _mm256_castps_si256(x); }
  static F AsF(I x) { return _mm256_castsi256_ps(x); }
  // x where `mask` is not zero, else 0.
  static I KeepNonZero(I mask, I x) {
    return _mm256_andnot_si256(_mm256_cmpeq_epi32(mask, _mm256_setzero_si256()), x);
  }
  static F Abs(F x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
  static F Max(F a, F b) { return _mm256_max_ps(a, b); }
  static float ReduceMax(F x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  static I LoadU8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static void StoreU8(uint8_t* p, I x) {
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }
  static void StoreU16(uint16_t* p, I x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
  }

  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F Set1(float x) { return _mm256_set1_ps(x); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }

  static F LoadGrad(const void* g, DType t, size_t i) {
    switch (t) {
      case DType::kBF16: {
        const __m128i h =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
      case DType::kF16:
        return _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i)));
      default:
        return _mm256_loadu_ps(static_cast<const float*>(g) + i);
    }
  }

  static void StoreOut(void* out, DType t, size_t i, F p) {
    __m128i h;
    if (t == DType::kBF16) {
      // Round to nearest even on the bit pattern; NaN lanes are quieted (core/convert.h).
      const __m256i x = _mm256_castps_si256(p);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), lsb), 16);
      const __m256 nan = _mm256_cmp_ps(p, p, _CMP_UNORD_Q);
      if (__builtin_expect(!_mm256_testz_ps(nan, nan), 0)) {
        const __m256i q = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
        r = _mm256_blendv_epi8(r, q, _mm256_castps_si256(nan));
      }
      h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    } else {
      h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), h);
  }

  // A lane is non-finite when its exponent bits are all ones.
  static bool AnyNonFinite(F a, F b, F c, F d) {
    const __m256i exp = _mm256_set1_epi32(0x7F800000);
    auto bad = [&](F x) {
      return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(x), exp), exp);
    };
    const __m256i any =
        _mm256_or_si256(_mm256_or_si256(bad(a), bad(b)), _mm256_or_si256(bad(c), bad(d)));
    return !_mm256_testz_si256(any, any);
  }

  static D ZeroD() { return _mm256_setzero_pd(); }
  static void AccumulateSquares(F g, D& acc0, D& acc1) {
    const D lo = _mm256_cvtps_pd(_mm256_castps256_ps128(g));
    const D hi = _mm256_cvtps_pd(_mm256_extractf128_ps(g, 1));
    acc0 = _mm256_fmadd_pd(lo, lo, acc0);
    acc1 = _mm256_fmadd_pd(hi, hi, acc1);
  }
  static double ReduceD(D a, D b) {
    const D s = _mm256_add_pd(a, b);
    alignas(32) double t[4];
    _mm256_store_pd(t, s);
    return (t[0] + t[1]) + (t[2] + t[3]);
  }
};

}  // namespace

const AdamKernels kAdamAvx2 = MakeAdamKernels<Avx2>();

}  // namespace tierzero::internal
