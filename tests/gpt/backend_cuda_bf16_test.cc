// The GPU's bf16 backend (gpt/backend_cuda_bf16.cc) against the CPU's bf16 backend, the
// reference for the same storage types (itself checked bit for bit against the fp32 ops on
// rounded inputs: activations_test.cc): every op within bf16 rounding on the same bf16 inputs,
// in both weight layouts and through each cuBLASLt epilogue, the parameter gradients written
// over the weight's own buffer and added to; the whole model's loss and gradients; and a second
// run bit-identical to the first. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention_reference.h"
#include "device_buffer.h"
#include "gpt/backend.h"
#include "gpt/gpt.h"
#include "tierzero/convert.h"
#include "tierzero/engine.h"

namespace tierzero::gpt {
namespace {

using Bits = std::vector<uint16_t>;

Bits RandomBf16(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  Bits b(n);
  EXPECT_TRUE(CastElements(v.data(), DType::kF32, b.data(), DType::kBF16, n).ok());
  return b;
}
template <typename T = uint16_t>
std::vector<T> Zeros(size_t n, T v = T{}) {
  return std::vector<T>(n, v);
}
std::vector<float> Widen(const Bits& b) {
  std::vector<float> v(b.size());
  EXPECT_TRUE(CastElements(b.data(), DType::kBF16, v.data(), DType::kF32, b.size()).ok());
  return v;
}

// Device memory holding a copy of host data.
template <typename T>
using Dev = testing_cuda::DeviceBuffer<T>;

// |gpu - cpu| <= tol (|cpu| + the largest |cpu| / 64): bf16 rounding of sums taken in another
// order.
void ExpectNear(const Bits& gpu, const Bits& cpu, const std::string& what, float tol = 2e-2f) {
  const auto g = Widen(gpu), c = Widen(cpu);
  ASSERT_EQ(g.size(), c.size()) << what;
  float mx = 0;
  for (float v : c) mx = std::max(mx, std::fabs(v));
  int bad = 0;
  for (size_t i = 0; i < c.size(); ++i)
    if (!(std::fabs(g[i] - c[i]) <= tol * (std::fabs(c[i]) + mx / 64))) {
      if (++bad <= 5) {
        ADD_FAILURE() << what << "[" << i << "]: gpu " << g[i] << " cpu " << c[i];
      }
    }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << c.size() << " differ";
}

// Attention's outputs against fp64 attention on the same bf16 operands
// (attention_reference.h): the GPU's norm-wise error within 3x the CPU bf16 backend's own (which
// activations_test.cc holds near 2e-3) or 8e-3, and no element off by more than 3% of the largest.
// Element-wise bounds on small values fail on rounding alone: softmax's backward subtracts nearly
// equal terms, and the GPU rounds the probabilities recomputed from log-sum-exps where the CPU
// keeps the forward's.
void ExpectWithinReference(const Bits& gpu, const Bits& cpu, const std::vector<double>& ref,
                           const std::string& what) {
  namespace ta = testing_attention;
  const double eg = ta::RelativeError(Widen(gpu), ref), ec = ta::RelativeError(Widen(cpu), ref);
  EXPECT_LE(eg, std::max(3 * ec, 8e-3)) << what << ": gpu " << eg << ", cpu " << ec;
  EXPECT_LE(ta::WorstErrorOfMax(Widen(gpu), ref), 3e-2) << what;
  std::printf("%s: relative error to fp64, gpu %.2e, cpu %.2e\n", what.c_str(), eg, ec);
}
std::vector<double> Wide(const Bits& b) {
  const std::vector<float> f = Widen(b);
  return std::vector<double>(f.begin(), f.end());
}

class CudaBf16BackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineConfig gc;
    gc.device = DeviceChoice::kCuda;
    auto ge = Engine::Create(gc);
    if (!ge.ok()) GTEST_SKIP() << ge.status().ToString();
    gpu_engine_ = std::move(*ge);
    // An engine finalizes with a parameter; the backend needs its compute stream.
    ASSERT_TRUE(gpu_engine_->RegisterParam({"unused", {16}, InitConstant(0), false}).ok());
    if (Status s = gpu_engine_->Finalize(); !s.ok()) GTEST_SKIP() << s.ToString();
    EngineConfig cc;
    cc.device = DeviceChoice::kHost;
    auto ce = Engine::Create(cc);
    ASSERT_TRUE(ce.ok());
    cpu_engine_ = std::move(*ce);
    BackendSpec spec;
    spec.params = spec.weights = spec.activations = DType::kBF16;
    spec.grads_in_place = true;
    auto cpu = Backend::Create(*cpu_engine_, spec);
    ASSERT_TRUE(cpu.ok());
    cpu_ = std::move(*cpu);
    spec.gpu = true;
    spec.fused_attention_wanted = true;
    auto gpu = Backend::Create(*gpu_engine_, spec);
    ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
    gpu_ = std::move(*gpu);
  }
  void TearDown() override {
    if (gpu_) {
      EXPECT_TRUE(gpu_->status().ok()) << gpu_->status().ToString();
    }
  }
  std::unique_ptr<Engine> gpu_engine_, cpu_engine_;
  std::unique_ptr<Backend> cpu_, gpu_;
};

