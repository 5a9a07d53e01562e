// AVX2 + FMA vector kernels (GELU, softmax rows). Compiled with -mavx2 -mfma (cmake
// tz_simd_sources).
#include <immintrin.h>

#include "gpt/vec_impl.h"

namespace tierzero::gpt::internal {
namespace {

struct Avx2 {
  using F = __m256;
  using I = __m256i;
  static constexpr int64_t kLanes = 8;

  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F Set1(float x) { return _mm256_set1_ps(x); }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Min(F a, F b) { return _mm256_min_ps(a, b); }
  static F Max(F a, F b) { return _mm256_max_ps(a, b); }
  static float ReduceMax(F a) {
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
  static F RoundNearest(F a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static I ToInt(F a) { return _mm256_cvtps_epi32(a); }  // exact: a is integral
  static F Exponent2(I n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  }
};

}  // namespace

const VectorKernels kVecAvx2 = MakeVectorKernels<Avx2>();

}  // namespace tierzero::gpt::internal
