// AVX2 block kernels (quantize.h): 32 elements per step (four vectors packed to bytes at once),
// the tail on the scalar element math. The same results as the scalar path (quantize_block.h):
// VCVTPS2DQ rounds in the default mode (to nearest, ties to even), as nearbyint does.
#include <immintrin.h>

#include <cstring>

#include "core/bf16_round_simd.h"
#include "kernels/quantize.h"
#include "kernels/quantize_block.h"

namespace tierzero::kernels::internal {
namespace {

// 8 elements of x[i ..] (fp32, bf16 or fp16) as fp32; exact.
inline __m256 Load(const void* x, DType t, uint64_t i) {
  if (t == DType::kF32) return _mm256_loadu_ps(static_cast<const float*>(x) + i);
  const __m128i h =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
  if (t == DType::kF16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// For bf16 and fp16, |x| orders as its bits do (sign cleared), so the maximum is taken on the
// 16-bit patterns, 16 per vector, and converted once; Inf and NaN are the patterns at or above
// the format's infinity. The same value as the fp32 path's maximum (every bf16 and fp16 is an
// fp32 exactly). Measured faster here (bf16 int8 quantize 18.6 -> 22.6 GB/s on one thread); on
// AVX-512 the float path with two accumulators was faster, so it stays there.
inline void AbsMax16(const uint16_t* x, DType t, uint64_t n, float* amax, bool* finite) {
  const __m256i magnitude = _mm256_set1_epi16(0x7FFF);
  __m256i m = _mm256_setzero_si256();
  uint64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m = _mm256_max_epu16(
        m,
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), magnitude));
  }
  __m128i q = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  q = _mm_max_epu16(q, _mm_srli_si128(q, 8));
  q = _mm_max_epu16(q, _mm_srli_si128(q, 4));
  q = _mm_max_epu16(q, _mm_srli_si128(q, 2));
  auto bits = static_cast<uint16_t>(_mm_extract_epi16(q, 0));
  for (; i < n; ++i) {
    const auto b = static_cast<uint16_t>(x[i] & 0x7FFF);
    bits = b > bits ? b : bits;
  }
  const uint16_t inf = t == DType::kBF16 ? 0x7F80 : 0x7C00;
  *finite = bits < inf;
  *amax = t == DType::kBF16 ? BF16ToF32Scalar(bits) : F16ToF32Scalar(bits);
}

inline void AbsMax(const void* x, DType t, uint64_t n, float* amax, bool* finite) {
  if (t != DType::kF32) {
    AbsMax16(static_cast<const uint16_t*>(x), t, n, amax, finite);
    return;
  }
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 huge = _mm256_set1_ps(3.4028234663852886e38f);
  __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, Load(x, t, i));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, huge, _CMP_NLE_UQ));
    m = _mm256_max_ps(m, a);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = 0;
  bool ok = _mm256_movemask_ps(bad) == 0;
  for (float l : lanes) best = best > l ? best : l;
  for (; i < n; ++i) {
    const float v = LoadElement(x, t, i);
    const float a = v < 0 ? -v : v;
    ok &= a <= 3.4028234663852886e38f;
    best = best > a ? best : a;
  }
  *amax = best;
  *finite = ok;
}

// Note [No clamp before packing]: x * inverse lies within qmax (1 + 2^-23) for |x| <= amax,
// because inverse = fl(qmax / amax) and each rounding adds at most 2^-24; it rounds to at most
// qmax. So the lanes need no clamp (non-finite blocks never get here; the scalar path's clamp
// never acts either), and the saturating packs cannot reach -128.
inline __m256i QuantizeLanes(__m256 x, __m256 inverse) {
  return _mm256_cvtps_epi32(_mm256_mul_ps(x, inverse));
}

