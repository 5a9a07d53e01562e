// bf16 activations on the CPU (Note [Activation types] in gpt/backend.h): each op of the CPU
// backend stores in bf16 exactly what the fp32 op computes from the bf16 inputs, rounded; the
// whole model with bf16 activations stays within bf16 rounding of the fp32 reference (loss and
// every gradient), keeps about half the activation bytes, and trains as well.
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
#include "gpt/backend.h"
#include "gpt/gpt.h"
#include "gpt/ops.h"
#include "tierzero/convert.h"
#include "tierzero/engine.h"

namespace tierzero::gpt {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<uint16_t> ToBf16(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  EXPECT_TRUE(CastElements(v.data(), DType::kF32, b.data(), DType::kBF16, v.size()).ok());
  return b;
}
std::vector<float> FromBf16(const std::vector<uint16_t>& b) {
  std::vector<float> v(b.size());
  EXPECT_TRUE(CastElements(b.data(), DType::kBF16, v.data(), DType::kF32, b.size()).ok());
  return v;
}
// v rounded to bf16 and back.
std::vector<float> Rounded(const std::vector<float>& v) { return FromBf16(ToBf16(v)); }

void ExpectBitsEqual(const std::vector<uint16_t>& got, const std::vector<float>& want_f32,
                     const std::string& what) {
  const std::vector<uint16_t> want = ToBf16(want_f32);
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << what << " element " << i;
}

// The CPU backend with bf16 activations and bf16 weights (gradients added in place), next to
// the fp32 ops (gpt/ops.h) on the same, rounded, values.
class CpuBf16OpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    BackendSpec spec;
    spec.params = spec.weights = spec.activations = DType::kBF16;
    spec.grads_in_place = true;
    EngineConfig ec;
    ec.device = DeviceChoice::kHost;
    auto engine = Engine::Create(ec);
    ASSERT_TRUE(engine.ok());
    engine_ = std::move(*engine);
    auto k = Backend::Create(*engine_, spec);
    ASSERT_TRUE(k.ok()) << k.status().ToString();
    k_ = std::move(*k);
  }
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Backend> k_;
};

TEST_F(CpuBf16OpsTest, LinearBothLayoutsStoreTheRoundedFp32Result) {
  const int64_t rows = 9, in = 12, out = 7;
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    const auto x = Rounded(Random(rows * in, 1)), w = Rounded(Random(in * out, 2, 0.3f)),
               b = Rounded(Random(out, 3)), dy = Rounded(Random(rows * out, 4));
    const auto dw0 = Rounded(Random(in * out, 5)), db0 = Rounded(Random(out, 6));
    std::vector<float> y(rows * out), dx(rows * in), dw = dw0, db = db0;
    const bool io = layout == WeightLayout::kInOut;
    if (io) {
      cpu::LinearForward(x.data(), w.data(), b.data(), y.data(), rows, in, out);
      cpu::LinearBackward(dy.data(), x.data(), w.data(), dx.data(), dw.data(), db.data(), rows, in,
                          out);
    } else {
      cpu::LinearForwardOutIn(x.data(), w.data(), b.data(), y.data(), rows, in, out);
      cpu::LinearBackwardOutIn(dy.data(), x.data(), w.data(), dx.data(), dw.data(), db.data(), rows,
                               in, out);
    }
    auto bx = ToBf16(x), bw = ToBf16(w), bb = ToBf16(b), bdy = ToBf16(dy), bdw = ToBf16(dw0),
         bdb = ToBf16(db0);
    std::vector<uint16_t> by(rows * out), bdx(rows * in);
    k_->LinearForward(bx.data(), bw.data(), bb.data(), by.data(), rows, in, out, layout);
    k_->LinearBackward(bdy.data(), bx.data(), bw.data(), bdx.data(), GradOut{bdw.data(), true},
                       GradOut{bdb.data(), true}, rows, in, out, layout);
    const std::string l = io ? " (in x out)" : " (out x in)";
    ExpectBitsEqual(by, y, "y" + l);
    ExpectBitsEqual(bdx, dx, "dx" + l);
    ExpectBitsEqual(bdw, dw, "dw, added to" + l);
    ExpectBitsEqual(bdb, db, "dbias, added to" + l);
    // Written into the weight's own buffer (the engine may hand out the weight as its gradient's
    // buffer): dx from the weight as it was.
    std::vector<float> dw_new(in * out, 0.0f), dx_again(rows * in);
    if (io)
      cpu::LinearBackward(dy.data(), x.data(), w.data(), dx_again.data(), dw_new.data(),
                          static_cast<float*>(nullptr), rows, in, out);
    else
      cpu::LinearBackwardOutIn(dy.data(), x.data(), w.data(), dx_again.data(), dw_new.data(),
                               static_cast<float*>(nullptr), rows, in, out);
    k_->LinearBackward(bdy.data(), bx.data(), bw.data(), bdx.data(), GradOut{bw.data(), false},
                       GradOut{}, rows, in, out, layout);
    ExpectBitsEqual(bdx, dx_again, "dx, the gradient written over the weight" + l);
    ExpectBitsEqual(bw, dw_new, "dw written over the weight" + l);
  }
}

