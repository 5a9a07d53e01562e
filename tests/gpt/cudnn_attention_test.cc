// cuDNN's fused attention (gpt/cudnn_attention.h). On the host (no GPU needed, skipped where
// cuDNN cannot be loaded): every tensor and operation of the forward and backward graphs
// finalises, for GPT-2's fused rows and grouped-query attention on separate matrices, and an
// H100's engines take each graph (its properties given to cuDNN's heuristics). On a GPU
// (skipped without one): outputs and gradients against fp64 attention on the same bf16 operands,
// the log-sum-exps against the fused kernels' (each forward feeds the other's backward), and the
// repeatable backward bit-identical run to run.
#include "gpt/cudnn_attention.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "device_buffer.h"
#include "gpt/attention_cuda_bf16.h"

#ifdef __SANITIZE_ADDRESS__
#include <sanitizer/lsan_interface.h>
#endif

#include "attention_reference.h"
#include "gpt/flash_attention_cuda.h"
#include "tierzero/convert.h"

namespace tierzero::gpt::cuda {
namespace {

namespace ta = testing_attention;
using Bits = std::vector<uint16_t>;

// GPT-2's [q | k | v] rows (ld 3C), and grouped-query attention on separate matrices.
FlashShape Fused(int64_t B, int64_t T, int64_t H, int64_t D) {
  const int64_t C = H * D;
  return {B, T, H, H, D, 3 * C, 3 * C, 3 * C, C};
}
FlashShape Grouped(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D) {
  return {B, T, H, KV, D, H * D, KV * D, KV * D, H * D};
}

TEST(CudnnAttentionHostTest, EveryOperationOfBothGraphsFinalises) {
  for (const FlashShape& s : {Fused(2, 64, 4, 32), Fused(8, 1024, 16, 128),
                              Grouped(2, 150, 4, 2, 64), Grouped(1, 2048, 32, 8, 128)}) {
    for (const bool backward : {false, true}) {
      for (const bool deterministic : {true, false}) {
        const Status st = BuildAttentionOperationsOnHost(s, backward, deterministic);
        if (st.code() == StatusCode::kUnavailable &&
            std::string(st.message()).find("could not be loaded") != std::string::npos)
          GTEST_SKIP() << st.ToString();
        EXPECT_TRUE(st.ok()) << (backward ? "backward" : "forward") << " H " << s.heads << " KV "
                             << s.kv_heads << ": " << st.ToString();
      }
    }
  }
}

// An H100 SXM5 80 GB's properties (NVIDIA's published figures: 132 SMs, 50 MiB of L2, 227 KiB
// of shared memory a block may opt in to, sm_90) in cuDNN's device-property JSON, whose keys
// cuDNN 9.19 names when one is missing.
constexpr std::string_view kH100 = R"({
  "cudaDeviceId": 0, "deviceName": "NVIDIA H100 80GB HBM3", "deviceVer": 900, "driverVer": 13000,
  "pciDeviceId": 8960, "isTccDriver": 0, "supportCoopLaunch": 1, "totalGlobalMem": 85045231616,
  "multiProcessorCount": 132, "warpSize": 32, "maxGridSize": [2147483647, 65535, 65535],
  "maxBlockSize": [1024, 1024, 64], "maxThreadsPerBlock": 1024, "maxThreadsPerSM": 2048,
  "maxCtasPerSM": 32, "regsPerBlock": 65536, "maxRegistersPerSM": 65536,
  "maxSharedMemoryPerBlock": 49152, "maxSharedMemoryPerBlockOptin": 232448,
  "reservedSharedMemoryPerBlock": 1024, "l2CacheSize": 52428800, "smClockRateKHz": 1980000,
  "memClockRateKHz": 2619000})";

// cuDNN's runtime-compiled engines check their support with a libcuda loaded: the machine's
// driver, or without one the toolkit's stub (which answers every call with an error, so no GPU
// work is possible; later CUDA calls in this process see no device). Whether one is loaded.
bool LibcudaLoaded() {
  if (dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL) != nullptr) return true;
  return dlopen(TZ_CUDA_LIBRARY_DIR "/stubs/libcuda.so", RTLD_NOW | RTLD_GLOBAL) != nullptr;
}

