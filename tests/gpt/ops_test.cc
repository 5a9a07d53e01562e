// Every GPT op's backward against central finite differences of its forward, in double
// precision (models/gpt/ops.h instantiates each op for double as well as float).
#include "gpt/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/tunable.h"
#include "finite_differences.h"

namespace tierzero::gpt::cpu {
namespace {

TEST(GptOps, LinearBackward) {
  std::mt19937_64 rng(1);
  const int64_t rows = 7, in = 5, out = 6;
  Vec x = Random(rows * in, rng), wt = Random(in * out, rng), b = Random(out, rng);
  auto fwd = [&] {
    Vec y(rows * out);
    LinearForward(x.data(), wt.data(), b.data(), y.data(), rows, in, out);
    return y;
  };
  const Vec dy = Random(rows * out, rng);
  Vec dx(x.size()), dw(wt.size(), 0.0), db(b.size(), 0.0);
  LinearBackward(dy.data(), x.data(), wt.data(), dx.data(), dw.data(), db.data(), rows, in, out);
  CheckAgainstFiniteDifferences({&x, &wt, &b}, fwd, dy, {dx, dw, db}, "linear");
  // Parameter gradients accumulate.
  Vec dw2 = dw, db2 = db;
  LinearBackward(dy.data(), x.data(), wt.data(), dx.data(), dw2.data(), db2.data(), rows, in, out);
  for (size_t i = 0; i < dw.size(); ++i) EXPECT_DOUBLE_EQ(dw2[i], 2 * dw[i]);
  for (size_t i = 0; i < db.size(); ++i) EXPECT_DOUBLE_EQ(db2[i], 2 * db[i]);
}

TEST(GptOps, LayerNormBackward) {
  std::mt19937_64 rng(2);
  const int64_t rows = 5, cols = 9;
  Vec x = Random(rows * cols, rng, 2.0), g = Random(cols, rng), b = Random(cols, rng);
  auto fwd = [&] {
    Vec y(rows * cols), mean(rows), rstd(rows);
    LayerNormForward(x.data(), g.data(), b.data(), y.data(), mean.data(), rstd.data(), rows, cols);
    return y;
  };
  Vec y(rows * cols), mean(rows), rstd(rows);
  LayerNormForward(x.data(), g.data(), b.data(), y.data(), mean.data(), rstd.data(), rows, cols);
  // Forward against the definition.
  for (int64_t r = 0; r < rows; ++r) {
    double mu = 0, var = 0;
    for (int64_t c = 0; c < cols; ++c) mu += x[r * cols + c] / cols;
    for (int64_t c = 0; c < cols; ++c)
      var += (x[r * cols + c] - mu) * (x[r * cols + c] - mu) / cols;
    for (int64_t c = 0; c < cols; ++c)
      EXPECT_NEAR(y[r * cols + c], (x[r * cols + c] - mu) / std::sqrt(var + 1e-5) * g[c] + b[c],
                  1e-12);
  }
  const Vec dy = Random(rows * cols, rng);
  Vec dx(x.size()), dg(cols, 0.0), db(cols, 0.0);
  LayerNormBackward(dy.data(), x.data(), g.data(), mean.data(), rstd.data(), dx.data(), dg.data(),
                    db.data(), rows, cols);
  CheckAgainstFiniteDifferences({&x, &g, &b}, fwd, dy, {dx, dg, db}, "layernorm");
}

TEST(GptOps, GeluBackward) {
  std::mt19937_64 rng(3);
  const int64_t n = 2049;  // not a multiple of the block
  Vec x = Random(n, rng, 3.0);
  auto fwd = [&] {
    Vec y(n);
    GeluForward(x.data(), y.data(), n);
    return y;
  };
  Vec y = fwd();
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    EXPECT_NEAR(y[i], 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))),
                1e-14);
  }
  const Vec dy = Random(n, rng);
  Vec dx(n);
  GeluBackward(dy.data(), x.data(), dx.data(), n);
  CheckAgainstFiniteDifferences({&x}, fwd, dy, {dx}, "gelu");
}