TEST_F(CpuBf16OpsTest, NormGeluAttentionEmbeddingAndLossStoreTheRoundedFp32Result) {
  const int64_t B = 2, T = 5, C = 8, H = 2, R = B * T, V = 11;
  const auto x = Rounded(Random(R * C, 1)), g = Rounded(Random(C, 2)), be = Rounded(Random(C, 3)),
             dy = Rounded(Random(R * C, 4));
  {
    std::vector<float> y(R * C), mean(R), rstd(R), dx(R * C), dg(C, 0.0f), db(C, 0.0f);
    cpu::LayerNormForward(x.data(), g.data(), be.data(), y.data(), mean.data(), rstd.data(), R, C);
    cpu::LayerNormBackward(dy.data(), x.data(), g.data(), mean.data(), rstd.data(), dx.data(),
                           dg.data(), db.data(), R, C);
    auto bx = ToBf16(x), bg = ToBf16(g), bbe = ToBf16(be), bdy = ToBf16(dy);
    // Written: whatever the buffers held before is replaced.
    std::vector<uint16_t> by(R * C), bdx(R * C), bdg(C, 0x4000), bdb(C, 0x4000);
    std::vector<float> kmean(R), krstd(R);
    k_->LayerNormForward(bx.data(), bg.data(), bbe.data(), by.data(), kmean.data(), krstd.data(), R,
                         C);
    EXPECT_EQ(kmean, mean);  // the statistics stay fp32
    EXPECT_EQ(krstd, rstd);
    k_->LayerNormBackward(bdy.data(), bx.data(), bg.data(), kmean.data(), krstd.data(), bdx.data(),
                          GradOut{bdg.data(), false}, GradOut{bdb.data(), false}, R, C);
    ExpectBitsEqual(by, y, "layernorm y");
    ExpectBitsEqual(bdx, dx, "layernorm dx");
    ExpectBitsEqual(bdg, dg, "layernorm dgamma");
    ExpectBitsEqual(bdb, db, "layernorm dbeta");
  }
  {
    // GELU backward in place (dx = dy's buffer), as the model calls it.
    std::vector<float> y(R * C), d = dy;
    cpu::GeluForward(x.data(), y.data(), R * C);
    cpu::GeluBackward(d.data(), x.data(), d.data(), R * C);
    auto bx = ToBf16(x), bd = ToBf16(dy);
    std::vector<uint16_t> by(R * C);
    k_->GeluForward(bx.data(), by.data(), R * C);
    k_->GeluBackward(bd.data(), bx.data(), bd.data(), R * C);
    ExpectBitsEqual(by, y, "gelu");
    ExpectBitsEqual(bd, d, "gelu backward in place");
  }
  {
    const auto qkv = Rounded(Random(R * 3 * C, 7)), dout = Rounded(Random(R * C, 8));
    std::vector<float> out(R * C), probs(B * H * T * T), dqkv(R * 3 * C);
    cpu::AttentionForward(qkv.data(), out.data(), probs.data(), B, T, C, H);
    // Backward reads the probabilities as they were stored: rounded.
    const auto probs_r = Rounded(probs);
    cpu::AttentionBackward(dout.data(), qkv.data(), probs_r.data(), dqkv.data(), B, T, C, H);
    auto bqkv = ToBf16(qkv), bdout = ToBf16(dout);
    std::vector<uint16_t> bout(R * C), bprobs(B * H * T * T), bdqkv(R * 3 * C);
    const AttnDims ad{B, T, H, H, C / H, 3 * C, 3 * C, 3 * C};
    k_->AttentionForward(bqkv.data(), bqkv.data() + C, bqkv.data() + 2 * C, bout.data(),
                         bprobs.data(), ad);
    k_->AttentionBackward(bdout.data(), bqkv.data(), bqkv.data() + C, bqkv.data() + 2 * C,
                          bout.data(), bprobs.data(), bdqkv.data(), bdqkv.data() + C,
                          bdqkv.data() + 2 * C, ad);
    ExpectBitsEqual(bout, out, "attention out");
    ExpectBitsEqual(bprobs, probs, "attention probabilities");
    ExpectBitsEqual(bdqkv, dqkv, "attention dqkv");
  }
  {
    const std::vector<int32_t> tokens = {3, 0, 10, 4, 4, 7, 1, 9, 2, 3};
    const auto wte = Rounded(Random(V * C, 9)), wpe = Rounded(Random(T * C, 10));
    std::vector<float> ex(R * C), dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
    cpu::EmbeddingForward(tokens.data(), wte.data(), wpe.data(), ex.data(), B, T, C);
    const auto dwte0 = Rounded(Random(V * C, 11));  // what the LM head wrote first
    dwte = dwte0;
    cpu::EmbeddingBackward(tokens.data(), dy.data(), dwte.data(), dwpe.data(), B, T, C);
    auto bwte = ToBf16(wte), bwpe = ToBf16(wpe), bdy = ToBf16(dy), bdwte = ToBf16(dwte0);
    std::vector<uint16_t> bex(R * C), bdwpe(T * C, 0x4000);
    k_->EmbeddingForward(tokens.data(), bwte.data(), bwpe.data(), bex.data(), B, T, C);
    k_->EmbeddingBackward(tokens.data(), tokens.data(), bdy.data(), GradOut{bdwte.data(), true}, V,
                          GradOut{bdwpe.data(), false}, B, T, C);
    ExpectBitsEqual(bex, ex, "embedding");
    ExpectBitsEqual(bdwte, dwte, "wte gradient, added to the head's");
    ExpectBitsEqual(bdwpe, dwpe, "wpe gradient");
    // A written table gradient is zero in the rows no token names (5, 6, 8).
    std::vector<uint16_t> bfresh(V * C, 0x4000), bpos(T * C);
    k_->EmbeddingBackward(tokens.data(), tokens.data(), bdy.data(), GradOut{bfresh.data(), false},
                          V, GradOut{bpos.data(), false}, B, T, C);
    std::vector<float> fresh(V * C, 0.0f), unused(T * C, 0.0f);
    cpu::EmbeddingBackward(tokens.data(), dy.data(), fresh.data(), unused.data(), B, T, C);
    ExpectBitsEqual(bfresh, fresh, "wte gradient, written");
  }
  {
    const auto logits = Rounded(Random(R * V, 12, 2.0f));
    std::vector<int32_t> targets(R), am(R), kam(R);
    for (int64_t i = 0; i < R; ++i) targets[i] = static_cast<int32_t>((i * 7) % V);
    std::vector<float> mask(R, 1.0f), dl(R * V);
    mask[3] = 0;
    const double loss = cpu::CrossEntropy(logits.data(), targets.data(), mask.data(), dl.data(),
                                          am.data(), R, V, 1.0);
    auto bl = ToBf16(logits);
    std::vector<uint16_t> bdl(R * V);
    ASSERT_TRUE(
        k_->CrossEntropy(bl.data(), targets.data(), mask.data(), bdl.data(), kam.data(), R, V, 1.0)
            .ok());
    auto kl = k_->Loss();
    ASSERT_TRUE(kl.ok());
    EXPECT_EQ(*kl, loss);  // summed in double from the same fp32 values
    EXPECT_EQ(kam, am);
    ExpectBitsEqual(bdl, dl, "dlogits");
  }
  {
    const auto a = Rounded(Random(R * C, 13));
    std::vector<float> y(R * C), z = x;
    cpu::Add(x.data(), a.data(), y.data(), R * C);
    cpu::AddInPlace(z.data(), a.data(), R * C);
    auto bx = ToBf16(x), ba = ToBf16(a);
    std::vector<uint16_t> by(R * C);
    k_->Add(bx.data(), ba.data(), by.data(), R * C);
    k_->AddInPlace(bx.data(), ba.data(), R * C);
    ExpectBitsEqual(by, y, "add");
    ExpectBitsEqual(bx, z, "add in place");
  }
}

