// fp32 <-> bf16 and fp32 <-> fp16 conversions, vectorised (AVX-512, AVX2+F16C) with a scalar
// path, chosen at run time by ActiveSimdLevel().
//
// Semantics, identical on every path (tests compare the paths bit for bit):
// - fp32 -> bf16/fp16 rounds to nearest, ties to even. Values beyond the target's range become
//   +-Inf (fp16: |x| >= 65520); values below it become signed zero or a denormal, rounded.
// - NaN stays NaN with its sign, and is quieted: the target's quiet bit is set and the top
//   payload bits that fit are kept. This matches what F16C does in hardware. Every non-NaN and
//   every quiet-NaN bit pattern of bf16/fp16 therefore survives a round trip through fp32
//   exactly; a signalling NaN comes back quiet.
// - bf16/fp16 -> fp32 is exact (fp16 denormals become fp32 normals).
//
// See Note [BF16 rounding without VCVTNEPS2BF16] in convert_avx512.cc.
//
// Thread-safety: all functions are pure and may run concurrently on distinct buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/cpu_features.h"
#include "core/status.h"
#include "tierzero/types.h"

namespace tierzero {

// ---- Scalar single-element conversions (the reference the SIMD paths must equal) -------------
// These also compile as CUDA device code, so the GPU casts (src/kernels) round identically.
// Note [Internal linkage for helpers of SIMD files]: they are `static inline` because the SIMD
// translation units compile them with -mavx2/-mavx512*. With external linkage the linker would
// keep one out-of-line copy for the whole program, possibly an AVX-512 one, and the scalar path
// would die with SIGILL on an older CPU (seen as a risk in -O0/ASan builds, where such copies are
// common). Each file keeps its own copy instead.

#if defined(__CUDACC__)
#define TZ_HOST_DEVICE __host__ __device__
#else
#define TZ_HOST_DEVICE
#endif

TZ_HOST_DEVICE static inline uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
TZ_HOST_DEVICE static inline float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

TZ_HOST_DEVICE static inline uint16_t F32ToBF16Scalar(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  const uint32_t lsb = (x >> 16) & 1u;
  return static_cast<uint16_t>((x + 0x7FFFu + lsb) >> 16);
}

TZ_HOST_DEVICE static inline float BF16ToF32Scalar(uint16_t h) {
  return BitsToFloat(static_cast<uint32_t>(h) << 16);
}

TZ_HOST_DEVICE static inline uint16_t F32ToF16Scalar(float f) {
  const uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 and Inf
  const uint32_t exp = abs >> 23;
  if (exp < 113) {
    // Result is a denormal (or zero, or rounds up to the smallest normal): units of 2^-24.
    if (exp < 102) return static_cast<uint16_t>(sign);  // below 2^-25: rounds to zero
    const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14..24
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  const uint32_t rebased = abs - (112u << 23);  // exponent bias 127 -> 15
  uint32_t q = rebased >> 13;
  const uint32_t rem = rebased & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

TZ_HOST_DEVICE static inline float F16ToF32Scalar(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) {
    return BitsToFloat(sign | 0x7F800000u | (mant ? 0x400000u | (mant << 13) : 0u));
  }
  if (exp == 0) {
    if (mant == 0) return BitsToFloat(sign);
    // Denormal: normalise. value = mant * 2^-24.
    int e = -1;
    do {
      mant <<= 1;
      ++e;
    } while ((mant & 0x400u) == 0);
    return BitsToFloat(sign | ((112u - e) << 23) | ((mant & 0x3FFu) << 13));
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

// ---- Array conversions -------------------------------------------------------------------------

// One table per SIMD level. REQUIRES for every function: src and dst do not overlap.
struct ConvertKernels {
  void (*f32_to_bf16)(const float* src, uint16_t* dst, size_t n);
  void (*bf16_to_f32)(const uint16_t* src, float* dst, size_t n);
  void (*f32_to_f16)(const float* src, uint16_t* dst, size_t n);
  void (*f16_to_f32)(const uint16_t* src, float* dst, size_t n);
};

// The table for `level`, or nullptr when this CPU cannot run it.
const ConvertKernels* ConvertKernelsFor(SimdLevel level);
// The table for ActiveSimdLevel().
const ConvertKernels& ActiveConvertKernels();

inline void ConvertF32ToBF16(const float* src, uint16_t* dst, size_t n) {
  ActiveConvertKernels().f32_to_bf16(src, dst, n);
}

// Converts n elements between any two of fp32, bf16, fp16 (same type: a copy). bf16 <-> fp16
// goes through fp32 in blocks, rounding once. Other dtypes are InvalidArgument.
Status Convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n);

// acc[i] += src[i] widened to fp32, for n elements (src fp32, bf16 or fp16), one fp32 add each:
// gradient accumulation, the same bits wherever it runs. InvalidArgument for another dtype.
Status AddToF32(float* acc, const void* src, DType src_type, size_t n);

}  // namespace tierzero
