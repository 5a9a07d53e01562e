#include <cuda_runtime.h>

#include <string>

#include "cpu_adam/adam_kernels.h"
#include "cpu_adam/gpu_adam.h"
#include "kernels/cuda_status.h"

namespace tierzero {
namespace {

using internal::AdamBlock;
using internal::AdamScalars;

// internal::AdamElement (adam_kernels.h), the CPU paths' element update, one thread per element.
__global__ void AdamKernel(AdamBlock b, AdamScalars s) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < b.n;
       i += size_t{gridDim.x} * blockDim.x)
    internal::AdamElement(b, s, i);
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
  const AdamBlock block{b.master, b.m, b.v, b.grad, b.grad_dtype, b.out, b.out_dtype, b.n};
  AdamKernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(cuda_stream)>>>(block, s);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());  // the launch's own error
  return Status::OK();
}

}  // namespace tierzero