// The CPU's bf16 attention (fused q, k, v columns and grouped-query heads on separate matrices)
// within bf16 rounding of fp64 attention on the same bf16 operands: the bound the GPU's kernels
// are held to (backend_cuda_bf16_test.cc) is measured from this backend's own error.
TEST_F(CpuBf16OpsTest, AttentionWithinBf16RoundingOfFp64) {
  namespace ta = testing_attention;
  struct Case {
    int64_t B, T, H, KV, hd;
  };
  for (const Case& c : {Case{3, 70, 2, 2, 64}, Case{2, 150, 4, 2, 64}, Case{1, 33, 6, 1, 16}}) {
    const int64_t R = c.B * c.T, qw = c.H * c.hd, kw = c.KV * c.hd;
    const auto q = ToBf16(Random(R * qw, 1)), k = ToBf16(Random(R * kw, 2)),
               v = ToBf16(Random(R * kw, 3)), dout = ToBf16(Random(R * qw, 4));
    std::vector<uint16_t> out(R * qw), probs(c.B * c.H * c.T * c.T), dq(R * qw), dk(R * kw),
        dv(R * kw);
    const AttnDims ad{c.B, c.T, c.H, c.KV, c.hd, qw, kw, kw};
    k_->AttentionForward(q.data(), k.data(), v.data(), out.data(), probs.data(), ad);
    k_->AttentionBackward(dout.data(), q.data(), k.data(), v.data(), out.data(), probs.data(),
                          dq.data(), dk.data(), dv.data(), ad);
    auto wide = [](const std::vector<uint16_t>& b) {
      const std::vector<float> f = FromBf16(b);
      return std::vector<double>(f.begin(), f.end());
    };
    const ta::Result ref = ta::Reference(wide(q), wide(k), wide(v), wide(dout),
                                         ta::Dims{c.B, c.T, c.H, c.KV, c.hd, qw, kw, kw});
    const std::string what = "B " + std::to_string(c.B) + " T " + std::to_string(c.T) + " H " +
                             std::to_string(c.H) + " KV " + std::to_string(c.KV);
    // bf16 rounding of the outputs alone is about 2^-9 / sqrt(3) = 1.1e-3 norm-wise; the
    // probabilities are rounded to bf16 too.
    EXPECT_LT(ta::RelativeError(FromBf16(out), ref.out), 4e-3) << what;
    EXPECT_LT(ta::RelativeError(FromBf16(dq), ref.dq), 5e-3) << what;
    EXPECT_LT(ta::RelativeError(FromBf16(dk), ref.dk), 5e-3) << what;
    EXPECT_LT(ta::RelativeError(FromBf16(dv), ref.dv), 5e-3) << what;
    EXPECT_LT(ta::WorstErrorOfMax(FromBf16(dq), ref.dq), 2e-2) << what;
    // A gross error (a wrong head, a missing mask) is far outside: the reference's own check.
    std::vector<float> shifted = FromBf16(out);
    std::rotate(shifted.begin(), shifted.begin() + c.hd, shifted.end());
    EXPECT_GT(ta::RelativeError(shifted, ref.out), 0.3) << what;
    std::printf("%s: relative error out %.2e dq %.2e dk %.2e dv %.2e\n", what.c_str(),
                ta::RelativeError(FromBf16(out), ref.out), ta::RelativeError(FromBf16(dq), ref.dq),
                ta::RelativeError(FromBf16(dk), ref.dk), ta::RelativeError(FromBf16(dv), ref.dv));
  }
}