TEST(GptOps, AttentionBackward) {
  std::mt19937_64 rng(4);
  const int64_t batch = 2, seq = 5, channels = 6, heads = 2;
  Vec qkv = Random(batch * seq * 3 * channels, rng);
  auto fwd = [&] {
    Vec out(batch * seq * channels), probs(batch * heads * seq * seq);
    AttentionForward(qkv.data(), out.data(), probs.data(), batch, seq, channels, heads);
    return out;
  };
  Vec out(batch * seq * channels), probs(batch * heads * seq * seq);
  AttentionForward(qkv.data(), out.data(), probs.data(), batch, seq, channels, heads);
  // Causality: probabilities above the diagonal are zero, rows sum to one.
  for (int64_t bh = 0; bh < batch * heads; ++bh) {
    for (int64_t t = 0; t < seq; ++t) {
      double sum = 0;
      for (int64_t s = 0; s < seq; ++s) {
        const double p = probs[(bh * seq + t) * seq + s];
        if (s > t) {
          EXPECT_EQ(p, 0.0);
        }
        sum += p;
      }
      EXPECT_NEAR(sum, 1.0, 1e-12);
    }
  }
  const Vec dy = Random(out.size(), rng);
  Vec dqkv(qkv.size());
  AttentionBackward(dy.data(), qkv.data(), probs.data(), dqkv.data(), batch, seq, channels, heads);
  CheckAgainstFiniteDifferences({&qkv}, fwd, dy, {dqkv}, "attention");
}

TEST(GptOps, EmbeddingBackward) {
  std::mt19937_64 rng(5);
  const int64_t batch = 2, seq = 4, channels = 3, vocab = 5;
  const std::vector<int32_t> tokens = {1, 3, 3, 0, 4, 1, 2, 1};  // repeats accumulate
  Vec wte = Random(vocab * channels, rng), wpe = Random(seq * channels, rng);
  auto fwd = [&] {
    Vec x(batch * seq * channels);
    EmbeddingForward(tokens.data(), wte.data(), wpe.data(), x.data(), batch, seq, channels);
    return x;
  };
  const Vec dy = Random(batch * seq * channels, rng);
  Vec dwte(wte.size(), 0.0), dwpe(wpe.size(), 0.0);
  EmbeddingBackward(tokens.data(), dy.data(), dwte.data(), dwpe.data(), batch, seq, channels);
  CheckAgainstFiniteDifferences({&wte, &wpe}, fwd, dy, {dwte, dwpe}, "embedding");
}

TEST(GptOps, CrossEntropyBackward) {
  std::mt19937_64 rng(6);
  const int64_t rows = 6, vocab = 7;
  Vec logits = Random(rows * vocab, rng, 2.0);
  const std::vector<int32_t> targets = {0, 6, 3, 3, 1, 5};
  const std::vector<float> mask = {1, 0, 1, 1, 0, 1};
  auto fwd = [&] {
    return Vec{CrossEntropy<double>(logits.data(), targets.data(), mask.data(), nullptr, nullptr,
                                    rows, vocab, 1.0)};
  };
  Vec dlogits(logits.size());
  std::vector<int32_t> argmax(rows);
  const double loss = CrossEntropy<double>(logits.data(), targets.data(), mask.data(),
                                           dlogits.data(), argmax.data(), rows, vocab, 1.0);
  // Loss against the definition; argmax against a scan.
  double expect = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double z = 0;
    int64_t best = 0;
    for (int64_t j = 0; j < vocab; ++j) {
      z += std::exp(logits[r * vocab + j]);
      if (logits[r * vocab + j] > logits[r * vocab + best]) best = j;
    }
    expect += mask[r] * (std::log(z) - logits[r * vocab + targets[r]]);
    EXPECT_EQ(argmax[r], best);
  }
  EXPECT_NEAR(loss, expect / 4, 1e-12);
  CheckAgainstFiniteDifferences({&logits}, fwd, Vec{1.0}, {dlogits}, "cross-entropy");
  // The scale multiplies the gradient only.
  Vec scaled(logits.size());
  CrossEntropy<double>(logits.data(), targets.data(), mask.data(), scaled.data(), nullptr, rows,
                       vocab, 8.0);
  for (size_t i = 0; i < scaled.size(); ++i) EXPECT_DOUBLE_EQ(scaled[i], 8 * dlogits[i]);
}