TEST_F(CudaBf16BackendTest, LinearEveryLayoutAndEpilogue) {
  const int64_t rows = 70, in = 96, out = 160;
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    const std::string l = layout == WeightLayout::kInOut ? " (in x out)" : " (out x in)";
    const Bits x = RandomBf16(rows * in, 1), w = RandomBf16(in * out, 2, 0.1f),
               b = RandomBf16(out, 3), dy = RandomBf16(rows * out, 4),
               pre_in = RandomBf16(rows * in, 5), dw0 = RandomBf16(in * out, 6);
    // Forward: bias; bias + GELU keeping GELU's input.
    Bits y(rows * out), pre(rows * out), g(rows * out);
    cpu_->LinearForward(x.data(), w.data(), b.data(), y.data(), rows, in, out, layout);
    Bits cpre(rows * out), cg(rows * out);
    cpu_->LinearGeluForward(x.data(), w.data(), b.data(), cpre.data(), cg.data(), rows, in, out,
                            layout);
    Dev<uint16_t> dx_(x), dw_(w), db_(b), dyv(Zeros(rows * out)), dpre(Zeros(rows * out)),
        dg(Zeros(rows * out));
    gpu_->LinearForward(dx_.get(), dw_.get(), db_.get(), dyv.get(), rows, in, out, layout);
    gpu_->LinearGeluForward(dx_.get(), dw_.get(), db_.get(), dpre.get(), dg.get(), rows, in, out,
                            layout);
    ExpectNear(dyv.Get(), y, "y" + l);
    ExpectNear(dpre.Get(), cpre, "GELU's input" + l);
    ExpectNear(dg.Get(), cg, "GELU(x W + b)" + l);
    // Backward: dx (and through GELU), dW added to, dbias written; then dW written over W.
    Bits cdx(rows * in), cdw = dw0, cdb(out), cdxg(rows * in), cdw2 = dw0, cdb2(out);
    cpu_->LinearBackward(dy.data(), x.data(), w.data(), cdx.data(), GradOut{cdw.data(), true},
                         GradOut{cdb.data(), false}, rows, in, out, layout);
    cpu_->LinearBackwardGelu(dy.data(), x.data(), w.data(), pre_in.data(), cdxg.data(),
                             GradOut{cdw2.data(), true}, GradOut{cdb2.data(), false}, rows, in, out,
                             layout);
    Dev<uint16_t> gdy(dy), gpre_in(pre_in), gdx(Zeros(rows * in)), gdw(dw0), gdb(Zeros(out)),
        gdxg(Zeros(rows * in)), gdw2(dw0), gdb2(Zeros(out));
    gpu_->LinearBackward(gdy.get(), dx_.get(), dw_.get(), gdx.get(), GradOut{gdw.get(), true},
                         GradOut{gdb.get(), false}, rows, in, out, layout);
    gpu_->LinearBackwardGelu(gdy.get(), dx_.get(), dw_.get(), gpre_in.get(), gdxg.get(),
                             GradOut{gdw2.get(), true}, GradOut{gdb2.get(), false}, rows, in, out,
                             layout);
    ExpectNear(gdx.Get(), cdx, "dx" + l);
    ExpectNear(gdw.Get(), cdw, "dW added to" + l);
    ExpectNear(gdb.Get(), cdb, "dbias (epilogue)" + l);
    ExpectNear(gdxg.Get(), cdxg, "dx through GELU (epilogue)" + l);
    Bits cw = w, cdx3(rows * in);
    cpu_->LinearBackward(dy.data(), x.data(), cw.data(), cdx3.data(), GradOut{cw.data(), false},
                         GradOut{}, rows, in, out, layout);
    gpu_->LinearBackward(gdy.get(), dx_.get(), dw_.get(), gdx.get(), GradOut{dw_.get(), false},
                         GradOut{}, rows, in, out, layout);
    ExpectNear(gdx.Get(), cdx3, "dx, dW written over W" + l);
    ExpectNear(dw_.Get(), cw, "dW written over W" + l);
  }
}