TEST_F(CpuBf16OpsTest, CastAddsInFp32AndRoundsOnce) {
  const size_t n = 10000;  // past one block of the cast's loop
  const auto src = Random(n, 1), dst0 = Rounded(Random(n, 2));
  auto b = ToBf16(dst0);
  ASSERT_TRUE(k_->Cast(src.data(), DType::kF32, b.data(), DType::kBF16, n, /*add=*/true).ok());
  std::vector<float> want(n);
  for (size_t i = 0; i < n; ++i) want[i] = dst0[i] + src[i];
  ExpectBitsEqual(b, want, "cast add");
}

// One micro-batch through the whole model: the loss, and every gradient read back in fp32.
struct Pass {
  double loss = 0;
  std::vector<std::vector<float>> grads;
  uint64_t activation_peak = 0;
};

Pass RunModel(DType compute, Activations acts, bool checkpointing, Arch arch = Arch::kGpt2) {
  GptConfig mc;
  if (arch == Arch::kLlama) {
    mc = AsLlama(mc);
    mc.n_kv_head = 2;
  }
  mc.vocab = 29;
  mc.seq_len = 12;
  mc.d_model = 32;
  mc.n_layer = 3;
  mc.n_head = 4;
  mc.seed = 5;
  mc.activations = acts;
  mc.activation_checkpointing = checkpointing;
  EngineConfig ec;
  ec.device = DeviceChoice::kHost;
  ec.compute_dtype = compute;
  ec.chunk_elems = 4096;
  Pass out;
  auto engine = Engine::Create(ec);
  EXPECT_TRUE(engine.ok());
  if (!engine.ok()) return out;
  auto model = Gpt::Create(**engine, mc);
  EXPECT_TRUE(model.ok());
  EXPECT_TRUE((*engine)->Finalize().ok());
  Batch b;
  b.batch = 3;
  b.seq = mc.seq_len;
  std::mt19937 rng(9);
  for (int i = 0; i < b.batch * b.seq; ++i) {
    b.tokens.push_back(static_cast<int32_t>(rng() % 29));
    b.targets.push_back(static_cast<int32_t>(rng() % 29));
    b.mask.push_back(i % 5 == 2 ? 0.0f : 1.0f);
  }
  auto loss = (*model)->ForwardBackward(b);
  EXPECT_TRUE(loss.ok()) << loss.status().ToString();
  if (!loss.ok()) return out;
  out.loss = *loss;
  for (ParamId p = 0; p < (*engine)->num_params(); ++p) {
    std::vector<float> g(static_cast<size_t>((*engine)->numel(p)));
    EXPECT_TRUE((*engine)->ReadGrad(p, g).ok());
    out.grads.push_back(std::move(g));
  }
  auto trace = (*engine)->RecordedTrace();
  EXPECT_TRUE(trace.ok());
  for (const TraceMoment& m : trace->moments)
    out.activation_peak = std::max(out.activation_peak, m.activation_peak);
  return out;
}