TEST(GptOps, FloatGemmMatchesDoubleReference) {
  // The float path goes through oneDNN: every transpose combination against the double loops.
  std::mt19937_64 rng(7);
  const int64_t m = 37, n = 29, k = 53;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      Vec a = Random(m * k, rng), b = Random(k * n, rng), c = Random(m * n, rng);
      std::vector<float> af(a.begin(), a.end()), bf(b.begin(), b.end()), cf(c.begin(), c.end());
      const int64_t lda = ta ? m : k, ldb = tb ? k : n;
      Gemm<double>(ta, tb, m, n, k, 1.5, a.data(), lda, b.data(), ldb, 0.5, c.data(), n);
      Gemm<float>(ta, tb, m, n, k, 1.5f, af.data(), lda, bf.data(), ldb, 0.5f, cf.data(), n);
      for (size_t i = 0; i < c.size(); ++i) EXPECT_NEAR(cf[i], c[i], 1e-4 * (1 + std::abs(c[i])));
    }
  }
}

TEST(GptOps, FloatGemmWithTwoKibStridesMatchesDoubleReference) {
  // Operands whose rows lie a multiple of 2 KiB apart go through padded copies (Note [Operands
  // with a 2 KiB stride]); sub-matrices of wider buffers, every transpose, and one product large
  // enough to be taken in two slabs along k.
  std::mt19937_64 rng(17);
  struct Shape {
    int64_t m, n, k, ld;
  };
  for (const Shape& s : {Shape{200, 130, 300, 512}, Shape{130, 520, 4100, 1024}}) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        // An operand whose rows run along k needs a leading dimension of at least k: the next
        // multiple of 512 (A not transposed is never copied, whatever its stride).
        const int64_t along_k = (s.k + 511) / 512 * 512;
        const int64_t lda = ta ? s.ld : along_k, ldb = tb ? std::max(s.ld, along_k) : s.ld;
        const int64_t a_rows = ta ? s.k : s.m, b_rows = tb ? s.n : s.k;
        Vec a = Random(a_rows * lda, rng), b = Random(b_rows * ldb, rng);
        Vec c = Random(s.m * s.n, rng);
        std::vector<float> af(a.begin(), a.end()), bf(b.begin(), b.end()), cf(c.begin(), c.end());
        Gemm<double>(ta, tb, s.m, s.n, s.k, 1.5, a.data(), lda, b.data(), ldb, 0.5, c.data(), s.n);
        Gemm<float>(ta, tb, s.m, s.n, s.k, 1.5f, af.data(), lda, bf.data(), ldb, 0.5f, cf.data(),
                    s.n);
        // fp32 sums of k products of unit normals: error grows like sqrt(k) ulp of the terms.
        const double tol = 2e-6 * std::sqrt(static_cast<double>(s.k)) * 1.5 * 4;
        for (size_t i = 0; i < c.size(); ++i) {
          ASSERT_NEAR(cf[i], c[i], tol * (1 + std::abs(c[i])))
              << "ta " << ta << " tb " << tb << " m " << s.m << " at " << i;
        }
      }
    }
  }
}

TEST(GptOps, FloatGemmWithTwoKibStridesAndAnEmptySide) {
  // A padded operand beside an empty side: nothing to compute, C untouched.
  std::vector<float> a(300 * 512, 1.0f), b(300 * 512, 1.0f), c(4, 5.0f);
  Gemm<float>(true, false, 0, 130, 300, 1.0f, a.data(), 512, b.data(), 512, 0.0f, c.data(), 130);
  Gemm<float>(false, false, 200, 0, 300, 1.0f, a.data(), 512, b.data(), 512, 0.0f, c.data(), 1);
  for (float v : c) EXPECT_EQ(v, 5.0f);
}

