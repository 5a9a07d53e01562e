// CUDA quantization kernels (quantize.h): one thread block per quantization block (a grid-stride
// loop over blocks), the block's values staged in shared memory as fp32, its absmax reduced in
// shared memory, the element math of quantize_block.h, so the results equal the CPU paths bit
// for bit (tests/kernels/quantize_cuda_test.cc checks it where a GPU is).
#include <cuda_runtime.h>

#include <string>

#include "core/convert.h"
#include "kernels/cuda_status.h"
#include "kernels/quantize.h"
#include "kernels/quantize_block.h"

namespace tierzero::kernels {
namespace {

using internal::BlockPayload;
using internal::BlockScale;
using internal::ChooseScale;
using internal::QMax;
using internal::QuantizedAt;
using internal::QuantizeElement;

constexpr int kThreads = 256;
constexpr int kMaxBlock = 4096;

struct BlockAt {
  uint64_t elem, n, byte;
};

// Where quantization block `blk` is: binary search of the run table.
__device__ BlockAt Locate(const QuantLayout::Run* runs, int num_runs, uint64_t blk,
                          uint32_t block_elems, int bits) {
  int lo = 0, hi = num_runs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (runs[mid].block <= blk)
      lo = mid;
    else
      hi = mid - 1;
  }
  const QuantLayout::Run& r = runs[lo];
  const uint64_t k = blk - r.block;
  const uint64_t elem = r.elem + k * block_elems;
  const uint64_t end = r.elem + r.elems;
  const uint64_t n = end - elem < block_elems ? end - elem : block_elems;
  return {elem, n, r.byte + k * BlockPayload(block_elems, bits)};
}

// Scales are read and written a byte at a time: a packed buffer's scales start at any byte (the
// quantized shards of several ranks lie back to back, each layout.bytes() long, which need not be
// a multiple of 4), and CUDA faults on a misaligned float access where the CPU does not.
__device__ float LoadScale(const uint8_t* p) {
  float v;
  memcpy(&v, p, sizeof v);
  return v;
}
__device__ void StoreScale(uint8_t* p, float v) { memcpy(p, &v, sizeof v); }

// q * scale as the CPU computes it. A non-finite block's scale is NaN (ChooseScale): x86 returns
// that NaN operand itself, where CUDA would return its canonical NaN, so return it here too.
__device__ float Dequantized(int q, float scale) {
  return scale != scale ? scale : __fmul_rn(static_cast<float>(q), scale);
}

__device__ void StoreAs(void* dst, DType t, uint64_t i, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(dst)[i] = v;
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(dst)[i] = F32ToBF16Scalar(v);
      break;
    default:
      static_cast<uint16_t*>(dst)[i] = F32ToF16Scalar(v);
      break;
  }
}

// Quantizes x[0 .. n) (shared memory, written by this thread block) into scale and payload.
__device__ void QuantizeShared(const float* x, uint64_t n, int bits, uint8_t* scale,
                               uint8_t* payload) {
  __shared__ float amax_part[kThreads];
  __shared__ int bad_part[kThreads];
  __shared__ BlockScale s;
  float amax = 0;
  int bad = 0;
  for (uint64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float a = fabsf(x[i]);
    bad |= !(a <= 3.4028234663852886e38f);
    amax = a > amax ? a : amax;
  }
  amax_part[threadIdx.x] = amax;
  bad_part[threadIdx.x] = bad;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const float o = amax_part[threadIdx.x + stride];
      amax_part[threadIdx.x] = o > amax_part[threadIdx.x] ? o : amax_part[threadIdx.x];
      bad_part[threadIdx.x] |= bad_part[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    s = ChooseScale(amax_part[0], bad_part[0] == 0, bits);
    StoreScale(scale, s.scale);
  }
  __syncthreads();
  const int qmax = QMax(bits);
  if (bits == 8) {
    for (uint64_t i = threadIdx.x; i < n; i += blockDim.x)
      payload[i] = s.nonzero ? static_cast<uint8_t>(QuantizeElement(x[i], s.inverse, qmax)) : 0;
  } else {
    for (uint64_t j = threadIdx.x; j < (n + 1) / 2; j += blockDim.x) {
      int lo = 0, hi = 0;
      if (s.nonzero) {
        lo = QuantizeElement(x[2 * j], s.inverse, qmax);
        hi = 2 * j + 1 < n ? QuantizeElement(x[2 * j + 1], s.inverse, qmax) : 0;
      }
      payload[j] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
    }
  }
  __syncthreads();  // x and s are reused by this thread block's next quantization block
}

