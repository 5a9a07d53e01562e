// GPU Adam against CpuAdam: bit-identical masters, moments and output copies on random data of
// awkward sizes, for every gradient dtype, Adam and AdamW, with and without the output copy.
// Skipped without a GPU.
#include "cpu_adam/gpu_adam.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "../common/cuda_buffers.h"
#include "core/convert.h"
#include "cpu_adam/cpu_adam.h"

namespace tierzero {
namespace {

using testing_cuda::Download;
using testing_cuda::Upload;

TEST(GpuAdam, BitIdenticalToCpuAdam) {
  int count = 0;
  if (!GpuAdamBuilt() || cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    GTEST_SKIP() << "no GPU";
  std::mt19937 gen(3);
  std::normal_distribution<float> d(0, 1);
  for (size_t n : {size_t{1}, size_t{1000}, size_t{65537}, size_t{1} << 20}) {
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

}  // namespace
}  // namespace tierzero
