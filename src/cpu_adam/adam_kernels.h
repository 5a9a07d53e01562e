// Per-SIMD-level Adam kernels (internal to cpu_adam). Each works on one block of elements.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/convert.h"
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
  float* m;
  float* v;
  const void* grad;  // already offset to the block
  DType grad_dtype;
  void* out;  // already offset to the block, or null
  DType out_dtype;
  size_t n;
};

struct AdamKernels {
  void (*step)(const AdamBlock& block, const AdamScalars& s);
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

// Also the GPU kernel's body (gpu_adam.cu): fmaf and sqrtf are the IEEE operations on both.
TZ_HOST_DEVICE static inline void AdamElement(const AdamBlock& b, const AdamScalars& s, size_t i) {
  float g = LoadGradScalar(b.grad, b.grad_dtype, i) * s.grad_scale;
  float p = b.master[i];
  g = fmaf(s.l2, p, g);
  const float m = fmaf(s.beta1, b.m[i], s.one_minus_beta1 * g);
  const float v = fmaf(s.beta2, b.v[i], s.one_minus_beta2 * (g * g));
  const float denom = fmaf(sqrtf(v), s.inv_sqrt_bc2, s.eps);
  p = p * s.decay;
  p = fmaf(-s.step_size, m / denom, p);
  b.master[i] = p;
  b.m[i] = m;
  b.v[i] = v;
  if (b.out != nullptr) {
    static_cast<uint16_t*>(b.out)[i] =
        b.out_dtype == DType::kBF16 ? F32ToBF16Scalar(p) : F32ToF16Scalar(p);
  }
}

}  // namespace tierzero::internal
