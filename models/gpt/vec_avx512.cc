// AVX-512 vector kernels (GELU, softmax rows). Compiled with -mavx512f ... (cmake tz_simd_sources).
#include <immintrin.h>

#include "gpt/vec_impl.h"

namespace tierzero::gpt::internal {
namespace {

struct Avx512 {
  using F = __m512;
  using I = __m512i;
  static constexpr int64_t kLanes = 16;

  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F Set1(float x) { return _mm512_set1_ps(x); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Min(F a, F b) { return _mm512_min_ps(a, b); }
  static F Max(F a, F b) { return _mm512_max_ps(a, b); }
  static float ReduceMax(F a) { return _mm512_reduce_max_ps(a); }
  static F RoundNearest(F a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static I ToInt(F a) { return _mm512_cvtps_epi32(a); }  // exact: a is integral
  static F Exponent2(I n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
  }
};

}  // namespace

const VectorKernels kVecAvx512 = MakeVectorKernels<Avx512>();

}  // namespace tierzero::gpt::internal
