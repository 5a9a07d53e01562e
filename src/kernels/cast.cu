// CUDA casts. One thread per element in a grid-stride loop over 4-element groups, so the
// loads and stores of a warp cover contiguous memory.
#include <cuda_runtime.h>

#include <string>

#include "core/convert.h"
#include "kernels/cast.h"
#include "kernels/cuda_status.h"

namespace tierzero::kernels {
namespace {

template <typename In, typename Out, typename Op>
__global__ void CastKernel(const In* __restrict__ src, Out* __restrict__ dst, size_t n, Op op) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = op(src[i]);
  }
}

struct F32ToBF16Op {
  __device__ uint16_t operator()(float x) const { return F32ToBF16Scalar(x); }
};
struct F32ToF16Op {
  __device__ uint16_t operator()(float x) const { return F32ToF16Scalar(x); }
};
struct BF16ToF32Op {
  __device__ float operator()(uint16_t x) const { return BF16ToF32Scalar(x); }
};
struct F16ToF32Op {
  __device__ float operator()(uint16_t x) const { return F16ToF32Scalar(x); }
};
struct BF16ToF16Op {
  __device__ uint16_t operator()(uint16_t x) const { return F32ToF16Scalar(BF16ToF32Scalar(x)); }
};
struct F16ToBF16Op {
  __device__ uint16_t operator()(uint16_t x) const { return F32ToBF16Scalar(F16ToF32Scalar(x)); }
};

template <typename In, typename Out, typename Op>
Status Launch(const void* src, void* dst, size_t n, cudaStream_t stream, Op op) {
  constexpr int kThreads = 256;
  // Enough blocks to fill any current GPU several times over; the loop covers the rest.
  const size_t blocks = std::min<size_t>((n + kThreads - 1) / kThreads, 65536);
  (void)cudaGetLastError();  // report this launch's error, not an earlier call's
  CastKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<const In*>(src),
                                                                     static_cast<Out*>(dst), n, op);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());  // the launch's own error
  return Status::OK();
}

}  // namespace

bool CudaKernelsBuilt() { return true; }

Status CastCudaAsync(const void* src, DType src_type, void* dst, DType dst_type, size_t n,
                     void* cuda_stream) {
  if (!IsFloatType(src_type) || !IsFloatType(dst_type)) {
    return InvalidArgumentError("cast supports fp32, bf16 and fp16, not " +
                                std::string(DTypeName(src_type)) + " -> " +
                                std::string(DTypeName(dst_type)));
  }
  if (n == 0) return Status::OK();
  auto stream = static_cast<cudaStream_t>(cuda_stream);
  if (src_type == dst_type) {
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, DTypeBytes(src_type, n), cudaMemcpyDeviceToDevice, stream));
    return Status::OK();
  }
  switch (src_type) {
    case DType::kF32:
      return dst_type == DType::kBF16 ? Launch<float, uint16_t>(src, dst, n, stream, F32ToBF16Op{})
                                      : Launch<float, uint16_t>(src, dst, n, stream, F32ToF16Op{});
    case DType::kBF16:
      return dst_type == DType::kF32
                 ? Launch<uint16_t, float>(src, dst, n, stream, BF16ToF32Op{})
                 : Launch<uint16_t, uint16_t>(src, dst, n, stream, BF16ToF16Op{});
    default:
      return dst_type == DType::kF32
                 ? Launch<uint16_t, float>(src, dst, n, stream, F16ToF32Op{})
                 : Launch<uint16_t, uint16_t>(src, dst, n, stream, F16ToBF16Op{});
  }
}

namespace {

template <typename In, typename Widen>
__global__ void AccumulateKernel(float* __restrict__ acc, const In* __restrict__ src, size_t n,
                                 Widen widen) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    acc[i] += widen(src[i]);
}
struct SameF32 {
  __device__ float operator()(float x) const { return x; }
};

}  // namespace

Status AccumulateCudaAsync(float* acc, const void* src, DType src_type, size_t n,
                           void* cuda_stream) {
  if (!IsFloatType(src_type)) {
    return InvalidArgumentError("accumulate supports fp32, bf16 and fp16, not " +
                                std::string(DTypeName(src_type)));
  }
  if (n == 0) return Status::OK();
  auto stream = static_cast<cudaStream_t>(cuda_stream);
  constexpr int kThreads = 256;
  const unsigned blocks =
      static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 65536));
  (void)cudaGetLastError();
  switch (src_type) {
    case DType::kF32:
      AccumulateKernel<<<blocks, kThreads, 0, stream>>>(acc, static_cast<const float*>(src), n,
                                                        SameF32{});
      break;
    case DType::kBF16:
      AccumulateKernel<<<blocks, kThreads, 0, stream>>>(acc, static_cast<const uint16_t*>(src), n,
                                                        BF16ToF32Op{});
      break;
    default:
      AccumulateKernel<<<blocks, kThreads, 0, stream>>>(acc, static_cast<const uint16_t*>(src), n,
                                                        F16ToF32Op{});
      break;
  }
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::OK();
}

}  // namespace tierzero::kernels
