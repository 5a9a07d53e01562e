// CpuAdam with compressed moments (bf16, 8-bit codes): the codes against their definition (every
// code decodes and encodes back to itself, magnitudes in order, stochastic rounding unbiased), a
// step against AdamW in double precision from the decoded states (the master to fp32's accuracy,
// each moment within one step of its code), every SIMD path bit for bit equal to the scalar one,
// and the reason for stochastic rounding: with beta2 = 0.999 and no gradient, v decays as it
// should, where rounding to nearest would hold it still.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/convert.h"
#include "core/tunable.h"
#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/state_codes.h"

namespace tierzero {
namespace {

using internal::DecodeM;
using internal::DecodeV;
using internal::EncodeM;
using internal::EncodeV;

TEST(StateCodesTest, EveryCodeDecodesAndEncodesBackToItselfInOrder) {
  // Scale 1 (a block whose largest magnitude is kCodeTop): codes are their own values.
  float prev_m = -1, prev_v = -1;
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    for (uint32_t r : {0u, 0x1234u, 0xFFFFu}) {
      EXPECT_EQ(EncodeV(DecodeV(code, 1.0f), 1.0f, r), code) << c;
      EXPECT_EQ(EncodeM(DecodeM(code, 1.0f), 1.0f, r), code) << c;
    }
    const float v = DecodeV(code, 1.0f);
    EXPECT_GT(v, prev_v) << c;  // strictly increasing
    prev_v = v;
    if (c < 128) {
      const float m = DecodeM(code, 1.0f);
      EXPECT_GT(m, prev_m) << c;
      EXPECT_EQ(DecodeM(static_cast<uint8_t>(c | 0x80), 1.0f), -m);
      prev_m = m;
    }
  }
  EXPECT_EQ(DecodeM(127, 1.0f), internal::kCodeTop);
  EXPECT_EQ(DecodeV(255, 1.0f), internal::kCodeTop);
  EXPECT_EQ(DecodeM(1, 1.0f), std::ldexp(1.125f, -15));  // 4 exponent bits, 3 mantissa
  EXPECT_EQ(DecodeV(1, 1.0f), std::ldexp(1.125f, -31));  // 5 exponent bits, 3 mantissa
  // A non-zero v is never coded 0; a tiny m is.
  EXPECT_EQ(EncodeV(1e-30f, 1.0f, 0), 1);
  EXPECT_EQ(EncodeV(0.0f, 1.0f, 0xFFFF), 0);
  EXPECT_EQ(EncodeM(1e-30f, 1.0f, 0xFFFF) & 0x7F, 0);
  EXPECT_EQ(MomentBytes(StateFormat::kF32, 100), 400u);
  EXPECT_EQ(MomentBytes(StateFormat::kBF16, 100), 200u);
  EXPECT_EQ(MomentBytes(StateFormat::kInt8, 100), 100u + 2 * 4);
}

TEST(StateCodesTest, StochasticRoundingIsUnbiased) {
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> u(0.001f, 1.8f);
  for (int k = 0; k < 50; ++k) {
    const float x = u(rng);
    double sum_m = 0, sum_v = 0, sum_b = 0;
    for (uint32_t r = 0; r < 65536; ++r) {
      sum_m += DecodeM(EncodeM(-x, 1.0f, r), 1.0f);
      sum_v += DecodeV(EncodeV(x, 1.0f, r), 1.0f);
      sum_b += BF16ToF32Scalar(internal::Bf16Stochastic(x, r));
    }
    // Over every 16-bit draw the expectation is x, less the 4 low bits the draws do not reach
    // (a bias of at most 2^-16 of a code's step, 12.5% of x): ~2e-6 relative.
    EXPECT_NEAR(sum_m / 65536, -x, 4e-6 * x) << x;
    EXPECT_NEAR(sum_v / 65536, x, 4e-6 * x) << x;
    EXPECT_NEAR(sum_b / 65536, x, 1e-7 * x) << x;  // bf16 drops exactly 16 bits: exact
  }
}

// Compressed moments and their buffers, misaligned by one element like cpu_adam_test's.
struct Moments {
  StateFormat f;
  size_t n;
  std::vector<uint8_t> m, v;  // codes or bf16 bytes, one element of slack in front
  std::vector<float> ms, vs;  // scales (kInt8)
  void* m_at() { return m.data() + Width(); }
  void* v_at() { return v.data() + Width(); }
  size_t Width() const { return f == StateFormat::kBF16 ? 2 : 1; }
  float M(size_t i) const {
    return f == StateFormat::kBF16 ? BF16ToF32Scalar(Bf16(m, i))
                                   : DecodeM(m[i + 1], ms[i / internal::kStateBlockElems]);
  }
  float V(size_t i) const {
    return f == StateFormat::kBF16 ? BF16ToF32Scalar(Bf16(v, i))
                                   : DecodeV(v[i + 1], vs[i / internal::kStateBlockElems]);
  }
  static uint16_t Bf16(const std::vector<uint8_t>& b, size_t i) {
    uint16_t x;
    std::memcpy(&x, b.data() + 2 * (i + 1), 2);
    return x;
  }
};

// Random moments with magnitudes spread over several decades, coded.
Moments MakeMoments(StateFormat f, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> decades(-3.0f, 0.0f);
  Moments s{f, n, {}, {}, {}, {}};
  const size_t w = f == StateFormat::kBF16 ? 2 : 1;
  s.m.assign(w * (n + 1), 0);
  s.v.assign(w * (n + 1), 0);
  const size_t blocks = StateScaleCount(n);
  s.ms.assign(blocks, 0);
  s.vs.assign(blocks, 0);
  std::vector<float> m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    m[i] = 0.01f * normal(rng) * std::pow(10.0f, decades(rng));
    v[i] = 1e-4f * std::pow(10.0f, 2 * decades(rng));
  }
  if (f == StateFormat::kBF16) {
    for (size_t i = 0; i < n; ++i) {
      const uint16_t a = F32ToBF16Scalar(m[i]), b = F32ToBF16Scalar(v[i]);
      std::memcpy(s.m.data() + 2 * (i + 1), &a, 2);
      std::memcpy(s.v.data() + 2 * (i + 1), &b, 2);
    }
    return s;
  }
  for (size_t k = 0; k < blocks; ++k) {
    const size_t b = k * internal::kStateBlockElems;
    const size_t e = std::min(n, b + internal::kStateBlockElems);
    float am = 0, av = 0;
    for (size_t i = b; i < e; ++i) {
      am = std::max(am, std::fabs(m[i]));
      av = std::max(av, v[i]);
    }
    float mi, vi;
    internal::BlockScale(am, &s.ms[k], &mi);
    internal::BlockScale(av, &s.vs[k], &vi);
    for (size_t i = b; i < e; ++i) {
      s.m[i + 1] = EncodeM(m[i], mi, 0x8000);
      s.v[i + 1] = EncodeV(v[i], vi, 0x8000);
    }
  }
  return s;
}

