// Block quantization for ZeRO++'s collectives (docs/zero.md, "ZeRO++"): fp32/bf16/fp16 values
// to int8 or int4, one fp32 scale per block, on the CPU (scalar, AVX2, AVX-512, chosen at run
// time like the rest of the CPU code) and on a CUDA GPU (same element math, bit-identical).
//
//   QuantSpec spec{.bits = 8, .block_elems = 256};
//   auto layout = *QuantLayout::Create(spec, {tensor_a_elems, tensor_b_elems});  // the runs
//   std::vector<uint8_t> packed(layout.bytes());
//   Quantize(layout, shard, DType::kBF16, packed.data());
//   Dequantize(layout, packed.data(), out, DType::kBF16);
//
// Note [Quantization format]
// The elements are split into runs (the pieces of a chunk's shard that belong to one tensor), and
// each run into blocks of block_elems (the last one shorter), so a block never spans two tensors:
// a tensor of small weights never shares a scale with one of large ones. A packed buffer is the
// blocks' fp32 scales, then their payloads, each block's payload starting on a byte: int8 one
// byte per element; int4 two per byte, the even element in the low nibble, ceil(n/2) bytes for a
// block of n. A block's scale is absmax / qmax (qmax = 127 or 7, fp32 division); its elements are
// q = round_half_even(x * (qmax / absmax)) clamped to [-qmax, qmax] (fp32 product), dequantized
// as q * scale (fp32, then rounded to the output dtype). So |x - dequantized| <= scale / 2 up to
// fp32 rounding (a relative 2^-22 of absmax), plus the output dtype's rounding.
//
// An all-zero block has scale 0 and zero payload. Non-finite values are propagated, not hidden: a
// block with an Inf or NaN gets a NaN scale and zero payload, so every one of its dequantized
// elements is NaN, and a gradient that overflowed stays non-finite for the step's finite check
// (loss scaling skips the step) instead of becoming a large finite number.
//
// Thread-safety: the functions are pure; a layout is immutable once created.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "tierzero/types.h"

namespace tierzero::kernels {

struct QuantSpec {
  int bits = 8;                // 8 or 4
  uint32_t block_elems = 256;  // 64 .. 4096
};

// InvalidArgument naming the field unless bits is 4 or 8 and block_elems in [64, 4096].
Status ValidateQuantSpec(const QuantSpec& spec);

class QuantLayout {
 public:
  // One run of elements (POD: the CUDA kernels read a copy of the table in device memory).
  struct Run {
    uint64_t elem;   // first element
    uint64_t elems;  // elements (> 0)
    uint64_t block;  // index of its first block
    uint64_t byte;   // its first payload byte, from the start of the payload
  };

  // Runs of the given lengths, in order (zero lengths are skipped). InvalidArgument for a bad
  // spec.
  static StatusOr<QuantLayout> Create(const QuantSpec& spec,
                                      const std::vector<uint64_t>& run_elems);

  const QuantSpec& spec() const { return spec_; }
  const std::vector<Run>& runs() const { return runs_; }
  uint64_t elems() const { return elems_; }
  uint64_t blocks() const { return blocks_; }
  uint64_t payload_bytes() const { return payload_bytes_; }
  // The scales (4 bytes per block), then the payload.
  uint64_t scale_bytes() const { return blocks_ * 4; }
  uint64_t bytes() const { return scale_bytes() + payload_bytes_; }
  // Payload bytes of a block of n elements.
  uint64_t BlockPayloadBytes(uint64_t n) const;

