// The scalar kernels and the choice of level (Note [GELU through one exponential] and Note
// [Softmax rows in sixteen partial sums] in vec_kernels.h).
#include "gpt/vec_kernels.h"

#include <cmath>
#include <cstring>

#include "tierzero/simd.h"

namespace tierzero::gpt::internal {

float ExpScalar(float x) {
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

namespace {

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
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] / (1.0f + ExpScalar(GeluMinusTwoU(x[i])));
}

void BackwardScalar(const float* dy, const float* x, float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float e = ExpScalar(GeluMinusTwoU(v));
    const float s = 1.0f / (1.0f + e);
    dx[i] = dy[i] * (s * std::fmaf(v * GeluTwoDu(v), e * s, 1.0f));
  }
}

// The sum of Note [Softmax rows in sixteen partial sums], as the vector code adds: a[i] b[i]
// (b null: a[i]) into partial i mod 16, then the partials in order.
float SumInSixteenPartials(const float* a, const float* b, int64_t n) {
  float partial[kSoftmaxPartials] = {};
  for (int64_t i = 0; i < n; ++i) {
    float& p = partial[i % kSoftmaxPartials];
    p = b == nullptr ? p + a[i] : std::fma(a[i], b[i], p);
  }
  float sum = partial[0];
  for (int64_t q = 1; q < kSoftmaxPartials; ++q) sum += partial[q];
  return sum;
}

void SoftmaxForwardScalar(float* row, int64_t n) {
  float mx = row[0];
  for (int64_t i = 1; i < n; ++i) mx = std::fmax(mx, row[i]);
  for (int64_t i = 0; i < n; ++i) row[i] = ExpScalar(row[i] - mx);
  const float inv = 1.0f / SumInSixteenPartials(row, nullptr, n);
  for (int64_t i = 0; i < n; ++i) row[i] *= inv;
}

void SoftmaxBackwardScalar(const float* p, float* ds, int64_t n, float scale) {
  const float dot = SumInSixteenPartials(p, ds, n);
  for (int64_t i = 0; i < n; ++i) ds[i] = p[i] * (ds[i] - dot) * scale;
}

void SwigluForwardScalar(const float* g, const float* u, float* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = g[i];
    h[i] = (v / (1.0f + ExpScalar(0.0f - v))) * u[i];
  }
}

void SwigluBackwardScalar(const float* dh, const float* g, const float* u, float* dg, float* du,
                          int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = g[i], d = dh[i], uu = u[i];
    const float e = ExpScalar(0.0f - v);
    const float s = 1.0f / (1.0f + e);
    dg[i] = ((d * uu) * s) * std::fmaf(v, e * s, 1.0f);
    du[i] = d * (v * s);
  }
}

float DotScalar(const float* a, const float* b, int64_t n) { return SumInSixteenPartials(a, b, n); }

}  // namespace

const VectorKernels kVecScalar = {ForwardScalar,
                                  BackwardScalar,
                                  SoftmaxForwardScalar,
                                  SoftmaxBackwardScalar,
                                  SwigluForwardScalar,
                                  SwigluBackwardScalar,
                                  DotScalar};

const VectorKernels& ActiveVectorKernels() {
  switch (ActiveSimdLevel()) {
    case SimdLevel::kAvx512:
      return kVecAvx512;
    case SimdLevel::kAvx2:
      return kVecAvx2;
    case SimdLevel::kScalar:
      break;
  }
  return kVecScalar;
}

}  // namespace tierzero::gpt::internal
