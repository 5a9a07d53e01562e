// CudaOps' conversions between the float types and its stream-ordered copies
// (gpt/ops_cuda.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "gpt/kernels_cuda.cuh"
#include "gpt/ops_cuda.h"
#include "gpt/ops_cuda_impl.cuh"

namespace tierzero::gpt::cuda {
namespace {

template <typename In, typename Op>
__global__ void WidenKernel(const In* src, float* dst, int64_t n, Op op) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = op(src[i]);
}
template <typename Out, typename Op>
__global__ void NarrowKernel(const float* src, Out* dst, int64_t n, Op op) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = op(src[i]);
}
// dst = round(widen(dst) + src)
template <typename T, typename From, typename To>
__global__ void AccumulateKernel(const float* src, T* dst, int64_t n, From from, To to) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = to(from(dst[i]) + src[i]);
}
struct FromBF16 {
  __device__ float operator()(__nv_bfloat16 v) const { return __bfloat162float(v); }
};
struct FromF16 {
  __device__ float operator()(__half v) const { return __half2float(v); }
};
struct ToBF16 {
  __device__ __nv_bfloat16 operator()(float v) const { return __float2bfloat16_rn(v); }
};
struct ToF16 {
  __device__ __half operator()(float v) const { return __float2half_rn(v); }
};

struct Identity {
  __device__ float operator()(float v) const { return v; }
};

}  // namespace

void CudaOps::Zero(void* dst, uint64_t bytes) {
  impl_->Check(cudaMemsetAsync(dst, 0, bytes, impl_->stream), "cudaMemsetAsync");
}

void CudaOps::Copy(void* dst, const void* src, uint64_t bytes) {
  impl_->Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, impl_->stream),
               "cudaMemcpyAsync (device to device)");
}

Status CudaOps::Upload(void* dst, const void* host, uint64_t bytes) {
  impl_->Check(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, impl_->stream),
               "cudaMemcpyAsync (upload)");
  impl_->Check(cudaStreamSynchronize(impl_->stream), "cudaStreamSynchronize");
  return impl_->first_error;
}

Status CudaOps::Download(void* host, const void* src, uint64_t bytes) {
  impl_->Check(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, impl_->stream),
               "cudaMemcpyAsync (download)");
  impl_->Check(cudaStreamSynchronize(impl_->stream), "cudaStreamSynchronize");
  return impl_->first_error;
}

Status CudaOps::Widen(const void* src, DType src_type, float* dst, int64_t n) {
  switch (src_type) {
    case DType::kF32:
      impl_->Check(
          cudaMemcpyAsync(dst, src, sizeof(float) * n, cudaMemcpyDeviceToDevice, impl_->stream),
          "cudaMemcpyAsync (widen fp32)");
      break;
    case DType::kBF16:
      WidenKernel<<<Blocks(n), kThreads, 0, impl_->stream>>>(static_cast<const __nv_bfloat16*>(src),
                                                             dst, n, FromBF16{});
      break;
    case DType::kF16:
      WidenKernel<<<Blocks(n), kThreads, 0, impl_->stream>>>(static_cast<const __half*>(src), dst,
                                                             n, FromF16{});
      break;
    default:
      return InvalidArgumentError("Widen: the source must be fp32, bf16 or fp16");
  }
  impl_->CheckLaunch("WidenKernel");
  return impl_->first_error;
}

Status CudaOps::Narrow(const float* src, void* dst, DType dst_type, int64_t n) {
  switch (dst_type) {
    case DType::kF32:
      impl_->Check(
          cudaMemcpyAsync(dst, src, sizeof(float) * n, cudaMemcpyDeviceToDevice, impl_->stream),
          "cudaMemcpyAsync (narrow fp32)");
      break;
    case DType::kBF16:
      NarrowKernel<<<Blocks(n), kThreads, 0, impl_->stream>>>(src, static_cast<__nv_bfloat16*>(dst),
                                                              n, ToBF16{});
      break;
    case DType::kF16:
      NarrowKernel<<<Blocks(n), kThreads, 0, impl_->stream>>>(src, static_cast<__half*>(dst), n,
                                                              ToF16{});
      break;
    default:
      return InvalidArgumentError("Narrow: the destination must be fp32, bf16 or fp16");
  }
  impl_->CheckLaunch("NarrowKernel");
  return impl_->first_error;
}

Status CudaOps::Accumulate(const float* src, void* dst, DType dst_type, int64_t n) {
  switch (dst_type) {
    case DType::kF32:
      AccumulateKernel<<<Blocks(n), kThreads, 0, impl_->stream>>>(src, static_cast<float*>(dst), n,
                                                                  Identity{}, Identity{});
      break;
    case DType::kBF16:
      AccumulateKernel<<<Blocks(n), kThreads, 0, impl_->stream>>>(
          src, static_cast<__nv_bfloat16*>(dst), n, FromBF16{}, ToBF16{});
      break;
    case DType::kF16:
      AccumulateKernel<<<Blocks(n), kThreads, 0, impl_->stream>>>(src, static_cast<__half*>(dst), n,
                                                                  FromF16{}, ToF16{});
      break;
    default:
      return InvalidArgumentError("Accumulate: the destination must be fp32, bf16 or fp16");
  }
  impl_->CheckLaunch("AccumulateKernel");
  return impl_->first_error;
}

}  // namespace tierzero::gpt::cuda
