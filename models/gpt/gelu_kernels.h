// The GELU's fp32 kernels per SIMD level (internal to models/gpt; ops.cc dispatches on
// ActiveSimdLevel(), as CPU Adam does).
//
// Note [GELU through one exponential]
// The tanh approximation 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), equals
// x * sigmoid(2u) = x / (1 + e) with e = exp(-2u), so the forward needs one exponential and one
// division and no tanh (libm's scalar tanhf/expm1f were a fifth of a training step). With
// s = 1 / (1 + e) and t = 1 - s = e s, the derivative s + 2 x s (1 - s) u' is s (1 + 2 x u' t)
// (t is formed as e s, never 2 x u' e, which overflows for large negative x).
// The exponential is ours, written once over the vector traits and once for scalars with the same
// operations in the same order (Cody-Waite reduction by ln 2, a degree-7 polynomial, the exponent
// put in by integer add; fused multiply-adds throughout), so every SIMD level gives bit-identical
// results. Its argument is clamped to [-80, 80]: beyond that the GELU is x or 0 (and its
// derivative 1 or 0) to far below fp32's resolution of the result, and s stays a normal number.
// Accuracy: within a few ulps of the fp64 formula (tests/gpt/ops_test.cc,
// FloatOpsTest.GeluMatchesDouble).
#pragma once

#include <cstdint>

namespace tierzero::gpt::internal {

struct GeluKernels {
  void (*forward)(const float* x, float* y, int64_t n);
  void (*backward)(const float* dy, const float* x, float* dx, int64_t n);
};

extern const GeluKernels kGeluScalar;
extern const GeluKernels kGeluAvx2;
extern const GeluKernels kGeluAvx512;

// The kernels of ActiveSimdLevel() (TZ_SIMD).
const GeluKernels& ActiveGeluKernels();

// Constants of Note [GELU through one exponential], shared by every level.
inline constexpr float kGeluSqrt2OverPi = 0.7978845608028654f;
inline constexpr float kGeluCubic = 0.044715f;
inline constexpr float kExpClamp = 80.0f;
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2Hi = 0.693359375f;  // ln 2 = hi + lo, hi with few mantissa bits
inline constexpr float kLn2Lo = -2.12194440e-4f;
// 1/k! for k = 7 down to 2 (the polynomial's leading terms 1 + r are added last).
inline constexpr float kExpPoly[6] = {1.0f / 5040, 1.0f / 720, 1.0f / 120,
                                      1.0f / 24,   1.0f / 6,   1.0f / 2};

}  // namespace tierzero::gpt::internal
