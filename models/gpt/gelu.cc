// The GELU's scalar kernels and the choice of level (Note [GELU through one exponential] in
// gelu_kernels.h).
#include "gpt/gelu_kernels.h"
#include "tierzero/simd.h"

namespace tierzero::gpt::internal {
namespace {

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