 private:
  QuantSpec spec_;
  std::vector<Run> runs_;
  uint64_t elems_ = 0, blocks_ = 0, payload_bytes_ = 0;
};

// Packed buffers start 4-byte aligned (the scales are floats).
//
// dst (layout.bytes()) = the packed quantization of src (layout.elems() of src_type: fp32,
// bf16 or fp16). Large inputs run on oneTBB's threads.
Status Quantize(const QuantLayout& layout, const void* src, DType src_type, void* dst);
// dst (layout.elems() of dst_type: fp32, bf16 or fp16) = dequantized src.
Status Dequantize(const QuantLayout& layout, const void* src, void* dst, DType dst_type);
// out[i] = sum over k in order of dequantized inputs[k][i], added in fp32 (every input packed
// with `layout`).
Status DequantizeSum(const QuantLayout& layout, const std::vector<const void*>& inputs, float* out);
// dst = Quantize(DequantizeSum(inputs)) without leaving fp32 between the steps: the fused
// dequantize-reduce-requantize of a hierarchical quantized reduction.
Status DequantizeSumRequantize(const QuantLayout& layout, const std::vector<const void*>& inputs,
                               void* dst);

// The CUDA kernels, queued on `cuda_stream` (a cudaStream_t). `device_runs` is layout.runs()
// copied to device memory; src, dst and inputs are device pointers. Unavailable in a build
// without CUDA.
Status QuantizeCudaAsync(const QuantLayout& layout, const QuantLayout::Run* device_runs,
                         const void* src, DType src_type, void* dst, void* cuda_stream);
Status DequantizeCudaAsync(const QuantLayout& layout, const QuantLayout::Run* device_runs,
                           const void* src, void* dst, DType dst_type, void* cuda_stream);
// DequantizeSumRequantize with `num_inputs` packed inputs at `inputs` + k * input_stride
// (default: layout.bytes(), back to back).
Status DequantizeSumRequantizeCudaAsync(const QuantLayout& layout,
                                        const QuantLayout::Run* device_runs, const void* inputs,
                                        int num_inputs, void* dst, void* cuda_stream);
Status DequantizeSumRequantizeCudaAsync(const QuantLayout& layout,
                                        const QuantLayout::Run* device_runs, const void* inputs,
                                        int num_inputs, uint64_t input_stride, void* dst,
                                        void* cuda_stream);
// out (layout.elems() of out_type) = DequantizeSum of the `num_inputs` packed inputs at
// `inputs` + k * input_stride, divided by `divisor` in fp32 and rounded once to out_type: the
// last stage of a quantized mean (comm/quantized.h) in one pass, with the CPU path's arithmetic.
Status DequantizeMeanCudaAsync(const QuantLayout& layout, const QuantLayout::Run* device_runs,
                               const void* inputs, int num_inputs, uint64_t input_stride,
                               float divisor, void* out, DType out_type, void* cuda_stream);

namespace internal {

// One level's block kernels (quantize_{scalar,avx2,avx512}.cc). `n` is 1 .. 4096; `scale(s)` and
// `payload` point at the (first) block's scale and first payload byte.
struct QuantKernels {
  // Quantizes `count` consecutive blocks of n values of x (fp32, bf16 or fp16) each: scales[0 ..
  // count), each block's payload BlockPayload(n) bytes after the previous one's (Note [Blocks in
  // groups] in quantize_block.h).
  void (*quantize)(const void* x, DType t, uint64_t n, uint64_t count, int bits, float* scales,
                   uint8_t* payload);
  // out[0 .. n) = dequantized values (accumulate: out += them).
  void (*dequantize)(const uint8_t* payload, float scale, uint64_t n, int bits, float* out,
                     bool accumulate);
  // out[0 .. n) = dequantized values rounded to bf16 or fp16 (`t`) as Convert rounds them, in
  // registers: no fp32 block in between.
  void (*dequantize16)(const uint8_t* payload, float scale, uint64_t n, int bits, uint16_t* out,
                       DType t);
};
extern const QuantKernels kQuantScalar;
extern const QuantKernels kQuantAvx2;
extern const QuantKernels kQuantAvx512;
// The table for a level (nullptr when this CPU lacks it); the active level's.
const QuantKernels* QuantKernelsFor(int simd_level);
const QuantKernels& ActiveQuantKernels();

}  // namespace internal

}  // namespace tierzero::kernels