// Note [cuDNN's engines asked without a GPU] (gpt/cudnn_graph.cc): cuDNN's heuristics for an
// H100 find an engine that takes each graph, forward and both backwards, at the benchmark's
// shapes and the GPU tests' (heads of 32, 64 and 128; sequences not a multiple of 64; grouped
// query heads). A graph an engine would not match finds none.
TEST(CudnnAttentionHostTest, AnH100sEnginesTakeEveryGraph) {
  if (!LibcudaLoaded()) GTEST_SKIP() << "no libcuda, not even the toolkit's stub";
  for (const FlashShape& s : {Fused(8, 1024, 16, 128), Grouped(2, 2048, 32, 8, 128),
                              Fused(2, 64, 4, 32), Fused(2, 256, 4, 128), Grouped(2, 150, 4, 2, 64),
                              Fused(3, 40, 2, 64), Grouped(3, 40, 4, 2, 32)}) {
    for (const bool backward : {false, true}) {
      for (const bool deterministic : {true, false}) {
        if (!backward && !deterministic) continue;
        Status st;
        {
#ifdef __SANITIZE_ADDRESS__
          // cuDNN's runtime-compiled engines load modules of their own for these checks and
          // unload them, their allocations unreleased and their frames nameless (no
          // suppression can match them): not tierzero's memory.
          __lsan::ScopedDisabler cudnn_owns_these;
#endif
          st = BuildAttentionOperationsOnHost(s, backward, deterministic, kH100);
        }
        const std::string m(st.message());
        if (m.find("could not be loaded") != std::string::npos ||
            m.find("takes no device properties") != std::string::npos)
          GTEST_SKIP() << st.ToString();
        EXPECT_TRUE(st.ok()) << (backward ? (deterministic ? "backward" : "backward (atomic dQ)")
                                          : "forward")
                             << " T " << s.seq << " H " << s.heads << " KV " << s.kv_heads << " D "
                             << s.head_dim << ": " << st.ToString();
      }
    }
  }
}

// A machine without cuDNN, or without a GPU, gets a message that says what is missing and what
// to do (the bf16 backend then runs the fused kernels and its summary carries the message). Each
// in a fresh process: the library is opened once per process.
TEST(CudnnAttentionHostTest, AMissingLibraryOrGpuIsAClearRefusal) {
  // Re-executed, not forked: a fork would inherit this process's opened library.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("TZ_CUDNN_LIBRARY", "/nonexistent/libcudnn.so.9", 1);
        auto c = CudnnAttention::Create(nullptr);
        std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
        std::exit(!c.ok() && c.status().code() == StatusCode::kUnavailable ? 0 : 1);
      },
      ::testing::ExitedWithCode(0),
      "cuDNN could not be loaded.*/nonexistent/libcudnn.so.9.*TZ_CUDNN_LIBRARY");
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) GTEST_SKIP() << "a GPU is here";
  EXPECT_EXIT(
      {
        auto c = CudnnAttention::Create(nullptr);
        std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
        const std::string m(c.status().message());
        std::exit(!c.ok() && (m.find("no handle") != std::string::npos ||
                              m.find("could not be loaded") != std::string::npos)
                      ? 0
                      : 1);
      },
      ::testing::ExitedWithCode(0), "cuDNN (has no handle|could not be loaded)");
}

Bits RandomBf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  Bits b(n);
  EXPECT_TRUE(CastElements(v.data(), DType::kF32, b.data(), DType::kBF16, n).ok());
  return b;
}
std::vector<double> Wide(const Bits& b) {
  std::vector<float> f(b.size());
  EXPECT_TRUE(CastElements(b.data(), DType::kBF16, f.data(), DType::kF32, b.size()).ok());
  return std::vector<double>(f.begin(), f.end());
}

template <typename T>
using Dev = testing_cuda::DeviceBuffer<T>;

using bf16 = __nv_bfloat16;
bf16* B16(uint16_t* p) { return reinterpret_cast<bf16*>(p); }

