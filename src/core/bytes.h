// Byte units and alignment. Parsing and printing sizes is public (tierzero/bytes.h).
#pragma once

#include <cstdint>

#include "core/status.h"
#include "tierzero/bytes.h"

namespace tierzero {

inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kMiB = 1024 * kKiB;
inline constexpr uint64_t kGiB = 1024 * kMiB;
inline constexpr uint64_t kTiB = 1024 * kGiB;

// Rounds up to a multiple of `alignment` (a power of two).
constexpr uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) & ~(alignment - 1);
}

}  // namespace tierzero
