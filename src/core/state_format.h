// How Adam's moments are stored (docs/optimizer.md, "Compressed optimizer states";
// cpu_adam/state_codes.h): fp32; bf16 rounded stochastically; 8-bit codes in blocks of 64
// elements with a scale per block and moment. Shared by the optimizer's kernels (cpu_adam) and
// the memory that holds the states (shard/optimizer_states.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tierzero {

enum class StateFormat : uint8_t { kF32, kBF16, kInt8, kNone };

inline std::string_view StateFormatName(StateFormat f) {
  switch (f) {
    case StateFormat::kF32:
      return "fp32";
    case StateFormat::kBF16:
      return "bf16";
    case StateFormat::kInt8:
      return "int8";
    case StateFormat::kNone:
      return "none";
  }
  return "?";
}

// Bytes per element of one moment's values (kNone: no moments are held).
inline uint64_t MomentWidth(StateFormat f) {
  return f == StateFormat::kF32 ? 4 : f == StateFormat::kBF16 ? 2 : f == StateFormat::kInt8 ? 1 : 0;
}

// The 8-bit blocks (each with one scale per moment) of n elements' moments.
inline constexpr size_t kStateBlockElems = 64;
inline size_t StateScaleCount(size_t n) { return (n + kStateBlockElems - 1) / kStateBlockElems; }

// Bytes of one moment of n elements in format f: the values, and with kInt8 the scales.
inline uint64_t MomentBytes(StateFormat f, uint64_t n) {
  return MomentWidth(f) * n + (f == StateFormat::kInt8 ? 4 * StateScaleCount(n) : 0);
}

}  // namespace tierzero