TEST(GptOps, AFailedProductThrowsInsteadOfAborting) {
  // A leading dimension shorter than a row: oneDNN refuses the product. Note [A product that
  // fails throws] (ops.cc): the caller gets an exception (a command's last net turns it into
  // its failure), not an abort of the process.
  std::vector<float> a(16, 1.0f), b(16, 1.0f), c(16, 0.0f);
  EXPECT_THROW(
      Gemm<float>(false, false, 4, 4, 4, 1.0f, a.data(), 1, b.data(), 4, 0.0f, c.data(), 4),
      std::runtime_error);
}

// The fp32 ops with their own kernels (the GELU's exponential, attention through sgemm) against
// the fp64 generic versions, on awkward sizes, at every SIMD level this CPU runs.
class FloatOpsTest : public ::testing::TestWithParam<SimdLevel> {
 protected:
  void SetUp() override {
    if (!SimdLevelSupported(GetParam())) GTEST_SKIP() << "this CPU lacks the level";
    forced_.emplace(kSimdTunable, std::string(SimdLevelName(GetParam())));
  }
  std::optional<ScopedTunable<std::string>> forced_;
};

TEST_P(FloatOpsTest, GeluMatchesDouble) {
  std::mt19937_64 rng(8);
  // Not a multiple of any vector width or block; values across the clamp of the exponential
  // (|x| above about 9 saturates), around zero, and the tails.
  const int64_t n = 3 * 4096 + 77;
  Vec x = Random(n, rng, 4.0);
  x[0] = 0;
  x[1] = -0.0;
  x[2] = 60;
  x[3] = -60;
  x[4] = 1e-30;
  x[5] = -9.5;
  const Vec dy = Random(n, rng);
  std::vector<float> xf(x.begin(), x.end()), dyf(dy.begin(), dy.end()), yf(n), dxf(n);
  GeluForward<float>(xf.data(), yf.data(), n);
  GeluBackward<float>(dyf.data(), xf.data(), dxf.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    // The fp64 results of the fp32 inputs; a few ulps of the result, or of the input's scale
    // where the result cancels (the GELU's minimum near x = -0.75).
    const double xv = xf[static_cast<size_t>(i)];
    double ye = 0, dxe = 0;
    GeluForward<double>(&xv, &ye, 1);
    const double dyv = dyf[static_cast<size_t>(i)];
    GeluBackward<double>(&dyv, &xv, &dxe, 1);
    ASSERT_NEAR(yf[i], ye, 4e-7 * std::abs(ye) + 1e-7 * std::abs(xv) + 1e-37) << "x = " << xv;
    ASSERT_NEAR(dxf[i], dxe, 4e-7 * std::abs(dxe) + 4e-7 * std::abs(dyv) + 1e-37) << "x = " << xv;
  }
}

TEST_P(FloatOpsTest, GeluIsTheSameAtEveryLevel) {
  // Note [GELU through one exponential]: the scalar and vector kernels do the same operations.
  std::mt19937_64 rng(9);
  const int64_t n = 1000;
  const Vec x = Random(n, rng, 3.0), dy = Random(n, rng);
  std::vector<float> xf(x.begin(), x.end()), dyf(dy.begin(), dy.end());
  std::vector<float> y(n), dx(n), ys(n), dxs(n);
  GeluForward<float>(xf.data(), y.data(), n);
  GeluBackward<float>(dyf.data(), xf.data(), dx.data(), n);
  {
    ScopedTunable<std::string> scalar(kSimdTunable, "scalar");
    GeluForward<float>(xf.data(), ys.data(), n);
    GeluBackward<float>(dyf.data(), xf.data(), dxs.data(), n);
  }
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(y[i], ys[i]) << i;
    ASSERT_EQ(dx[i], dxs[i]) << i;
  }
}

