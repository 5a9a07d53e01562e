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

#if !defined(__CUDACC__)
// Note [Blocks in groups]: a block's scale waits on its absmax (a horizontal reduction) and two
// divisions, a chain of some tens of cycles that was a third of a 256-element block's time on
// one thread when each block ran start to end. So the CPU kernels take `count` equal blocks at
// once and go through them in groups (up to 16 blocks, at most 8 KiB of input, so that the
// second pass reads L1): the absmaxes of a group first (independent chains the core overlaps),
// then each block's scale and elements, while the next group's input is prefetched for blocks of
// up to 2 KiB (the hardware prefetcher keeps up within larger ones; a burst of prefetches for a
// 16 KiB block measured slower). The results are those of one block at a time; only the order
// of the work changes. Measured on one thread (quant_bench, block 256): bf16 -> int4 0.60 -> 0.82
// of memcpy with AVX2, 0.66 -> 0.78 with AVX-512.
//
// `abs_max(block input, n, &amax, &finite)` and `body(block input, n, scale, payload)` (called
// for blocks that do not quantize to zero) are the level's kernels.
template <typename AbsMaxFn, typename BodyFn>
static inline void QuantizeInGroups(const void* x, DType t, uint64_t n, uint64_t count, int bits,
                                    float* scales, uint8_t* payload, AbsMaxFn abs_max,
                                    BodyFn body) {
  constexpr uint64_t kMaxGroup = 16, kGroupBytes = 8192, kPrefetchBytes = 2048;
  const uint64_t in_bytes = DTypeBytes(t, n), out_bytes = BlockPayload(n, bits);
  const uint64_t group = count == 1 || in_bytes >= kGroupBytes ? 1
                         : kGroupBytes / in_bytes < kMaxGroup  ? kGroupBytes / in_bytes
                                                               : kMaxGroup;
  const auto* src = static_cast<const uint8_t*>(x);
  for (uint64_t first = 0; first < count; first += group) {
    const uint64_t m = count - first < group ? count - first : group;
    float amax[kMaxGroup];
    bool finite[kMaxGroup];
    for (uint64_t j = 0; j < m; ++j) abs_max(src + (first + j) * in_bytes, n, &amax[j], &finite[j]);
    for (uint64_t j = 0; j < m; ++j) {
      if (in_bytes <= kPrefetchBytes && first + group + j < count) {
        const uint8_t* next = src + (first + group + j) * in_bytes;
        for (uint64_t b = 0; b < in_bytes; b += 64) __builtin_prefetch(next + b);
      }
      uint8_t* out = payload + (first + j) * out_bytes;
      const BlockScale s = StartBlock(amax[j], finite[j], n, bits, scales + first + j, out);
      if (s.nonzero) body(src + (first + j) * in_bytes, n, s, out);
    }
  }
}
#endif

}  // namespace tierzero::kernels::internal
