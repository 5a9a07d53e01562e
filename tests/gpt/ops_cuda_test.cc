// The GPT's CUDA ops against the CPU ops (gpt/ops.h, themselves checked against finite
// differences in double) on random inputs of awkward sizes: sizes that are not multiples of the
// warp or block width, heads wider than a warp, sequences longer than one. Skipped without a GPU.
#include "gpt/ops_cuda.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "device_buffer.h"
#include "gpt/ops.h"
#include "tierzero/convert.h"
#include "tierzero/engine.h"

namespace tierzero::gpt {
namespace {

template <typename T>
using DeviceVec = testing_cuda::DeviceBuffer<T>;

template <typename T>
std::vector<T> Filled(size_t n, T value = T{}) {
  return std::vector<T>(n, value);
}

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

// |gpu - cpu| <= 1e-4 |cpu| + 1e-5 max|cpu| elementwise (fp32 sums in another order).
void ExpectClose(const std::vector<float>& gpu, const std::vector<float>& cpu, const char* what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  float mx = 0;
  for (float v : cpu) mx = std::max(mx, std::fabs(v));
  int bad = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (std::fabs(gpu[i] - cpu[i]) > 1e-4f * std::fabs(cpu[i]) + 1e-5f * mx) {
      if (++bad <= 5) ADD_FAILURE() << what << "[" << i << "]: gpu " << gpu[i] << " cpu " << cpu[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << cpu.size() << " elements differ";
}

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ops = cuda::CudaOps::Create(nullptr);
    if (!ops.ok()) GTEST_SKIP() << ops.status().ToString();
    ops_ = std::move(*ops);
  }
  void TearDown() override {
    if (ops_) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_TRUE(ops_->status().ok()) << ops_->status().ToString();
    }
  }
  std::unique_ptr<cuda::CudaOps> ops_;
};

TEST_F(CudaOpsTest, GemmEveryTranspose) {
  const int64_t m = 37, n = 67, k = 45;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      auto a = Random(m * k, 1), b = Random(k * n, 2), c = Random(m * n, 3);
      const int64_t lda = ta ? m : k, ldb = tb ? k : n;
      auto ref = c;
      cpu::Gemm<float>(ta, tb, m, n, k, 0.7f, a.data(), lda, b.data(), ldb, 0.3f, ref.data(), n);
      DeviceVec<float> da(a), db(b), dc(c);
      ops_->Gemm(ta, tb, m, n, k, 0.7f, da.get(), lda, db.get(), ldb, 0.3f, dc.get(), n);
      ExpectClose(dc.Get(), ref, "gemm");
    }
}

TEST_F(CudaOpsTest, LinearForwardAndBackward) {
  const int64_t rows = 37, in = 45, out = 67;
  auto x = Random(rows * in, 1), w = Random(in * out, 2), bias = Random(out, 3);
  auto dy = Random(rows * out, 4), dw = Random(in * out, 5), db = Random(out, 6);
  std::vector<float> y(rows * out), dx(rows * in);
  cpu::LinearForward<float>(x.data(), w.data(), bias.data(), y.data(), rows, in, out);
  DeviceVec<float> gx(x), gw(w), gb(bias), gy(Filled<float>(rows * out, 7.0f)), gdy(dy), gdx(dx),
      gdw(dw), gdb(db);
  ops_->LinearForward(gx.get(), gw.get(), gb.get(), gy.get(), rows, in, out);
  ExpectClose(gy.Get(), y, "y");
  cpu::LinearBackward<float>(dy.data(), x.data(), w.data(), dx.data(), dw.data(), db.data(), rows,
                             in, out);
  ops_->LinearBackward(gdy.get(), gx.get(), gw.get(), gdx.get(), gdw.get(), gdb.get(), rows, in,
                       out);
  ExpectClose(gdx.Get(), dx, "dx");
  ExpectClose(gdw.Get(), dw, "dw (accumulated)");
  ExpectClose(gdb.Get(), db, "dbias (accumulated)");
}

