// The vector Adam kernels, written once over a traits type V and instantiated by each SIMD
// translation unit (adam_avx2.cc, adam_avx512.cc) with its own intrinsics. Include only there.
//
// V provides: F (vector of V::kLanes floats), Load/Store/Set1/Add/Mul/Fma(a,b,c)=a*b+c/Sqrt/Div,
// LoadGrad(ptr, dtype, i), StoreOut(ptr, dtype, i, F), NonFiniteMask-based AnyNonFinite(F) and
// SumSquaresBlock(F, double accumulators); for the compressed moments I (vector of 32-bit
// integers) with Set1I/Iota/Add32/Sub32/And/Or/Xor/MulLo/Max32/Min32/Srli<n>/Slli<n>/AsI/AsF/
// KeepNonZero(mask, x), Abs/Max/ReduceMax on F, and LoadU8/StoreU8/StoreU16 (zero-extended lanes).
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

// RoundingBits (state_codes.h) on every lane: keys `key` + lane.
template <typename V>
typename V::I HashLanes(uint32_t key, typename V::I step_mix) {
  using I = typename V::I;
  I x = V::Xor(V::MulLo(V::Iota(key), V::Set1I(0x9E3779B1u)), step_mix);
  x = V::Xor(x, V::template Srli<16>(x));
  x = V::MulLo(x, V::Set1I(0x21F0AAADu));
  return V::Xor(x, V::template Srli<15>(x));
}

// The scalars of AdamMath, broadcast once per call.
template <typename V>
struct AdamVectors {
  using F = typename V::F;
  explicit AdamVectors(const AdamScalars& s)
      : grad_scale(V::Set1(s.grad_scale)),
        beta1(V::Set1(s.beta1)),
        beta2(V::Set1(s.beta2)),
        omb1(V::Set1(s.one_minus_beta1)),
        omb2(V::Set1(s.one_minus_beta2)),
        eps(V::Set1(s.eps)),
        inv_sqrt_bc2(V::Set1(s.inv_sqrt_bc2)),
        neg_step(V::Set1(-s.step_size)),
        l2(V::Set1(s.l2)),
        decay(V::Set1(s.decay)) {}
  // AdamMath on L lanes: p, m, v updated from the raw gradient.
  void Math(F graw, F& p, F& m, F& v) const {
    F g = V::Mul(graw, grad_scale);
    g = V::Fma(l2, p, g);
    m = V::Fma(beta1, m, V::Mul(omb1, g));
    v = V::Fma(beta2, v, V::Mul(omb2, V::Mul(g, g)));
    const F denom = V::Fma(V::Sqrt(v), inv_sqrt_bc2, eps);
    p = V::Mul(p, decay);
    p = V::Fma(neg_step, V::Div(m, denom), p);
  }
  F grad_scale, beta1, beta2, omb1, omb2, eps, inv_sqrt_bc2, neg_step, l2, decay;
};

template <typename V>
void AdamStepBlockBf16States(const AdamBlock& b, const AdamScalars& s) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr size_t L = V::kLanes;
  const AdamVectors<V> a(s);
  const I step_mix = V::Set1I(b.step_mix), low16 = V::Set1I(0xFFFFu);
  auto* qm = static_cast<uint16_t*>(b.qm);
  auto* qv = static_cast<uint16_t*>(b.qv);
  size_t i = 0;
  for (; i + L <= b.n; i += L) {
    F p = V::Load(b.master + i);
    F m = V::LoadGrad(qm, DType::kBF16, i);
    F v = V::LoadGrad(qv, DType::kBF16, i);
    a.Math(V::LoadGrad(b.grad, b.grad_dtype, i), p, m, v);
    V::Store(b.master + i, p);
    if (b.out != nullptr) V::StoreOut(b.out, b.out_dtype, i, p);
    const I r = HashLanes<V>(b.key + static_cast<uint32_t>(i), step_mix);
    V::StoreU16(qm + i, V::template Srli<16>(V::Add32(V::AsI(m), V::And(r, low16))));
    V::StoreU16(qv + i, V::template Srli<16>(V::Add32(V::AsI(v), V::template Srli<16>(r))));
  }
  for (; i < b.n; ++i) AdamElementBf16States(b, s, i);
}

