// AVX-512 block kernels (quantize.h): 16 elements per step, the tail through masks. The same
// element math as the scalar path (quantize_block.h): fp32 products rounded by VCVTPS2DQ in the
// default rounding mode (to nearest, ties to even), as nearbyint does.
#include <immintrin.h>

#include "core/bf16_round_simd.h"
#include "kernels/quantize.h"
#include "kernels/quantize_block.h"

namespace tierzero::kernels::internal {
namespace {

using tierzero::internal::RoundToBF16;  // core/bf16_round_simd.h

inline __mmask16 Mask(uint64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// The lanes of mask m of x[i ..] (fp32, bf16 or fp16) as fp32, zero elsewhere; exact.
inline __m512 Load(const void* x, DType t, uint64_t i, __mmask16 m) {
  if (t == DType::kF32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(x) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(x) + i);
  if (t == DType::kF16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 32 bf16 values as two fp32 vectors by interleaving zero halves within 128-bit lanes: `lo`
// holds elements [0-3, 8-11, 16-19, 24-27], `hi` [4-7, 12-15, 20-23, 28-31]. One unpack per 16
// values instead of a lane-crossing widening and a shift.
inline void Bf16Halves(const uint16_t* x, __m512* lo, __m512* hi) {
  const __m512i v = _mm512_loadu_si512(x);
  *lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), v));
  *hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), v));
}

// |x| as the block's running maximum, and whether any lane was Inf or NaN.
inline void AbsMax(const void* x, DType t, uint64_t n, float* amax, bool* finite) {
  const __m512 huge = _mm512_set1_ps(3.4028234663852886e38f);
  __m512 m0 = _mm512_setzero_ps(), m1 = _mm512_setzero_ps();
  __mmask16 bad = 0;
  uint64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512 a, b;
    if (t == DType::kBF16) {
      // 32 bf16 at once, widened in lane order (Bf16Halves); the order does not matter here.
      Bf16Halves(static_cast<const uint16_t*>(x) + i, &a, &b);
      a = _mm512_abs_ps(a);
      b = _mm512_abs_ps(b);
    } else {
      a = _mm512_abs_ps(Load(x, t, i, 0xFFFF));
      b = _mm512_abs_ps(Load(x, t, i + 16, 0xFFFF));
    }
    bad |= _mm512_cmp_ps_mask(a, huge, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(b, huge, _CMP_NLE_UQ);
    m0 = _mm512_max_ps(m0, a);
    m1 = _mm512_max_ps(m1, b);
  }
  for (; i < n; i += 16) {
    const __m512 a = _mm512_abs_ps(Load(x, t, i, Mask(n - i)));
    bad |= _mm512_cmp_ps_mask(a, huge, _CMP_NLE_UQ);
    m0 = _mm512_max_ps(m0, a);
  }
  *amax = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
  *finite = bad == 0;
}

inline __m512i QuantizeLanes(__m512 x, __m512 inverse, __m512i qmax) {
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(x, inverse));
  return _mm512_max_epi32(_mm512_min_epi32(q, qmax),
                          _mm512_sub_epi32(_mm512_setzero_si512(), qmax));
}

