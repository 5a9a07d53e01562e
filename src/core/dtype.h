// dtypes: names, sizes and parsing. The enum lives in the public tierzero/types.h.
#pragma once

#include <string_view>

#include "core/status.h"
#include "tierzero/types.h"

namespace tierzero {

// Accepts the names DTypeName prints, plus "float32", "bfloat16", "float16", "half".
StatusOr<DType> ParseDType(std::string_view name);

// True for fp32, bf16, fp16.
constexpr bool IsFloatType(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16;
}

}  // namespace tierzero