// EncodeMagnitude (state_codes.h) on every lane.
template <typename V>
typename V::I EncodeLanes(typename V::F y, typename V::I r20, uint32_t bias, int32_t max_code,
                          int32_t floor) {
  using I = typename V::I;
  const I bits = V::AsI(y);
  I c = V::Sub32(V::template Srli<20>(V::Add32(bits, r20)), V::Set1I(bias));
  c = V::Min32(V::Max32(c, V::Set1I(static_cast<uint32_t>(floor))),
               V::Set1I(static_cast<uint32_t>(max_code)));
  // With floor 0, y = 0 already codes 0: its bits are 0, so c = (r >> 20) - bias < 0.
  return floor == 0 ? c : V::KeepNonZero(bits, c);
}

// DecodeMagnitude on every lane, times the scale.
template <typename V>
typename V::F DecodeLanes(typename V::I c, uint32_t bias, typename V::F scale) {
  const typename V::F f = V::AsF(V::template Slli<20>(V::Add32(c, V::Set1I(bias))));
  return V::Mul(V::AsF(V::KeepNonZero(c, V::AsI(f))), scale);
}

template <typename V>
void AdamStepBlockInt8States(const AdamBlock& b, const AdamScalars& s) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr size_t L = V::kLanes;
  constexpr size_t B = kStateBlockElems;
  static_assert(B % L == 0);
  const AdamVectors<V> a(s);
  const I step_mix = V::Set1I(b.step_mix), low16 = V::Set1I(0xFFFFu);
  const I mag7 = V::Set1I(0x7Fu), sign8 = V::Set1I(0x80u), sign32 = V::Set1I(0x80000000u);
  auto* qm = static_cast<uint8_t*>(b.qm);
  auto* qv = static_cast<uint8_t*>(b.qv);
  size_t begin = 0;
  for (; begin + B <= b.n; begin += B) {
    const size_t k = begin / B;
    const F m_scale = V::Set1(b.m_scale[k]), v_scale = V::Set1(b.v_scale[k]);
    alignas(64) float m_new[B], v_new[B];
    F m_amax = V::Set1(0.0f), v_amax = V::Set1(0.0f);
    for (size_t j = 0; j < B; j += L) {
      const size_t i = begin + j;
      const I cm = V::LoadU8(qm + i);
      F m = DecodeLanes<V>(V::And(cm, mag7), kMBias, m_scale);
      m = V::AsF(V::Or(V::AsI(m), V::template Slli<24>(V::And(cm, sign8))));
      F v = DecodeLanes<V>(V::LoadU8(qv + i), kVBias, v_scale);
      F p = V::Load(b.master + i);
      a.Math(V::LoadGrad(b.grad, b.grad_dtype, i), p, m, v);
      V::Store(b.master + i, p);
      if (b.out != nullptr) V::StoreOut(b.out, b.out_dtype, i, p);
      V::Store(m_new + j, m);
      V::Store(v_new + j, v);
      m_amax = V::Max(m_amax, V::Abs(m));
      v_amax = V::Max(v_amax, v);
    }
    float m_inv, v_inv;
    BlockScale(V::ReduceMax(m_amax), &b.m_scale[k], &m_inv);
    BlockScale(V::ReduceMax(v_amax), &b.v_scale[k], &v_inv);
    const F mi = V::Set1(m_inv), vi = V::Set1(v_inv);
    for (size_t j = 0; j < B; j += L) {
      const size_t i = begin + j;
      const I r = HashLanes<V>(b.key + static_cast<uint32_t>(i), step_mix);
      const F m = V::Load(m_new + j);
      const I cm = EncodeLanes<V>(V::Mul(V::Abs(m), mi), V::template Slli<4>(V::And(r, low16)),
                                  kMBias, kMMaxCode, 0);
      V::StoreU8(qm + i, V::Or(cm, V::template Srli<24>(V::And(V::AsI(m), sign32))));
      const I cv =
          EncodeLanes<V>(V::Mul(V::Load(v_new + j), vi),
                         V::template Slli<4>(V::template Srli<16>(r)), kVBias, kVMaxCode, 1);
      V::StoreU8(qv + i, cv);
    }
  }
  if (begin < b.n) AdamInt8StatesBlockScalar(b, s, begin, b.n - begin);
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
  return AdamKernels{AdamStepBlock<V>, AdamStepBlockBf16States<V>, AdamStepBlockInt8States<V>,
                     AllFiniteImpl<V>, SumSquaresImpl<V>};
}

}  // namespace tierzero::internal
