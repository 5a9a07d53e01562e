// The GELU's scalar kernels and the choice of level (Note [GELU through one exponential] in
// gelu_kernels.h).
#include <cmath>
#include <cstring>

#include "gpt/gelu_kernels.h"
#include "tierzero/simd.h"

namespace tierzero::gpt::internal {
namespace {

// The scalar exponential, operation for operation as the vector one in gelu_impl.h.
float GeluExpScalar(float x) {
  x = std::fmin(std::fmax(x, -kExpClamp), kExpClamp);
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fmaf(n, -kLn2Hi, x);
  r = std::fmaf(n, -kLn2Lo, r);
  float p = kExpPoly[0];
  for (int k = 1; k < 6; ++k) p = std::fmaf(p, r, kExpPoly[k]);
  p = std::fmaf(p, r, 1.0f);
  p = std::fmaf(p, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// -2u of the GELU for x, as the vector code computes it: -2 c x (1 + k x^2).
float GeluMinusTwoU(float x) {
  const float inner = std::fmaf(kGeluCubic * x, x, 1.0f);
  return (-2.0f * kGeluSqrt2OverPi) * x * inner;
}

// 2 u' = 2 c (1 + 3 k x^2).
float GeluTwoDu(float x) {
  return (2.0f * kGeluSqrt2OverPi) * std::fmaf(3.0f * kGeluCubic * x, x, 1.0f);
}

void ForwardScalar(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] / (1.0f + GeluExpScalar(GeluMinusTwoU(x[i])));
}

void BackwardScalar(const float* dy, const float* x, float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float e = GeluExpScalar(GeluMinusTwoU(v));
    const float s = 1.0f / (1.0f + e);
    dx[i] = dy[i] * (s * std::fmaf(v * GeluTwoDu(v), e * s, 1.0f));
  }
}

}  // namespace

const GeluKernels kGeluScalar = {ForwardScalar, BackwardScalar};

const GeluKernels& ActiveGeluKernels() {
  switch (ActiveSimdLevel()) {
    case SimdLevel::kAvx512:
      return kGeluAvx512;
    case SimdLevel::kAvx2:
      return kGeluAvx2;
    case SimdLevel::kScalar:
      break;
  }
  return kGeluScalar;
}

}  // namespace tierzero::gpt::internal