TEST_P(FloatOpsTest, AttentionMatchesDouble) {
  // Short rows take the loops, long ones the products (Note [Attention as matrix products]).
  for (const int64_t seq : {5, 15, 16, 37, 64}) {
    std::mt19937_64 rng(10 + static_cast<uint64_t>(seq));
    const int64_t batch = 3, channels = 24, heads = 3;
    const Vec qkv = Random(batch * seq * 3 * channels, rng);
    const Vec dout = Random(batch * seq * channels, rng);
    Vec out(dout.size()), probs(batch * heads * seq * seq), dqkv(qkv.size());
    AttentionForward<double>(qkv.data(), out.data(), probs.data(), batch, seq, channels, heads);
    AttentionBackward<double>(dout.data(), qkv.data(), probs.data(), dqkv.data(), batch, seq,
                              channels, heads);
    std::vector<float> qkvf(qkv.begin(), qkv.end()), doutf(dout.begin(), dout.end());
    std::vector<float> outf(out.size()), probsf(probs.size(), -1.0f), dqkvf(qkv.size(), 7.0f);
    AttentionForward<float>(qkvf.data(), outf.data(), probsf.data(), batch, seq, channels, heads);
    AttentionBackward<float>(doutf.data(), qkvf.data(), probsf.data(), dqkvf.data(), batch, seq,
                             channels, heads);
    for (size_t i = 0; i < probs.size(); ++i) {
      const int64_t t = static_cast<int64_t>(i) / seq % seq, s = static_cast<int64_t>(i) % seq;
      if (s > t) {
        ASSERT_EQ(probsf[i], 0.0f) << "seq " << seq << " element " << i;
      } else {
        ASSERT_NEAR(probsf[i], probs[i], 1e-5) << "seq " << seq << " element " << i;
      }
    }
    for (size_t i = 0; i < out.size(); ++i)
      ASSERT_NEAR(outf[i], out[i], 1e-5 * (1 + std::abs(out[i]))) << "seq " << seq << " " << i;
    for (size_t i = 0; i < dqkv.size(); ++i)
      ASSERT_NEAR(dqkvf[i], dqkv[i], 2e-5 * (1 + std::abs(dqkv[i]))) << "seq " << seq << " " << i;
  }
}

TEST_P(FloatOpsTest, AttentionIsTheSameAtEveryLevel) {
  // Note [Softmax rows in sixteen partial sums]: rows of every length up to 37 (across the 8 and
  // 16 lanes), at a scale where some scores lie more than 80 below their row's maximum (the
  // exponential's clamp) and at an ordinary one.
  for (const double spread : {1.0, 12.0}) {
    std::mt19937_64 rng(11);
    const int64_t batch = 2, seq = 37, channels = 32, heads = 2;
    const Vec qkv = Random(batch * seq * 3 * channels, rng, spread);
    const Vec dout = Random(batch * seq * channels, rng);
    std::vector<float> qkvf(qkv.begin(), qkv.end()), doutf(dout.begin(), dout.end());
    std::vector<float> out(dout.size()), probs(batch * heads * seq * seq), dqkv(qkv.size());
    std::vector<float> outs(out.size()), probss(probs.size()), dqkvs(dqkv.size());
    AttentionForward<float>(qkvf.data(), out.data(), probs.data(), batch, seq, channels, heads);
    AttentionBackward<float>(doutf.data(), qkvf.data(), probs.data(), dqkv.data(), batch, seq,
                             channels, heads);
    {
      ScopedTunable<std::string> scalar(kSimdTunable, "scalar");
      AttentionForward<float>(qkvf.data(), outs.data(), probss.data(), batch, seq, channels, heads);
      AttentionBackward<float>(doutf.data(), qkvf.data(), probss.data(), dqkvs.data(), batch, seq,
                               channels, heads);
    }
    for (size_t i = 0; i < probs.size(); ++i) ASSERT_EQ(probs[i], probss[i]) << i;
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], outs[i]) << i;
    for (size_t i = 0; i < dqkv.size(); ++i) ASSERT_EQ(dqkv[i], dqkvs[i]) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, FloatOpsTest,
                         ::testing::Values(SimdLevel::kScalar, SimdLevel::kAvx2,
                                           SimdLevel::kAvx512),
                         [](const auto& info) { return std::string(SimdLevelName(info.param)); });

}  // namespace
}  // namespace tierzero::gpt::cpu