// One shape's operands on the device, laid out as the shape says (q, k, v inside one buffer of
// rows for the fused layout).
struct Operands {
  explicit Operands(const FlashShape& s)
      : s(s),
        fused(s.ld_q == s.ld_k && s.heads == s.kv_heads && s.ld_q == 3 * s.heads * s.head_dim),
        rows(s.batch * s.seq),
        qn(rows * s.ld_q),
        kn(fused ? 0 : rows * s.ld_k),
        vn(fused ? 0 : rows * s.ld_v),
        on(rows * s.ld_o),
        hq(RandomBf16(qn, 1)),
        hk(RandomBf16(std::max<size_t>(kn, 1), 2)),
        hv(RandomBf16(std::max<size_t>(vn, 1), 3)),
        hdo(RandomBf16(on, 4)),
        q(qn, hq.data()),
        k(std::max<size_t>(kn, 1), hk.data()),
        v(std::max<size_t>(vn, 1), hv.data()),
        dout(on, hdo.data()) {}
  bf16* Q() const { return B16(q.get()); }
  bf16* K() const { return fused ? B16(q.get()) + s.heads * s.head_dim : B16(k.get()); }
  bf16* V() const { return fused ? B16(q.get()) + 2 * s.heads * s.head_dim : B16(v.get()); }
  // The fp64 reference on the same bf16 operands (separate q, k, v matrices).
  ta::Result Reference() const {
    const int64_t C = s.heads * s.head_dim, KC = s.kv_heads * s.head_dim;
    const std::vector<double> wq = Wide(hq);
    if (fused) {
      // Offsets: q at 0, k at C, v at 2C within each row of 3C.
      return ta::Reference(Strip(wq, 0, C), Strip(wq, C, C), Strip(wq, 2 * C, C), Wide(hdo),
                           ta::Dims{s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, C, C, C});
    }
    return ta::Reference(wq, Wide(hk), Wide(hv), Wide(hdo),
                         ta::Dims{s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, C, KC, KC});
  }
  std::vector<double> Strip(const std::vector<double>& x, int64_t at, int64_t width) const {
    std::vector<double> out;
    for (int64_t r = 0; r < rows; ++r)
      out.insert(out.end(), x.begin() + r * s.ld_q + at, x.begin() + r * s.ld_q + at + width);
    return out;
  }
  // A gradient buffer strided as the operands' rows, reduced to the matrix of `width` at `at`.
  std::vector<double> Take(const Bits& g, int64_t ld, int64_t at, int64_t width) const {
    std::vector<double> w = Wide(g), out;
    for (int64_t r = 0; r < rows; ++r)
      out.insert(out.end(), w.begin() + r * ld + at, w.begin() + r * ld + at + width);
    return out;
  }

  FlashShape s;
  bool fused;
  int64_t rows;
  size_t qn, kn, vn, on;
  Bits hq, hk, hv, hdo;
  Dev<uint16_t> q, k, v, dout;
};

struct Grads {
  Bits out, dq, dk, dv;
  std::vector<float> lse;
};

