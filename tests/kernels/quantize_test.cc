// Block quantization (kernels/quantize.h) element by element against a scalar double reference,
// on awkward layouts (tails, blocks of one element, runs shorter than a block), on every SIMD
// path this CPU supports (forced through TZ_SIMD), which must also agree with each other bit for
// bit; all-zero, tiny and non-finite blocks; the fused sum and requantization.
#include "kernels/quantize.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/convert.h"
#include "core/cpu_features.h"

namespace tierzero::kernels {
namespace {

std::vector<SimdLevel> Levels() {
  std::vector<SimdLevel> out;
  for (SimdLevel l : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512})
    if (SimdLevelSupported(l)) out.push_back(l);
  return out;
}

QuantLayout MakeLayout(int bits, uint32_t block, std::vector<uint64_t> runs) {
  auto l = QuantLayout::Create({bits, block}, runs);
  EXPECT_TRUE(l.ok()) << l.status().ToString();
  return *l;
}

// Values spanning magnitudes, with runs of very different scale (a block must not share one).
std::vector<float> Values(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i)
    v[i] = normal(rng) * std::ldexp(1.0f, static_cast<int>(i / 97 % 9) - 4);
  return v;
}

// Rounds the values to `t` and back, so the reference sees exactly what the kernel reads.
std::vector<uint8_t> AsType(const std::vector<float>& v, DType t, std::vector<float>* seen) {
  std::vector<uint8_t> raw(DTypeBytes(t, v.size()));
  EXPECT_TRUE(Convert(v.data(), DType::kF32, raw.data(), t, v.size()).ok());
  seen->resize(v.size());
  EXPECT_TRUE(Convert(raw.data(), t, seen->data(), DType::kF32, v.size()).ok());
  return raw;
}

int RefQ(const uint8_t* payload, uint64_t i, int bits) {
  if (bits == 8) return static_cast<int8_t>(payload[i]);
  const int nib = (payload[i / 2] >> (4 * (i % 2))) & 0xF;
  return nib >= 8 ? nib - 16 : nib;
}

// Checks `packed` against the double reference of the format (quantize.h), block by block:
// the scale is absmax / qmax rounded once, each q is the nearest integer to x * qmax / absmax
// (a tie may go either way: the kernel's product is rounded to fp32 first), padding nibbles 0.
void CheckPacked(const QuantLayout& l, const std::vector<float>& x,
                 const std::vector<uint8_t>& packed) {
  const int bits = l.spec().bits, qmax = bits == 8 ? 127 : 7;
  const auto* scales = reinterpret_cast<const float*>(packed.data());
  const uint8_t* payload = packed.data() + l.scale_bytes();
  for (const QuantLayout::Run& r : l.runs()) {
    for (uint64_t k = 0; k * l.spec().block_elems < r.elems; ++k) {
      const uint64_t first = r.elem + k * l.spec().block_elems;
      const uint64_t n = std::min<uint64_t>(l.spec().block_elems, r.elem + r.elems - first);
      const uint8_t* p = payload + r.byte + k * l.BlockPayloadBytes(l.spec().block_elems);
      double amax = 0;
      for (uint64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(double{x[first + i]}));
      const float scale = scales[r.block + k];
      ASSERT_EQ(scale, static_cast<float>(amax / qmax)) << "block " << r.block + k;
      for (uint64_t i = 0; i < n; ++i) {
        const double exact = double{x[first + i]} * qmax / amax;
        const int q = RefQ(p, i, bits);
        ASSERT_LE(std::abs(q), qmax);
        ASSERT_LE(std::fabs(q - exact), 0.5 + 1e-5)
            << "element " << first + i << " x " << x[first + i];
        if (std::fabs(std::fabs(exact - std::trunc(exact)) - 0.5) > 1e-5) {
          ASSERT_EQ(q, static_cast<int>(std::lround(exact))) << "element " << first + i;
        }
      }
      if (bits == 4 && n % 2 == 1) {
        ASSERT_EQ(p[n / 2] >> 4, 0) << "padding nibble";
      }
    }
  }
}

