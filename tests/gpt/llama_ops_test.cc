// The Llama family's CPU ops (gpt/ops.h) in double precision against central finite differences
// and their definitions (Hugging Face's LlamaRMSNorm, rotate_half, LlamaMLP), and grouped-query
// attention against multi-head attention over repeated key/value heads; fp32 against fp64.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "finite_differences.h"
#include "gpt/ops.h"

namespace tierzero::gpt::cpu {
namespace {

TEST(LlamaOps, RmsNormIsItsDefinitionAndBackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(1);
  const int64_t rows = 6, cols = 10;
  const double eps = 1e-6;
  Vec x = Random(rows * cols, rng), w = Random(cols, rng);
  auto fwd = [&] {
    Vec y(x.size()), rstd(rows);
    RmsNormForward(x.data(), w.data(), y.data(), rstd.data(), rows, cols, eps);
    return y;
  };
  const Vec y = fwd();
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t j = 0; j < cols; ++j) ms += x[r * cols + j] * x[r * cols + j] / cols;
    for (int64_t j = 0; j < cols; ++j)
      EXPECT_NEAR(y[r * cols + j], w[j] * x[r * cols + j] / std::sqrt(ms + eps), 1e-12);
  }
  Vec yy(x.size()), rstd(rows);
  RmsNormForward(x.data(), w.data(), yy.data(), rstd.data(), rows, cols, eps);
  const Vec dy = Random(x.size(), rng);
  Vec dx(x.size()), dw(cols, 0.0);
  RmsNormBackward(dy.data(), x.data(), w.data(), rstd.data(), dx.data(), dw.data(), rows, cols);
  CheckAgainstFiniteDifferences({&x, &w}, fwd, dy, {dx, dw}, "rmsnorm");
}

TEST(LlamaOps, RopeRotatesHalvesAndBackwardIsItsTranspose) {
  std::mt19937_64 rng(2);
  const int64_t batch = 2, seq = 5, heads = 3, hd = 8, ld = 30;  // rows wider than the heads
  const double theta = 500000;
  Vec x = Random(batch * seq * ld, rng);
  auto fwd = [&] {
    Vec y = x;
    RopeForward(y.data(), batch, seq, heads, hd, ld, Rope{theta});
    return y;
  };
  const Vec y = fwd();
  for (int64_t r = 0; r < batch * seq; ++r) {
    const int64_t t = r % seq;
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < hd / 2; ++j) {
        const double a = t * std::pow(theta, -2.0 * j / hd);
        const double x1 = x[r * ld + h * hd + j], x2 = x[r * ld + h * hd + j + hd / 2];
        EXPECT_NEAR(y[r * ld + h * hd + j], x1 * std::cos(a) - x2 * std::sin(a), 1e-12);
        EXPECT_NEAR(y[r * ld + h * hd + j + hd / 2], x2 * std::cos(a) + x1 * std::sin(a), 1e-12);
      }
    for (int64_t c = heads * hd; c < ld; ++c) EXPECT_EQ(y[r * ld + c], x[r * ld + c]);  // untouched
  }
  const Vec dy = Random(x.size(), rng);
  Vec dx = dy;
  RopeBackward(dx.data(), batch, seq, heads, hd, ld, Rope{theta});
  CheckAgainstFiniteDifferences({&x}, fwd, dy, {dx}, "rope");
}