TEST_F(CudaOpsTest, LayerNormForwardAndBackward) {
  for (int64_t cols : {7, 131, 2560}) {
    const int64_t rows = 19;
    auto x = Random(rows * cols, 1, 3.0f), g = Random(cols, 2), b = Random(cols, 3);
    auto dy = Random(rows * cols, 4), dg = Random(cols, 5), dbeta = Random(cols, 6);
    std::vector<float> y(rows * cols), mean(rows), rstd(rows), dx(rows * cols);
    cpu::LayerNormForward<float>(x.data(), g.data(), b.data(), y.data(), mean.data(), rstd.data(),
                                 rows, cols);
    cpu::LayerNormBackward<float>(dy.data(), x.data(), g.data(), mean.data(), rstd.data(),
                                  dx.data(), dg.data(), dbeta.data(), rows, cols);
    DeviceVec<float> gx(x), gg(g), gb(Random(cols, 3)), gy(Filled<float>(rows * cols));
    DeviceVec<float> gmean(Filled<float>(rows)), grstd(Filled<float>(rows));
    DeviceVec<float> gdy(dy), gdx(Filled<float>(rows * cols)), gdg(Random(cols, 5)),
        gdb(Random(cols, 6));
    ops_->LayerNormForward(gx.get(), gg.get(), gb.get(), gy.get(), gmean.get(), grstd.get(), rows,
                           cols);
    ExpectClose(gy.Get(), y, "y");
    ExpectClose(gmean.Get(), mean, "mean");
    ExpectClose(grstd.Get(), rstd, "rstd");
    ops_->LayerNormBackward(gdy.get(), gx.get(), gg.get(), gmean.get(), grstd.get(), gdx.get(),
                            gdg.get(), gdb.get(), rows, cols);
    ExpectClose(gdx.Get(), dx, "dx");
    ExpectClose(gdg.Get(), dg, "dgamma");
    ExpectClose(gdb.Get(), dbeta, "dbeta");
  }
}

TEST_F(CudaOpsTest, GeluAddAndAddInPlace) {
  const int64_t n = 1001;
  auto x = Random(n, 1, 2.0f), dy = Random(n, 2), b = Random(n, 3);
  std::vector<float> y(n), dx(n), sum(n), acc = b;
  cpu::GeluForward<float>(x.data(), y.data(), n);
  cpu::GeluBackward<float>(dy.data(), x.data(), dx.data(), n);
  cpu::Add<float>(x.data(), b.data(), sum.data(), n);
  cpu::AddInPlace<float>(acc.data(), x.data(), n);
  DeviceVec<float> gx(x), gdy(dy), gb(b), gy(Filled<float>(n, 7.0f)), gdx(Filled<float>(n, 7.0f)),
      gsum(Filled<float>(n, 7.0f)), gacc(b);
  ops_->GeluForward(gx.get(), gy.get(), n);
  ops_->GeluBackward(gdy.get(), gx.get(), gdx.get(), n);
  ops_->Add(gx.get(), gb.get(), gsum.get(), n);
  ops_->AddInPlace(gacc.get(), gx.get(), n);
  ExpectClose(gy.Get(), y, "gelu");
  ExpectClose(gdx.Get(), dx, "gelu backward");
  ExpectClose(gsum.Get(), sum, "add");
  ExpectClose(gacc.Get(), acc, "add in place");
}

struct AttnShape {
  int64_t batch, seq, channels, heads;
};

TEST_F(CudaOpsTest, AttentionForwardAndBackward) {
  // hd 8 (< warp), hd 72 (> warp); seq 13 (< warp), 70 (> 2 warps).
  for (AttnShape s : {AttnShape{3, 13, 40, 5}, AttnShape{2, 70, 144, 2}}) {
    const int64_t rows = s.batch * s.seq, probs_n = s.batch * s.heads * s.seq * s.seq;
    auto qkv = Random(rows * 3 * s.channels, 1), dout = Random(rows * s.channels, 2);
    std::vector<float> out(rows * s.channels), probs(probs_n), dqkv(rows * 3 * s.channels);
    cpu::AttentionForward<float>(qkv.data(), out.data(), probs.data(), s.batch, s.seq, s.channels,
                                 s.heads);
    cpu::AttentionBackward<float>(dout.data(), qkv.data(), probs.data(), dqkv.data(), s.batch,
                                  s.seq, s.channels, s.heads);
    DeviceVec<float> gqkv(qkv), gout(std::vector<float>(out.size())),
        gprobs(Filled<float>(probs_n, 7.0f)), gdout(dout),
        gdqkv(std::vector<float>(dqkv.size(), 7.0f));
    ops_->AttentionForward(gqkv.get(), gout.get(), gprobs.get(), s.batch, s.seq, s.channels,
                           s.heads);
    ExpectClose(gout.Get(), out, "attention out");
    ExpectClose(gprobs.Get(), probs, "attention probs (zeros above the diagonal)");
    ops_->AttentionBackward(gdout.get(), gqkv.get(), gout.get(), gprobs.get(), gdqkv.get(), s.batch,
                            s.seq, s.channels, s.heads);
    ExpectClose(gdqkv.Get(), dqkv, "dqkv");
  }
}