// The fused sums round once, where the CPU's bf16 composition rounds the op's output before
// adding (half a bf16 step of the op's output apart where the residual cancels it): their
// reference is the op in fp32 on the widened operands (the CPU's fp32 backend) plus the residual,
// rounded once.
std::unique_ptr<Backend> Fp32CpuBackend(Engine& e) {
  auto b = Backend::Create(e, BackendSpec{});
  EXPECT_TRUE(b.ok()) << b.status().ToString();
  return b.ok() ? std::move(*b) : nullptr;
}
Bits PlusRoundedOnce(const std::vector<float>& op, const Bits& residual) {
  std::vector<float> sum = Widen(residual);
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = op[i] + sum[i];
  Bits out(sum.size());
  EXPECT_TRUE(CastElements(sum.data(), DType::kF32, out.data(), DType::kBF16, sum.size()).ok());
  return out;
}

// The residual stream's fused sums (Note [The residual stream's additions]) against the op in
// fp32 plus the residual, rounded once: the projection with the residual as cuBLASLt's C, in
// both layouts, with and without a bias; the norms' backward with the residual's gradient added
// in their row kernels.
TEST_F(CudaBf16BackendTest, ResidualSumsFusedWithTheirOps) {
  const std::unique_ptr<Backend> f32 = Fp32CpuBackend(*cpu_engine_);
  ASSERT_NE(f32, nullptr);
  const int64_t rows = 70, in = 96, out = 128;
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    for (const bool with_bias : {true, false}) {
      const std::string l =
          std::string(layout == WeightLayout::kInOut ? " (in x out" : " (out x in") +
          (with_bias ? ", bias)" : ")");
      const Bits x = RandomBf16(rows * in, 31), w = RandomBf16(in * out, 32, 0.1f),
                 b = RandomBf16(out, 33), res = RandomBf16(rows * out, 34);
      std::vector<float> y32(rows * out);
      const std::vector<float> b32 = Widen(b);
      f32->LinearForward(Widen(x).data(), Widen(w).data(), with_bias ? b32.data() : nullptr,
                         y32.data(), rows, in, out, layout);
      const Bits cy = PlusRoundedOnce(y32, res);
      Dev<uint16_t> gx(x), gw(w), gb(b), gres(res), gy(Zeros(rows * out));
      gpu_->LinearResidualForward(gx.get(), gw.get(), with_bias ? gb.get() : nullptr, gres.get(),
                                  gy.get(), rows, in, out, layout);
      ExpectNear(gy.Get(), cy, "x W + b + residual" + l);
      EXPECT_EQ(gres.Get(), res) << "the residual is read only";
    }
  }
  const int64_t R = 210, C = 128;
  const Bits x = RandomBf16(R * C, 35), gm = RandomBf16(C, 36), bt = RandomBf16(C, 37),
             dy = RandomBf16(R * C, 38), dres = RandomBf16(R * C, 39);
  std::vector<float> mean(R), rstd(R);
  Bits y(R * C), cdg(C), cdb(C), rdw(C);
  std::vector<float> dx32(R * C), g32(C), b32(C), rdx32(R * C), rw32(C);
  const std::vector<float> x32 = Widen(x), gm32 = Widen(gm), dy32 = Widen(dy);
  cpu_->LayerNormForward(x.data(), gm.data(), bt.data(), y.data(), mean.data(), rstd.data(), R, C);
  cpu_->LayerNormBackward(dy.data(), x.data(), gm.data(), mean.data(), rstd.data(), y.data(),
                          GradOut{cdg.data(), false}, GradOut{cdb.data(), false}, R, C);
  f32->LayerNormBackward(dy32.data(), x32.data(), gm32.data(), mean.data(), rstd.data(),
                         dx32.data(), GradOut{g32.data(), false}, GradOut{b32.data(), false}, R, C);
  const Bits cdx = PlusRoundedOnce(dx32, dres);
  std::vector<float> rrstd(R);
  cpu_->RmsNormForward(x.data(), gm.data(), y.data(), rrstd.data(), R, C, 1e-5);
  cpu_->RmsNormBackward(dy.data(), x.data(), gm.data(), rrstd.data(), y.data(),
                        GradOut{rdw.data(), false}, R, C);
  f32->RmsNormBackward(dy32.data(), x32.data(), gm32.data(), rrstd.data(), rdx32.data(),
                       GradOut{rw32.data(), false}, R, C);
  const Bits rdx = PlusRoundedOnce(rdx32, dres);
  Dev<uint16_t> gx(x), ggm(gm), gdy(dy), gdres(dres), gdx(Zeros(R * C)), gdg(Zeros(C)),
      gdb(Zeros(C)), grdx(Zeros(R * C)), grdw(Zeros(C));
  Dev<float> gmean(mean), grstd(rstd), grrstd(rrstd);
  gpu_->LayerNormBackwardResidual(gdy.get(), gx.get(), ggm.get(), gmean.get(), grstd.get(),
                                  gdres.get(), gdx.get(), GradOut{gdg.get(), false},
                                  GradOut{gdb.get(), false}, R, C);
  gpu_->RmsNormBackwardResidual(gdy.get(), gx.get(), ggm.get(), grrstd.get(), gdres.get(),
                                grdx.get(), GradOut{grdw.get(), false}, R, C);
  ExpectNear(gdx.Get(), cdx, "dresidual + layernorm dx");
  ExpectNear(gdg.Get(), cdg, "layernorm dgamma beside the residual");
  ExpectNear(gdb.Get(), cdb, "layernorm dbeta beside the residual");
  ExpectNear(grdx.Get(), rdx, "dresidual + rmsnorm dx");
  ExpectNear(grdw.Get(), rdw, "rmsnorm dw beside the residual");
}

