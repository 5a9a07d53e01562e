// Adam/AdamW as one CUDA kernel: the same math, operation order, fused multiply-adds and
// rounding as CpuAdam (cpu_adam.h), so a GPU step and the scalar CPU path agree bit for bit
// (IEEE division and square root: nvcc's defaults, no fast math). One thread per element in a
// grid-stride loop; with 8-bit moments one warp per block of 64 (state_codes.h), the same
// codes, scales and stochastic rounding as the CPU's. For sub-groups updated on the device
// (DESIGN.md section 7); the engine does not place optimizer state on the device yet, so today only
// its tests and gpu_bench call it. C++17 and CUDA-free (the stream is a void*).
#pragma once

#include <cstddef>

#include "core/status.h"
#include "cpu_adam/cpu_adam.h"

namespace tierzero {

// True when this build contains the kernel.
bool GpuAdamBuilt();

// Enqueues one step over device buffers (AdamBuffers' meaning; every pointer on the device) on
// `cuda_stream`. InvalidArgument as CpuAdam::Step; Unavailable without CUDA; Internal for a
// launch failure.
Status GpuAdamStepAsync(const AdamConfig& config, const AdamStepOptions& step,
                        const AdamBuffers& buffers, void* cuda_stream);

// Enqueues the sum of squares of grad[0, n) (fp32, bf16 or fp16, device memory) as `parts`
// block sums in double written to `parts` (device memory; each block's threads in a fixed tree,
// so the same bits on every run). Unavailable without CUDA; Internal for a launch failure.
Status GpuSumSquaresAsync(const void* grad, DType dtype, size_t n, double* parts, int num_parts,
                          void* cuda_stream);

}  // namespace tierzero
