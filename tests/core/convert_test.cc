// Conversions against an independent reference: the nearest representable value found by
// comparing exact distances in double precision, ties to the even encoding, over values decoded
// from the bit fields. Every SIMD path this CPU supports is run, directly and through TZ_SIMD.
#include "core/convert.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "tierzero/convert.h"

namespace tierzero {
namespace {

// ---- Independent reference -------------------------------------------------------------------

// Magnitude of the 16-bit encoding `t` (sign bit clear). The infinity encoding counts as the
// next power of two above the largest finite value, which is where IEEE rounding puts overflow.
double Bf16Magnitude(uint32_t t) {
  const int e = static_cast<int>(t >> 7), m = static_cast<int>(t & 0x7F);
  if (e == 0) return std::ldexp(m, -133);
  return std::ldexp(128 + m, e - 134);
}
double F16Magnitude(uint32_t t) {
  const int e = static_cast<int>(t >> 10), m = static_cast<int>(t & 0x3FF);
  if (e == 0) return std::ldexp(m, -24);
  return std::ldexp(1024 + m, e - 25);
}

// Nearest of the encodings 0..inf_code by magnitude, ties to even.
uint16_t RoundMagnitude(double a, uint32_t inf_code, double (*magnitude)(uint32_t)) {
  if (a >= magnitude(inf_code)) return static_cast<uint16_t>(inf_code);
  uint32_t lo = 0, hi = inf_code;  // invariant: mag(lo) <= a < mag(hi)
  while (hi - lo > 1) {
    uint32_t mid = (lo + hi) / 2;
    (magnitude(mid) <= a ? lo : hi) = mid;
  }
  const double dlo = a - magnitude(lo), dhi = magnitude(hi) - a;
  if (dlo < dhi) return static_cast<uint16_t>(lo);
  if (dhi < dlo) return static_cast<uint16_t>(hi);
  return static_cast<uint16_t>((lo & 1) ? hi : lo);
}

uint16_t RefToBF16(float f) {
  const uint32_t bits = FloatBits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet, keep payload
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  return sign | RoundMagnitude(std::fabs(static_cast<double>(f)), 0x7F80, Bf16Magnitude);
}

uint16_t RefToF16(float f) {
  const uint32_t bits = FloatBits(f);
  if (std::isnan(f))
    return static_cast<uint16_t>(((bits >> 16) & 0x8000) | 0x7E00 | ((bits >> 13) & 0x3FF));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  return sign | RoundMagnitude(std::fabs(static_cast<double>(f)), 0x7C00, F16Magnitude);
}

double RefDecode(uint16_t h, double (*magnitude)(uint32_t), uint32_t inf_code) {
  const uint32_t t = h & 0x7FFF;
  const double v = t == inf_code ? INFINITY : magnitude(t);
  return (h & 0x8000) ? -v : v;
}

// ---- Helpers -----------------------------------------------------------------------------------

std::vector<SimdLevel> SupportedLevels() {
  std::vector<SimdLevel> levels;
  for (SimdLevel l : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (SimdLevelSupported(l)) levels.push_back(l);
  }
  return levels;
}

class ConvertPathTest : public testing::TestWithParam<SimdLevel> {
 protected:
  void SetUp() override {
    if (!SimdLevelSupported(GetParam())) {
      GTEST_SKIP() << SimdLevelName(GetParam()) << " is not supported by this CPU";
    }
    k_ = ConvertKernelsFor(GetParam());
    ASSERT_NE(k_, nullptr);
  }
  const ConvertKernels* k_ = nullptr;
};

// Values that stress every branch: random bit patterns (all exponents, NaNs, Infs, denormals),
// values around the fp16 range and its denormals, and exact ties.
std::vector<float> StressValues(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_real_distribution<float> wide(-70000.0f, 70000.0f);
  std::uniform_int_distribution<int> exp(-30, 17);
  std::uniform_real_distribution<float> unit(1.0f, 2.0f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    switch (i % 4) {
      case 0:
        v[i] = BitsToFloat(bits(rng));
        break;
      case 1:
        v[i] = wide(rng);
        break;
      case 2:
        v[i] = std::ldexp(unit(rng), exp(rng)) * ((bits(rng) & 1) ? -1.0f : 1.0f);
        break;
      default: {
        // Exact halfway points of bf16 (low 16 bits 0x8000) and of fp16 normals (low 13 bits).
        uint32_t b = bits(rng);
        v[i] = BitsToFloat((i % 8 == 3) ? ((b & 0xFFFF0000u) | 0x8000u)
                                        : ((b & 0x87FFE000u) | 0x38000000u | 0x1000u));
      }
    }
  }
  return v;
}

// ---- Tests -------------------------------------------------------------------------------------

TEST(ConvertScalarTest, ReferenceAgreesOnSpecialValues) {
  const float specials[] = {0.0f,     -0.0f,         INFINITY,       -INFINITY, NAN,
                            -NAN,     1.0f,          -2.5f,          65504.0f,  65519.99f,
                            65520.0f, 1e-45f,        5.96e-8f,       2.98e-8f,  3.0e-8f,
                            6.1e-5f,  3.4028235e38f, 1.17549435e-38f};
  for (float f : specials) {
    EXPECT_EQ(F32ToBF16Scalar(f), RefToBF16(f)) << f;
    EXPECT_EQ(F32ToF16Scalar(f), RefToF16(f)) << f;
  }
  EXPECT_EQ(F32ToF16Scalar(65520.0f), 0x7C00);  // overflow: tie rounds to even = Inf
  EXPECT_EQ(F32ToF16Scalar(65519.99f), 0x7BFF);
  EXPECT_EQ(F32ToF16Scalar(-1e6f), 0xFC00);
  EXPECT_EQ(F32ToF16Scalar(std::ldexp(1.0f, -25)), 0x0000);  // tie between 0 and 2^-24 -> 0
  EXPECT_EQ(F32ToF16Scalar(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(F32ToF16Scalar(std::ldexp(1.0f, -24)), 0x0001);  // smallest denormal
  EXPECT_EQ(F32ToBF16Scalar(3.4028235e38f), 0x7F80);         // fp32 max rounds up to bf16 Inf
  EXPECT_TRUE(std::isnan(BF16ToF32Scalar(F32ToBF16Scalar(NAN))));
  EXPECT_TRUE(std::isnan(F16ToF32Scalar(F32ToF16Scalar(-NAN))));
  EXPECT_EQ(F32ToF16Scalar(-NAN) & 0x8000, 0x8000);
}

TEST_P(ConvertPathTest, AllBF16PatternsRoundTripExactly) {
  std::vector<uint16_t> h(65536), back(65536);
  std::vector<float> f(65536);
  for (uint32_t i = 0; i < 65536; ++i) h[i] = static_cast<uint16_t>(i);
  k_->bf16_to_f32(h.data(), f.data(), h.size());
  k_->f32_to_bf16(f.data(), back.data(), f.size());
  for (uint32_t i = 0; i < 65536; ++i) {
    const bool nan = (i & 0x7FFF) > 0x7F80;
    if (nan) {
      ASSERT_TRUE(std::isnan(f[i])) << std::hex << i;
      // NaN is quieted (documented in convert.h): sign and payload survive, quiet bit set.
      ASSERT_EQ(back[i], i | 0x40) << std::hex << i;
    } else {
      ASSERT_EQ(static_cast<double>(f[i]), RefDecode(h[i], Bf16Magnitude, 0x7F80)) << std::hex << i;
      ASSERT_EQ(back[i], i) << std::hex << i;
    }
  }
}

TEST_P(ConvertPathTest, AllF16PatternsRoundTripExactly) {
  std::vector<uint16_t> h(65536), back(65536);
  std::vector<float> f(65536);
  for (uint32_t i = 0; i < 65536; ++i) h[i] = static_cast<uint16_t>(i);
  k_->f16_to_f32(h.data(), f.data(), h.size());
  k_->f32_to_f16(f.data(), back.data(), f.size());
  for (uint32_t i = 0; i < 65536; ++i) {
    const bool nan = (i & 0x7FFF) > 0x7C00;
    if (nan) {
      ASSERT_TRUE(std::isnan(f[i])) << std::hex << i;
      ASSERT_EQ(back[i], i | 0x200) << std::hex << i;
    } else {
      ASSERT_EQ(static_cast<double>(f[i]), RefDecode(h[i], F16Magnitude, 0x7C00)) << std::hex << i;
      ASSERT_EQ(back[i], i) << std::hex << i;
    }
  }
}

TEST_P(ConvertPathTest, TenMillionRandomValuesMatchReference) {
  // 10^7 values: large enough that the 16-bit outputs (20 MB) take the streaming-store path.
  constexpr size_t kN = 10'000'000;
  std::vector<float> src = StressValues(kN, 1234);
  std::vector<uint16_t> bf(kN), hf(kN);
  k_->f32_to_bf16(src.data(), bf.data(), kN);
  k_->f32_to_f16(src.data(), hf.data(), kN);
  size_t bad_bf = 0, bad_hf = 0;
  for (size_t i = 0; i < kN; ++i) {
    if (bf[i] != RefToBF16(src[i]) && bad_bf++ < 5) {
      ADD_FAILURE() << "bf16 of " << std::hexfloat << src[i] << ": got 0x" << std::hex << bf[i]
                    << " want 0x" << RefToBF16(src[i]);
    }
    if (hf[i] != RefToF16(src[i]) && bad_hf++ < 5) {
      ADD_FAILURE() << "fp16 of " << std::hexfloat << src[i] << ": got 0x" << std::hex << hf[i]
                    << " want 0x" << RefToF16(src[i]);
    }
  }
  EXPECT_EQ(bad_bf, 0u);
  EXPECT_EQ(bad_hf, 0u);
}

TEST_P(ConvertPathTest, AwkwardSizesAndMisalignedBuffersEqualScalar) {
  std::mt19937 rng(7);
  for (size_t n :
       {size_t{0}, size_t{1}, size_t{7}, size_t{15}, size_t{16}, size_t{17}, size_t{31}, size_t{33},
        size_t{255}, size_t{1023}, size_t{(1 << 20) + 7}, size_t{(5 << 20) + 3}}) {
    for (size_t offset : {0, 1, 3}) {
      std::vector<float> src = StressValues(n + offset, static_cast<uint32_t>(n));
      std::vector<uint16_t> out(n + offset + 1, 0xDEAD), want(n);
      std::vector<float> fout(n + offset + 1, -7.0f);
      const float* s = src.data() + offset;
      k_->f32_to_bf16(s, out.data() + offset, n);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[offset + i], F32ToBF16Scalar(s[i])) << n;
      ASSERT_EQ(out[offset + n], 0xDEAD) << "wrote past the end, n=" << n;
      k_->bf16_to_f32(out.data() + offset, fout.data() + offset, n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(FloatBits(fout[offset + i]), FloatBits(BF16ToF32Scalar(out[offset + i])));
      }
      ASSERT_EQ(fout[offset + n], -7.0f);
      k_->f32_to_f16(s, out.data() + offset, n);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[offset + i], F32ToF16Scalar(s[i])) << n;
      k_->f16_to_f32(out.data() + offset, fout.data() + offset, n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(FloatBits(fout[offset + i]), FloatBits(F16ToF32Scalar(out[offset + i])));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, ConvertPathTest,
                         testing::Values(SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512),
                         [](const auto& info) { return std::string(SimdLevelName(info.param)); });

TEST(ConvertDispatchTest, TunableForcesEachPath) {
  for (SimdLevel level : SupportedLevels()) {
    ScopedTunable<std::string> forced(kSimdTunable, std::string(SimdLevelName(level)));
    EXPECT_EQ(ActiveSimdLevel(), level);
    EXPECT_EQ(&ActiveConvertKernels(), ConvertKernelsFor(level));
  }
  ScopedTunable<std::string> automatic(kSimdTunable, "auto");
  EXPECT_EQ(ActiveSimdLevel(), DetectedSimdLevel());
}

TEST(ConvertDispatchTest, UnsupportedForcedLevelFallsBack) {
  if (SimdLevelSupported(SimdLevel::kAvx512)) GTEST_SKIP() << "this CPU has AVX-512";
  ScopedTunable<std::string> forced(kSimdTunable, "avx512");
  EXPECT_EQ(ActiveSimdLevel(), DetectedSimdLevel());
  EXPECT_EQ(ConvertKernelsFor(SimdLevel::kAvx512), nullptr);
}

TEST(ConvertDispatchTest, GenericConvertCoversEveryFloatPair) {
  std::vector<float> src = StressValues(1000, 99);
  const DType types[] = {DType::kF32, DType::kBF16, DType::kF16};
  for (DType from : types) {
    // Source values representable in `from`.
    std::vector<uint8_t> a(4000), b(4000);
    ASSERT_TRUE(Convert(src.data(), DType::kF32, a.data(), from, 1000).ok());
    for (DType to : types) {
      ASSERT_TRUE(Convert(a.data(), from, b.data(), to, 1000).ok());
      std::vector<float> af(1000), bf(1000);
      ASSERT_TRUE(Convert(a.data(), from, af.data(), DType::kF32, 1000).ok());
      ASSERT_TRUE(Convert(b.data(), to, bf.data(), DType::kF32, 1000).ok());
      for (int i = 0; i < 1000; ++i) {
        // One rounding: b must equal the direct rounding of a's exact value.
        uint16_t want16 = to == DType::kBF16 ? F32ToBF16Scalar(af[i]) : F32ToF16Scalar(af[i]);
        if (to == DType::kF32) {
          ASSERT_EQ(FloatBits(bf[i]), FloatBits(af[i]));
        } else {
          ASSERT_EQ(reinterpret_cast<uint16_t*>(b.data())[i], want16)
              << DTypeName(from) << "->" << DTypeName(to);
        }
      }
    }
  }
  Status bad = Convert(src.data(), DType::kF32, src.data(), DType::kI8, 1);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  // The public entry refuses a null buffer (hunt 48: a crash); none is read for no elements.
  EXPECT_EQ(CastElements(nullptr, DType::kF32, src.data(), DType::kBF16, 8).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CastElements(src.data(), DType::kF32, nullptr, DType::kBF16, 8).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(CastElements(nullptr, DType::kF32, nullptr, DType::kBF16, 0).ok());
}

}  // namespace
}  // namespace tierzero