// LayerNorm at widths that take each of its kernels (Note [Vectorised row kernels] in
// gpt/bf16_kernels_cuda.cu): 1, 2, 4 and 8 vectors a lane (some lanes idle at 200 and 768), and
// the scalar kernels (a width not a multiple of 8; wider than 2048), forward and backward, with
// and without the residual's gradient.
TEST_F(CudaBf16BackendTest, LayerNormAtEveryWidth) {
  const std::unique_ptr<Backend> f32 = Fp32CpuBackend(*cpu_engine_);
  ASSERT_NE(f32, nullptr);
  const int64_t R = 37;
  for (const int64_t C : {128, 200, 512, 768, 2048, 100, 4096}) {
    const std::string w = " (" + std::to_string(C) + " wide)";
    const Bits x = RandomBf16(R * C, 41), gm = RandomBf16(C, 42), bt = RandomBf16(C, 43),
               dy = RandomBf16(R * C, 44), dres = RandomBf16(R * C, 45);
    std::vector<float> mean(R), rstd(R);
    Bits cy(R * C), cdx(R * C), cdg(C), cdb(C);
    cpu_->LayerNormForward(x.data(), gm.data(), bt.data(), cy.data(), mean.data(), rstd.data(), R,
                           C);
    cpu_->LayerNormBackward(dy.data(), x.data(), gm.data(), mean.data(), rstd.data(), cdx.data(),
                            GradOut{cdg.data(), false}, GradOut{cdb.data(), false}, R, C);
    // (The residual's reference: the fp32 backward plus the residual, rounded once.)
    std::vector<float> dx32(R * C), g32(C), b32(C);
    f32->LayerNormBackward(Widen(dy).data(), Widen(x).data(), Widen(gm).data(), mean.data(),
                           rstd.data(), dx32.data(), GradOut{g32.data(), false},
                           GradOut{b32.data(), false}, R, C);
    const Bits cdxr = PlusRoundedOnce(dx32, dres);
    Dev<uint16_t> gx(x), ggm(gm), gbt(bt), gy(Zeros(R * C)), gdy(dy), gdres(dres),
        gdx(Zeros(R * C)), gdxr(Zeros(R * C)), gdg(Zeros(C)), gdb(Zeros(C)), gdg2(Zeros(C)),
        gdb2(Zeros(C));
    Dev<float> gmean(Zeros<float>(R)), grstd(Zeros<float>(R));
    gpu_->LayerNormForward(gx.get(), ggm.get(), gbt.get(), gy.get(), gmean.get(), grstd.get(), R,
                           C);
    gpu_->LayerNormBackward(gdy.get(), gx.get(), ggm.get(), gmean.get(), grstd.get(), gdx.get(),
                            GradOut{gdg.get(), false}, GradOut{gdb.get(), false}, R, C);
    gpu_->LayerNormBackwardResidual(gdy.get(), gx.get(), ggm.get(), gmean.get(), grstd.get(),
                                    gdres.get(), gdxr.get(), GradOut{gdg2.get(), false},
                                    GradOut{gdb2.get(), false}, R, C);
    ExpectNear(gy.Get(), cy, "layernorm y" + w);
    const std::vector<float> gm_ = gmean.Get(), gr_ = grstd.Get();
    for (int64_t r = 0; r < R; ++r) {
      EXPECT_NEAR(gm_[r], mean[r], 1e-4f * (1 + std::fabs(mean[r]))) << "mean" << w;
      EXPECT_NEAR(gr_[r], rstd[r], 1e-4f * rstd[r]) << "rstd" << w;
    }
    ExpectNear(gdx.Get(), cdx, "layernorm dx" + w);
    ExpectNear(gdxr.Get(), cdxr, "dresidual + layernorm dx" + w);
    ExpectNear(gdg.Get(), cdg, "layernorm dgamma" + w);
    ExpectNear(gdb.Get(), cdb, "layernorm dbeta" + w);
    if (C != 512) continue;
    // Rows a multiple of 8 wide but not 16-byte aligned: the scalar kernels.
    Bits xo(R * C + 1), yo(R * C + 1, 0);
    std::copy(x.begin(), x.end(), xo.begin() + 1);
    Dev<uint16_t> gxo(xo), gyo(yo);
    gpu_->LayerNormForward(gxo.get() + 1, ggm.get(), gbt.get(), gyo.get() + 1, gmean.get(),
                           grstd.get(), R, C);
    const Bits yo_back = gyo.Get();
    ExpectNear(Bits(yo_back.begin() + 1, yo_back.end()), cy, "layernorm y, unaligned rows" + w);
  }
}

