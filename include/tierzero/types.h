// Element types shared by the public API and the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tierzero/status.h"

namespace tierzero {

// Element types. int4 packs two elements per byte (low nibble first).
enum class DType : uint8_t { kF32 = 0, kBF16, kF16, kI8, kI4 };

// Bits per element: 32, 16, 16, 8, 4.
constexpr int DTypeBits(DType t) {
  switch (t) {
    case DType::kF32:
      return 32;
    case DType::kBF16:
      return 16;
    case DType::kF16:
      return 16;
    case DType::kI8:
      return 8;
    case DType::kI4:
      return 4;
  }
  return 0;
}

// Bytes that `n` elements occupy (int4 rounds up to whole bytes).
constexpr size_t DTypeBytes(DType t, size_t n) { return (n * DTypeBits(t) + 7) / 8; }

// True for fp32, bf16, fp16.
constexpr bool IsFloatType(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16;
}

// "fp32", "bf16", "fp16", "int8", "int4".
std::string_view DTypeName(DType t);
// Accepts the names DTypeName prints and the aliases float32, f32, bfloat16, float16, half, f16,
// i8, i4; InvalidArgument naming the accepted ones otherwise.
StatusOr<DType> ParseDType(std::string_view name);

// Why parameters are acquired: forward, backward (gradients are written), or recomputation of a
// checkpointed block's forward during backward (counts as neither use).
enum class Phase : uint8_t { kForward, kBackward, kRecompute };

}  // namespace tierzero