TEST_F(CudaOpsTest, EmbeddingForwardAndBackward) {
  const int64_t batch = 3, seq = 11, channels = 70, vocab = 29;
  std::vector<int32_t> tokens(batch * seq);
  std::mt19937 gen(5);
  for (int32_t& t : tokens) t = static_cast<int32_t>(gen() % 7);  // repeats: accumulation
  auto wte = Random(vocab * channels, 1), wpe = Random(seq * channels, 2);
  auto dx = Random(batch * seq * channels, 3), dwte = Random(vocab * channels, 4),
       dwpe = Random(seq * channels, 5);
  std::vector<float> x(batch * seq * channels);
  DeviceVec<int32_t> gt(tokens);
  DeviceVec<float> gwte(wte), gwpe(wpe), gx(x), gdx(dx), gdwte(dwte), gdwpe(dwpe);
  cpu::EmbeddingForward<float>(tokens.data(), wte.data(), wpe.data(), x.data(), batch, seq,
                               channels);
  cpu::EmbeddingBackward<float>(tokens.data(), dx.data(), dwte.data(), dwpe.data(), batch, seq,
                                channels);
  ops_->EmbeddingForward(gt.get(), gwte.get(), gwpe.get(), gx.get(), batch, seq, channels);
  ops_->EmbeddingBackward(gt.get(), gdx.get(), gdwte.get(), gdwpe.get(), batch, seq, channels);
  ExpectClose(gx.Get(), x, "x");
  ExpectClose(gdwte.Get(), dwte, "dwte");
  ExpectClose(gdwpe.Get(), dwpe, "dwpe");
}

TEST_F(CudaOpsTest, CrossEntropyLossGradientAndArgmax) {
  const int64_t rows = 23, vocab = 300;
  auto logits = Random(rows * vocab, 1, 3.0f);
  logits[5 * vocab + 17] = logits[5 * vocab + 200] = 50.0f;  // a tie: the first index wins
  std::vector<int32_t> targets(rows), argmax(rows), gargmax_init(rows, -1);
  std::vector<float> mask(rows), dl(rows * vocab);
  for (int64_t r = 0; r < rows; ++r) {
    targets[r] = static_cast<int32_t>((r * 37) % vocab);
    mask[r] = r % 4 == 0 ? 0.0f : 1.0f;
  }
  const double loss = cpu::CrossEntropy<float>(logits.data(), targets.data(), mask.data(),
                                               dl.data(), argmax.data(), rows, vocab, 2.0);
  DeviceVec<float> gl(logits), gmask(mask), gdl(std::vector<float>(dl.size()));
  DeviceVec<int32_t> gt(targets), ga(gargmax_init);
  auto gloss =
      ops_->CrossEntropy(gl.get(), gt.get(), gmask.get(), gdl.get(), ga.get(), rows, vocab, 2.0);
  ASSERT_TRUE(gloss.ok()) << gloss.status().ToString();
  EXPECT_NEAR(*gloss, loss, 1e-9 * std::fabs(loss));
  ExpectClose(gdl.Get(), dl, "dlogits");
  EXPECT_EQ(ga.Get(), argmax);
  EXPECT_EQ(argmax[5], 17);
}

TEST_F(CudaOpsTest, WidenAndNarrowMatchTheEngineCasts) {
  const int64_t n = 1237;
  auto x = Random(n, 1, 100.0f);
  x[0] = 0.0f;
  x[1] = -0.0f;
  x[2] = 1e-40f;  // subnormal
  x[3] = 3.0e38f;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> cpu_narrow(n);
    std::vector<float> cpu_wide(n);
    ASSERT_TRUE(CastElements(x.data(), DType::kF32, cpu_narrow.data(), dt, n).ok());
    ASSERT_TRUE(CastElements(cpu_narrow.data(), dt, cpu_wide.data(), DType::kF32, n).ok());
    DeviceVec<float> gx(x), gw(Filled<float>(n));
    DeviceVec<uint16_t> gn(Filled<uint16_t>(n));
    ASSERT_TRUE(ops_->Narrow(gx.get(), gn.get(), dt, n).ok());
    ASSERT_TRUE(ops_->Widen(gn.get(), dt, gw.get(), n).ok());
    EXPECT_EQ(gn.Get(), cpu_narrow) << DTypeName(dt);
    const auto wide = gw.Get();
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(std::memcmp(&wide[i], &cpu_wide[i], 4), 0) << DTypeName(dt) << " at " << i;
  }
}