// The elements of a block whose scale is s (nonzero).
void QuantizeBlock(const void* x, DType t, uint64_t n, int bits, const BlockScale& s,
                   uint8_t* payload) {
  const __m512 inverse = _mm512_set1_ps(s.inverse);
  const __m512i qmax = _mm512_set1_epi32(QMax(bits));
  uint64_t i = 0;
  // 64 elements at a time: four vectors of int32 packed to 64 bytes with saturating packs
  // (which interleave the 128-bit lanes; one permute restores the order) and clamped as bytes;
  // int4 then pairs nibbles in 16-bit lanes and narrows them to 32 bytes. The same values as the
  // 16-lane path below: a quantized value never exceeds qmax by more than rounding, so clamping
  // after the (saturating) narrowing equals clamping before it.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i hi8 = _mm512_set1_epi8(static_cast<char>(QMax(bits)));
  const __m512i lo8 = _mm512_set1_epi8(static_cast<char>(-QMax(bits)));
  // bf16 through Bf16Halves: the packs then leave, in 128-bit lane k, elements 8k..8k+7 and
  // 32+8k..32+8k+7 (four bytes each from a, b, c, d), so dword 4k+j goes to 2k, 2k+1, 8+2k, 9+2k.
  const __m512i bf16_order =
      _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  const bool bf16 = t == DType::kBF16;
  for (; i + 64 <= n; i += 64) {
    __m512 fa, fb, fc, fd;
    if (bf16) {
      Bf16Halves(static_cast<const uint16_t*>(x) + i, &fa, &fb);
      Bf16Halves(static_cast<const uint16_t*>(x) + i + 32, &fc, &fd);
    } else {
      fa = Load(x, t, i, 0xFFFF);
      fb = Load(x, t, i + 16, 0xFFFF);
      fc = Load(x, t, i + 32, 0xFFFF);
      fd = Load(x, t, i + 48, 0xFFFF);
    }
    const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(fa, inverse));
    const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(fb, inverse));
    const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(fc, inverse));
    const __m512i d = _mm512_cvtps_epi32(_mm512_mul_ps(fd, inverse));
    __m512i bytes = _mm512_packs_epi16(_mm512_packs_epi32(a, b), _mm512_packs_epi32(c, d));
    bytes = _mm512_permutexvar_epi32(bf16 ? bf16_order : order, bytes);
    bytes = _mm512_max_epi8(_mm512_min_epi8(bytes, hi8), lo8);
    if (bits == 8) {
      _mm512_storeu_si512(payload + i, bytes);
      continue;
    }
    const __m512i nib =
        _mm512_or_si512(_mm512_and_si512(bytes, _mm512_set1_epi16(0x000F)),
                        _mm512_and_si512(_mm512_srli_epi16(bytes, 4), _mm512_set1_epi16(0x00F0)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(payload + i / 2), _mm512_cvtepi16_epi8(nib));
  }
  for (; i < n; i += 16) {
    const __mmask16 m = Mask(n - i);
    const __m512i q = QuantizeLanes(Load(x, t, i, m), inverse, qmax);
    if (bits == 8) {
      if (n - i >= 16) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(payload + i), _mm512_cvtepi32_epi8(q));
      } else {
        _mm512_mask_cvtepi32_storeu_epi8(payload + i, m, q);
      }
      continue;
    }
    if (n - i >= 16) {
      // To bytes, then in 16-bit lanes (even byte, odd byte): even & 0xF | (odd & 0xF) << 4.
      const __m128i w = _mm512_cvtepi32_epi8(q);
      const __m128i p = _mm_or_si128(_mm_and_si128(w, _mm_set1_epi16(0x000F)),
                                     _mm_and_si128(_mm_srli_epi16(w, 4), _mm_set1_epi16(0x00F0)));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(payload + i / 2),
                       _mm_packus_epi16(p, _mm_setzero_si128()));
      continue;
    }
    // The tail: pairs of lanes into bytes, the even element in the low nibble.
    const __m512i nib = _mm512_and_si512(q, _mm512_set1_epi32(0xF));
    const __m512i pairs = _mm512_or_si512(nib, _mm512_srli_epi64(nib, 28));
    const uint64_t left = n - i < 16 ? n - i : 16;
    const auto bytes = static_cast<__mmask8>((1u << ((left + 1) / 2)) - 1);
    _mm512_mask_cvtepi64_storeu_epi8(payload + i / 2, bytes, pairs);
  }
}

