// CRC32C with the SSE4.2 crc32 instruction. Compiled with AVX2 flags (which include SSE4.2).
//
// The instruction has a latency of 3 cycles and a throughput of 1, so one dependency chain runs
// at a third of its possible speed. Three independent streams over thirds of each 24 KiB block
// keep it busy; their CRCs are combined by shifting two of them over the bytes that follow
// (multiplication by x^(8*len) mod P, done with the instruction itself on a zero word).
#include <immintrin.h>

#include <cstring>

#include "offload/crc32c.h"

namespace tierzero::internal {
namespace {

// crc of `len` zero bytes appended to a message with crc state `crc` (raw, not inverted).
// Computes crc * x^(8*len) mod P by square-and-multiply over GF(2) polynomials.
uint32_t MultiplyModP(uint32_t a, uint32_t b) {
  // Reflected representation: bit 31 is x^0.
  uint32_t product = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & 0x80000000u) product ^= b;
    a <<= 1;
    b = (b & 1) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
  }
  return product;
}

uint32_t XPow8n(size_t n) {
  // x^(8n) mod P in reflected form; x^0 is 0x80000000.
  uint32_t result = 0x80000000u;
  uint32_t power = 0x00800000u;  // x^8
  while (n) {
    if (n & 1) result = MultiplyModP(result, power);
    power = MultiplyModP(power, power);
    n >>= 1;
  }
  return result;
}

uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

}  // namespace

uint32_t Crc32cHardware(const void* data, size_t n, uint32_t crc) {
  auto* p = static_cast<const uint8_t*>(data);
  uint64_t c0 = ~crc;
  constexpr size_t kStream = 8192;  // bytes per stream per block
  static const uint32_t kShift = XPow8n(kStream);
  while (n >= 3 * kStream) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < kStream; i += 8) {
      c0 = _mm_crc32_u64(c0, Load64(p + i));
      c1 = _mm_crc32_u64(c1, Load64(p + kStream + i));
      c2 = _mm_crc32_u64(c2, Load64(p + 2 * kStream + i));
    }
    // crc(A B C) = shift(shift(crcA) ^ crcB) ^ crcC, where the streams B and C started from 0.
    c0 = MultiplyModP(static_cast<uint32_t>(c0), kShift) ^ static_cast<uint32_t>(c1);
    c0 = MultiplyModP(static_cast<uint32_t>(c0), kShift) ^ static_cast<uint32_t>(c2);
    p += 3 * kStream;
    n -= 3 * kStream;
  }
  for (; n >= 8; n -= 8, p += 8) c0 = _mm_crc32_u64(c0, Load64(p));
  uint32_t c = static_cast<uint32_t>(c0);
  for (; n > 0; --n, ++p) c = _mm_crc32_u8(c, *p);
  return ~c;
}

}  // namespace tierzero::internal
