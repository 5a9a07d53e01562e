// Per-SIMD-level Adam kernels (internal to cpu_adam). Each works on one block of elements.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/convert.h"
#include "cpu_adam/state_codes.h"
#include "tierzero/types.h"

namespace tierzero::internal {

// Scalars derived once per step from the config and the step options.
struct AdamScalars {
  float grad_scale;
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2;
  float eps;
  float step_size;     // lr / (1 - beta1^t)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^t)
  float l2;            // weight_decay for Adam, 0 for AdamW
  float decay;         // 1 - lr * weight_decay for AdamW, 1 for Adam
  bool adamw;
};

struct AdamBlock {
  float* master;
  float* m;  // fp32 moments (StateFormat::kF32)
  float* v;
  const void* grad;  // already offset to the block
  DType grad_dtype;
  void* out;  // already offset to the block, or null
  DType out_dtype;
  size_t n;
  // Compressed moments (state_codes.h), already offset to the block: bf16 (uint16_t) or 8-bit
  // codes (uint8_t) with one scale per kStateBlockElems elements from the block's start.
  void* qm = nullptr;
  void* qv = nullptr;
  float* m_scale = nullptr;
  float* v_scale = nullptr;
  uint32_t key = 0;       // the block's first element's rounding key (RoundingBits)
  uint32_t step_mix = 0;  // StepMix(step)
};

struct AdamKernels {
  void (*step)(const AdamBlock& block, const AdamScalars& s);
  // The same with bf16 moments, and with 8-bit moments (block.n a multiple of kStateBlockElems
  // but for the buffers' last block).
  void (*step_bf16_states)(const AdamBlock& block, const AdamScalars& s);
  void (*step_int8_states)(const AdamBlock& block, const AdamScalars& s);
  // Number of non-finite elements is not needed: true when all are finite.
  bool (*all_finite)(const void* grad, DType dtype, size_t n);
  double (*sum_squares)(const void* grad, DType dtype, size_t n);
};

extern const AdamKernels kAdamScalar;
extern const AdamKernels kAdamAvx2;
extern const AdamKernels kAdamAvx512;
extern const AdamKernels kAdamAvx512Bf16;

// ---- The scalar element update, shared by every path's tail ------------------------------------
// `static inline`: see Note [Internal linkage for helpers of SIMD files] in core/convert.h.
// The operation order and the fused multiply-adds match the vector code lane for lane, and the
// GPU kernel runs this very function.

TZ_HOST_DEVICE static inline float LoadGradScalar(const void* grad, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kBF16:
      return BF16ToF32Scalar(static_cast<const uint16_t*>(grad)[i]);
    case DType::kF16:
      return F16ToF32Scalar(static_cast<const uint16_t*>(grad)[i]);
    default:
      return static_cast<const float*>(grad)[i];
  }
}

// One element's AdamW on fp32 values: the moments and the parameter updated in place from the
// raw gradient. The fp32, bf16-state and 8-bit-state paths all run exactly this.
TZ_HOST_DEVICE static inline void AdamMath(float graw, const AdamScalars& s, float& p, float& m,
                                           float& v) {
  float g = graw * s.grad_scale;
  g = fmaf(s.l2, p, g);
  m = fmaf(s.beta1, m, s.one_minus_beta1 * g);
  v = fmaf(s.beta2, v, s.one_minus_beta2 * (g * g));
  const float denom = fmaf(sqrtf(v), s.inv_sqrt_bc2, s.eps);
  p = p * s.decay;
  p = fmaf(-s.step_size, m / denom, p);
}

TZ_HOST_DEVICE static inline void StoreOutScalar(const AdamBlock& b, size_t i, float p) {
  if (b.out != nullptr) {
    static_cast<uint16_t*>(b.out)[i] =
        b.out_dtype == DType::kBF16 ? F32ToBF16Scalar(p) : F32ToF16Scalar(p);
  }
}

// Also the GPU kernel's body (gpu_adam.cu): fmaf and sqrtf are the IEEE operations on both.
TZ_HOST_DEVICE static inline void AdamElement(const AdamBlock& b, const AdamScalars& s, size_t i) {
  float p = b.master[i], m = b.m[i], v = b.v[i];
  AdamMath(LoadGradScalar(b.grad, b.grad_dtype, i), s, p, m, v);
  b.master[i] = p;
  b.m[i] = m;
  b.v[i] = v;
  StoreOutScalar(b, i, p);
}

// Element i with bf16 moments (Note [Stochastic rounding of the moments]).
TZ_HOST_DEVICE static inline void AdamElementBf16States(const AdamBlock& b, const AdamScalars& s,
                                                        size_t i) {
  auto* qm = static_cast<uint16_t*>(b.qm);
  auto* qv = static_cast<uint16_t*>(b.qv);
  float p = b.master[i], m = BF16ToF32Scalar(qm[i]), v = BF16ToF32Scalar(qv[i]);
  AdamMath(LoadGradScalar(b.grad, b.grad_dtype, i), s, p, m, v);
  const uint32_t r = RoundingBits(b.key + static_cast<uint32_t>(i), b.step_mix);
  b.master[i] = p;
  qm[i] = Bf16Stochastic(m, r & 0xFFFFu);
  qv[i] = Bf16Stochastic(v, r >> 16);
  StoreOutScalar(b, i, p);
}

// The 8-bit block of `len` (<= kStateBlockElems) elements at `begin` (a multiple of
// kStateBlockElems): decoded with its scales, updated, re-scaled and coded (Note [8-bit moment
// codes]). `m_new` and `v_new` hold the block's new moments between the two passes.
static inline void AdamInt8StatesBlockScalar(const AdamBlock& b, const AdamScalars& s, size_t begin,
                                             size_t len) {
  auto* qm = static_cast<uint8_t*>(b.qm);
  auto* qv = static_cast<uint8_t*>(b.qv);
  const size_t k = begin / kStateBlockElems;
  float m_new[kStateBlockElems], v_new[kStateBlockElems];
  float m_amax = 0, v_amax = 0;
  for (size_t j = 0; j < len; ++j) {
    const size_t i = begin + j;
    float p = b.master[i], m = DecodeM(qm[i], b.m_scale[k]), v = DecodeV(qv[i], b.v_scale[k]);
    AdamMath(LoadGradScalar(b.grad, b.grad_dtype, i), s, p, m, v);
    b.master[i] = p;
    StoreOutScalar(b, i, p);
    m_new[j] = m;
    v_new[j] = v;
    m_amax = fmaxf(m_amax, AbsBits(m));
    v_amax = fmaxf(v_amax, v);
  }
  float m_inv, v_inv;
  BlockScale(m_amax, &b.m_scale[k], &m_inv);
  BlockScale(v_amax, &b.v_scale[k], &v_inv);
  for (size_t j = 0; j < len; ++j) {
    const size_t i = begin + j;
    const uint32_t r = RoundingBits(b.key + static_cast<uint32_t>(i), b.step_mix);
    qm[i] = EncodeM(m_new[j], m_inv, r & 0xFFFFu);
    qv[i] = EncodeV(v_new[j], v_inv, r >> 16);
  }
}

}  // namespace tierzero::internal