// 32 values from x[i ..] quantized to 32 signed bytes, in order; for bf16 with `ordered` false,
// the 64-bit groups of elements 0-7, 16-23, 8-15, 24-31 (the int4 packing orders them later).
template <bool ordered = true>
inline __m256i Quantize32(const void* x, DType t, uint64_t i, __m256 inverse) {
  __m256i bytes;
  if (t == DType::kBF16) {
    // A bf16 is the top half of its fp32: unpacking 16 of them with zeros within 128-bit lanes
    // gives elements 0-3 | 8-11 and 4-7 | 12-15, which the packs below put back in order per
    // lane; one 64-bit permute then orders the lanes.
    const auto* h = static_cast<const uint16_t*>(x) + i;
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 16));
    const __m256i z = _mm256_setzero_si256();
    const __m256i a = QuantizeLanes(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v0)), inverse);
    const __m256i b = QuantizeLanes(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v0)), inverse);
    const __m256i c = QuantizeLanes(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v1)), inverse);
    const __m256i d = QuantizeLanes(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v1)), inverse);
    // 0-7, 16-23 | 8-15, 24-31
    bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    if (ordered) bytes = _mm256_permute4x64_epi64(bytes, 0xD8);
  } else {
    const __m256i a = QuantizeLanes(Load(x, t, i), inverse);
    const __m256i b = QuantizeLanes(Load(x, t, i + 8), inverse);
    const __m256i c = QuantizeLanes(Load(x, t, i + 16), inverse);
    const __m256i d = QuantizeLanes(Load(x, t, i + 24), inverse);
    // packs works within 128-bit lanes: a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7.
    bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  return bytes;
}

// The elements of a block whose scale is s (nonzero).
void QuantizeBlock(const void* x, DType t, uint64_t n, int bits, const BlockScale& s,
                   uint8_t* payload) {
  const int qm = QMax(bits);
  const __m256 inverse = _mm256_set1_ps(s.inverse);
  uint64_t i = 0;
  if (bits == 8) {
    for (; i + 32 <= n; i += 32)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(payload + i), Quantize32(x, t, i, inverse));
    for (; i < n; ++i)
      payload[i] = static_cast<uint8_t>(QuantizeElement(LoadElement(x, t, i), s.inverse, qm));
    return;
  }
  const __m256i nibbles = _mm256_set1_epi8(0x0F), weights = _mm256_set1_epi16(0x1001);
  // In 16-bit lanes (even byte, odd byte): even & 0xF + (odd & 0xF) * 16 through one multiply-add
  // of unsigned bytes by the weights 1 and 16, then to bytes. For bf16 the bytes stay in
  // Quantize32's group order, each 64-bit group a 32-bit one after the multiply-add: packing
  // leaves p's groups 0, 1, q's 0, 1 | p's 2, 3, q's 2, 3, which one permute puts in order.
  if (t == DType::kBF16) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; i + 64 <= n; i += 64) {
      const __m256i p = Quantize32<false>(x, t, i, inverse);
      const __m256i q = Quantize32<false>(x, t, i + 32, inverse);
      const __m256i pn = _mm256_maddubs_epi16(_mm256_and_si256(p, nibbles), weights);
      const __m256i qn = _mm256_maddubs_epi16(_mm256_and_si256(q, nibbles), weights);
      const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(pn, qn), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(payload + i / 2), packed);
    }
  }
  for (; i + 64 <= n; i += 64) {
    const __m256i p = Quantize32(x, t, i, inverse);
    const __m256i q = Quantize32(x, t, i + 32, inverse);
    const __m256i pn = _mm256_maddubs_epi16(_mm256_and_si256(p, nibbles), weights);
    const __m256i qn = _mm256_maddubs_epi16(_mm256_and_si256(q, nibbles), weights);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(pn, qn), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(payload + i / 2), packed);
  }
  for (; i < n; i += 2) {
    const int lo = QuantizeElement(LoadElement(x, t, i), s.inverse, qm);
    const int hi = i + 1 < n ? QuantizeElement(LoadElement(x, t, i + 1), s.inverse, qm) : 0;
    payload[i / 2] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
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

// 8 quantized values from element i as floats.
inline __m256 LoadLanes(const uint8_t* payload, uint64_t i, int bits) {
  if (bits == 8) {
    int64_t w;
    std::memcpy(&w, payload + i, 8);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(w)));
  }
  int32_t w;
  std::memcpy(&w, payload + i / 2, 4);
  // Byte j's nibbles into lanes 2j (low) and 2j+1 (high), then sign-extended from 4 bits.
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_cvtsi32_si128(w));
  const __m256i spread =
      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  const __m256i shifted = _mm256_srlv_epi32(spread, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
  const __m256i nib = _mm256_and_si256(shifted, _mm256_set1_epi32(0xF));
  const __m256i eight = _mm256_set1_epi32(8);
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_xor_si256(nib, eight), eight));
}