TEST_F(CudaBf16BackendTest, NormEmbeddingAttentionAndLoss) {
  const int64_t B = 3, T = 70, C = 128, H = 2, R = B * T, V = 301;
  const Bits x = RandomBf16(R * C, 1), gm = RandomBf16(C, 2), bt = RandomBf16(C, 3),
             dy = RandomBf16(R * C, 4);
  {
    Bits cy(R * C), cdx(R * C), cdg = RandomBf16(C, 5), cdb(C);
    std::vector<float> mean(R), rstd(R);
    cpu_->LayerNormForward(x.data(), gm.data(), bt.data(), cy.data(), mean.data(), rstd.data(), R,
                           C);
    const Bits dg0 = cdg;
    cpu_->LayerNormBackward(dy.data(), x.data(), gm.data(), mean.data(), rstd.data(), cdx.data(),
                            GradOut{cdg.data(), true}, GradOut{cdb.data(), false}, R, C);
    Dev<uint16_t> gx(x), ggm(gm), gbt(bt), gy(Zeros(R * C)), gdy(dy), gdx(Zeros(R * C)), gdg(dg0),
        gdb(Zeros(C));
    Dev<float> gmean(Zeros<float>(R)), grstd(Zeros<float>(R));
    gpu_->LayerNormForward(gx.get(), ggm.get(), gbt.get(), gy.get(), gmean.get(), grstd.get(), R,
                           C);
    gpu_->LayerNormBackward(gdy.get(), gx.get(), ggm.get(), gmean.get(), grstd.get(), gdx.get(),
                            GradOut{gdg.get(), true}, GradOut{gdb.get(), false}, R, C);
    ExpectNear(gy.Get(), cy, "layernorm y");
    ExpectNear(gdx.Get(), cdx, "layernorm dx");
    ExpectNear(gdg.Get(), cdg, "layernorm dgamma added to");
    ExpectNear(gdb.Get(), cdb, "layernorm dbeta written");
  }
  {
    std::vector<int32_t> tokens(R);
    for (int64_t i = 0; i < R; ++i) tokens[i] = static_cast<int32_t>((i * i * 7 + 3) % 50);
    const Bits wte = RandomBf16(V * C, 6), wpe = RandomBf16(T * C, 7);
    Bits cx(R * C), cdwte = RandomBf16(V * C, 8), cdwpe(T * C), cfresh(V * C, 0x4000);
    const Bits dwte0 = cdwte;
    cpu_->EmbeddingForward(tokens.data(), wte.data(), wpe.data(), cx.data(), B, T, C);
    cpu_->EmbeddingBackward(tokens.data(), tokens.data(), dy.data(), GradOut{cdwte.data(), true}, V,
                            GradOut{cdwpe.data(), false}, B, T, C);
    cpu_->EmbeddingBackward(tokens.data(), tokens.data(), dy.data(), GradOut{cfresh.data(), false},
                            V, GradOut{}, B, T, C);
    Dev<int32_t> gt(tokens);
    Dev<uint16_t> gwte(wte), gwpe(wpe), gx(Zeros(R * C)), gdy(dy), gdwte(dwte0),
        gdwpe(Zeros(T * C)), gfresh(Zeros<uint16_t>(V * C, 0x4000));
    gpu_->EmbeddingForward(gt.get(), gwte.get(), gwpe.get(), gx.get(), B, T, C);
    gpu_->EmbeddingBackward(gt.get(), tokens.data(), gdy.get(), GradOut{gdwte.get(), true}, V,
                            GradOut{gdwpe.get(), false}, B, T, C);
    gpu_->EmbeddingBackward(gt.get(), tokens.data(), gdy.get(), GradOut{gfresh.get(), false}, V,
                            GradOut{}, B, T, C);
    ExpectNear(gx.Get(), cx, "embedding");
    ExpectNear(gdwte.Get(), cdwte, "wte gradient added to");
    ExpectNear(gdwpe.Get(), cdwpe, "wpe gradient");
    ExpectNear(gfresh.Get(), cfresh, "wte gradient written");
  }
  {
    // Attention: the GPU keeps log-sum-exps, the CPU probabilities; outputs and gradients agree.
    const Bits qkv = RandomBf16(R * 3 * C, 9), dout = RandomBf16(R * C, 10);
    Bits cout(R * C), cprobs(B * H * T * T), cdqkv(R * 3 * C);
    const AttnDims ad{B, T, H, H, C / H, 3 * C, 3 * C, 3 * C};
    cpu_->AttentionForward(qkv.data(), qkv.data() + C, qkv.data() + 2 * C, cout.data(),
                           cprobs.data(), ad);
    cpu_->AttentionBackward(dout.data(), qkv.data(), qkv.data() + C, qkv.data() + 2 * C,
                            cout.data(), cprobs.data(), cdqkv.data(), cdqkv.data() + C,
                            cdqkv.data() + 2 * C, ad);
    Dev<uint16_t> gq(qkv), go(Zeros(R * C)), gdo(dout), gdq(Zeros(R * 3 * C));
    Dev<float> glse(Zeros<float>(B * H * T));
    gpu_->AttentionForward(gq.get(), gq.get() + C, gq.get() + 2 * C, go.get(), glse.get(), ad);
    gpu_->AttentionBackward(gdo.get(), gq.get(), gq.get() + C, gq.get() + 2 * C, go.get(),
                            glse.get(), gdq.get(), gdq.get() + C, gdq.get() + 2 * C, ad);
    namespace ta = testing_attention;
    const auto col = [&](const Bits& m, int64_t c0) { return ta::Columns(m, R, 3 * C, c0, C); };
    const ta::Result ref =
        ta::Reference(Wide(col(qkv, 0)), Wide(col(qkv, C)), Wide(col(qkv, 2 * C)), Wide(dout),
                      ta::Dims{B, T, H, H, C / H, C, C, C});
    ExpectWithinReference(go.Get(), cout, ref.out, "attention out");
    const Bits gdqkv = gdq.Get();
    ExpectWithinReference(col(gdqkv, 0), col(cdqkv, 0), ref.dq, "attention dq");
    ExpectWithinReference(col(gdqkv, C), col(cdqkv, C), ref.dk, "attention dk");
    ExpectWithinReference(col(gdqkv, 2 * C), col(cdqkv, 2 * C), ref.dv, "attention dv");
  }
  {
    const Bits logits = RandomBf16(R * V, 11, 3.0f);
    std::vector<int32_t> targets(R), cam(R);
    for (int64_t i = 0; i < R; ++i) targets[i] = static_cast<int32_t>((i * 13) % V);
    std::vector<float> mask(R, 1.0f);
    for (int64_t i = 0; i < R; i += 7) mask[i] = 0;
    Bits cdl(R * V);
    ASSERT_TRUE(cpu_->CrossEntropy(logits.data(), targets.data(), mask.data(), cdl.data(),
                                   cam.data(), R, V, 2.0)
                    .ok());
    const double closs = *cpu_->Loss();
    Dev<uint16_t> gl(logits), gdl(Zeros(R * V));
    Dev<int32_t> gtg(targets), gam(Zeros<int32_t>(R));
    Dev<float> gmask(mask);
    ASSERT_TRUE(
        gpu_->CrossEntropy(gl.get(), gtg.get(), gmask.get(), gdl.get(), gam.get(), R, V, 2.0).ok());
    auto gloss = gpu_->Loss();
    ASSERT_TRUE(gloss.ok()) << gloss.status().ToString();
    EXPECT_NEAR(*gloss, closs, 1e-4 * std::fabs(closs));
    EXPECT_EQ(gam.Get(), cam);
    ExpectNear(gdl.Get(), cdl, "dlogits");
  }
}

