#include <cuda_runtime.h>

#include <string>

#include "cpu_adam/adam_kernels.h"
#include "cpu_adam/gpu_adam.h"

namespace tierzero {
namespace {

using internal::AdamScalars;

__device__ __forceinline__ float LoadGrad(const void* g, DType t, size_t i) {
  switch (t) {
    case DType::kBF16:
      return BF16ToF32Scalar(static_cast<const uint16_t*>(g)[i]);
    case DType::kF16:
      return F16ToF32Scalar(static_cast<const uint16_t*>(g)[i]);
    default:
      return static_cast<const float*>(g)[i];
  }
}

// internal::AdamElement, operation for operation.
__global__ void AdamKernel(float* __restrict__ master, float* __restrict__ m1,
                           float* __restrict__ v1, const void* __restrict__ grad, DType grad_dtype,
                           void* __restrict__ out, DType out_dtype, size_t n, AdamScalars s) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    float g = LoadGrad(grad, grad_dtype, i) * s.grad_scale;
    float p = master[i];
    g = fmaf(s.l2, p, g);
    const float m = fmaf(s.beta1, m1[i], s.one_minus_beta1 * g);
    const float v = fmaf(s.beta2, v1[i], s.one_minus_beta2 * (g * g));
    const float denom = fmaf(sqrtf(v), s.inv_sqrt_bc2, s.eps);
    p = p * s.decay;
    p = fmaf(-s.step_size, m / denom, p);
    master[i] = p;
    m1[i] = m;
    v1[i] = v;
    if (out != nullptr) {
      static_cast<uint16_t*>(out)[i] =
          out_dtype == DType::kBF16 ? F32ToBF16Scalar(p) : F32ToF16Scalar(p);
    }
  }
}

}  // namespace

bool GpuAdamBuilt() { return true; }

Status GpuAdamStepAsync(const AdamConfig& config, const AdamStepOptions& step, const AdamBuffers& b,
                        void* cuda_stream) {
  if (step.step < 1) return InvalidArgumentError("adam step must be >= 1");
  if (b.grad_dtype != DType::kF32 && b.grad_dtype != DType::kBF16 && b.grad_dtype != DType::kF16)
    return InvalidArgumentError("GPU Adam gradients are fp32, bf16 or fp16");
  if (b.out != nullptr && b.out_dtype != DType::kBF16 && b.out_dtype != DType::kF16)
    return InvalidArgumentError("GPU Adam output copy must be bf16 or fp16");
  if (b.n == 0) return Status::OK();
  if (b.master == nullptr || b.m == nullptr || b.v == nullptr || b.grad == nullptr)
    return InvalidArgumentError("GPU Adam needs master, m, v and grad buffers");
  const AdamScalars s = MakeAdamScalars(config, step);
  constexpr int kThreads = 256;
  const size_t want = (b.n + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want < 65536 * 8 ? want : 65536 * 8);
  AdamKernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(cuda_stream)>>>(
      b.master, b.m, b.v, b.grad, b.grad_dtype, b.out, b.out_dtype, b.n, s);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return InternalError(std::string("GPU Adam launch: ") + cudaGetErrorString(e));
  return Status::OK();
}

}  // namespace tierzero