// One forward and backward; `cudnn_forward`/`cudnn_backward` choose each side's implementation.
Grads RunOnce(CudnnAttention& cudnn, const Operands& x, bool cudnn_forward, bool cudnn_backward) {
  const FlashShape& s = x.s;
  Dev<uint16_t> out(x.on), dq(x.qn), dk(std::max<size_t>(x.kn, 1)), dv(std::max<size_t>(x.vn, 1));
  Dev<float> lse(s.batch * s.heads * s.seq), rowdot(s.batch * s.heads * s.seq);
  bf16* dQ = B16(dq.get());
  bf16* dK = x.fused ? dQ + s.heads * s.head_dim : B16(dk.get());
  bf16* dV = x.fused ? dQ + 2 * s.heads * s.head_dim : B16(dv.get());
  if (cudnn_forward) {
    const Status st = cudnn.Forward(x.Q(), x.K(), x.V(), B16(out.get()), lse.get(), s);
    EXPECT_TRUE(st.ok()) << st.ToString();
  } else {
    EXPECT_EQ(FlashAttentionForward(x.Q(), x.K(), x.V(), B16(out.get()), lse.get(), s, nullptr),
              cudaSuccess);
  }
  if (cudnn_backward) {
    const Status st = cudnn.Backward(B16(x.dout.get()), x.Q(), x.K(), x.V(), B16(out.get()),
                                     lse.get(), dQ, dK, dV, s);
    EXPECT_TRUE(st.ok()) << st.ToString();
  } else {
    EXPECT_EQ(FlashAttentionBackward(B16(x.dout.get()), x.Q(), x.K(), x.V(), B16(out.get()),
                                     lse.get(), rowdot.get(), dQ, dK, dV, s, nullptr),
              cudaSuccess);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Grads g;
  g.out = out.Get();
  g.dq = dq.Get();
  if (!x.fused) {
    g.dk = dk.Get();
    g.dv = dv.Get();
  }
  g.lse = lse.Get();
  return g;
}

class CudnnAttentionGpuTest : public ::testing::TestWithParam<FlashShape> {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no GPU";
    auto c = CudnnAttention::Create(nullptr);
    if (!c.ok()) GTEST_SKIP() << c.status().ToString();
    cudnn_ = std::move(*c);
    std::printf("%s\n", cudnn_->Version().c_str());
    const Status st = cudnn_->Prepare(GetParam());
    // A version the frontend's support surface refuses for this shape is a skip; a refusal by
    // cuDNN itself (no engine) a failure.
    const std::string m(st.message());
    if (!st.ok() && (m.find("before 9.15.1") != std::string::npos ||
                     m.find("known bf16 attention bugs") != std::string::npos))
      GTEST_SKIP() << st.ToString();
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
  std::unique_ptr<CudnnAttention> cudnn_;
};

// Norm-wise relative error to fp64 within 8e-3 (the fused kernels' bound in
// backend_cuda_bf16_test.cc), no element off by more than 3% of the largest.
void ExpectNearReference(const std::vector<double>& got, const std::vector<double>& ref,
                         const std::string& what) {
  std::vector<float> g(got.begin(), got.end());
  const double e = ta::RelativeError(g, ref);
  EXPECT_LE(e, 8e-3) << what;
  EXPECT_LE(ta::WorstErrorOfMax(g, ref), 3e-2) << what;
  std::printf("%s: relative error to fp64 %.2e\n", what.c_str(), e);
}

TEST_P(CudnnAttentionGpuTest, WithinBf16RoundingOfFp64AndInterchangeableWithTheKernels) {
  const FlashShape s = GetParam();
  const Operands x(s);
  const ta::Result ref = x.Reference();
  const int64_t C = s.heads * s.head_dim, KC = s.kv_heads * s.head_dim;
  for (const auto& [fwd, bwd, name] :
       {std::tuple{true, true, "cudnn"}, std::tuple{true, false, "cudnn fwd + kernel bwd"},
        std::tuple{false, true, "kernel fwd + cudnn bwd"}}) {
    const Grads g = RunOnce(*cudnn_, x, fwd, bwd);
    const std::string n = std::string(name) + (x.fused ? " (fused rows)" : " (GQA)");
    ExpectNearReference(x.Take(g.out, s.ld_o, 0, C), ref.out, n + " out");
    ExpectNearReference(x.Take(g.dq, s.ld_q, 0, C), ref.dq, n + " dq");
    if (x.fused) {
      ExpectNearReference(x.Take(g.dq, s.ld_q, C, C), ref.dk, n + " dk");
      ExpectNearReference(x.Take(g.dq, s.ld_q, 2 * C, C), ref.dv, n + " dv");
    } else {
      ExpectNearReference(x.Take(g.dk, s.ld_k, 0, KC), ref.dk, n + " dk");
      ExpectNearReference(x.Take(g.dv, s.ld_v, 0, KC), ref.dv, n + " dv");
    }
  }
  // The state both backwards read: cuDNN's log-sum-exps against the kernels'.
  const Grads a = RunOnce(*cudnn_, x, true, true), b = RunOnce(*cudnn_, x, false, false);
  double worst = 0;
  for (size_t i = 0; i < a.lse.size(); ++i)
    worst = std::max(worst, static_cast<double>(std::fabs(a.lse[i] - b.lse[i])));
  EXPECT_LE(worst, 1e-3) << "log-sum-exps differ from the fused kernels'";
  // Repeatable (the default plan): a second run bit-identical.
  const Grads c = RunOnce(*cudnn_, x, true, true);
  EXPECT_EQ(a.out, c.out);
  EXPECT_EQ(a.dq, c.dq);
  EXPECT_EQ(a.dk, c.dk);
  EXPECT_EQ(a.dv, c.dv);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudnnAttentionGpuTest,
                         // Grouped_T256: grouped heads on cuDNN before 9.15.1 too, whose
                         // backward takes only multiples of 128 (session 37's H100 had 9.14).
                         ::testing::Values(Fused(2, 64, 4, 32), Fused(2, 256, 4, 128),
                                           Grouped(2, 150, 4, 2, 64), Grouped(2, 256, 4, 2, 64)),
                         [](const ::testing::TestParamInfo<FlashShape>& i) {
                           const FlashShape& s = i.param;
                           return std::string(s.heads == s.kv_heads ? "Rows" : "Grouped") + "_T" +
                                  std::to_string(s.seq) + "_H" + std::to_string(s.heads) + "_KV" +
                                  std::to_string(s.kv_heads) + "_D" + std::to_string(s.head_dim);
                         });

// The backend's attention (gpt/attention_cuda_bf16.h) under TZ_GPT_ATTENTION=auto: the first
// forward and backward of a shape are checked against the fused kernels (Note [cuDNN checked
// against the fused kernels]) and cuDNN's results kept bit for bit when they agree.
class Bf16AttentionAgreementTest : public CudnnAttentionGpuTest {};

TEST_P(Bf16AttentionAgreementTest, CheckedAtFirstUseAndCudnnsResultsKept) {
  const FlashShape s = GetParam();
  const Operands x(s);
  const Grads direct = RunOnce(*cudnn_, x, true, true);
  unsetenv("TZ_GPT_ATTENTION");
  auto a = Bf16Attention::Create(nullptr);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  for (int pass = 0; pass < 2; ++pass) {  // the first checks, the second does not
    Dev<uint16_t> out(x.on), dq(x.qn), dk(std::max<size_t>(x.kn, 1)), dv(std::max<size_t>(x.vn, 1));
    Dev<float> lse(s.batch * s.heads * s.seq);
    bf16* dQ = B16(dq.get());
    bf16* dK = x.fused ? dQ + s.heads * s.head_dim : B16(dk.get());
    bf16* dV = x.fused ? dQ + 2 * s.heads * s.head_dim : B16(dv.get());
    Status st = (*a)->Forward(x.Q(), x.K(), x.V(), B16(out.get()), lse.get(), s);
    ASSERT_TRUE(st.ok()) << st.ToString();
    st = (*a)->Backward(B16(x.dout.get()), x.Q(), x.K(), x.V(), B16(out.get()), lse.get(), dQ, dK,
                        dV, s);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(out.Get(), direct.out) << "pass " << pass;
    EXPECT_EQ(lse.Get(), direct.lse) << "pass " << pass;
    EXPECT_EQ(dq.Get(), direct.dq) << "pass " << pass;
    if (!x.fused) {
      EXPECT_EQ(dk.Get(), direct.dk) << "pass " << pass;
      EXPECT_EQ(dv.Get(), direct.dv) << "pass " << pass;
    }
  }
  const std::string summary = (*a)->Summary();
  std::printf("%s\n", summary.c_str());
  EXPECT_NE(summary.find("agreeing with the fused kernels"), std::string::npos) << summary;
  EXPECT_NE(summary.find("backward"), std::string::npos) << summary;
  EXPECT_EQ(summary.find("elsewhere"), std::string::npos) << summary;
}

INSTANTIATE_TEST_SUITE_P(Shapes, Bf16AttentionAgreementTest,
                         ::testing::Values(Fused(2, 256, 4, 128), Grouped(2, 150, 4, 2, 64),
                                           Grouped(2, 256, 4, 2, 64)),
                         [](const ::testing::TestParamInfo<FlashShape>& i) {
                           return std::string(i.param.heads == i.param.kv_heads ? "Rows"
                                                                                : "Grouped") +
                                  "_T" + std::to_string(i.param.seq);
                         });

}  // namespace

