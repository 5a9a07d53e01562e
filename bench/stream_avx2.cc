// The bandwidth ceiling for cpu_adam_bench: the same streams as an Adam step (read param, grad,
// m, v; write param, m, v in place; optionally write a 16-bit copy), with trivial arithmetic.
// Compiled with AVX2 flags (tz_simd_sources) so the loads and stores are as wide as Adam's.
#include <immintrin.h>

#include <initializer_list>

#include "bench/stream_kernels.h"

namespace tierzero::bench {

void StreamLikeAdamAvx2(float* p, float* m, float* v, const void* grad, bool grad_bf16,
                        uint16_t* out, size_t n) {
  const __m256 a = _mm256_set1_ps(1e-7f);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 g;
    if (grad_bf16) {
      const __m128i h =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
      g = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      g = _mm256_loadu_ps(static_cast<const float*>(grad) + i);
    }
    const __m256 np = _mm256_fmadd_ps(a, g, _mm256_loadu_ps(p + i));
    _mm256_storeu_ps(p + i, np);
    _mm256_storeu_ps(m + i, _mm256_fmadd_ps(a, g, _mm256_loadu_ps(m + i)));
    _mm256_storeu_ps(v + i, _mm256_fmadd_ps(a, g, _mm256_loadu_ps(v + i)));
    if (out != nullptr) {
      const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(np), 16);
      _mm_storeu_si128(
          reinterpret_cast<__m128i*>(out + i),
          _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
    }
  }
  for (; i < n; ++i) {
    const float g = grad_bf16 ? 0.0f : static_cast<const float*>(grad)[i];
    p[i] += 1e-7f * g;
    m[i] += 1e-7f * g;
    v[i] += 1e-7f * g;
    if (out != nullptr) out[i] = 0;
  }
}

void StreamLikeAdamStatesAvx2(float* p, void* m, void* v, float* m_scale, float* v_scale,
                              const uint16_t* grad, uint16_t* out, size_t n, int moment_bytes) {
  const __m256 a = _mm256_set1_ps(1e-7f);
  const __m256i one = _mm256_set1_epi32(1);
  for (size_t i = 0; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(grad + i));
    const __m256 g = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    const __m256 np = _mm256_fmadd_ps(a, g, _mm256_loadu_ps(p + i));
    _mm256_storeu_ps(p + i, np);
    const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(np), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
    if (moment_bytes == 2) {
      for (void* q : {m, v}) {
        auto* at = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(q) + i);
        _mm_storeu_si128(at, _mm_add_epi16(_mm_loadu_si128(at), _mm256_castsi256_si128(one)));
      }
    } else {
      for (void* q : {m, v}) {
        auto* at = reinterpret_cast<__m128i*>(static_cast<uint8_t*>(q) + i);
        _mm_storel_epi64(at, _mm_add_epi8(_mm_loadl_epi64(at), _mm256_castsi256_si128(one)));
      }
      if (i % 64 == 0) {
        m_scale[i / 64] += 1e-7f;
        v_scale[i / 64] += 1e-7f;
      }
    }
  }
}

}  // namespace tierzero::bench
