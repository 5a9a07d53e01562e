// The compressed forms of Adam's moments (docs/optimizer.md, "Compressed optimizer states"): the
// element math every path (scalar, AVX2, AVX-512, later the GPU) shares, written once here so the
// vector code can equal it bit for bit.
//
// Note [Stochastic rounding of the moments]
// A moment is rewritten every step from its own old value: v_t = beta2 v_{t-1} + (1 - beta2) g^2.
// With beta2 = 0.999 a step changes v by 0.1% of itself when the gradient is quiet, less than half
// a bf16 ulp (0.2-0.4%) and far less than an 8-bit code's step: rounded to nearest, v never decays
// (it stalls at a value too large, and the updates shrink), and m's small changes are lost the same
// way. So both compressed forms round stochastically: up with the probability of the discarded
// fraction, which makes every stored moment the exact value in expectation. The random bits are a
// hash of the element's key (its place in the chunk layout) and the step (RoundingBits), not a
// generator's state: the same on every path and thread, so the vector paths still equal the scalar
// one bit for bit and a resumed run rounds as the uninterrupted one would.
//
// Note [8-bit moment codes]
// Blocks of kStateBlockElems elements share a scale, the block's largest magnitude / kCodeTop.
// Each moment is then a tiny float relative to that scale, coded from its fp32 bit pattern (so the
// vector code is a few integer operations), not a linear step of the maximum: a linear code puts
// every element under maximum / 254 at zero, and Adam divides by sqrt(v): a second moment coded
// as zero next to a first moment that is not makes an update of m / eps, the failure the 8-bit
// optimizer papers and bitsandbytes' reports describe (blockwise scales and a non-linear map are
// their remedy; a map that never codes a non-zero v as zero is the 4-bit papers'). So:
//   m: a sign and 7 bits: 4 of exponent (2^-15 .. 2^0 of the scale) and 3 of mantissa (E4M3);
//      below the smallest code it is 0 (an update too small to matter).
//   v: 8 bits: 5 of exponent (2^-31 .. 2^0: v is a square, its range the gradient's squared) and
//      3 of mantissa (E5M3); a non-zero v is never coded 0, at least the smallest code (an update
//      smaller than the true one, never larger).
// Code c > 0 decodes to the float whose bits are (c + bias) << 20, c = 0 to 0; the top code is
// 1.875 (exponent 0, mantissa 7/8) = kCodeTop, so the block's largest value is coded exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/convert.h"
#include "core/state_format.h"

namespace tierzero::internal {

inline constexpr size_t kStateBlockElems = 64;       // elements per 8-bit block (one scale each)
inline constexpr float kCodeTop = 1.875f;            // the top code's value, times the scale
inline constexpr uint32_t kMBias = (127 - 15) << 3;  // m: exponents 2^-15 .. 2^0
inline constexpr uint32_t kVBias = 1023 - 255;       // v: exponents 2^-31 .. 2^0
inline constexpr int32_t kMMaxCode = 127, kVMaxCode = 255;

// FloatBits and BitsToFloat: core/convert.h.

// The step's part of the hash (once per call).
TZ_HOST_DEVICE static inline uint32_t StepMix(int64_t step) {
  return static_cast<uint32_t>(step) * 0x85EBCA77u;
}

// 32 random bits for the element with key `key` at the step mixed into `step_mix` (key x golden
// ratio ^ step, then two rounds of xor-shift-multiply: a two-multiply integer hash, enough to
// decorrelate neighbouring elements and steps): the low 16 round m, the high 16 round v.
TZ_HOST_DEVICE static inline uint32_t RoundingBits(uint32_t key, uint32_t step_mix) {
  uint32_t x = (key * 0x9E3779B1u) ^ step_mix;
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  return x;
}

// fp32 -> bf16, rounded stochastically with 16 random bits (Note [Stochastic rounding of the
// moments]): the magnitude rounds up with the probability of the discarded fraction.
TZ_HOST_DEVICE static inline uint16_t Bf16Stochastic(float x, uint32_t r16) {
  return static_cast<uint16_t>((FloatBits(x) + r16) >> 16);
}

// A magnitude y (= |x| / scale, in [0, kCodeTop]) as an 8-bit code's magnitude part: the bits of y
// plus 20 random bits, truncated to the 3 mantissa bits kept (Note [8-bit moment codes]). 0 for
// y = 0; below the smallest code `floor` (0 for m, 1 for v).
TZ_HOST_DEVICE static inline uint32_t EncodeMagnitude(float y, uint32_t r20, uint32_t bias,
                                                      int32_t max_code, int32_t floor) {
  const uint32_t b = FloatBits(y);
  int32_t c = static_cast<int32_t>((b + r20) >> 20) - static_cast<int32_t>(bias);
  c = c < floor ? floor : c;
  c = c > max_code ? max_code : c;
  return b == 0 ? 0u : static_cast<uint32_t>(c);
}
TZ_HOST_DEVICE static inline float DecodeMagnitude(uint32_t c, uint32_t bias) {
  return c == 0 ? 0.0f : BitsToFloat((c + bias) << 20);
}

// |x| by clearing the sign bit (-0 becomes +0, as the vector code's and-not does).
TZ_HOST_DEVICE static inline float AbsBits(float x) {
  return BitsToFloat(FloatBits(x) & 0x7FFFFFFFu);
}

TZ_HOST_DEVICE static inline uint8_t EncodeM(float m, float inv_scale, uint32_t r16) {
  const float y = AbsBits(m) * inv_scale;
  const uint32_t c = EncodeMagnitude(y, r16 << 4, kMBias, kMMaxCode, 0);
  return static_cast<uint8_t>(((FloatBits(m) >> 24) & 0x80u) | c);
}
TZ_HOST_DEVICE static inline float DecodeM(uint8_t code, float scale) {
  const float y = DecodeMagnitude(code & 0x7Fu, kMBias) * scale;
  return (code & 0x80u) != 0 ? -y : y;
}
TZ_HOST_DEVICE static inline uint8_t EncodeV(float v, float inv_scale, uint32_t r16) {
  return static_cast<uint8_t>(EncodeMagnitude(v * inv_scale, r16 << 4, kVBias, kVMaxCode, 1));
}
TZ_HOST_DEVICE static inline float DecodeV(uint8_t code, float scale) {
  return DecodeMagnitude(code, kVBias) * scale;
}

// A block's scale and its inverse from the block's largest magnitude.
TZ_HOST_DEVICE static inline void BlockScale(float amax, float* scale, float* inv_scale) {
  *scale = amax / kCodeTop;
  *inv_scale = amax > 0 ? kCodeTop / amax : 0.0f;
}

}  // namespace tierzero::internal