void Dequantize(const uint8_t* payload, float scale, uint64_t n, int bits, float* out,
                bool accumulate) {
  const __m256 s = _mm256_set1_ps(scale);
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(LoadLanes(payload, i, bits), s);
    if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(out + i), v);
    _mm256_storeu_ps(out + i, v);
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(QuantizedAt(payload, i, bits)) * scale;
    out[i] = accumulate ? out[i] + v : v;
  }
}

void Dequantize16(const uint8_t* payload, float scale, uint64_t n, int bits, uint16_t* out,
                  DType t) {
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 s = _mm256_set1_ps(scale);
  uint64_t i = 0;
  if (bits == 4) {
    // An int4 block has 16 possible values (nibble v holds q = (v ^ 8) - 8): their 16-bit
    // results, with the same multiply and rounding, as a low-byte and a high-byte table in both
    // 128-bit lanes, and each element two byte lookups (VPSHUFB) by its nibble: 32 elements per
    // step from 16 payload bytes. The table takes a handful of vector operations, so a block of
    // 64 elements pays for it as little as one of 4096.
    const __m256i eight32 = _mm256_set1_epi32(8);
    const __m256 q0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(
        _mm256_xor_si256(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), eight32), eight32));
    const __m256 q1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(
        _mm256_xor_si256(_mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15), eight32), eight32));
    const __m256i h = t == DType::kBF16
                          ? tierzero::internal::PackBF16(_mm256_mul_ps(q0, s), _mm256_mul_ps(q1, s))
                          : _mm256_set_m128i(_mm256_cvtps_ph(_mm256_mul_ps(q1, s), kRne),
                                             _mm256_cvtps_ph(_mm256_mul_ps(q0, s), kRne));
    // Per 128-bit lane: the low bytes of its eight values, then their high bytes.
    const __m256i split = _mm256_shuffle_epi8(
        h, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10,
                            12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m128i s0 = _mm256_castsi256_si128(split), s1 = _mm256_extracti128_si256(split, 1);
    const __m256i tlo = _mm256_broadcastsi128_si256(_mm_unpacklo_epi64(s0, s1));
    const __m256i thi = _mm256_broadcastsi128_si256(_mm_unpackhi_epi64(s0, s1));
    const __m128i low = _mm_set1_epi8(0x0F);
    for (; i + 32 <= n; i += 32) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(payload + i / 2));
      const __m128i lo = _mm_and_si128(b, low);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
      // Nibbles in element order: 0-15 in the low lane, 16-31 in the high one.
      const __m256i idx = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
      const __m256i l = _mm256_shuffle_epi8(tlo, idx), hh = _mm256_shuffle_epi8(thi, idx);
      // Within lanes: u0 holds elements 0-7 | 16-23, u1 8-15 | 24-31.
      const __m256i u0 = _mm256_unpacklo_epi8(l, hh), u1 = _mm256_unpackhi_epi8(l, hh);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                          _mm256_permute2x128_si256(u0, u1, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i + 16),
                          _mm256_permute2x128_si256(u0, u1, 0x31));
    }
  } else if (t == DType::kBF16 && scale == scale) {
    // q * scale is NaN only where the scale is (|q| <= 127): a finite scale needs no NaN check
    // per vector; a NaN one (a non-finite block) takes the scalar loop below.
    for (; i + 16 <= n; i += 16) {
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(out + i),
          tierzero::internal::PackBF16NoNan(_mm256_mul_ps(LoadLanes(payload, i, bits), s),
                                            _mm256_mul_ps(LoadLanes(payload, i + 8, bits), s)));
    }
  } else if (t == DType::kF16) {
    for (; i + 8 <= n; i += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       _mm256_cvtps_ph(_mm256_mul_ps(LoadLanes(payload, i, bits), s), kRne));
    }
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(QuantizedAt(payload, i, bits)) * scale;
    out[i] = t == DType::kBF16 ? F32ToBF16Scalar(v) : F32ToF16Scalar(v);
  }
}

}  // namespace

const QuantKernels kQuantAvx2 = {Quantize, Dequantize, Dequantize16};

}  // namespace tierzero::kernels::internal
