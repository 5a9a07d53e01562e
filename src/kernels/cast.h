// Element casts between fp32, bf16 and fp16 on the CPU and on a CUDA GPU, with the rounding
// rules of core/convert.h on both (the GPU uses the same scalar code, so results are
// bit-identical to the CPU paths).
#pragma once

#include <cstddef>

#include "core/status.h"
#include "tierzero/types.h"

namespace tierzero::kernels {

// True when this build contains the CUDA kernels.
bool CudaKernelsBuilt();

// Enqueues a cast of n elements on `cuda_stream` (a cudaStream_t). src and dst are device
// pointers and must not overlap. Same-dtype casts are device copies. Returns Unavailable in a
// build without CUDA, InvalidArgument for a non-float dtype, Internal for a launch failure.
Status CastCudaAsync(const void* src, DType src_type, void* dst, DType dst_type, size_t n,
                     void* cuda_stream);

// Enqueues acc[i] += widen(src[i]) for n elements (src fp32, bf16 or fp16; one fp32 add per
// element, as AddToF32 on the CPU: bit-identical). Device pointers; Unavailable without CUDA,
// InvalidArgument for a non-float dtype.
Status AccumulateCudaAsync(float* acc, const void* src, DType src_type, size_t n,
                           void* cuda_stream);

}  // namespace tierzero::kernels