// A cuDNN result that is wrong (here: the output and gradients overwritten after cuDNN wrote
// them) is replaced by the kernels' before anything reads it, and the shape runs the kernels
// from then on. A friend of Bf16Attention, to reach the check itself.
class Bf16AttentionCheckTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no GPU";
    unsetenv("TZ_GPT_ATTENTION");
    auto a = Bf16Attention::Create(nullptr);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    attention_ = std::move(*a);
    if (attention_->cudnn_ == nullptr) GTEST_SKIP() << attention_->Summary();
  }
  // Runs cuDNN's forward and backward for s unchecked, spoils what it wrote, then checks.
  void SpoilAndCheck(const FlashShape& s, const Operands& x, Dev<uint16_t>& out, Dev<float>& lse,
                     bf16* dq, bf16* dk, bf16* dv) {
    auto use = attention_->Choose(s);
    ASSERT_TRUE(use.ok()) << use.status().ToString();
    if (!(*use)->cudnn) {
      // What the frontend's support surface refuses for this cuDNN (or a device too full for
      // the workspace) is a skip; cuDNN refusing the shape itself a failure.
      const std::string why = attention_->Summary();
      if (why.find("known bf16 attention bugs") != std::string::npos ||
          why.find("before 9.15.1") != std::string::npos ||
          why.find("of workspace for this shape") != std::string::npos)
        GTEST_SKIP() << why;
      FAIL() << why;
    }
    (*use)->forward_checked = (*use)->backward_checked = true;  // run cuDNN alone
    ASSERT_TRUE(attention_->Forward(x.Q(), x.K(), x.V(), B16(out.get()), lse.get(), s).ok());
    ASSERT_EQ(cudaMemset(out.get(), 0x3f, x.on * 2), cudaSuccess);  // ~0.75 everywhere
    ASSERT_TRUE(
        attention_->CheckForward(**use, x.Q(), x.K(), x.V(), B16(out.get()), lse.get(), s).ok());
    EXPECT_FALSE((*use)->cudnn) << "a spoiled forward must leave cuDNN";
    // And the backward, on its own: the shape back on cuDNN.
    (*use)->cudnn = true;
    ++attention_->cudnn_shapes_;
    --attention_->kernel_shapes_;
    ASSERT_TRUE(attention_
                    ->Backward(B16(x.dout.get()), x.Q(), x.K(), x.V(), B16(out.get()), lse.get(),
                               dq, dk, dv, s)
                    .ok());
    // dq's elements (not the rest of GPT-2's [dq | dk | dv] rows), ~0.75 each.
    ASSERT_EQ(cudaMemset2D(dq, 2 * s.ld_q, 0x3f, 2 * s.heads * s.head_dim, s.batch * s.seq),
              cudaSuccess);
    ASSERT_TRUE(attention_
                    ->CheckBackward(**use, B16(x.dout.get()), x.Q(), x.K(), x.V(), B16(out.get()),
                                    lse.get(), dq, dk, dv, s)
                    .ok());
    EXPECT_FALSE((*use)->cudnn) << "a spoiled backward must leave cuDNN";
  }
  std::unique_ptr<Bf16Attention> attention_;
};

