// The GPT's element-wise fp32 kernels per SIMD level: the GELU and the rows of the causal softmax
// (internal to models/gpt; ops.cc dispatches on ActiveSimdLevel(), as CPU Adam does).
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
//
// Note [Softmax rows in sixteen partial sums]
// Attention's softmax (forward: p = exp(s - max) / sum; backward: ds = p (dp - <p, dp>) scale)
// runs on each causal row's first t + 1 entries, through the exponential above (the clamp at -80
// only raises entries below e^-80 of the row's largest, far under fp32's resolution of the sum).
// libm's scalar expf and the loops' dependent sums were about 4% of a 128-token step. The sums
// are vectorised without making the result depend on the vector width: element i is added into
// partial sum i mod 16, in order of i, and the sixteen partials are then added in order 0..15 --
// AVX-512 holds the partials in one register, AVX2 in two, the scalar code in an array, and each
// does the same additions, so every level gives bit-identical rows.
//
// Note [SwiGLU and RMSNorm through the same kernels]
// Llama's element-wise work on the CPU: SwiGLU's silu(g) = g / (1 + e), e = exp(-g), through the
// exponential above (its clamp: beyond |g| = 80, silu is g or 0 to far below fp32's resolution),
// with its derivative s (1 + g t), s = 1 / (1 + e), t = 1 - s formed as e s (as the GELU's); and
// RMSNorm's sums of squares and of products through the sixteen partial sums. libm's scalar expf
// and the dependent sums were about 11% of a Llama step on the CPU (4 x 256, 8 x 128 tokens,
// perf); every SIMD level gives the same bits, as for the GELU.
#pragma once

#include <cstdint>

namespace tierzero::gpt::internal {

struct VectorKernels {
  void (*gelu_forward)(const float* x, float* y, int64_t n);
  void (*gelu_backward)(const float* dy, const float* x, float* dx, int64_t n);
  // row[0, n) := its softmax, in place (n >= 1).
  void (*softmax_forward)(float* row, int64_t n);
  // ds[i] := p[i] (ds[i] - sum_j p[j] ds[j]) scale for i < n: the softmax's backward, dp in ds.
  void (*softmax_backward)(const float* p, float* ds, int64_t n, float scale);
  // Llama's SwiGLU (Note [SwiGLU and RMSNorm through the same kernels]): h := silu(g) u;
  // dg, du from dh (dh may be dg or du: each element is read before it is written).
  void (*swiglu_forward)(const float* g, const float* u, float* h, int64_t n);
  void (*swiglu_backward)(const float* dh, const float* g, const float* u, float* dg, float* du,
                          int64_t n);
  // sum_i a[i] b[i] in the order of Note [Softmax rows in sixteen partial sums] (RMSNorm's sums).
  float (*dot)(const float* a, const float* b, int64_t n);
};

extern const VectorKernels kVecScalar;
extern const VectorKernels kVecAvx2;
extern const VectorKernels kVecAvx512;

// The kernels of ActiveSimdLevel() (TZ_SIMD).
const VectorKernels& ActiveVectorKernels();

// The exponential of Note [GELU through one exponential] on one float, operation for operation as
// the vector one (vec_impl.h).
float ExpScalar(float x);

// The partial sums of Note [Softmax rows in sixteen partial sums].
inline constexpr int64_t kSoftmaxPartials = 16;

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
