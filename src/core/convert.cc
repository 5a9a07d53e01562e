#include "core/convert.h"

#include <algorithm>
#include <atomic>
#include <string>

#include "core/convert_internal.h"
#include "core/tunable.h"
#include "tierzero/convert.h"

namespace tierzero {
namespace internal {

TZ_TUNABLE(ByteSize, kStreamingStoreThreshold, "TZ_CONVERT_STREAMING_BYTES",
           ByteSize{8 * 1024 * 1024},
           "Conversions writing at least this many bytes use non-temporal stores");

size_t StreamingStoreThresholdBytes() {
  // Cached per Set/Reset of the tunable: its mutex would otherwise be taken on every conversion.
  static std::atomic<uint64_t> cached_generation{0};
  static std::atomic<size_t> cached{0};
  const uint64_t generation = kStreamingStoreThreshold.generation();
  if (cached_generation.load(std::memory_order_acquire) != generation) {
    cached.store(kStreamingStoreThreshold.Get().bytes, std::memory_order_relaxed);
    cached_generation.store(generation, std::memory_order_release);
  }
  return cached.load(std::memory_order_relaxed);
}

namespace {

void F32ToBF16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F32ToBF16Scalar(src[i]);
}
void BF16ToF32(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = BF16ToF32Scalar(src[i]);
}
void F32ToF16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F32ToF16Scalar(src[i]);
}
void F16ToF32(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F16ToF32Scalar(src[i]);
}

}  // namespace

const ConvertKernels kConvertScalar = {F32ToBF16, BF16ToF32, F32ToF16, F16ToF32};

}  // namespace internal

const ConvertKernels* ConvertKernelsFor(SimdLevel level) {
  if (!SimdLevelSupported(level)) return nullptr;
  switch (level) {
    case SimdLevel::kScalar:
      return &internal::kConvertScalar;
    case SimdLevel::kAvx2:
      return &internal::kConvertAvx2;
    case SimdLevel::kAvx512:
      return &internal::kConvertAvx512;
  }
  return nullptr;
}

const ConvertKernels& ActiveConvertKernels() { return *ConvertKernelsFor(ActiveSimdLevel()); }

Status Convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  if (!IsFloatType(src_type) || !IsFloatType(dst_type)) {
    return InvalidArgumentError("Convert supports fp32, bf16 and fp16, not " +
                                std::string(DTypeName(src_type)) + " -> " +
                                std::string(DTypeName(dst_type)));
  }
  if (src_type == dst_type) {
    if (n) std::memmove(dst, src, DTypeBytes(src_type, n));
    return Status::OK();
  }
  const ConvertKernels& k = ActiveConvertKernels();
  const auto* s16 = static_cast<const uint16_t*>(src);
  auto* d16 = static_cast<uint16_t*>(dst);
  if (src_type == DType::kF32) {
    (dst_type == DType::kBF16 ? k.f32_to_bf16 : k.f32_to_f16)(static_cast<const float*>(src), d16,
                                                              n);
  } else if (dst_type == DType::kF32) {
    (src_type == DType::kBF16 ? k.bf16_to_f32 : k.f16_to_f32)(s16, static_cast<float*>(dst), n);
  } else {
    // 16-bit to 16-bit through an fp32 block on the stack.
    constexpr size_t kBlock = 2048;
    float tmp[kBlock];
    for (size_t i = 0; i < n; i += kBlock) {
      size_t m = std::min(kBlock, n - i);
      (src_type == DType::kBF16 ? k.bf16_to_f32 : k.f16_to_f32)(s16 + i, tmp, m);
      (dst_type == DType::kBF16 ? k.f32_to_bf16 : k.f32_to_f16)(tmp, d16 + i, m);
    }
  }
  return Status::OK();
}

// tierzero/convert.h: the same, public.
Status CastElements(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  // (The public entry: a null buffer is the caller's error to hear of, not a crash: hunt 48.)
  if (n > 0 && (src == nullptr || dst == nullptr))
    return InvalidArgumentError("CastElements of " + std::to_string(n) +
                                " elements with a null buffer");
  return Convert(src, src_type, dst, dst_type, n);
}

Status AddToF32(float* acc, const void* src, DType src_type, size_t n) {
  constexpr size_t kBlock = 4096;
  float tmp[kBlock];
  const auto* s = static_cast<const uint8_t*>(src);
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t m = std::min(kBlock, n - b);
    RETURN_IF_ERROR(Convert(s + DTypeBytes(src_type, b), src_type, tmp, DType::kF32, m));
    for (size_t k = 0; k < m; ++k) acc[b + k] += tmp[k];
  }
  return Status::OK();
}

}  // namespace tierzero
