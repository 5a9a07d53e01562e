// The quantization layout, the CPU drivers (blocks in parallel on oneTBB) and the scalar block
// kernels, which define the element math the SIMD and CUDA paths reproduce bit for bit (Note
// [Quantization format] in quantize.h).
#include "kernels/quantize.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/check.h"
#include "core/convert.h"
#include "core/cpu_features.h"
#include "kernels/quantize_block.h"

namespace tierzero::kernels {

Status ValidateQuantSpec(const QuantSpec& spec) {
  if (spec.bits != 4 && spec.bits != 8) {
    return InvalidArgumentError("quantization bits must be 4 or 8, not " +
                                std::to_string(spec.bits));
  }
  if (spec.block_elems < 64 || spec.block_elems > 4096) {
    return InvalidArgumentError("quantization block size must be 64 to 4096 elements, not " +
                                std::to_string(spec.block_elems));
  }
  return Status::OK();
}

StatusOr<QuantLayout> QuantLayout::Create(const QuantSpec& spec,
                                          const std::vector<uint64_t>& run_elems) {
  RETURN_IF_ERROR(ValidateQuantSpec(spec));
  QuantLayout l;
  l.spec_ = spec;
  const uint64_t b = spec.block_elems;
  for (uint64_t n : run_elems) {
    if (n == 0) continue;
    l.runs_.push_back({l.elems_, n, l.blocks_, l.payload_bytes_});
    const uint64_t full = n / b, tail = n % b;
    l.elems_ += n;
    l.blocks_ += full + (tail != 0 ? 1 : 0);
    l.payload_bytes_ += full * l.BlockPayloadBytes(b) + l.BlockPayloadBytes(tail);
  }
  return l;
}

uint64_t QuantLayout::BlockPayloadBytes(uint64_t n) const {
  return internal::BlockPayload(n, spec_.bits);
}

namespace internal {

namespace {

void AbsMaxScalar(const void* x, DType t, uint64_t n, float* amax, bool* finite) {
  float m = 0;
  bool ok = true;
  for (uint64_t i = 0; i < n; ++i) {
    const float a = std::fabs(LoadElement(x, t, i));
    ok &= a <= std::numeric_limits<float>::max();
    m = std::max(m, a);
  }
  *amax = m;
  *finite = ok;
}

void QuantizeBlockScalar(const void* x, DType t, uint64_t n, int bits, const BlockScale& s,
                         uint8_t* payload) {
  const int qmax = QMax(bits);
  if (bits == 8) {
    for (uint64_t i = 0; i < n; ++i)
      payload[i] = static_cast<uint8_t>(QuantizeElement(LoadElement(x, t, i), s.inverse, qmax));
    return;
  }
  for (uint64_t i = 0; i < n; i += 2) {
    const int lo = QuantizeElement(LoadElement(x, t, i), s.inverse, qmax);
    const int hi = i + 1 < n ? QuantizeElement(LoadElement(x, t, i + 1), s.inverse, qmax) : 0;
    payload[i / 2] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
  }
}

void QuantizeScalar(const void* x, DType t, uint64_t n, uint64_t count, int bits, float* scales,
                    uint8_t* payload) {
  QuantizeInGroups(
      x, t, n, count, bits, scales, payload,
      [t](const void* b, uint64_t m, float* amax, bool* finite) {
        AbsMaxScalar(b, t, m, amax, finite);
      },
      [t, bits](const void* b, uint64_t m, const BlockScale& s, uint8_t* out) {
        QuantizeBlockScalar(b, t, m, bits, s, out);
      });
}

void DequantizeScalar(const uint8_t* payload, float scale, uint64_t n, int bits, float* out,
                      bool accumulate) {
  for (uint64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(QuantizedAt(payload, i, bits)) * scale;
    out[i] = accumulate ? out[i] + v : v;
  }
}

void Dequantize16Scalar(const uint8_t* payload, float scale, uint64_t n, int bits, uint16_t* out,
                        DType t) {
  for (uint64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(QuantizedAt(payload, i, bits)) * scale;
    out[i] = t == DType::kBF16 ? F32ToBF16Scalar(v) : F32ToF16Scalar(v);
  }
}

}  // namespace

const QuantKernels kQuantScalar = {QuantizeScalar, DequantizeScalar, Dequantize16Scalar};

const QuantKernels* QuantKernelsFor(int simd_level) {
  const auto level = static_cast<SimdLevel>(simd_level);
  if (!SimdLevelSupported(level)) return nullptr;
  switch (level) {
    case SimdLevel::kScalar:
      return &kQuantScalar;
    case SimdLevel::kAvx2:
      return &kQuantAvx2;
    case SimdLevel::kAvx512:
      return &kQuantAvx512;
  }
  return nullptr;
}

const QuantKernels& ActiveQuantKernels() {
  return *QuantKernelsFor(static_cast<int>(ActiveSimdLevel()));
}

}  // namespace internal

namespace {

Status CheckFloat(DType t, const char* what) {
  if (IsFloatType(t)) return Status::OK();
  return InvalidArgumentError(std::string(what) + " must be fp32, bf16 or fp16, not " +
                              std::string(DTypeName(t)));
}

// Calls body(first block, count, first element, elements per block, payload offset) for every
// span of blocks in one run with the same length (a run's full blocks, then its tail), in
// parallel for large layouts (about 64K elements per task; a span never crosses tasks).
template <typename Body>
void ForEachSpan(const QuantLayout& layout, Body body) {
  if (layout.blocks() == 0) return;
  const auto& runs = layout.runs();
  const uint64_t b = layout.spec().block_elems;
  const uint64_t block_bytes = layout.BlockPayloadBytes(b);
  auto range = [&](uint64_t first, uint64_t last) {
    auto run =
        std::upper_bound(runs.begin(), runs.end(), first,
                         [](uint64_t blk, const QuantLayout::Run& r) { return blk < r.block; });
    --run;
    for (uint64_t blk = first; blk < last;) {
      while (run + 1 != runs.end() && (run + 1)->block <= blk) ++run;
      const uint64_t k = blk - run->block, full = run->elems / b;
      const uint64_t count = k < full ? std::min(full - k, last - blk) : 1;
      const uint64_t elem = run->elem + k * b;
      const uint64_t n = k < full ? b : run->elems - full * b;
      body(blk, count, elem, n, run->byte + k * block_bytes);
      blk += count;
    }
  };
  const uint64_t grain = std::max<uint64_t>(1, 65536 / b);
  if (layout.blocks() <= 4 * grain) {
    range(0, layout.blocks());
    return;
  }
  tbb::parallel_for(tbb::blocked_range<uint64_t>(0, layout.blocks(), grain),
                    [&](const tbb::blocked_range<uint64_t>& r) { range(r.begin(), r.end()); });
}

// ForEachSpan one block at a time: body(block, first element, elements, payload offset).
template <typename Body>
void ForEachBlock(const QuantLayout& layout, Body body) {
  const uint64_t block_bytes = layout.BlockPayloadBytes(layout.spec().block_elems);
  ForEachSpan(layout, [&](uint64_t blk, uint64_t count, uint64_t elem, uint64_t n, uint64_t byte) {
    for (uint64_t j = 0; j < count; ++j) body(blk + j, elem + j * n, n, byte + j * block_bytes);
  });
}

float* Scales(void* packed) { return static_cast<float*>(packed); }
const float* Scales(const void* packed) { return static_cast<const float*>(packed); }
uint8_t* Payload(const QuantLayout& l, void* packed) {
  return static_cast<uint8_t*>(packed) + l.scale_bytes();
}
const uint8_t* Payload(const QuantLayout& l, const void* packed) {
  return static_cast<const uint8_t*>(packed) + l.scale_bytes();
}

}  // namespace

Status Quantize(const QuantLayout& layout, const void* src, DType src_type, void* dst) {
  RETURN_IF_ERROR(CheckFloat(src_type, "the quantized input"));
  const internal::QuantKernels& k = internal::ActiveQuantKernels();
  const int bits = layout.spec().bits;
  float* scales = Scales(dst);
  uint8_t* payload = Payload(layout, dst);
  const auto* s = static_cast<const uint8_t*>(src);
  ForEachSpan(layout, [&](uint64_t blk, uint64_t count, uint64_t elem, uint64_t n, uint64_t byte) {
    k.quantize(s + DTypeBytes(src_type, elem), src_type, n, count, bits, scales + blk,
               payload + byte);
  });
  return Status::OK();
}

Status Dequantize(const QuantLayout& layout, const void* src, void* dst, DType dst_type) {
  RETURN_IF_ERROR(CheckFloat(dst_type, "the dequantized output"));
  const internal::QuantKernels& k = internal::ActiveQuantKernels();
  const int bits = layout.spec().bits;
  const float* scales = Scales(src);
  const uint8_t* payload = Payload(layout, src);
  auto* d = static_cast<uint8_t*>(dst);
  ForEachBlock(layout, [&](uint64_t blk, uint64_t elem, uint64_t n, uint64_t byte) {
    void* out = d + DTypeBytes(dst_type, elem);
    if (dst_type == DType::kF32) {
      k.dequantize(payload + byte, scales[blk], n, bits, static_cast<float*>(out), false);
      return;
    }
    k.dequantize16(payload + byte, scales[blk], n, bits, static_cast<uint16_t*>(out), dst_type);
  });
  return Status::OK();
}

namespace {

// out[0 .. n) = the sum of block `blk` of every input, in input order.
void SumBlock(const internal::QuantKernels& k, const QuantLayout& layout,
              const std::vector<const void*>& inputs, uint64_t blk, uint64_t n, uint64_t byte,
              float* out) {
  const int bits = layout.spec().bits;
  for (size_t i = 0; i < inputs.size(); ++i) {
    k.dequantize(Payload(layout, inputs[i]) + byte, Scales(inputs[i])[blk], n, bits, out, i > 0);
  }
}

Status CheckInputs(const std::vector<const void*>& inputs) {
  if (inputs.empty()) return InvalidArgumentError("a quantized sum needs at least one input");
  return Status::OK();
}

}  // namespace

Status DequantizeSum(const QuantLayout& layout, const std::vector<const void*>& inputs,
                     float* out) {
  RETURN_IF_ERROR(CheckInputs(inputs));
  const internal::QuantKernels& k = internal::ActiveQuantKernels();
  ForEachBlock(layout, [&](uint64_t blk, uint64_t elem, uint64_t n, uint64_t byte) {
    SumBlock(k, layout, inputs, blk, n, byte, out + elem);
  });
  return Status::OK();
}

Status DequantizeSumRequantize(const QuantLayout& layout, const std::vector<const void*>& inputs,
                               void* dst) {
  RETURN_IF_ERROR(CheckInputs(inputs));
  const internal::QuantKernels& k = internal::ActiveQuantKernels();
  float* scales = Scales(dst);
  uint8_t* payload = Payload(layout, dst);
  ForEachBlock(layout, [&](uint64_t blk, uint64_t, uint64_t n, uint64_t byte) {
    float acc[4096];
    SumBlock(k, layout, inputs, blk, n, byte, acc);
    k.quantize(acc, DType::kF32, n, 1, layout.spec().bits, scales + blk, payload + byte);
  });
  return Status::OK();
}

}  // namespace tierzero::kernels