TEST_F(CudaOpsTest, RepeatedCallsAreBitIdentical) {
  const AttnShape s{2, 70, 144, 2};
  const int64_t rows = s.batch * s.seq, probs_n = s.batch * s.heads * s.seq * s.seq;
  auto qkv = Random(rows * 3 * s.channels, 1), dout = Random(rows * s.channels, 2);
  DeviceVec<float> gqkv(qkv), gout(Filled<float>(rows * s.channels)),
      gprobs(Filled<float>(probs_n)), gdout(dout), gdqkv(Filled<float>(qkv.size()));
  std::vector<float> first;
  for (int rep = 0; rep < 2; ++rep) {
    ops_->AttentionForward(gqkv.get(), gout.get(), gprobs.get(), s.batch, s.seq, s.channels,
                           s.heads);
    ops_->AttentionBackward(gdout.get(), gqkv.get(), gout.get(), gprobs.get(), gdqkv.get(), s.batch,
                            s.seq, s.channels, s.heads);
    auto d = gdqkv.Get();
    if (rep == 0)
      first = d;
    else
      EXPECT_EQ(std::memcmp(d.data(), first.data(), 4 * d.size()), 0);
  }
}

// ---- bf16 tensor cores (gpt/tensor_core_cuda.h) ---------------------------------------------

// ||gpu - cpu|| / ||cpu|| in double: bf16 operands (relative rounding 2^-9 each) with fp32 sums
// land near 3e-3 on random data; fp32 products near 1e-7; a wrong index near 1.
double RelativeError(const std::vector<float>& gpu, const std::vector<float>& cpu) {
  double num = 0, den = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double d = static_cast<double>(gpu[i]) - cpu[i];
    num += d * d;
    den += static_cast<double>(cpu[i]) * cpu[i];
  }
  return std::isfinite(num) ? std::sqrt(num / den) : 1e300;
}

void ExpectWithinBf16(const std::vector<float>& gpu, const std::vector<float>& cpu,
                      const std::string& what, double bound = 1e-2) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  const double e = RelativeError(gpu, cpu);
  std::printf("  %-44s relative error %.2e\n", what.c_str(), e);
  EXPECT_LT(e, bound) << what;
  EXPECT_GT(e, 0.0) << what << ": bit-identical to fp32, so not on bf16 operands";
}

class CudaTensorCoreOpsTest : public CudaOpsTest {
 protected:
  void SetUp() override {
    auto ops = cuda::CudaOps::Create(nullptr, /*tensor_cores=*/true);
    if (!ops.ok()) GTEST_SKIP() << ops.status().ToString();
    ops_ = std::move(*ops);
  }
};

class CudaFusedAttentionTest : public CudaOpsTest {
 protected:
  void SetUp() override {
    auto ops = cuda::CudaOps::Create(nullptr, /*tensor_cores=*/true, /*fused_attention=*/true);
    if (!ops.ok()) GTEST_SKIP() << ops.status().ToString();
    ops_ = std::move(*ops);
  }
};

// Each row's log-sum-exp of its scaled causal scores, in double: what the fused forward keeps.
std::vector<float> LogSumExps(const std::vector<float>& qkv, const AttnShape& s) {
  const int64_t T = s.seq, C = s.channels, H = s.heads, hd = C / H;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<float> lse(s.batch * H * T);
  std::vector<double> x(T);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const float* q = &qkv[(b * T + t) * 3 * C + h * hd];
        double mx = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          const float* k = &qkv[(b * T + j) * 3 * C + C + h * hd];
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d) dot += static_cast<double>(q[d]) * k[d];
          x[j] = dot * scale;
          mx = std::max(mx, x[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= t; ++j) sum += std::exp(x[j] - mx);
        lse[(b * H + h) * T + t] = static_cast<float>(mx + std::log(sum));
      }
  return lse;
}