struct StepRun {
  std::vector<float> p;
  std::vector<uint16_t> out;
  std::vector<uint8_t> g;  // bf16 gradients
  Moments st;
};

StepRun MakeRun(StateFormat f, size_t n, uint32_t seed) {
  std::mt19937 rng(seed + 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  StepRun r{{}, {}, {}, MakeMoments(f, n, seed)};
  r.p.resize(n + 1);
  for (float& x : r.p) x = normal(rng);
  r.out.assign(n + 1, 0);
  r.g.resize(2 * (n + 1));
  for (size_t i = 0; i <= n; ++i) {
    const uint16_t b = F32ToBF16Scalar(0.02f * normal(rng));
    std::memcpy(r.g.data() + 2 * i, &b, 2);
  }
  return r;
}

AdamBuffers BuffersOf(StepRun& r, uint32_t key) {
  AdamBuffers b;
  b.master = r.p.data() + 1;
  b.grad = r.g.data() + 2;
  b.grad_dtype = DType::kBF16;
  b.out = r.out.data() + 1;
  b.out_dtype = DType::kBF16;
  b.n = r.st.n;
  b.states = r.st.f;
  b.m_state = r.st.m_at();
  b.v_state = r.st.v_at();
  b.m_scale = r.st.ms.data();
  b.v_scale = r.st.vs.data();
  b.rounding_key = key;
  return b;
}

AdamConfig Config() {
  AdamConfig c;
  c.lr = 1e-3f;
  c.beta1 = 0.9f;
  c.beta2 = 0.999f;
  c.eps = 1e-8f;
  c.weight_decay = 0.1f;
  c.adamw = true;
  return c;
}

std::unique_ptr<CpuAdam> MakeAdam(int threads = 2) {
  CpuAdamOptions o;
  o.threads = threads;
  o.block_elems = 1024;  // several work blocks per call
  return std::move(CpuAdam::Create(Config(), o)).value();
}

class CompressedPathTest : public testing::TestWithParam<std::tuple<SimdLevel, StateFormat>> {
 protected:
  void SetUp() override {
    if (!SimdLevelSupported(std::get<0>(GetParam()))) {
      GTEST_SKIP() << SimdLevelName(std::get<0>(GetParam())) << " is not supported by this CPU";
    }
  }
  SimdLevel level() const { return std::get<0>(GetParam()); }
  StateFormat format() const { return std::get<1>(GetParam()); }
};

// One step from decoded states against AdamW in double precision: the master and its bf16 copy
// as fp32 delivers them, each new moment within one step of its representation of the exact one.
TEST_P(CompressedPathTest, AStepMatchesDoublePrecisionAdamWFromTheDecodedStates) {
  ScopedTunable<std::string> forced(kSimdTunable, std::string(SimdLevelName(level())));
  const size_t n = 5000;  // blocks of 64 and a tail; several work blocks
  StepRun r = MakeRun(format(), n, 7);
  const StepRun before = r;
  auto adam = MakeAdam();
  AdamStepOptions so;
  so.step = 3;
  so.lr = 2e-3f;
  ASSERT_TRUE(adam->Step(BuffersOf(r, 1000), so).ok());
  const AdamConfig c = Config();
  const double bc1 = 1 - std::pow(0.9, 3.0), bc2 = 1 - std::pow(0.999, 3.0);
  int bad = 0;
  for (size_t i = 0; i < n && bad < 5; ++i) {
    const double gd = BF16ToF32Scalar(Moments::Bf16(before.g, i));
    const double m = 0.9 * before.st.M(i) + 0.1 * gd;
    const double v = 0.999 * before.st.V(i) + 0.001 * gd * gd;
    const double p0 = before.p[i + 1];
    const double upd = so.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + c.eps);
    const double p = p0 * (1 - so.lr * c.weight_decay) - upd;
    const double got_p = r.p[i + 1];
    // One code step: 2^-7 relative for bf16, 2^-3 for the 8-bit codes; the 8-bit codes also round
    // to the block's smallest code (m to 0) at 2^-15 (m) or 2^-31 (v) of its scale.
    const double rel = format() == StateFormat::kBF16 ? 1.0 / 128 : 1.0 / 8;
    const size_t k = i / internal::kStateBlockElems;
    const double m_floor = format() == StateFormat::kInt8 ? r.st.ms[k] * std::ldexp(1.2, -15) : 0;
    const double v_floor = format() == StateFormat::kInt8 ? r.st.vs[k] * std::ldexp(1.2, -31) : 0;
    const bool ok = std::fabs(got_p - p) <= 1e-6 * std::fabs(p0) + 1e-5 * std::fabs(upd) &&
                    r.out[i + 1] == F32ToBF16Scalar(r.p[i + 1]) &&
                    std::fabs(r.st.M(i) - m) <= rel * std::fabs(m) * 1.0001 + m_floor + 1e-12 &&
                    std::fabs(r.st.V(i) - v) <= rel * std::fabs(v) * 1.0001 + v_floor + 1e-20;
    if (!ok) {
      ++bad;
      ADD_FAILURE() << "element " << i << ": p " << got_p << " (" << p << "), m " << r.st.M(i)
                    << " (" << m << "), v " << r.st.V(i) << " (" << v << ")";
    }
  }
}

