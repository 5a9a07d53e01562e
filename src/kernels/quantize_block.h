// The element math of one quantization block (Note [Quantization format] in quantize.h), shared
// by the scalar, SIMD and CUDA paths so that they agree bit for bit. `static inline` for the SIMD
// translation units: Note [Internal linkage for helpers of SIMD files] in core/convert.h.
#pragma once

#include <cstdint>

#include "core/convert.h"  // TZ_HOST_DEVICE

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace tierzero::kernels::internal {

TZ_HOST_DEVICE static inline int QMax(int bits) { return bits == 8 ? 127 : 7; }

TZ_HOST_DEVICE static inline uint64_t BlockPayload(uint64_t n, int bits) {
  return bits == 8 ? n : (n + 1) / 2;
}

struct BlockScale {
  float scale;    // stored with the block: absmax / qmax, 0 or NaN
  float inverse;  // qmax / absmax, what the elements are multiplied by
  bool nonzero;   // false: the payload is all zero (scale 0 or NaN)
};

// Note [Tiny blocks]: a block whose absmax is below qmax * FLT_MIN (about 1.5e-36 for int8)
// quantizes to zero with scale 0, so that the scale is a normal float and qmax / absmax finite;
// the error is below that absmax. A non-finite value makes the scale NaN.
TZ_HOST_DEVICE static inline BlockScale ChooseScale(float amax, bool finite, int bits) {
  if (!finite) return {BitsToFloat(0x7FC00000u), 0.0f, false};
  const float qmax = static_cast<float>(QMax(bits));
  if (!(amax >= qmax * 0x1p-126f)) return {0.0f, 0.0f, false};
  return {amax / qmax, qmax / amax, true};
}

// Stores the block's scale (from its absmax over n elements) and returns it; when the block
// quantizes to zero (all zero, tiny or non-finite), zeroes its payload too.
TZ_HOST_DEVICE static inline BlockScale StartBlock(float amax, bool finite, uint64_t n, int bits,
                                                   float* scale, uint8_t* payload) {
  const BlockScale s = ChooseScale(amax, finite, bits);
  *scale = s.scale;
  if (!s.nonzero) {
    for (uint64_t i = 0; i < BlockPayload(n, bits); ++i) payload[i] = 0;
  }
  return s;
}

// round_half_even(x * inverse), clamped to [-qmax, qmax].
TZ_HOST_DEVICE static inline int QuantizeElement(float x, float inverse, int qmax) {
#if defined(__CUDA_ARCH__)
  const int q = __float2int_rn(__fmul_rn(x, inverse));
#else
  const int q = static_cast<int>(std::nearbyint(x * inverse));
#endif
  return q > qmax ? qmax : (q < -qmax ? -qmax : q);
}

// Element i of x (fp32, bf16 or fp16) as fp32, exactly.
TZ_HOST_DEVICE static inline float LoadElement(const void* x, DType t, uint64_t i) {
  if (t == DType::kF32) return static_cast<const float*>(x)[i];
  const uint16_t h = static_cast<const uint16_t*>(x)[i];
  return t == DType::kBF16 ? BF16ToF32Scalar(h) : F16ToF32Scalar(h);
}

// The signed value of element i of a block's payload.
TZ_HOST_DEVICE static inline int QuantizedAt(const uint8_t* payload, uint64_t i, int bits) {
  if (bits == 8) return static_cast<int8_t>(payload[i]);
  const int nibble = (payload[i / 2] >> ((i % 2) * 4)) & 0xF;
  return (nibble ^ 8) - 8;
}

}  // namespace tierzero::kernels::internal