// The fused kernels (gpt/flash_attention_cuda.h) against the CPU ops: one tile and several, seq
// under a tile and past a multiple of it (the zero-padded, masked rows and keys), every head
// width they take; the state is each row's log-sum-exp, written exactly (a guard after it stays),
// and a second run repeats bit for bit (no atomics).
TEST_F(CudaFusedAttentionTest, WithinBf16RoundingStateIsLogSumExpAndRepeatable) {
  for (AttnShape s :
       {AttnShape{2, 13, 128, 4}, AttnShape{2, 64, 128, 2}, AttnShape{3, 70, 256, 4},
        AttnShape{1, 130, 384, 4}, AttnShape{2, 200, 256, 2}, AttnShape{1, 257, 512, 4}}) {
    const int64_t rows = s.batch * s.seq, hd = s.channels / s.heads;
    ASSERT_TRUE(ops_->fused_attention(hd)) << hd;
    const int64_t state_n = s.batch * s.heads * s.seq;  // one log-sum-exp a row
    auto qkv = Random(rows * 3 * s.channels, 1), dout = Random(rows * s.channels, 2);
    std::vector<float> out(rows * s.channels), probs(s.batch * s.heads * s.seq * s.seq),
        dqkv(rows * 3 * s.channels);
    cpu::AttentionForward<float>(qkv.data(), out.data(), probs.data(), s.batch, s.seq, s.channels,
                                 s.heads);
    cpu::AttentionBackward<float>(dout.data(), qkv.data(), probs.data(), dqkv.data(), s.batch,
                                  s.seq, s.channels, s.heads);
    const std::vector<float> lse = LogSumExps(qkv, s);
    constexpr int64_t kGuard = 64;
    DeviceVec<float> gqkv(qkv), gout(Filled<float>(out.size(), 7.0f)),
        gstate(Filled<float>(state_n + kGuard, 7.0f)), gdout(dout),
        gdqkv(Filled<float>(dqkv.size(), 7.0f));
    const std::string shape = " seq " + std::to_string(s.seq) + " hd " + std::to_string(hd);
    std::vector<float> first;
    for (int rep = 0; rep < 2; ++rep) {
      ops_->AttentionForward(gqkv.get(), gout.get(), gstate.get(), s.batch, s.seq, s.channels,
                             s.heads);
      ops_->AttentionBackward(gdout.get(), gqkv.get(), gout.get(), gstate.get(), gdqkv.get(),
                              s.batch, s.seq, s.channels, s.heads);
      ASSERT_TRUE(ops_->status().ok()) << ops_->status().ToString() << shape;
      const auto d = gdqkv.Get();
      if (rep == 1) {
        EXPECT_EQ(std::memcmp(d.data(), first.data(), 4 * d.size()), 0) << "repeat" << shape;
        break;
      }
      first = d;
      ExpectWithinBf16(gout.Get(), out, "fused attention out" + shape);
      auto state = gstate.Get();
      for (int64_t i = state_n; i < state_n + kGuard; ++i)
        ASSERT_EQ(state[i], 7.0f) << "written past the state at " << i << shape;
      state.resize(state_n);
      ExpectWithinBf16(state, lse, "fused attention log-sum-exp" + shape);
      ExpectWithinBf16(d, dqkv, "fused dqkv" + shape, 2e-2);
    }
  }
}

// Head widths the kernels do not take run the batched products, state = probabilities.
TEST_F(CudaFusedAttentionTest, OtherHeadWidthsTakeTheBatchedProducts) {
  const AttnShape s{2, 70, 144, 2};
  EXPECT_FALSE(ops_->fused_attention(72));
  const int64_t rows = s.batch * s.seq, probs_n = s.batch * s.heads * s.seq * s.seq;
  auto qkv = Random(rows * 3 * s.channels, 1), dout = Random(rows * s.channels, 2);
  std::vector<float> out(rows * s.channels), probs(probs_n), dqkv(rows * 3 * s.channels);
  cpu::AttentionForward<float>(qkv.data(), out.data(), probs.data(), s.batch, s.seq, s.channels,
                               s.heads);
  cpu::AttentionBackward<float>(dout.data(), qkv.data(), probs.data(), dqkv.data(), s.batch, s.seq,
                                s.channels, s.heads);
  DeviceVec<float> gqkv(qkv), gout(Filled<float>(out.size(), 7.0f)),
      gprobs(Filled<float>(probs_n, 7.0f)), gdout(dout), gdqkv(Filled<float>(dqkv.size(), 7.0f));
  ops_->AttentionForward(gqkv.get(), gout.get(), gprobs.get(), s.batch, s.seq, s.channels, s.heads);
  ops_->AttentionBackward(gdout.get(), gqkv.get(), gout.get(), gprobs.get(), gdqkv.get(), s.batch,
                          s.seq, s.channels, s.heads);
  ExpectWithinBf16(gout.Get(), out, "attention out hd 72");
  ExpectWithinBf16(gprobs.Get(), probs, "attention probs hd 72");
  ExpectWithinBf16(gdqkv.Get(), dqkv, "dqkv hd 72", 2e-2);
}

