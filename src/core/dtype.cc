#include <string>

#include "tierzero/types.h"

namespace tierzero {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "fp32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    case DType::kI8:
      return "int8";
    case DType::kI4:
      return "int4";
  }
  return "unknown";
}

StatusOr<DType> ParseDType(std::string_view name) {
  struct Alias {
    std::string_view name;
    DType type;
  };
  static constexpr Alias kAliases[] = {
      {"fp32", DType::kF32},    {"float32", DType::kF32},   {"f32", DType::kF32},
      {"bf16", DType::kBF16},   {"bfloat16", DType::kBF16}, {"fp16", DType::kF16},
      {"float16", DType::kF16}, {"half", DType::kF16},      {"f16", DType::kF16},
      {"int8", DType::kI8},     {"i8", DType::kI8},         {"int4", DType::kI4},
      {"i4", DType::kI4},
  };
  for (const Alias& a : kAliases) {
    if (a.name == name) return a.type;
  }
  return InvalidArgumentError("unknown dtype '" + std::string(name) +
                              "'; expected fp32, bf16, fp16, int8 or int4");
}

}  // namespace tierzero