double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
    den += double{want[i]} * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

TEST(GptBf16Activations, WithinBf16RoundingOfTheFp32Reference) {
  for (Arch arch : {Arch::kGpt2, Arch::kLlama})
    for (DType compute : {DType::kF32, DType::kBF16}) {
      for (bool ckpt : {false, true}) {
        const std::string c = std::string(ArchName(arch)) + " " + std::string(DTypeName(compute)) +
                              (ckpt ? " checkpointed" : "");
        const Pass ref = RunModel(compute, Activations::kF32, ckpt, arch);
        const Pass got = RunModel(compute, Activations::kBF16, ckpt, arch);
        ASSERT_EQ(got.grads.size(), ref.grads.size());
        // Not the reference itself: the activations really were rounded.
        EXPECT_NE(got.loss, ref.loss) << c;
        EXPECT_NEAR(got.loss, ref.loss, 1e-2 * ref.loss) << c;
        for (size_t p = 0; p < ref.grads.size(); ++p)
          EXPECT_LT(RelativeError(got.grads[p], ref.grads[p]), 3e-2) << c << " parameter " << p;
        // Every activation but the fp32 statistics in half the bytes, and (bf16 parameters) no
        // widened weights or fp32 gradient buffers: at most a little over half the peak, but
        // the fp32 statistics and the batch keep it well above a quarter.
        const double ratio = static_cast<double>(got.activation_peak) / ref.activation_peak;
        EXPECT_GT(ratio, 0.25) << c;
        EXPECT_LT(ratio, 0.56) << c;
      }
    }
}

}  // namespace
}  // namespace tierzero::gpt
