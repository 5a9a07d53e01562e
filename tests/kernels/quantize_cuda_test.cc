// The CUDA quantization kernels against the CPU kernels (which tests/kernels/quantize_test.cc
// checks against the double reference), bit for bit. Skipped without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "../common/cuda_buffers.h"
#include "core/convert.h"
#include "kernels/cast.h"
#include "kernels/quantize.h"

namespace tierzero::kernels {
namespace {

bool HaveGpu() {
  int count = 0;
  return CudaKernelsBuilt() && cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

using testing_cuda::Download;
using testing_cuda::Upload;

TEST(QuantizeCudaTest, BitIdenticalToTheCpuKernels) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0, 1);
  for (int bits : {4, 8}) {
    for (uint32_t block : {64u, 100u, 256u, 4096u}) {
      for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
        SCOPED_TRACE("int" + std::to_string(bits) + " block " + std::to_string(block) + " " +
                     std::string(DTypeName(t)));
        auto layout =
            QuantLayout::Create({bits, block}, std::vector<uint64_t>{1, 3, block + 1, 777, 200003});
        ASSERT_TRUE(layout.ok());
        const QuantLayout& l = *layout;
        std::vector<float> x(l.elems());
        for (uint64_t i = 0; i < x.size(); ++i)
          x[i] = normal(rng) * std::ldexp(1.0f, int(i / 97 % 9) - 4);
        for (uint64_t i = 0; i < 64; ++i) x[300 + i] = 0;  // zero blocks
        x[5000] = std::numeric_limits<float>::infinity();
        x[9000] = std::numeric_limits<float>::quiet_NaN();
        std::vector<uint8_t> src(DTypeBytes(t, x.size()));
        ASSERT_TRUE(Convert(x.data(), DType::kF32, src.data(), t, x.size()).ok());
        std::vector<uint8_t> cpu(l.bytes());
        ASSERT_TRUE(Quantize(l, src.data(), t, cpu.data()).ok());

        auto* runs = Upload(l.runs());
        auto* dsrc = Upload(src);
        uint8_t* dq = Upload(cpu);
        ASSERT_EQ(cudaMemset(dq, 0xAB, cpu.size()), cudaSuccess);
        ASSERT_TRUE(QuantizeCudaAsync(l, runs, dsrc, t, dq, nullptr).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_EQ(Download(dq, cpu.size()), cpu);

        std::vector<uint8_t> cpu_out(src.size());
        ASSERT_TRUE(Dequantize(l, cpu.data(), cpu_out.data(), t).ok());
        ASSERT_TRUE(DequantizeCudaAsync(l, runs, dq, dsrc, t, nullptr).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_EQ(Download(dsrc, src.size()), cpu_out);

        // Three inputs summed and requantized.
        std::vector<uint8_t> three(3 * l.bytes());
        std::vector<const void*> inputs;
        for (int k = 0; k < 3; ++k) {
          for (float& v : x) v = normal(rng);
          ASSERT_TRUE(Quantize(l, x.data(), DType::kF32, three.data() + k * l.bytes()).ok());
          inputs.push_back(three.data() + k * l.bytes());
        }
        ASSERT_TRUE(DequantizeSumRequantize(l, inputs, cpu.data()).ok());
        uint8_t* din = Upload(three);
        ASSERT_TRUE(DequantizeSumRequantizeCudaAsync(l, runs, din, 3, dq, nullptr).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_EQ(Download(dq, cpu.size()), cpu);
        for (void* p : {static_cast<void*>(runs), static_cast<void*>(dsrc), static_cast<void*>(dq),
                        static_cast<void*>(din)})
          cudaFree(p);
      }
    }
  }
}

// The stages of qgZ's reduction on the GPU (comm/quantized_stream.cc): a sum-requantize whose
// inputs lie a stride apart (with another slot between them), and the mean in one kernel,
// against DequantizeSum, an fp32 division and Convert on the CPU.
TEST(QuantizeCudaTest, StridedSumAndMeanEqualTheCpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0, 1);
  for (int bits : {4, 8}) {
    auto layout = QuantLayout::Create({bits, 100}, std::vector<uint64_t>{1, 300, 1036});
    ASSERT_TRUE(layout.ok());
    const QuantLayout& l = *layout;
    const uint64_t stride = 2 * l.bytes() + 3;  // odd: the scales are read a byte at a time
    std::vector<uint8_t> packed(3 * stride);
    std::vector<const void*> inputs;
    std::vector<float> x(l.elems());
    for (int k = 0; k < 3; ++k) {
      for (float& v : x) v = normal(rng) * 3;
      // A non-finite block in one input: its NaN scale must come out with the CPU's bits.
      if (k == 1) x[450] = std::numeric_limits<float>::infinity();
      ASSERT_TRUE(Quantize(l, x.data(), DType::kF32, packed.data() + k * stride).ok());
      inputs.push_back(packed.data() + k * stride);
    }
    std::vector<uint8_t> cpu(l.bytes());
    ASSERT_TRUE(DequantizeSumRequantize(l, inputs, cpu.data()).ok());
    std::vector<float> sum(l.elems());
    ASSERT_TRUE(DequantizeSum(l, inputs, sum.data()).ok());
    for (float& v : sum) v /= 6.0f;
    auto* runs = Upload(l.runs());
    uint8_t* din = Upload(packed);
    uint8_t* dq = Upload(cpu);
    ASSERT_EQ(cudaMemset(dq, 0xAB, cpu.size()), cudaSuccess);
    ASSERT_TRUE(DequantizeSumRequantizeCudaAsync(l, runs, din, 3, stride, dq, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(Download(dq, cpu.size()), cpu) << "int" << bits;
    for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
      std::vector<uint8_t> want(DTypeBytes(t, l.elems()));
      ASSERT_TRUE(Convert(sum.data(), DType::kF32, want.data(), t, l.elems()).ok());
      uint8_t* dout = Upload(want);
      ASSERT_EQ(cudaMemset(dout, 0xCD, want.size()), cudaSuccess);
      ASSERT_TRUE(DequantizeMeanCudaAsync(l, runs, din, 3, stride, 6.0f, dout, t, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(Download(dout, want.size()), want) << "int" << bits << " " << DTypeName(t);
      cudaFree(dout);
    }
    for (void* p : {static_cast<void*>(runs), static_cast<void*>(din), static_cast<void*>(dq)})
      cudaFree(p);
  }
}

}  // namespace
}  // namespace tierzero::kernels