__global__ void QuantizeKernel(const QuantLayout::Run* runs, int num_runs, uint64_t blocks,
                               uint32_t block_elems, int bits, uint64_t scale_bytes,
                               const void* src, DType src_type, uint8_t* dst) {
  __shared__ float x[kMaxBlock];
  for (uint64_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const BlockAt at = Locate(runs, num_runs, blk, block_elems, bits);
    for (uint64_t i = threadIdx.x; i < at.n; i += blockDim.x)
      x[i] = internal::LoadElement(src, src_type, at.elem + i);
    __syncthreads();
    QuantizeShared(x, at.n, bits, dst + 4 * blk, dst + scale_bytes + at.byte);
  }
}

__global__ void DequantizeKernel(const QuantLayout::Run* runs, int num_runs, uint64_t blocks,
                                 uint32_t block_elems, int bits, uint64_t scale_bytes,
                                 const uint8_t* src, void* dst, DType dst_type) {
  for (uint64_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const BlockAt at = Locate(runs, num_runs, blk, block_elems, bits);
    const float scale = LoadScale(src + 4 * blk);
    const uint8_t* payload = src + scale_bytes + at.byte;
    for (uint64_t i = threadIdx.x; i < at.n; i += blockDim.x)
      StoreAs(dst, dst_type, at.elem + i, Dequantized(QuantizedAt(payload, i, bits), scale));
  }
}

// Element i of block `at` summed over the inputs in order, in fp32, with the CPU's arithmetic
// (an unfused multiply and add: no contraction into an FMA). A NaN (a non-finite block's scale)
// is passed on as it is, as x86 returns a NaN operand, where CUDA's add would return its
// canonical NaN (Dequantized does the same for the product).
__device__ float SumAt(const uint8_t* inputs, int num_inputs, uint64_t input_stride,
                       uint64_t scale_bytes, uint64_t blk, const BlockAt& at, uint64_t i,
                       int bits) {
  float sum = 0;
  for (int k = 0; k < num_inputs; ++k) {
    const uint8_t* in = inputs + static_cast<uint64_t>(k) * input_stride;
    const float v =
        Dequantized(QuantizedAt(in + scale_bytes + at.byte, i, bits), LoadScale(in + 4 * blk));
    if (k == 0) {
      sum = v;
    } else if (sum == sum) {
      sum = v != v ? v : __fadd_rn(sum, v);
    }
  }
  return sum;
}

__global__ void SumRequantizeKernel(const QuantLayout::Run* runs, int num_runs, uint64_t blocks,
                                    uint32_t block_elems, int bits, uint64_t scale_bytes,
                                    uint64_t input_stride, const uint8_t* inputs, int num_inputs,
                                    uint8_t* dst) {
  __shared__ float acc[kMaxBlock];
  for (uint64_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const BlockAt at = Locate(runs, num_runs, blk, block_elems, bits);
    for (uint64_t i = threadIdx.x; i < at.n; i += blockDim.x)
      acc[i] = SumAt(inputs, num_inputs, input_stride, scale_bytes, blk, at, i, bits);
    __syncthreads();
    QuantizeShared(acc, at.n, bits, dst + 4 * blk, dst + scale_bytes + at.byte);
  }
}

__global__ void MeanKernel(const QuantLayout::Run* runs, int num_runs, uint64_t blocks,
                           uint32_t block_elems, int bits, uint64_t scale_bytes,
                           uint64_t input_stride, const uint8_t* inputs, int num_inputs,
                           float divisor, void* out, DType out_type) {
  for (uint64_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const BlockAt at = Locate(runs, num_runs, blk, block_elems, bits);
    for (uint64_t i = threadIdx.x; i < at.n; i += blockDim.x) {
      const float sum = SumAt(inputs, num_inputs, input_stride, scale_bytes, blk, at, i, bits);
      StoreAs(out, out_type, at.elem + i, sum != sum ? sum : __fdiv_rn(sum, divisor));
    }
  }
}

