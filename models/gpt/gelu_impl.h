// The GELU's vector kernels, written once over a traits type V and instantiated by each SIMD
// translation unit (gelu_avx2.cc, gelu_avx512.cc) with its intrinsics. Include only there.
// Note [GELU through one exponential] in gelu_kernels.h.
//
// V provides: F (a vector of V::kLanes floats), I (its integer lanes), Load/Store/Set1, Add/Mul/
// Div/Fma(a, b, c) = a * b + c, Min/Max, RoundNearest, ToInt, and Exponent2(I n) = 2^n as floats.
#pragma once

#include "gpt/gelu_kernels.h"

namespace tierzero::gpt::internal {

template <typename V>
typename V::F GeluExp(typename V::F x) {
  using F = typename V::F;
  x = V::Min(V::Max(x, V::Set1(-kExpClamp)), V::Set1(kExpClamp));
  const F n = V::RoundNearest(V::Mul(x, V::Set1(kLog2e)));
  F r = V::Fma(n, V::Set1(-kLn2Hi), x);
  r = V::Fma(n, V::Set1(-kLn2Lo), r);
  F p = V::Set1(kExpPoly[0]);
  for (int k = 1; k < 6; ++k) p = V::Fma(p, r, V::Set1(kExpPoly[k]));
  const F one = V::Set1(1.0f);
  p = V::Fma(p, r, one);
  p = V::Fma(p, r, one);
  return V::Mul(p, V::Exponent2(V::ToInt(n)));
}

template <typename V>
typename V::F MinusTwoU(typename V::F x) {
  const auto inner = V::Fma(V::Mul(V::Set1(kGeluCubic), x), x, V::Set1(1.0f));
  return V::Mul(V::Mul(V::Set1(-2.0f * kGeluSqrt2OverPi), x), inner);
}

template <typename V>
void GeluForwardImpl(const float* x, float* y, int64_t n) {
  constexpr int64_t L = V::kLanes;
  const auto one = V::Set1(1.0f);
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const auto v = V::Load(x + i);
    const auto e = GeluExp<V>(MinusTwoU<V>(v));
    V::Store(y + i, V::Div(v, V::Add(one, e)));
  }
  kGeluScalar.forward(x + i, y + i, n - i);  // the tail: the same operations, one at a time
}

template <typename V>
void GeluBackwardImpl(const float* dy, const float* x, float* dx, int64_t n) {
  constexpr int64_t L = V::kLanes;
  const auto one = V::Set1(1.0f);
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const auto v = V::Load(x + i);
    const auto e = GeluExp<V>(MinusTwoU<V>(v));
    const auto s = V::Div(one, V::Add(one, e));
    const auto two_du = V::Mul(V::Set1(2.0f * kGeluSqrt2OverPi),
                               V::Fma(V::Mul(V::Set1(3.0f * kGeluCubic), v), v, one));
    // s (1 + 2 x u' t), t = e s = 1 - s (in [0, 1], so nothing overflows)
    const auto g = V::Mul(s, V::Fma(V::Mul(v, two_du), V::Mul(e, s), one));
    V::Store(dx + i, V::Mul(V::Load(dy + i), g));
  }
  kGeluScalar.backward(dy + i, x + i, dx + i, n - i);
}

template <typename V>
constexpr GeluKernels MakeGeluKernels() {
  return GeluKernels{GeluForwardImpl<V>, GeluBackwardImpl<V>};
}

}  // namespace tierzero::gpt::internal