// The dequantized value of every element: q * scale, exact in double, rounded once to fp32.
std::vector<float> RefDequantize(const QuantLayout& l, const std::vector<uint8_t>& packed) {
  std::vector<float> out(l.elems());
  const auto* scales = reinterpret_cast<const float*>(packed.data());
  const uint8_t* payload = packed.data() + l.scale_bytes();
  for (const QuantLayout::Run& r : l.runs()) {
    for (uint64_t i = 0; i < r.elems; ++i) {
      const uint64_t k = i / l.spec().block_elems, j = i % l.spec().block_elems;
      const uint8_t* p = payload + r.byte + k * l.BlockPayloadBytes(l.spec().block_elems);
      out[r.elem + i] = static_cast<float>(double{scales[r.block + k]} * RefQ(p, j, l.spec().bits));
    }
  }
  return out;
}

TEST(QuantLayoutTest, BlocksNeverSpanRuns) {
  const QuantLayout l = MakeLayout(4, 64, {1, 0, 64, 65, 200});
  ASSERT_EQ(l.runs().size(), 4u);  // the empty run is skipped
  EXPECT_EQ(l.elems(), 330u);
  // 1 | 64 | 64 + 1 | 64 + 64 + 64 + 8
  EXPECT_EQ(l.blocks(), 1u + 1 + 2 + 4);
  EXPECT_EQ(l.payload_bytes(), 1u + 32 + 33 + 100);
  EXPECT_EQ(l.runs()[2].block, 2u);
  EXPECT_EQ(l.runs()[2].byte, 33u);
  EXPECT_EQ(l.runs()[3].elem, 130u);
  EXPECT_EQ(l.bytes(), l.blocks() * 4 + l.payload_bytes());
}

TEST(QuantLayoutTest, EmptyLayoutsQuantizeNothing) {
  const QuantLayout l = MakeLayout(8, 64, {0});
  EXPECT_EQ(l.blocks(), 0u);
  EXPECT_EQ(l.bytes(), 0u);
  float x = 1;
  uint8_t packed = 0xAB;
  EXPECT_TRUE(Quantize(l, &x, DType::kF32, &packed).ok());
  EXPECT_TRUE(Dequantize(l, &packed, &x, DType::kF32).ok());
  EXPECT_EQ(packed, 0xAB);
  EXPECT_EQ(x, 1.0f);
}