unsigned GridFor(uint64_t blocks) {
  return static_cast<unsigned>(blocks < 65535 ? (blocks == 0 ? 1 : blocks) : 65535);
}

Status CheckFloat(DType t) {
  if (IsFloatType(t)) return Status::OK();
  return InvalidArgumentError("quantization supports fp32, bf16 and fp16, not " +
                              std::string(DTypeName(t)));
}

}  // namespace

Status QuantizeCudaAsync(const QuantLayout& layout, const QuantLayout::Run* device_runs,
                         const void* src, DType src_type, void* dst, void* cuda_stream) {
  RETURN_IF_ERROR(CheckFloat(src_type));
  if (layout.blocks() == 0) return Status::OK();
  (void)cudaGetLastError();
  QuantizeKernel<<<GridFor(layout.blocks()), kThreads, 0, static_cast<cudaStream_t>(cuda_stream)>>>(
      device_runs, static_cast<int>(layout.runs().size()), layout.blocks(),
      layout.spec().block_elems, layout.spec().bits, layout.scale_bytes(), src, src_type,
      static_cast<uint8_t*>(dst));
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::OK();
}

Status DequantizeCudaAsync(const QuantLayout& layout, const QuantLayout::Run* device_runs,
                           const void* src, void* dst, DType dst_type, void* cuda_stream) {
  RETURN_IF_ERROR(CheckFloat(dst_type));
  if (layout.blocks() == 0) return Status::OK();
  (void)cudaGetLastError();
  DequantizeKernel<<<GridFor(layout.blocks()), kThreads, 0,
                     static_cast<cudaStream_t>(cuda_stream)>>>(
      device_runs, static_cast<int>(layout.runs().size()), layout.blocks(),
      layout.spec().block_elems, layout.spec().bits, layout.scale_bytes(),
      static_cast<const uint8_t*>(src), dst, dst_type);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::OK();
}

Status DequantizeSumRequantizeCudaAsync(const QuantLayout& layout,
                                        const QuantLayout::Run* device_runs, const void* inputs,
                                        int num_inputs, void* dst, void* cuda_stream) {
  return DequantizeSumRequantizeCudaAsync(layout, device_runs, inputs, num_inputs, layout.bytes(),
                                          dst, cuda_stream);
}

Status DequantizeSumRequantizeCudaAsync(const QuantLayout& layout,
                                        const QuantLayout::Run* device_runs, const void* inputs,
                                        int num_inputs, uint64_t input_stride, void* dst,
                                        void* cuda_stream) {
  if (num_inputs < 1) return InvalidArgumentError("a quantized sum needs at least one input");
  if (layout.blocks() == 0) return Status::OK();
  (void)cudaGetLastError();
  SumRequantizeKernel<<<GridFor(layout.blocks()), kThreads, 0,
                        static_cast<cudaStream_t>(cuda_stream)>>>(
      device_runs, static_cast<int>(layout.runs().size()), layout.blocks(),
      layout.spec().block_elems, layout.spec().bits, layout.scale_bytes(), input_stride,
      static_cast<const uint8_t*>(inputs), num_inputs, static_cast<uint8_t*>(dst));
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::OK();
}

Status DequantizeMeanCudaAsync(const QuantLayout& layout, const QuantLayout::Run* device_runs,
                               const void* inputs, int num_inputs, uint64_t input_stride,
                               float divisor, void* out, DType out_type, void* cuda_stream) {
  if (num_inputs < 1) return InvalidArgumentError("a quantized mean needs at least one input");
  RETURN_IF_ERROR(CheckFloat(out_type));
  if (layout.blocks() == 0) return Status::OK();
  (void)cudaGetLastError();
  MeanKernel<<<GridFor(layout.blocks()), kThreads, 0, static_cast<cudaStream_t>(cuda_stream)>>>(
      device_runs, static_cast<int>(layout.runs().size()), layout.blocks(),
      layout.spec().block_elems, layout.spec().bits, layout.scale_bytes(), input_stride,
      static_cast<const uint8_t*>(inputs), num_inputs, divisor, out, out_type);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::OK();
}

}  // namespace tierzero::kernels
