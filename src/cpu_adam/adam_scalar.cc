// Scalar Adam kernels: the portable path and the reference the vector paths equal bit for bit.
#include <algorithm>
#include <cmath>

#include "cpu_adam/adam_kernels.h"

namespace tierzero::internal {
namespace {

void StepScalar(const AdamBlock& b, const AdamScalars& s) {
  for (size_t i = 0; i < b.n; ++i) AdamElement(b, s, i);
}

void StepBf16StatesScalar(const AdamBlock& b, const AdamScalars& s) {
  for (size_t i = 0; i < b.n; ++i) AdamElementBf16States(b, s, i);
}

void StepInt8StatesScalar(const AdamBlock& b, const AdamScalars& s) {
  for (size_t i = 0; i < b.n; i += kStateBlockElems)
    AdamInt8StatesBlockScalar(b, s, i, std::min(kStateBlockElems, b.n - i));
}

bool AllFiniteScalar(const void* grad, DType dtype, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(LoadGradScalar(grad, dtype, i))) return false;
  }
  return true;
}

double SumSquaresScalar(const void* grad, DType dtype, size_t n) {
  double total = 0;
  for (size_t i = 0; i < n; ++i) {
    const double g = LoadGradScalar(grad, dtype, i);
    total += g * g;
  }
  return total;
}

}  // namespace

const AdamKernels kAdamScalar = {StepScalar, StepBf16StatesScalar, StepInt8StatesScalar,
                                 AllFiniteScalar, SumSquaresScalar};

}  // namespace tierzero::internal