// The Llama family's element-wise ops: RMSNorm (its weight gradient added to and written),
// rotary embeddings with and without Llama 3's scaling on heads inside a wider row, forward and
// backward, and SwiGLU.
TEST_F(CudaBf16BackendTest, RmsNormRopeAndSwiglu) {
  const int64_t B = 3, T = 70, C = 128, R = B * T;
  const Bits x = RandomBf16(R * C, 21), w = RandomBf16(C, 22), dy = RandomBf16(R * C, 23);
  {
    Bits cy(R * C), cdx(R * C), cdw = RandomBf16(C, 24), cfresh(C);
    std::vector<float> rstd(R);
    const Bits dw0 = cdw;
    cpu_->RmsNormForward(x.data(), w.data(), cy.data(), rstd.data(), R, C, 1e-5);
    cpu_->RmsNormBackward(dy.data(), x.data(), w.data(), rstd.data(), cdx.data(),
                          GradOut{cdw.data(), true}, R, C);
    cpu_->RmsNormBackward(dy.data(), x.data(), w.data(), rstd.data(), cdx.data(),
                          GradOut{cfresh.data(), false}, R, C);
    Dev<uint16_t> gx(x), gw(w), gy(Zeros(R * C)), gdy(dy), gdx(Zeros(R * C)), gdw(dw0),
        gfresh(Zeros(C));
    Dev<float> grstd(Zeros<float>(R));
    gpu_->RmsNormForward(gx.get(), gw.get(), gy.get(), grstd.get(), R, C, 1e-5);
    gpu_->RmsNormBackward(gdy.get(), gx.get(), gw.get(), grstd.get(), gdx.get(),
                          GradOut{gdw.get(), true}, R, C);
    gpu_->RmsNormBackward(gdy.get(), gx.get(), gw.get(), grstd.get(), gdx.get(),
                          GradOut{gfresh.get(), false}, R, C);
    ExpectNear(gy.Get(), cy, "rmsnorm y");
    ExpectNear(gdx.Get(), cdx, "rmsnorm dx");
    ExpectNear(gdw.Get(), cdw, "rmsnorm dw added to");
    ExpectNear(gfresh.Get(), cfresh, "rmsnorm dw written");
    const std::vector<float> gr = grstd.Get();
    for (int64_t i = 0; i < R; ++i) EXPECT_NEAR(gr[i], rstd[i], 1e-3 * rstd[i]) << "rstd " << i;
  }
  for (const bool scaled : {false, true}) {
    // 2 heads of 64 in rows of 3 x 128 (the first third of a fused q, k, v row).
    Rope rope;
    rope.theta = 500000.0;
    if (scaled) {
      rope.factor = 8;
      rope.original_positions = 32;
    }
    const int64_t H = 2, hd = 64, ld = 3 * C;
    const Bits q = RandomBf16(R * ld, scaled ? 25 : 26);
    Bits cf = q, cb = q;
    cpu_->RopeForward(cf.data(), B, T, H, hd, ld, rope);
    cpu_->RopeBackward(cb.data(), B, T, H, hd, ld, rope);
    Dev<uint16_t> gf(q), gb(q);
    gpu_->RopeForward(gf.get(), B, T, H, hd, ld, rope);
    gpu_->RopeBackward(gb.get(), B, T, H, hd, ld, rope);
    const std::string what = scaled ? "rope (llama3 scaling)" : "rope";
    const Bits ff = gf.Get(), fb = gb.Get();
    ExpectNear(ff, cf, what + " forward");
    ExpectNear(fb, cb, what + " backward");
    // The columns past the heads are untouched.
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = H * hd; c < ld; ++c)
        ASSERT_EQ(ff[r * ld + c], q[r * ld + c]) << what << " wrote past its heads";
  }
  {
    const int64_t n = R * 344;
    const Bits g = RandomBf16(n, 27, 2.0f), u = RandomBf16(n, 28), dh = RandomBf16(n, 29);
    Bits ch(n), cdg(n), cdu(n);
    cpu_->SwigluForward(g.data(), u.data(), ch.data(), n);
    cpu_->SwigluBackward(dh.data(), g.data(), u.data(), cdg.data(), cdu.data(), n);
    Dev<uint16_t> gg(g), gu(u), gh(Zeros(n)), gdh(dh), gdg(Zeros(n)), gdu(Zeros(n));
    gpu_->SwigluForward(gg.get(), gu.get(), gh.get(), n);
    gpu_->SwigluBackward(gdh.get(), gg.get(), gu.get(), gdg.get(), gdu.get(), n);
    ExpectNear(gh.Get(), ch, "swiglu h");
    ExpectNear(gdg.Get(), cdg, "swiglu dg");
    ExpectNear(gdu.Get(), cdu, "swiglu du");
  }
}