void Quantize(const void* x, DType t, uint64_t n, uint64_t count, int bits, float* scales,
              uint8_t* payload) {
  QuantizeInGroups(
      x, t, n, count, bits, scales, payload,
      [t](const void* b, uint64_t m, float* amax, bool* finite) { AbsMax(b, t, m, amax, finite); },
      [t, bits](const void* b, uint64_t m, const BlockScale& s, uint8_t* out) {
        QuantizeBlock(b, t, m, bits, s, out);
      });
}

// 16 quantized values starting at element i (a multiple of 16) as signed 32-bit lanes.
inline __m512i LoadLanes(const uint8_t* payload, uint64_t i, uint64_t left, int bits) {
  // Masked loads only for the tail: they are slower than plain ones on some CPUs.
  if (bits == 8) {
    const __m128i b = left >= 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(payload + i))
                                 : _mm_maskz_loadu_epi8(Mask(left), payload + i);
    return _mm512_cvtepi8_epi32(b);
  }
  // Low and high nibbles interleaved back into element order, sign-extended from 4 bits.
  const auto bytes = static_cast<__mmask16>((1u << ((left < 16 ? left + 1 : 16) / 2)) - 1);
  const __m128i b = left >= 16 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(payload + i / 2))
                               : _mm_maskz_loadu_epi8(bytes, payload + i / 2);
  const __m128i low = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  const __m128i lo = _mm_and_si128(b, low);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
  const __m128i v = _mm_sub_epi8(_mm_xor_si128(_mm_unpacklo_epi8(lo, hi), eight), eight);
  return _mm512_cvtepi8_epi32(v);
}

void Dequantize(const uint8_t* payload, float scale, uint64_t n, int bits, float* out,
                bool accumulate) {
  const __m512 s = _mm512_set1_ps(scale);
  for (uint64_t i = 0; i < n; i += 16) {
    const __mmask16 m = Mask(n - i);
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(LoadLanes(payload, i, n - i, bits)), s);
    if (n - i >= 16) {
      if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(out + i), v);
      _mm512_storeu_ps(out + i, v);
      continue;
    }
    if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out + i), v);
    _mm512_mask_storeu_ps(out + i, m, v);
  }
}

void Dequantize16(const uint8_t* payload, float scale, uint64_t n, int bits, uint16_t* out,
                  DType t) {
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 s = _mm512_set1_ps(scale);
  const bool bf16 = t == DType::kBF16;
  uint64_t i = 0;
  if (bits == 4) {
    // An int4 block has 16 possible values: their 16-bit results (nibble v holds q = (v ^ 8) - 8)
    // are computed once, with the same multiply and rounding, and each element is a lookup
    // (VPERMW): 32 elements per step from 16 payload bytes.
    const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(
        _mm512_xor_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(8)),
        _mm512_set1_epi32(8)));
    const __m512 v = _mm512_mul_ps(q, s);
    const __m256i h = bf16 ? RoundToBF16(_mm512_castps_si512(v)) : _mm512_cvtps_ph(v, kRne);
    const __m512i table = _mm512_castsi256_si512(h);
    const __m128i low = _mm_set1_epi8(0x0F);
    for (; i + 32 <= n; i += 32) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(payload + i / 2));
      const __m128i lo = _mm_and_si128(b, low);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
      const __m256i nibbles =
          _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
      const __m512i idx = _mm512_cvtepu8_epi16(nibbles);
      _mm512_storeu_si512(out + i, _mm512_permutexvar_epi16(idx, table));
    }
  }
  for (; i < n; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(LoadLanes(payload, i, n - i, bits)), s);
    const __m256i h = bf16 ? RoundToBF16(_mm512_castps_si512(v)) : _mm512_cvtps_ph(v, kRne);
    if (n - i >= 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h);
    } else {
      _mm256_mask_storeu_epi16(out + i, Mask(n - i), h);
    }
  }
}

}  // namespace

const QuantKernels kQuantAvx512 = {Quantize, Dequantize, Dequantize16};

}  // namespace tierzero::kernels::internal
