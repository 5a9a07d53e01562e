// CRC32C (Castagnoli), used to check NVMe extents. The SSE4.2 crc32 instruction where the CPU
// has it (every AVX2 CPU does), a table otherwise; both give the same value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tierzero {

// CRC32C of [data, data+n), continuing from `crc` (0 to start). Crc32c("123456789") = 0xE3069283.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

namespace internal {
uint32_t Crc32cTable(const void* data, size_t n, uint32_t crc);
uint32_t Crc32cHardware(const void* data, size_t n, uint32_t crc);  // REQUIRES: SSE4.2
}  // namespace internal

}  // namespace tierzero