// Grouped-query attention on separate q, k, v (Llama's) through the general kernels: 4 query
// heads over 2 key/value heads of 64, a sequence across several tiles.
TEST_F(CudaBf16BackendTest, GroupedQueryAttentionOnSeparateMatrices) {
  const int64_t B = 2, T = 150, H = 4, KV = 2, hd = 64, R = B * T;
  const AttnDims ad{B, T, H, KV, hd, H * hd, KV * hd, KV * hd};
  const Bits q = RandomBf16(R * H * hd, 1), k = RandomBf16(R * KV * hd, 2),
             v = RandomBf16(R * KV * hd, 3), dout = RandomBf16(R * H * hd, 4);
  Bits cout(R * H * hd), cprobs(B * H * T * T), cdq(q.size()), cdk(k.size()), cdv(v.size());
  cpu_->AttentionForward(q.data(), k.data(), v.data(), cout.data(), cprobs.data(), ad);
  cpu_->AttentionBackward(dout.data(), q.data(), k.data(), v.data(), cout.data(), cprobs.data(),
                          cdq.data(), cdk.data(), cdv.data(), ad);
  Dev<uint16_t> gq(q), gk(k), gv(v), go(Zeros(R * H * hd)), gdo(dout), gdq(Zeros(q.size())),
      gdk(Zeros(k.size())), gdv(Zeros(v.size()));
  Dev<float> glse(Zeros<float>(B * H * T));
  gpu_->AttentionForward(gq.get(), gk.get(), gv.get(), go.get(), glse.get(), ad);
  gpu_->AttentionBackward(gdo.get(), gq.get(), gk.get(), gv.get(), go.get(), glse.get(), gdq.get(),
                          gdk.get(), gdv.get(), ad);
  namespace ta = testing_attention;
  const ta::Result ref = ta::Reference(Wide(q), Wide(k), Wide(v), Wide(dout),
                                       ta::Dims{B, T, H, KV, hd, H * hd, KV * hd, KV * hd});
  ExpectWithinReference(go.Get(), cout, ref.out, "GQA out");
  ExpectWithinReference(gdq.Get(), cdq, ref.dq, "GQA dq");
  ExpectWithinReference(gdk.Get(), cdk, ref.dk, "GQA dk (summed over the group)");
  ExpectWithinReference(gdv.Get(), cdv, ref.dv, "GQA dv (summed over the group)");
}

