// The vector Adam kernels, written once over a traits type V and instantiated by each SIMD
// translation unit (adam_avx2.cc, adam_avx512.cc) with its own intrinsics. Include only there.
//
// V provides: F (vector of V::kLanes floats), Load/Store/Set1/Add/Mul/Fma(a,b,c)=a*b+c/Sqrt/Div,
// LoadGrad(ptr, dtype, i), StoreOut(ptr, dtype, i, F), NonFiniteMask-based AnyNonFinite(F) and
// SumSquaresBlock(F, double accumulators).
#pragma once

#include "cpu_adam/adam_kernels.h"

namespace tierzero::internal {

template <typename V>
void AdamStepBlock(const AdamBlock& b, const AdamScalars& s) {
  using F = typename V::F;
  constexpr size_t L = V::kLanes;
  const F grad_scale = V::Set1(s.grad_scale);
  const F beta1 = V::Set1(s.beta1), beta2 = V::Set1(s.beta2);
  const F omb1 = V::Set1(s.one_minus_beta1), omb2 = V::Set1(s.one_minus_beta2);
  const F eps = V::Set1(s.eps), inv_sqrt_bc2 = V::Set1(s.inv_sqrt_bc2);
  const F neg_step = V::Set1(-s.step_size), l2 = V::Set1(s.l2), decay = V::Set1(s.decay);
  size_t i = 0;
  for (; i + L <= b.n; i += L) {
    F g = V::Mul(V::LoadGrad(b.grad, b.grad_dtype, i), grad_scale);
    F p = V::Load(b.master + i);
    g = V::Fma(l2, p, g);
    const F m = V::Fma(beta1, V::Load(b.m + i), V::Mul(omb1, g));
    const F v = V::Fma(beta2, V::Load(b.v + i), V::Mul(omb2, V::Mul(g, g)));
    const F denom = V::Fma(V::Sqrt(v), inv_sqrt_bc2, eps);
    p = V::Mul(p, decay);
    p = V::Fma(neg_step, V::Div(m, denom), p);
    V::Store(b.master + i, p);
    V::Store(b.m + i, m);
    V::Store(b.v + i, v);
    if (b.out != nullptr) V::StoreOut(b.out, b.out_dtype, i, p);
  }
  for (; i < b.n; ++i) AdamElement(b, s, i);
}

template <typename V>
bool AllFiniteImpl(const void* grad, DType dtype, size_t n) {
  constexpr size_t L = V::kLanes;
  size_t i = 0;
  // Four vectors per check keeps the branch off the critical path.
  for (; i + 4 * L <= n; i += 4 * L) {
    if (V::AnyNonFinite(V::LoadGrad(grad, dtype, i), V::LoadGrad(grad, dtype, i + L),
                        V::LoadGrad(grad, dtype, i + 2 * L), V::LoadGrad(grad, dtype, i + 3 * L))) {
      return false;
    }
  }
  for (; i < n; ++i) {
    if (!std::isfinite(LoadGradScalar(grad, dtype, i))) return false;
  }
  return true;
}

template <typename V>
double SumSquaresImpl(const void* grad, DType dtype, size_t n) {
  constexpr size_t L = V::kLanes;
  typename V::D acc0 = V::ZeroD(), acc1 = V::ZeroD();
  size_t i = 0;
  for (; i + L <= n; i += L) V::AccumulateSquares(V::LoadGrad(grad, dtype, i), acc0, acc1);
  double total = V::ReduceD(acc0, acc1);
  for (; i < n; ++i) {
    const double g = LoadGradScalar(grad, dtype, i);
    total += g * g;
  }
  return total;
}

template <typename V>
constexpr AdamKernels MakeAdamKernels() {
  return AdamKernels{AdamStepBlock<V>, AllFiniteImpl<V>, SumSquaresImpl<V>};
}

}  // namespace tierzero::internal