TEST(QuantLayoutTest, RejectsBadSpecs) {
  EXPECT_FALSE(QuantLayout::Create({6, 256}, std::vector<uint64_t>{10}).ok());
  EXPECT_FALSE(QuantLayout::Create({8, 32}, std::vector<uint64_t>{10}).ok());
  EXPECT_FALSE(QuantLayout::Create({8, 8192}, std::vector<uint64_t>{10}).ok());
  const QuantLayout l = MakeLayout(8, 64, {10});
  std::vector<uint8_t> packed(l.bytes());
  std::vector<int8_t> in(10);
  EXPECT_EQ(Quantize(l, in.data(), DType::kI8, packed.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Dequantize(l, packed.data(), in.data(), DType::kI8).code(),
            StatusCode::kInvalidArgument);
}

struct Case {
  int bits;
  uint32_t block;
  DType dtype;
};

class QuantizePathTest : public testing::TestWithParam<Case> {};

TEST_P(QuantizePathTest, EveryPathMatchesTheReferenceAndEachOther) {
  const Case c = GetParam();
  // Tails, runs of one element, a run of exactly one block, a large one that runs in parallel.
  const QuantLayout l =
      MakeLayout(c.bits, c.block, {1, 3, c.block, c.block + 1, 2 * c.block - 1, 1000, 300001});
  std::vector<float> seen;
  const std::vector<uint8_t> src = AsType(Values(l.elems(), 7), c.dtype, &seen);
  std::vector<uint8_t> first;
  for (SimdLevel level : Levels()) {
    SCOPED_TRACE(std::string(SimdLevelName(level)));
    ScopedTunable<std::string> forced(kSimdTunable, std::string(SimdLevelName(level)));
    std::vector<uint8_t> packed(l.bytes(), 0xAB);
    ASSERT_TRUE(Quantize(l, src.data(), c.dtype, packed.data()).ok());
    CheckPacked(l, seen, packed);
    if (first.empty()) first = packed;
    ASSERT_EQ(packed, first) << "the paths disagree";
    // Dequantized into each dtype: q * scale rounded once to fp32, then to the dtype.
    const std::vector<float> ref = RefDequantize(l, packed);
    for (DType out : {DType::kF32, DType::kBF16, DType::kF16}) {
      std::vector<uint8_t> got(DTypeBytes(out, l.elems()));
      ASSERT_TRUE(Dequantize(l, packed.data(), got.data(), out).ok());
      std::vector<uint8_t> want(got.size());
      ASSERT_TRUE(Convert(ref.data(), DType::kF32, want.data(), out, ref.size()).ok());
      ASSERT_EQ(got, want) << DTypeName(out);
    }
    // The documented error bound: half a scale, plus fp32 rounding.
    for (const QuantLayout::Run& r : l.runs()) {
      for (uint64_t i = 0; i < r.elems; ++i) {
        const uint64_t blk = r.block + i / c.block;
        const float scale = reinterpret_cast<const float*>(packed.data())[blk];
        ASSERT_LE(std::fabs(double{ref[r.elem + i]} - seen[r.elem + i]),
                  scale * (0.5 + 1e-4) + std::fabs(seen[r.elem + i]) * 1e-6);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantizePathTest,
                         testing::Values(Case{8, 256, DType::kF32}, Case{8, 64, DType::kBF16},
                                         Case{8, 100, DType::kF16}, Case{4, 256, DType::kBF16},
                                         Case{4, 4096, DType::kF32}, Case{4, 65, DType::kF16},
                                         Case{8, 4096, DType::kBF16}),
                         [](const auto& info) {
                           return "int" + std::to_string(info.param.bits) + "_block" +
                                  std::to_string(info.param.block) + "_" +
                                  std::string(DTypeName(info.param.dtype));
                         });

TEST(QuantizeSpecialTest, ZeroTinyAndNonFiniteBlocks) {
  // Blocks of 64: zeros, a tiny block, an Inf, a NaN, -Inf next to finite values, a normal one;
  // each block its own run, and all in one run (the kernels then take the blocks as a group,
  // Note [Blocks in groups]: a special block must not disturb its neighbours).
  const std::vector<std::vector<uint64_t>> run_sets = {{64, 64, 64, 64, 64, 63}, {383}};
  for (const std::vector<uint64_t>& runs : run_sets)
    for (int bits : {4, 8}) {
      SCOPED_TRACE(std::to_string(runs.size()) + " runs");
      const QuantLayout l = MakeLayout(bits, 64, runs);
      std::vector<float> x(l.elems(), 0.0f);
      for (int i = 64; i < 128; ++i) x[i] = 1e-38f * (i % 3 - 1);
      x[128 + 5] = std::numeric_limits<float>::infinity();
      x[192 + 9] = std::numeric_limits<float>::quiet_NaN();
      x[256] = -std::numeric_limits<float>::infinity();
      x[257] = 1.0f;
      for (int i = 320; i < 383; ++i) x[i] = static_cast<float>(i - 350);
      // The same values as fp32, bf16 and fp16 inputs (the 16-bit formats take their absolute
      // maximum on the bit patterns; Inf and NaN must still make the scale NaN).
      for (DType in : {DType::kF32, DType::kBF16, DType::kF16})
        for (SimdLevel level : Levels()) {
          SCOPED_TRACE(std::string(SimdLevelName(level)) + " int" + std::to_string(bits) +
                       " from " + std::string(DTypeName(in)));
          ScopedTunable<std::string> forced(kSimdTunable, std::string(SimdLevelName(level)));
          std::vector<uint8_t> xin(DTypeBytes(in, x.size()));
          ASSERT_TRUE(Convert(x.data(), DType::kF32, xin.data(), in, x.size()).ok());
          std::vector<uint8_t> packed(l.bytes(), 0xCD);
          ASSERT_TRUE(Quantize(l, xin.data(), in, packed.data()).ok());
          const auto* scales = reinterpret_cast<const float*>(packed.data());
          EXPECT_EQ(scales[0], 0.0f);
          EXPECT_EQ(scales[1], 0.0f);  // tiny: flushed (Note [Tiny blocks])
          EXPECT_TRUE(std::isnan(scales[2]) && std::isnan(scales[3]) && std::isnan(scales[4]));
          EXPECT_EQ(scales[5], bits == 8 ? 32.0f / 127 : 32.0f / 7);
          std::vector<float> out(l.elems());
          ASSERT_TRUE(Dequantize(l, packed.data(), out.data(), DType::kF32).ok());
          for (int i = 0; i < 128; ++i) ASSERT_EQ(out[i], 0.0f);
          for (int i = 128; i < 320; ++i) ASSERT_TRUE(std::isnan(out[i])) << i;  // whole block NaN
          std::vector<uint16_t> out16(l.elems());
          ASSERT_TRUE(Dequantize(l, packed.data(), out16.data(), DType::kBF16).ok());
          for (int i = 128; i < 320; ++i) {
            ASSERT_TRUE(std::isnan(BF16ToF32Scalar(out16[i]))) << "bf16 " << i;
          }
          for (int i = 320; i < 383; ++i) {
            ASSERT_LE(std::fabs(out[i] - x[i]), scales[5] * 0.5f * (1 + 1e-5f)) << i;
          }
          for (uint64_t b = 0; b < 2 * l.BlockPayloadBytes(64); ++b)
            ASSERT_EQ(packed[l.scale_bytes() + b], 0) << "zero payload";
        }
    }
}

// DequantizeSum adds the inputs in order in fp32; the fused requantization equals quantizing
// that sum.
TEST(QuantizeSumTest, SumsInOrderAndRequantizesTheSum) {
  for (int bits : {4, 8}) {
    const QuantLayout l = MakeLayout(bits, 128, {5, 1000, 129, 70000});
    std::vector<std::vector<uint8_t>> packed(3, std::vector<uint8_t>(l.bytes()));
    std::vector<const void*> inputs;
    for (int k = 0; k < 3; ++k) {
      std::vector<float> x = Values(l.elems(), 11 + k);
      ASSERT_TRUE(Quantize(l, x.data(), DType::kF32, packed[k].data()).ok());
      inputs.push_back(packed[k].data());
    }
    std::vector<float> want(l.elems(), 0.0f);
    for (int k = 0; k < 3; ++k) {
      const std::vector<float> d = RefDequantize(l, packed[k]);
      for (uint64_t i = 0; i < want.size(); ++i) want[i] = k == 0 ? d[i] : want[i] + d[i];
    }
    for (SimdLevel level : Levels()) {
      SCOPED_TRACE(std::string(SimdLevelName(level)) + " int" + std::to_string(bits));
      ScopedTunable<std::string> forced(kSimdTunable, std::string(SimdLevelName(level)));
      std::vector<float> sum(l.elems());
      ASSERT_TRUE(DequantizeSum(l, inputs, sum.data()).ok());
      ASSERT_EQ(std::memcmp(sum.data(), want.data(), sum.size() * 4), 0);
      std::vector<uint8_t> fused(l.bytes()), direct(l.bytes());
      ASSERT_TRUE(DequantizeSumRequantize(l, inputs, fused.data()).ok());
      ASSERT_TRUE(Quantize(l, want.data(), DType::kF32, direct.data()).ok());
      ASSERT_EQ(fused, direct);
    }
  }
  const QuantLayout l = MakeLayout(8, 64, {10});
  std::vector<float> out(10);
  EXPECT_EQ(DequantizeSum(l, {}, out.data()).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tierzero::kernels