namespace {

TEST_F(Bf16AttentionCheckTest, AWrongResultIsReplacedByTheKernels) {
  for (const FlashShape& s : {Fused(2, 128, 4, 64), Grouped(2, 128, 4, 2, 64)}) {
    const Operands x(s);
    Dev<uint16_t> out(x.on), dq(x.qn), dk(std::max<size_t>(x.kn, 1)), dv(std::max<size_t>(x.vn, 1));
    Dev<float> lse(s.batch * s.heads * s.seq), rowdot(s.batch * s.heads * s.seq);
    bf16* dQ = B16(dq.get());
    bf16* dK = x.fused ? dQ + s.heads * s.head_dim : B16(dk.get());
    bf16* dV = x.fused ? dQ + 2 * s.heads * s.head_dim : B16(dv.get());
    SpoilAndCheck(s, x, out, lse, dQ, dK, dV);
    if (IsSkipped() || HasFatalFailure()) return;
    // What the kernels compute from the same operands (the backward from the kernels' forward,
    // which the check put in place of the spoiled one).
    Dev<uint16_t> kout(x.on), kdq(x.qn), kdk(std::max<size_t>(x.kn, 1)),
        kdv(std::max<size_t>(x.vn, 1));
    Dev<float> klse(s.batch * s.heads * s.seq);
    bf16* kQ = B16(kdq.get());
    bf16* kK = x.fused ? kQ + s.heads * s.head_dim : B16(kdk.get());
    bf16* kV = x.fused ? kQ + 2 * s.heads * s.head_dim : B16(kdv.get());
    ASSERT_EQ(FlashAttentionForward(x.Q(), x.K(), x.V(), B16(kout.get()), klse.get(), s, nullptr),
              cudaSuccess);
    ASSERT_EQ(FlashAttentionBackward(B16(x.dout.get()), x.Q(), x.K(), x.V(), B16(kout.get()),
                                     klse.get(), rowdot.get(), kQ, kK, kV, s, nullptr),
              cudaSuccess);
    EXPECT_EQ(out.Get(), kout.Get());
    EXPECT_EQ(lse.Get(), klse.Get());
    // Each gradient's own elements (GPT-2's are one buffer of [dq | dk | dv] rows).
    const Bits g = dq.Get(), kg = kdq.Get();
    EXPECT_EQ(g, kg);
    if (!x.fused) {
      EXPECT_EQ(dk.Get(), kdk.Get());
      EXPECT_EQ(dv.Get(), kdv.Get());
    }
  }
  const std::string summary = attention_->Summary();
  std::printf("%s\n", summary.c_str());
  EXPECT_NE(summary.find("disagrees with the fused kernels"), std::string::npos) << summary;
}

}  // namespace
}  // namespace tierzero::gpt::cuda