// Llama 3's frequency scaling (rope_scaling "llama3"): each frequency as
// _compute_llama3_parameters makes it, high ones kept, low ones divided by the factor, the band
// between blended; checked on a head wide enough to have all three.
TEST(LlamaOps, Llama3ScalingKeepsHighDividesLowAndBlendsBetween) {
  const Rope r{500000.0, 8.0, 1.0, 4.0, 8192.0};
  const int64_t hd = 128;
  int kept = 0, divided = 0, blended = 0;
  for (int64_t j = 0; j < hd / 2; ++j) {
    const double inv = std::pow(500000.0, -2.0 * j / hd), wavelen = 2 * M_PI / inv;
    double want = inv;
    if (wavelen > 8192.0) {
      want = inv / 8;
      ++divided;
    } else if (wavelen >= 2048.0) {
      const double s = (8192.0 / wavelen - 1) / 3;
      want = (1 - s) * inv / 8 + s * inv;
      ++blended;
    } else {
      ++kept;
    }
    EXPECT_NEAR(RopeInverseFrequency<double>(r, j, hd), want, 1e-12 * want) << j;
    EXPECT_NEAR(RopeInverseFrequency<float>(r, j, hd), want, 1e-6 * want) << j;
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
}

TEST(LlamaOps, SwigluBackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(3);
  const int64_t n = 50;
  Vec g = Random(n, rng, 2.0), u = Random(n, rng);
  auto fwd = [&] {
    Vec h(n);
    SwigluForward(g.data(), u.data(), h.data(), n);
    return h;
  };
  const Vec h = fwd();
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(h[i], g[i] / (1 + std::exp(-g[i])) * u[i], 1e-12);
  const Vec dh = Random(n, rng);
  Vec dg(n), du(n);
  SwigluBackward(dh.data(), g.data(), u.data(), dg.data(), du.data(), n);
  CheckAgainstFiniteDifferences({&g, &u}, fwd, dh, {dg, du}, "swiglu");
}

// q (B T x H hd), k and v (B T x Hkv hd) in separate matrices.
struct Gqa {
  int64_t batch, seq, heads, kv_heads, hd;
  AttnShape shape() const {
    return {batch, seq, heads, kv_heads, hd, heads * hd, kv_heads * hd, kv_heads * hd};
  }
};

TEST(LlamaOps, GroupedQueryAttentionBackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(4);
  const Gqa g{2, 5, 4, 2, 3};
  const AttnShape s = g.shape();
  const int64_t rows = g.batch * g.seq;
  Vec q = Random(rows * s.ld_q, rng), k = Random(rows * s.ld_k, rng),
      v = Random(rows * s.ld_v, rng);
  auto fwd = [&] {
    Vec out(rows * g.heads * g.hd), probs(g.batch * g.heads * g.seq * g.seq);
    AttentionForward(q.data(), k.data(), v.data(), out.data(), probs.data(), s);
    return out;
  };
  Vec out(rows * g.heads * g.hd), probs(g.batch * g.heads * g.seq * g.seq);
  AttentionForward(q.data(), k.data(), v.data(), out.data(), probs.data(), s);
  const Vec dy = Random(out.size(), rng);
  Vec dq(q.size()), dk(k.size()), dv(v.size());
  AttentionBackward(dy.data(), q.data(), k.data(), v.data(), probs.data(), dq.data(), dk.data(),
                    dv.data(), s);
  CheckAgainstFiniteDifferences({&q, &k, &v}, fwd, dy, {dq, dk, dv}, "grouped-query attention");
}

// Grouped-query attention is multi-head attention over key/value heads repeated per group: the
// same outputs, and the repeated heads' gradients summed are the grouped ones. In fp32 through
// the products (seq >= 16) and the loops, against fp64.
TEST(LlamaOps, GroupedQueryAttentionIsMultiHeadOverRepeatedHeads) {
  for (const int64_t seq : {7, 33}) {
    std::mt19937_64 rng(5 + static_cast<uint64_t>(seq));
    const Gqa g{2, seq, 6, 2, 8};
    const AttnShape s = g.shape();
    const int64_t rows = g.batch * seq, group = g.heads / g.kv_heads;
    const Vec q = Random(rows * s.ld_q, rng), k = Random(rows * s.ld_k, rng),
              v = Random(rows * s.ld_v, rng), dy = Random(rows * g.heads * g.hd, rng);
    // Repeat each key/value head `group` times: query head h reads head h / group.
    Vec kr(rows * g.heads * g.hd), vr(kr.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < g.heads; ++h)
        for (int64_t d = 0; d < g.hd; ++d) {
          kr[(r * g.heads + h) * g.hd + d] = k[r * s.ld_k + (h / group) * g.hd + d];
          vr[(r * g.heads + h) * g.hd + d] = v[r * s.ld_v + (h / group) * g.hd + d];
        }
    const AttnShape mha{g.batch,        seq,           g.heads, g.heads, g.hd, g.heads * g.hd,
                        g.heads * g.hd, g.heads * g.hd};
    Vec out(dy.size()), outr(dy.size()), p(g.batch * g.heads * seq * seq), pr(p.size());
    Vec dq(q.size()), dk(k.size()), dv(v.size()), dqr(q.size()), dkr(kr.size()), dvr(vr.size());
    AttentionForward(q.data(), k.data(), v.data(), out.data(), p.data(), s);
    AttentionBackward(dy.data(), q.data(), k.data(), v.data(), p.data(), dq.data(), dk.data(),
                      dv.data(), s);
    AttentionForward(q.data(), kr.data(), vr.data(), outr.data(), pr.data(), mha);
    AttentionBackward(dy.data(), q.data(), kr.data(), vr.data(), pr.data(), dqr.data(), dkr.data(),
                      dvr.data(), mha);
    for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], outr[i], 1e-12);
    for (size_t i = 0; i < dq.size(); ++i) EXPECT_NEAR(dq[i], dqr[i], 1e-12);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t kh = 0; kh < g.kv_heads; ++kh)
        for (int64_t d = 0; d < g.hd; ++d) {
          double sk = 0, sv = 0;
          for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
            sk += dkr[(r * g.heads + h) * g.hd + d];
            sv += dvr[(r * g.heads + h) * g.hd + d];
          }
          EXPECT_NEAR(dk[r * s.ld_k + kh * g.hd + d], sk, 1e-12);
          EXPECT_NEAR(dv[r * s.ld_v + kh * g.hd + d], sv, 1e-12);
        }
    // fp32 (products for seq 33, loops for 7) against fp64.
    std::vector<float> qf(q.begin(), q.end()), kf(k.begin(), k.end()), vf(v.begin(), v.end()),
        dyf(dy.begin(), dy.end()), outf(out.size()), pf(p.size()), dqf(q.size(), 7.f),
        dkf(k.size(), 7.f), dvf(v.size(), 7.f);
    AttentionForward(qf.data(), kf.data(), vf.data(), outf.data(), pf.data(), s);
    AttentionBackward(dyf.data(), qf.data(), kf.data(), vf.data(), pf.data(), dqf.data(),
                      dkf.data(), dvf.data(), s);
    for (size_t i = 0; i < out.size(); ++i)
      ASSERT_NEAR(outf[i], out[i], 1e-5 * (1 + std::abs(out[i]))) << "seq " << seq << " out " << i;
    for (size_t i = 0; i < dk.size(); ++i) {
      ASSERT_NEAR(dkf[i], dk[i], 3e-5 * (1 + std::abs(dk[i]))) << "seq " << seq << " dk " << i;
      ASSERT_NEAR(dvf[i], dv[i], 3e-5 * (1 + std::abs(dv[i]))) << "seq " << seq << " dv " << i;
    }
    for (size_t i = 0; i < dq.size(); ++i)
      ASSERT_NEAR(dqf[i], dq[i], 3e-5 * (1 + std::abs(dq[i]))) << "seq " << seq << " dq " << i;
  }
}

}  // namespace
}  // namespace tierzero::gpt::cpu
