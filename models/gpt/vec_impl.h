// The GPT's vector kernels, written once over a traits type V and instantiated by each SIMD
// translation unit (vec_avx2.cc, vec_avx512.cc) with its intrinsics. Include only there.
// Note [GELU through one exponential] and Note [Softmax rows in sixteen partial sums] in
// vec_kernels.h.
//
// V provides: F (a vector of V::kLanes floats), I (its integer lanes), Load/Store/Set1, Add/Sub/
// Mul/Div/Fma(a, b, c) = a * b + c, Min/Max, ReduceMax, RoundNearest, ToInt, and Exponent2(I n) =
// 2^n as floats.
#pragma once

#include "gpt/vec_kernels.h"

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
  kVecScalar.gelu_forward(x + i, y + i, n - i);  // the tail: the same operations, one at a time
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
  kVecScalar.gelu_backward(dy + i, x + i, dx + i, n - i);
}

// Scalar helpers with internal linkage (Note [Internal linkage for helpers of SIMD files] in
// core/convert.h): std::max and std::fma are inline functions the linker may merge with a copy
// compiled for another instruction set.
static inline float ScalarMax(float a, float b) { return a < b ? b : a; }
static inline float ScalarFma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

// The in-order sum of Note [Softmax rows in sixteen partial sums] of the products a[i] b[i] (b
// null: of a[i]) for i < n.
template <typename V>
float SumInSixteenPartials(const float* a, const float* b, int64_t n) {
  constexpr int64_t L = V::kLanes, kAcc = kSoftmaxPartials / L;
  static_assert(kAcc * L == kSoftmaxPartials);
  typename V::F acc[kAcc];
  for (auto& x : acc) x = V::Set1(0.0f);
  int64_t i = 0;
  for (; i + kSoftmaxPartials <= n; i += kSoftmaxPartials) {
    for (int64_t q = 0; q < kAcc; ++q) {
      const auto x = V::Load(a + i + q * L);
      acc[q] = b == nullptr ? V::Add(acc[q], x) : V::Fma(x, V::Load(b + i + q * L), acc[q]);
    }
  }
  float partial[kSoftmaxPartials];
  for (int64_t q = 0; q < kAcc; ++q) V::Store(partial + q * L, acc[q]);
  for (; i < n; ++i) {
    float& p = partial[i % kSoftmaxPartials];
    p = b == nullptr ? p + a[i] : ScalarFma(a[i], b[i], p);
  }
  float sum = partial[0];
  for (int64_t q = 1; q < kSoftmaxPartials; ++q) sum += partial[q];
  return sum;
}

template <typename V>
void SoftmaxForwardImpl(float* row, int64_t n) {
  constexpr int64_t L = V::kLanes;
  int64_t i = 0;
  float mx = row[0];
  if (n >= L) {  // the maximum is exact in any order
    auto m = V::Load(row);
    for (i = L; i + L <= n; i += L) m = V::Max(m, V::Load(row + i));
    mx = ScalarMax(mx, V::ReduceMax(m));
  }
  for (; i < n; ++i) mx = ScalarMax(mx, row[i]);
  const auto vmx = V::Set1(mx);
  for (i = 0; i + L <= n; i += L) V::Store(row + i, GeluExp<V>(V::Sub(V::Load(row + i), vmx)));
  for (; i < n; ++i) row[i] = ExpScalar(row[i] - mx);
  const float inv = 1.0f / SumInSixteenPartials<V>(row, nullptr, n);
  const auto vinv = V::Set1(inv);
  for (i = 0; i + L <= n; i += L) V::Store(row + i, V::Mul(V::Load(row + i), vinv));
  for (; i < n; ++i) row[i] *= inv;
}

template <typename V>
void SoftmaxBackwardImpl(const float* p, float* ds, int64_t n, float scale) {
  constexpr int64_t L = V::kLanes;
  const float dot = SumInSixteenPartials<V>(p, ds, n);
  const auto vdot = V::Set1(dot), vscale = V::Set1(scale);
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const auto d = V::Mul(V::Load(p + i), V::Sub(V::Load(ds + i), vdot));
    V::Store(ds + i, V::Mul(d, vscale));
  }
  for (; i < n; ++i) ds[i] = p[i] * (ds[i] - dot) * scale;
}

template <typename V>
void SwigluForwardImpl(const float* g, const float* u, float* h, int64_t n) {
  constexpr int64_t L = V::kLanes;
  const auto one = V::Set1(1.0f), zero = V::Set1(0.0f);
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const auto v = V::Load(g + i);
    const auto e = GeluExp<V>(V::Sub(zero, v));
    V::Store(h + i, V::Mul(V::Div(v, V::Add(one, e)), V::Load(u + i)));
  }
  kVecScalar.swiglu_forward(g + i, u + i, h + i, n - i);
}

template <typename V>
void SwigluBackwardImpl(const float* dh, const float* g, const float* u, float* dg, float* du,
                        int64_t n) {
  constexpr int64_t L = V::kLanes;
  const auto one = V::Set1(1.0f), zero = V::Set1(0.0f);
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const auto v = V::Load(g + i), d = V::Load(dh + i), uu = V::Load(u + i);
    const auto e = GeluExp<V>(V::Sub(zero, v));
    const auto s = V::Div(one, V::Add(one, e));
    // d u s (1 + g t), t = e s; d silu(g), silu = g s
    V::Store(dg + i, V::Mul(V::Mul(V::Mul(d, uu), s), V::Fma(v, V::Mul(e, s), one)));
    V::Store(du + i, V::Mul(d, V::Mul(v, s)));
  }
  kVecScalar.swiglu_backward(dh + i, g + i, u + i, dg + i, du + i, n - i);
}

template <typename V>
float DotImpl(const float* a, const float* b, int64_t n) {
  return SumInSixteenPartials<V>(a, b, n);
}

template <typename V>
constexpr VectorKernels MakeVectorKernels() {
  return VectorKernels{GeluForwardImpl<V>,
                       GeluBackwardImpl<V>,
                       SoftmaxForwardImpl<V>,
                       SoftmaxBackwardImpl<V>,
                       SwigluForwardImpl<V>,
                       SwigluBackwardImpl<V>,
                       DotImpl<V>};
}

}  // namespace tierzero::gpt::internal