TEST_F(CudaTensorCoreOpsTest, GemmEveryTransposeWithinBf16Rounding) {
  for (auto [m, n, k] : {std::array<int64_t, 3>{37, 67, 45}, {300, 520, 704}}) {
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        auto a = Random(m * k, 1), b = Random(k * n, 2), c = Random(m * n, 3);
        const int64_t lda = ta ? m : k, ldb = tb ? k : n;
        auto ref = c;
        cpu::Gemm<float>(ta, tb, m, n, k, 0.7f, a.data(), lda, b.data(), ldb, 0.3f, ref.data(), n);
        DeviceVec<float> da(a), db(b), dc(c);
        ops_->Gemm(ta, tb, m, n, k, 0.7f, da.get(), lda, db.get(), ldb, 0.3f, dc.get(), n);
        ExpectWithinBf16(dc.Get(), ref,
                         "gemm " + std::to_string(m) + "x" + std::to_string(n) + "x" +
                             std::to_string(k) + " ta " + std::to_string(ta) + " tb " +
                             std::to_string(tb));
      }
  }
}

TEST_F(CudaTensorCoreOpsTest, AttentionWithinBf16RoundingAndRepeatable) {
  for (AttnShape s :
       {AttnShape{3, 13, 40, 5}, AttnShape{2, 70, 144, 2}, AttnShape{2, 200, 256, 4}}) {
    const int64_t rows = s.batch * s.seq, probs_n = s.batch * s.heads * s.seq * s.seq;
    auto qkv = Random(rows * 3 * s.channels, 1), dout = Random(rows * s.channels, 2);
    std::vector<float> out(rows * s.channels), probs(probs_n), dqkv(rows * 3 * s.channels);
    cpu::AttentionForward<float>(qkv.data(), out.data(), probs.data(), s.batch, s.seq, s.channels,
                                 s.heads);
    cpu::AttentionBackward<float>(dout.data(), qkv.data(), probs.data(), dqkv.data(), s.batch,
                                  s.seq, s.channels, s.heads);
    DeviceVec<float> gqkv(qkv), gout(Filled<float>(out.size(), 7.0f)),
        gprobs(Filled<float>(probs_n, 7.0f)), gdout(dout), gdqkv(Filled<float>(dqkv.size(), 7.0f));
    const std::string shape =
        " seq " + std::to_string(s.seq) + " hd " + std::to_string(s.channels / s.heads);
    std::vector<float> first;
    for (int rep = 0; rep < 2; ++rep) {
      ops_->AttentionForward(gqkv.get(), gout.get(), gprobs.get(), s.batch, s.seq, s.channels,
                             s.heads);
      ops_->AttentionBackward(gdout.get(), gqkv.get(), gout.get(), gprobs.get(), gdqkv.get(),
                              s.batch, s.seq, s.channels, s.heads);
      const auto d = gdqkv.Get();
      if (rep == 1) {
        EXPECT_EQ(std::memcmp(d.data(), first.data(), 4 * d.size()), 0) << "repeat" << shape;
        break;
      }
      first = d;
      ExpectWithinBf16(gout.Get(), out, "attention out" + shape);
      const auto p = gprobs.Get();
      ExpectWithinBf16(p, probs, "attention probs" + shape);
      for (int64_t r = 0; r < s.batch * s.heads * s.seq; ++r)
        for (int64_t c = r % s.seq + 1; c < s.seq; ++c)
          ASSERT_EQ(p[r * s.seq + c], 0.0f) << "above the diagonal at row " << r << shape;
      ExpectWithinBf16(d, dqkv, "dqkv" + shape, 2e-2);
    }
  }
}

}  // namespace
}  // namespace tierzero::gpt