// The whole model on the GPU with bf16 activations against the CPU with bf16 activations, and
// against itself.
struct Pass {
  double loss = 0;
  std::vector<std::vector<float>> grads;
};

StatusOr<Pass> RunModel(DeviceChoice device, bool llama = false) {
  GptConfig mc;
  mc.vocab = 97;
  mc.seq_len = 40;
  mc.d_model = 128;
  mc.n_layer = 2;
  mc.n_head = 2;  // heads 64 wide: the fused attention's
  if (llama) {
    mc = AsLlama(mc);
    mc.n_head = 4;  // heads 32 wide over 2 key/value heads
    mc.n_kv_head = 2;
  }
  mc.activations = Activations::kBF16;
  EngineConfig ec;
  ec.device = device;
  ec.compute_dtype = DType::kBF16;
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::Create(ec));
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<Gpt> model, Gpt::Create(*e, mc));
  TZ_RETURN_IF_ERROR(e->Finalize());
  Batch b;
  b.batch = 3;
  b.seq = mc.seq_len;
  std::mt19937 rng(4);
  for (int i = 0; i < b.batch * b.seq; ++i) {
    b.tokens.push_back(static_cast<int32_t>(rng() % 97));
    b.targets.push_back(static_cast<int32_t>(rng() % 97));
    b.mask.push_back(1.0f);
  }
  Pass out;
  TZ_ASSIGN_OR_RETURN(out.loss, model->ForwardBackward(b));
  for (ParamId p = 0; p < e->num_params(); ++p) {
    std::vector<float> g(static_cast<size_t>(e->numel(p)));
    TZ_RETURN_IF_ERROR(e->ReadGrad(p, g));
    out.grads.push_back(std::move(g));
  }
  return out;
}

class CudaBf16ModelTest : public CudaBf16BackendTest, public ::testing::WithParamInterface<bool> {};

TEST_P(CudaBf16ModelTest, ModelWithinBf16RoundingOfTheCpuAndRepeatable) {
  const bool llama = GetParam();
  auto cpu = RunModel(DeviceChoice::kHost, llama);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  auto gpu = RunModel(DeviceChoice::kCuda, llama);
  ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
  auto again = RunModel(DeviceChoice::kCuda, llama);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_NEAR(gpu->loss, cpu->loss, 1e-2 * cpu->loss);
  EXPECT_EQ(again->loss, gpu->loss);
  ASSERT_EQ(gpu->grads.size(), cpu->grads.size());
  for (size_t p = 0; p < cpu->grads.size(); ++p) {
    double num = 0, den = 0;
    for (size_t i = 0; i < cpu->grads[p].size(); ++i) {
      const double d = double{gpu->grads[p][i]} - cpu->grads[p][i];
      num += d * d;
      den += double{cpu->grads[p][i]} * cpu->grads[p][i];
    }
    EXPECT_LT(std::sqrt(num / std::max(den, 1e-30)), 5e-2) << "parameter " << p;
    EXPECT_EQ(std::memcmp(gpu->grads[p].data(), again->grads[p].data(), 4 * gpu->grads[p].size()),
              0)
        << "parameter " << p << " differs run to run";
  }
}

INSTANTIATE_TEST_SUITE_P(Gpt2AndLlama, CudaBf16ModelTest, ::testing::Values(false, true),
                         [](const auto& i) { return i.param ? "Llama" : "Gpt2"; });

}  // namespace
}  // namespace tierzero::gpt
