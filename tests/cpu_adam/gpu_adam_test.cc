// GPU Adam against CpuAdam: bit-identical masters, moments and output copies on random data of
// awkward sizes, for every gradient dtype, Adam and AdamW, with and without the output copy.
// Skipped without a GPU.
#include "cpu_adam/gpu_adam.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <vector>

#include "../common/cuda_buffers.h"
#include "core/convert.h"
#include "cpu_adam/cpu_adam.h"

namespace tierzero {
namespace {

using testing_cuda::Download;
using testing_cuda::UnderSanitizer;
using testing_cuda::Upload;

TEST(GpuAdam, BitIdenticalToCpuAdam) {
  int count = 0;
  if (!GpuAdamBuilt() || cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    GTEST_SKIP() << "no GPU";
  std::mt19937 gen(3);
  std::normal_distribution<float> d(0, 1);
  for (size_t n : {size_t{1}, size_t{1000}, size_t{65537}, size_t{1} << 20}) {
    if (n > 65537 && UnderSanitizer()) continue;
    for (DType gt : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (bool adamw : {false, true}) {
        for (bool copy : {false, true}) {
          AdamConfig cfg;
          cfg.adamw = adamw;
          cfg.weight_decay = 0.01f;
          cfg.lr = 3e-3f;
          std::vector<float> master(n), m(n), v(n), g32(n);
          for (size_t i = 0; i < n; ++i) {
            master[i] = d(gen);
            m[i] = 0.1f * d(gen);
            v[i] = std::abs(0.01f * d(gen));
            g32[i] = d(gen);
          }
          std::vector<uint16_t> g16(n);
          const void* grad = g32.data();
          if (gt != DType::kF32) {
            ASSERT_TRUE(Convert(g32.data(), DType::kF32, g16.data(), gt, n).ok());
            grad = g16.data();
          }
          AdamStepOptions so;
          so.step = 7;
          so.grad_scale = 0.5f;
          // GPU first (from copies), then the CPU in place.
          float* dm = Upload(master);
          float* d1 = Upload(m);
          float* d2 = Upload(v);
          void* dg = gt == DType::kF32 ? static_cast<void*>(Upload(g32)) : Upload(g16);
          uint16_t* dout = copy ? Upload(std::vector<uint16_t>(n)) : nullptr;
          AdamBuffers gb{dm, d1, d2, dg, gt, dout, DType::kBF16, n};
          ASSERT_TRUE(GpuAdamStepAsync(cfg, so, gb, nullptr).ok());
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          auto cpu = CpuAdam::Create(cfg);
          ASSERT_TRUE(cpu.ok());
          std::vector<uint16_t> out(n);
          AdamBuffers cb{master.data(), m.data(), v.data(), grad, gt, copy ? out.data() : nullptr,
                         DType::kBF16,  n};
          ASSERT_TRUE((*cpu)->Step(cb, so).ok());
          EXPECT_EQ(std::memcmp(Download(dm, n).data(), master.data(), 4 * n), 0) << n;
          EXPECT_EQ(std::memcmp(Download(d1, n).data(), m.data(), 4 * n), 0) << n;
          EXPECT_EQ(std::memcmp(Download(d2, n).data(), v.data(), 4 * n), 0) << n;
          if (copy) {
            EXPECT_EQ(Download(dout, n), out) << n;
          }
          cudaFree(dm);
          cudaFree(d1);
          cudaFree(d2);
          cudaFree(dg);
          cudaFree(dout);
        }
      }
    }
  }
}

// Compressed moments (bf16, 8-bit codes): the GPU's pass equals CpuAdam's bit for bit over four
// steps (the codes, the scales, the stochastic rounding's hash).
// The gradient norm's device sum (Note [Gradient shards on the device]): the block sums add up
// to CpuAdam's SumSquares within double rounding (another order), the same bits on a second
// run, and a non-finite element makes it non-finite.
TEST(GpuAdam, SumOfSquaresAgreesWithTheCpuAndRepeats) {
  int count = 0;
  if (!GpuAdamBuilt() || cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    GTEST_SKIP() << "no GPU";
  constexpr int kParts = 256;
  std::mt19937 gen(5);
  std::normal_distribution<float> d(0, 1);
  auto cpu = CpuAdam::Create(AdamConfig{});
  ASSERT_TRUE(cpu.ok());
  for (size_t n : {size_t{0}, size_t{1}, size_t{1000}, size_t{65537}, size_t{1} << 22}) {
    if (n > 65537 && UnderSanitizer()) continue;
    for (DType gt : {DType::kF32, DType::kBF16, DType::kF16}) {
      std::vector<float> g32(n);
      for (float& x : g32) x = d(gen);
      std::vector<uint16_t> g16(n);
      const void* grad = g32.data();
      if (gt != DType::kF32) {
        ASSERT_TRUE(Convert(g32.data(), DType::kF32, g16.data(), gt, n).ok());
        grad = g16.data();
      }
      void* dg = gt == DType::kF32 ? static_cast<void*>(Upload(g32)) : Upload(g16);
      double* parts = Upload(std::vector<double>(kParts, -1.0));
      auto sum = [&]() {
        EXPECT_TRUE(GpuSumSquaresAsync(dg, gt, n, parts, kParts, nullptr).ok());
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<double> h = Download(parts, kParts);
        double s = 0;
        for (double x : h) s += x;
        return s;
      };
      const double first = sum(), second = sum();
      auto want = (*cpu)->SumSquares(grad, gt, n);
      ASSERT_TRUE(want.ok());
      EXPECT_NEAR(first, *want, 1e-12 * *want + 1e-300) << n;
      EXPECT_EQ(std::memcmp(&first, &second, sizeof(double)), 0) << n;
      if (n > 0) {
        if (gt == DType::kF32) {
          g32[n / 2] = std::numeric_limits<float>::infinity();
          cudaFree(dg);
          dg = Upload(g32);
        } else {
          g16[n / 2] = 0x7FC0;  // a NaN in bf16 and in fp16
          cudaFree(dg);
          dg = Upload(g16);
        }
        EXPECT_FALSE(std::isfinite(sum())) << n;
      }
      cudaFree(dg);
      cudaFree(parts);
    }
  }
}

TEST(GpuAdam, CompressedMomentsBitIdenticalToCpuAdam) {
  int count = 0;
  if (!GpuAdamBuilt() || cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    GTEST_SKIP() << "no GPU";
  std::mt19937 gen(5);
  std::normal_distribution<float> d(0, 1);
  for (StateFormat f : {StateFormat::kBF16, StateFormat::kInt8}) {
    for (size_t n : {size_t{1}, size_t{63}, size_t{1000}, size_t{65537}}) {
      AdamConfig cfg;
      cfg.adamw = true;
      cfg.weight_decay = 0.01f;
      cfg.lr = 3e-3f;
      const size_t w = f == StateFormat::kBF16 ? 2 : 1;
      std::vector<float> master(n), ms(StateScaleCount(n), 0.0f), vs(StateScaleCount(n), 0.0f);
      std::vector<uint8_t> m(w * n, 0), v(w * n, 0);
      std::vector<uint16_t> g(n), out(n);
      for (size_t i = 0; i < n; ++i) {
        master[i] = d(gen);
        g[i] = F32ToBF16Scalar(0.02f * d(gen));
      }
      float* dm = Upload(master);
      float* dms = Upload(ms);
      float* dvs = Upload(vs);
      uint8_t* d1 = Upload(m);
      uint8_t* d2 = Upload(v);
      uint16_t* dg = Upload(g);
      uint16_t* dout = Upload(out);
      auto cpu = CpuAdam::Create(cfg);
      ASSERT_TRUE(cpu.ok());
      for (int t = 1; t <= 4; ++t) {
        AdamStepOptions so;
        so.step = t;
        AdamBuffers gb{dm, nullptr, nullptr, dg, DType::kBF16, dout, DType::kBF16, n};
        gb.states = f;
        gb.m_state = d1;
        gb.v_state = d2;
        gb.m_scale = dms;
        gb.v_scale = dvs;
        gb.rounding_key = 12345;
        ASSERT_TRUE(GpuAdamStepAsync(cfg, so, gb, nullptr).ok());
        AdamBuffers cb{master.data(), nullptr,    nullptr,      g.data(),
                       DType::kBF16,  out.data(), DType::kBF16, n};
        cb.states = f;
        cb.m_state = m.data();
        cb.v_state = v.data();
        cb.m_scale = ms.data();
        cb.v_scale = vs.data();
        cb.rounding_key = 12345;
        ASSERT_TRUE((*cpu)->Step(cb, so).ok());
      }
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(std::memcmp(Download(dm, n).data(), master.data(), 4 * n), 0) << n;
      EXPECT_EQ(Download(d1, w * n), m) << n;
      EXPECT_EQ(Download(d2, w * n), v) << n;
      EXPECT_EQ(Download(dout, n), out) << n;
      if (f == StateFormat::kInt8) {
        EXPECT_EQ(Download(dms, ms.size()), ms) << n;
        EXPECT_EQ(Download(dvs, vs.size()), vs) << n;
      }
      for (void* p : std::initializer_list<void*>{dm, dms, dvs, d1, d2, dg, dout}) cudaFree(p);
    }
  }
}

}  // namespace
}  // namespace tierzero