TEST_P(CompressedPathTest, BitIdenticalToTheScalarPathOverSteps) {
  for (size_t n : {size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{1000}, size_t{4099}}) {
    StepRun a = MakeRun(format(), n, 11), b = MakeRun(format(), n, 11);
    std::unique_ptr<CpuAdam> va, sa;
    {
      ScopedTunable<std::string> forced(kSimdTunable, std::string(SimdLevelName(level())));
      va = MakeAdam(2);
    }
    {
      ScopedTunable<std::string> forced(kSimdTunable, "scalar");
      sa = MakeAdam(1);
    }
    ASSERT_EQ(va->simd_level(), level());
    for (int t = 1; t <= 4; ++t) {
      AdamStepOptions so;
      so.step = t;
      ASSERT_TRUE(va->Step(BuffersOf(a, 77), so).ok());
      ASSERT_TRUE(sa->Step(BuffersOf(b, 77), so).ok());
    }
    EXPECT_EQ(a.p, b.p) << n;
    EXPECT_EQ(a.out, b.out) << n;
    EXPECT_EQ(a.st.m, b.st.m) << n;
    EXPECT_EQ(a.st.v, b.st.v) << n;
    EXPECT_EQ(a.st.ms, b.st.ms) << n;
    EXPECT_EQ(a.st.vs, b.st.vs) << n;
  }
}

