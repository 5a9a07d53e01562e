#include "offload/crc32c.h"

#include <array>

#include "core/cpu_features.h"

namespace tierzero {
namespace internal {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kTable = MakeTable();

}  // namespace

uint32_t Crc32cTable(const void* data, size_t n, uint32_t crc) {
  auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = kTable[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

}  // namespace internal

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
  static const bool hardware = SimdLevelSupported(SimdLevel::kAvx2);
  return hardware ? internal::Crc32cHardware(data, n, crc) : internal::Crc32cTable(data, n, crc);
}

}  // namespace tierzero
