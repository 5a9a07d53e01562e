// Llama's fp32 CPU ops with their own kernels (Note [SwiGLU and RMSNorm through the same
// kernels], vec_kernels.h) against the fp64 generic versions, on sizes that are no multiple of a
// vector or a block, at every SIMD level this CPU runs; and the same bits at every level.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/tunable.h"
#include "finite_differences.h"
#include "gpt/ops.h"

namespace tierzero::gpt::cpu {
namespace {

using FVec = std::vector<float>;

FVec ToFloat(const Vec& v) { return FVec(v.begin(), v.end()); }

class LlamaFloatOpsTest : public ::testing::TestWithParam<SimdLevel> {
 protected:
  void SetUp() override {
    if (!SimdLevelSupported(GetParam())) GTEST_SKIP() << "this CPU lacks the level";
    forced_.emplace(kSimdTunable, std::string(SimdLevelName(GetParam())));
  }
  std::optional<ScopedTunable<std::string>> forced_;
};

TEST_P(LlamaFloatOpsTest, SwigluMatchesDouble) {
  std::mt19937_64 rng(21);
  const int64_t n = 2 * 4096 + 45;
  Vec g = Random(n, rng, 5.0);
  g[0] = 0;
  g[1] = 90;   // past the exponential's clamp: silu(g) = g
  g[2] = -90;  // silu(g) = -0 (g e^g below fp32's resolution)
  g[3] = -17;
  g[4] = 1e-30;
  const Vec u = Random(n, rng, 2.0), dh = Random(n, rng);
  const FVec gf = ToFloat(g), uf = ToFloat(u), dhf = ToFloat(dh);
  FVec h(n), dg(n), du(n);
  SwigluForward<float>(gf.data(), uf.data(), h.data(), n);
  SwigluBackward<float>(dhf.data(), gf.data(), uf.data(), dg.data(), du.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    // The fp64 results of the fp32 inputs, within a few ulps of the result or of its inputs'
    // scale where it cancels (silu's derivative crosses zero near g = -1.28); past the clamp
    // (g < -80) within e^-80 |g u| of zero.
    const double gv = gf[i], uv = uf[i], dv = dhf[i];
    double he = 0, dge = 0, due = 0;
    SwigluForward<double>(&gv, &uv, &he, 1);
    SwigluBackward<double>(&dv, &gv, &uv, &dge, &due, 1);
    ASSERT_NEAR(h[i], he, 4e-7 * std::abs(he) + 1e-32) << "g = " << gv;
    ASSERT_NEAR(du[i], due, 4e-7 * std::abs(due) + 1e-32) << "g = " << gv;
    ASSERT_NEAR(dg[i], dge, 4e-7 * std::abs(dge) + 4e-7 * std::abs(dv * uv) + 1e-32)
        << "g = " << gv;
  }
}

TEST_P(LlamaFloatOpsTest, SwigluBackwardInPlaceOverEitherInput) {
  // dh may be dg or du (the model's backward writes over its incoming gradient).
  std::mt19937_64 rng(22);
  const int64_t n = 1000;
  const FVec g = ToFloat(Random(n, rng, 3.0)), u = ToFloat(Random(n, rng)),
             dh = ToFloat(Random(n, rng));
  FVec dg(n), du(n);
  SwigluBackward<float>(dh.data(), g.data(), u.data(), dg.data(), du.data(), n);
  FVec a = dh, b(n), c(n), d = dh;
  SwigluBackward<float>(a.data(), g.data(), u.data(), a.data(), b.data(), n);
  SwigluBackward<float>(d.data(), g.data(), u.data(), c.data(), d.data(), n);
  EXPECT_EQ(a, dg);
  EXPECT_EQ(b, du);
  EXPECT_EQ(c, dg);
  EXPECT_EQ(d, du);
}

TEST_P(LlamaFloatOpsTest, RmsNormMatchesDouble) {
  for (const int64_t cols : {1, 7, 16, 45, 256, 1000}) {
    std::mt19937_64 rng(30 + static_cast<uint64_t>(cols));
    const int64_t rows = 5;
    const Vec x = Random(rows * cols, rng, 3.0), w = Random(cols, rng),
              dy = Random(rows * cols, rng);
    Vec y(x.size()), rstd(rows), dx(x.size()), dw(cols, 0.0);
    RmsNormForward<double>(x.data(), w.data(), y.data(), rstd.data(), rows, cols, 1e-5);
    RmsNormBackward<double>(dy.data(), x.data(), w.data(), rstd.data(), dx.data(), dw.data(), rows,
                            cols);
    const FVec xf = ToFloat(x), wf = ToFloat(w), dyf = ToFloat(dy);
    FVec yf(x.size()), rstdf(rows), dxf(x.size()), dwf(cols, 0.0f);
    RmsNormForward<float>(xf.data(), wf.data(), yf.data(), rstdf.data(), rows, cols, 1e-5);
    RmsNormBackward<float>(dyf.data(), xf.data(), wf.data(), rstdf.data(), dxf.data(), dwf.data(),
                           rows, cols);
    for (int64_t r = 0; r < rows; ++r) ASSERT_NEAR(rstdf[r], rstd[r], 1e-6 * rstd[r]) << cols;
    for (int64_t r = 0; r < rows; ++r) {
      // dx = rstd (dy w - xhat mean(dy w . xhat)): its terms' scale, where they cancel (one
      // column: dx is about zero).
      double scale = 0;
      for (int64_t c = 0; c < cols; ++c)
        scale = std::max(scale, rstd[r] * std::abs(dy[r * cols + c] * w[c]));
      for (int64_t c = 0; c < cols; ++c) {
        const size_t i = static_cast<size_t>(r * cols + c);
        ASSERT_NEAR(yf[i], y[i], 2e-6 * (std::abs(y[i]) + 1e-3)) << cols << " " << i;
        ASSERT_NEAR(dxf[i], dx[i], 1e-5 * scale) << cols << " " << i;
      }
    }
    for (int64_t c = 0; c < cols; ++c) ASSERT_NEAR(dwf[c], dw[c], 1e-5 * (std::abs(dw[c]) + 1));
  }
}

TEST_P(LlamaFloatOpsTest, TheSameBitsAtEveryLevel) {
  std::mt19937_64 rng(23);
  const int64_t n = 4096 + 333, rows = 3, cols = 333;
  const FVec g = ToFloat(Random(n, rng, 4.0)), u = ToFloat(Random(n, rng)),
             dh = ToFloat(Random(n, rng)), x = ToFloat(Random(rows * cols, rng, 2.0)),
             w = ToFloat(Random(cols, rng)), dy = ToFloat(Random(rows * cols, rng));
  struct Out {
    FVec h, dg, du, y, rstd, dx, dw;
  };
  auto run = [&] {
    Out o{FVec(n), FVec(n), FVec(n), FVec(x.size()), FVec(rows), FVec(x.size()), FVec(cols)};
    SwigluForward<float>(g.data(), u.data(), o.h.data(), n);
    SwigluBackward<float>(dh.data(), g.data(), u.data(), o.dg.data(), o.du.data(), n);
    RmsNormForward<float>(x.data(), w.data(), o.y.data(), o.rstd.data(), rows, cols, 1e-6);
    RmsNormBackward<float>(dy.data(), x.data(), w.data(), o.rstd.data(), o.dx.data(), o.dw.data(),
                           rows, cols);
    return o;
  };
  const Out level = run();
  ScopedTunable<std::string> scalar(kSimdTunable, "scalar");
  const Out ref = run();
  EXPECT_EQ(level.h, ref.h);
  EXPECT_EQ(level.dg, ref.dg);
  EXPECT_EQ(level.du, ref.du);
  EXPECT_EQ(level.y, ref.y);
  EXPECT_EQ(level.rstd, ref.rstd);
  EXPECT_EQ(level.dx, ref.dx);
  EXPECT_EQ(level.dw, ref.dw);
}

INSTANTIATE_TEST_SUITE_P(Levels, LlamaFloatOpsTest,
                         ::testing::Values(SimdLevel::kScalar, SimdLevel::kAvx2,
                                           SimdLevel::kAvx512),
                         [](const auto& info) { return std::string(SimdLevelName(info.param)); });

}  // namespace
}  // namespace tierzero::gpt::cpu