// Note [Stochastic rounding of the moments]: no gradient for 700 steps, beta2 = 0.999. The exact v
// is v0 x 0.999^700 = 0.50 v0; rounded to nearest, a bf16 v would not move at all.
TEST_P(CompressedPathTest, TheSecondMomentDecaysWithoutAGradient) {
  ScopedTunable<std::string> forced(kSimdTunable, std::string(SimdLevelName(level())));
  const size_t n = 4096;
  StepRun r = MakeRun(format(), n, 3);
  std::fill(r.g.begin(), r.g.end(), 0);
  double v0 = 0;
  for (size_t i = 0; i < n; ++i) v0 += r.st.V(i);
  auto adam = MakeAdam();
  for (int t = 1; t <= 700; ++t) {
    AdamStepOptions so;
    so.step = t;
    so.lr = 0;
    ASSERT_TRUE(adam->Step(BuffersOf(r, 5), so).ok());
  }
  double v = 0;
  for (size_t i = 0; i < n; ++i) v += r.st.V(i);
  EXPECT_NEAR(v / v0, std::pow(0.999, 700), 0.02);
  // What rounding to nearest would do to one bf16 value.
  float x = 1e-4f;
  for (int t = 0; t < 700; ++t) x = BF16ToF32Scalar(F32ToBF16Scalar(0.999f * x));
  EXPECT_EQ(x, BF16ToF32Scalar(F32ToBF16Scalar(1e-4f)));
}

TEST(CompressedStatesTest, MissingBuffersAreInvalidArguments) {
  auto adam = MakeAdam();
  StepRun r = MakeRun(StateFormat::kInt8, 100, 1);
  AdamBuffers b = BuffersOf(r, 0);
  b.m_scale = nullptr;
  EXPECT_EQ(adam->Step(b, {}).status().code(), StatusCode::kInvalidArgument);
  b = BuffersOf(r, 0);
  b.states = StateFormat::kBF16;
  b.v_state = nullptr;
  EXPECT_EQ(adam->Step(b, {}).status().code(), StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Paths, CompressedPathTest,
                         testing::Combine(testing::Values(SimdLevel::kScalar, SimdLevel::kAvx2,
                                                          SimdLevel::kAvx512),
                                          testing::Values(StateFormat::kBF16, StateFormat::kInt8)),
                         [](const auto& info) {
                           return std::string(SimdLevelName(std::get<0>(info.param))) + "_" +
                                  std::string(StateFormatName(std::get<1>(info.param)));
                         });

}  // namespace
}  // namespace tierzero
