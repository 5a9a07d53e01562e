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

// AdamElementBf16States: bf16 moments, one thread per element.
__global__ void AdamBf16StatesKernel(AdamBlock b, AdamScalars s) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < b.n;
       i += size_t{gridDim.x} * blockDim.x)
    internal::AdamElementBf16States(b, s, i);
}

// 8-bit moments (AdamInt8StatesBlockScalar's math): one warp per block of 64 elements, two per
// lane; the block's largest magnitudes by shuffles (a maximum: any order gives the same value).
__global__ void AdamInt8StatesKernel(AdamBlock b, AdamScalars s) {
  constexpr unsigned kAll = 0xFFFFFFFFu;
  const int lane = threadIdx.x & 31;
  const size_t warp = (blockIdx.x * size_t{blockDim.x} + threadIdx.x) / 32;
  const size_t warps = size_t{gridDim.x} * (blockDim.x / 32);
  const size_t blocks = (b.n + internal::kStateBlockElems - 1) / internal::kStateBlockElems;
  auto* qm = static_cast<uint8_t*>(b.qm);
  auto* qv = static_cast<uint8_t*>(b.qv);
  for (size_t k = warp; k < blocks; k += warps) {
    float m_new[2] = {0, 0}, v_new[2] = {0, 0};
    float m_amax = 0, v_amax = 0;
    for (int h = 0; h < 2; ++h) {
      const size_t i = k * internal::kStateBlockElems + h * 32 + lane;
      if (i >= b.n) continue;
      float p = b.master[i];
      float m = internal::DecodeM(qm[i], b.m_scale[k]);
      float v = internal::DecodeV(qv[i], b.v_scale[k]);
      internal::AdamMath(internal::LoadGradScalar(b.grad, b.grad_dtype, i), s, p, m, v);
      b.master[i] = p;
      internal::StoreOutScalar(b, i, p);
      m_new[h] = m;
      v_new[h] = v;
      m_amax = fmaxf(m_amax, internal::AbsBits(m));
      v_amax = fmaxf(v_amax, v);
    }
    for (int off = 16; off > 0; off /= 2) {
      m_amax = fmaxf(m_amax, __shfl_xor_sync(kAll, m_amax, off));
      v_amax = fmaxf(v_amax, __shfl_xor_sync(kAll, v_amax, off));
    }
    float m_scale, m_inv, v_scale, v_inv;
    internal::BlockScale(m_amax, &m_scale, &m_inv);
    internal::BlockScale(v_amax, &v_scale, &v_inv);
    __syncwarp();  // every lane has read the old scales
    if (lane == 0) {
      b.m_scale[k] = m_scale;
      b.v_scale[k] = v_scale;
    }
    for (int h = 0; h < 2; ++h) {
      const size_t i = k * internal::kStateBlockElems + h * 32 + lane;
      if (i >= b.n) continue;
      const uint32_t r = internal::RoundingBits(b.key + static_cast<uint32_t>(i), b.step_mix);
      qm[i] = internal::EncodeM(m_new[h], m_inv, r & 0xFFFFu);
      qv[i] = internal::EncodeV(v_new[h], v_inv, r >> 16);
    }
  }
}

// Block b's sum of the squares of the elements b, b + blocks, ... (a grid-stride loop per
// thread, then a tree over the block's threads in shared memory): fixed for a given grid.
constexpr int kSumThreads = 256;
__global__ void SumSquaresKernel(const void* grad, DType dtype, size_t n, double* parts) {
  __shared__ double acc[kSumThreads];
  double s = 0;
  for (size_t i = blockIdx.x * size_t{kSumThreads} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * kSumThreads) {
    const double g = internal::LoadGradScalar(grad, dtype, i);
    s += g * g;
  }
  acc[threadIdx.x] = s;
  __syncthreads();
  for (int half = kSumThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) acc[threadIdx.x] += acc[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) parts[blockIdx.x] = acc[0];
}

}  // namespace

Status GpuSumSquaresAsync(const void* grad, DType dtype, size_t n, double* parts, int num_parts,
                          void* cuda_stream) {
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16)
    return InvalidArgumentError("a gradient's sum of squares takes fp32, bf16 or fp16");
  if (num_parts < 1 || parts == nullptr) return InvalidArgumentError("no parts for the sum");
  SumSquaresKernel<<<static_cast<unsigned>(num_parts), kSumThreads, 0,
                     static_cast<cudaStream_t>(cuda_stream)>>>(grad, dtype, n, parts);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::OK();
}

bool GpuAdamBuilt() { return true; }

Status GpuAdamStepAsync(const AdamConfig& config, const AdamStepOptions& step, const AdamBuffers& b,
                        void* cuda_stream) {
  if (step.step < 1) return InvalidArgumentError("adam step must be >= 1");
  if (b.grad_dtype != DType::kF32 && b.grad_dtype != DType::kBF16 && b.grad_dtype != DType::kF16)
    return InvalidArgumentError("GPU Adam gradients are fp32, bf16 or fp16");
  if (b.out != nullptr && b.out_dtype != DType::kBF16 && b.out_dtype != DType::kF16)
    return InvalidArgumentError("GPU Adam output copy must be bf16 or fp16");
  if (b.n == 0) return Status::OK();
  if (b.master == nullptr || b.grad == nullptr)
    return InvalidArgumentError("GPU Adam needs master and grad buffers");
  if (b.states == StateFormat::kNone)
    return InvalidArgumentError("GPU Adam needs moments: states held without them never step");
  if (b.states == StateFormat::kF32
          ? (b.m == nullptr || b.v == nullptr)
          : (b.m_state == nullptr || b.v_state == nullptr ||
             (b.states == StateFormat::kInt8 && (b.m_scale == nullptr || b.v_scale == nullptr))))
    return InvalidArgumentError("GPU Adam needs the moments' buffers");
  const AdamScalars s = MakeAdamScalars(config, step);
  constexpr int kThreads = 256;
  const size_t want = (b.n + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want < 65536 * 8 ? want : 65536 * 8);
  AdamBlock block{b.master, b.m, b.v, b.grad, b.grad_dtype, b.out, b.out_dtype, b.n};
  block.qm = b.m_state;
  block.qv = b.v_state;
  block.m_scale = b.m_scale;
  block.v_scale = b.v_scale;
  block.key = b.rounding_key;
  block.step_mix = internal::StepMix(step.step);
  auto stream = static_cast<cudaStream_t>(cuda_stream);
  switch (b.states) {
    case StateFormat::kF32:
      AdamKernel<<<blocks, kThreads, 0, stream>>>(block, s);
      break;
    case StateFormat::kBF16:
      AdamBf16StatesKernel<<<blocks, kThreads, 0, stream>>>(block, s);
      break;
    case StateFormat::kInt8: {
      // A warp per 64 elements.
      const size_t warps = (b.n + internal::kStateBlockElems - 1) / internal::kStateBlockElems;
      const size_t grid = (warps * 32 + kThreads - 1) / kThreads;
      AdamInt8StatesKernel<<<static_cast<unsigned>(grid < 65536 * 8 ? grid : 65536 * 8), kThreads,
                             0, stream>>>(block, s);
      break;
    }
    case StateFormat::kNone:  // (refused above)
      break;
  }
  CUDA_RETURN_IF_ERROR(cudaGetLastError());  // the launch's own error
  return Status::OK();
}

}  // namespace tierzero
