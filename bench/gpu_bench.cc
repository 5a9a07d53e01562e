// GPU figures for issue 9 (bench/RESULTS.md; run on the GPU machine through .device/run bench):
//   1. H2D and D2H bandwidth of the engine's copies (CudaDevice::CopyAsync from the pinned arena,
//      the chunk manager's path) against a plain cudaMemcpyAsync from cudaMallocHost memory, same
//      sizes, interleaved;
//   2. fused GPU Adam (bf16 gradients, bf16 copy-out: 4+4+4 read+written, 2 read, 2 written =
//      28 B/param) in GB/s against a device-to-device cudaMemcpy of the same bytes.
// Medians of --reps (default 10) after a warm-up. Exits 0 with a message without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cpu_adam/gpu_adam.h"
#include "offload/cuda_device.h"
#include "offload/device.h"
#include "offload/pinned_arena.h"

namespace {

using namespace tierzero;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F>
double TimeSeconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

#define CHECK_CUDA(x)                                               \
  do {                                                              \
    cudaError_t e_ = (x);                                           \
    if (e_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      return 1;                                                     \
    }                                                               \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  int reps = 10;
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--reps=", 7) == 0) reps = std::max(1, std::atoi(argv[i] + 7));
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("gpu_bench: no GPU here; nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("gpu_bench: %s, median of %d\n", prop.name, reps);

  const size_t kMax = size_t{256} << 20;
  CudaDeviceOptions opt;
  opt.capacity_bytes = 2 * kMax + (size_t{64} << 20);
  auto dev_or = CreateCudaDevice(opt);
  if (!dev_or.ok()) {
    std::fprintf(stderr, "gpu_bench: %s\n", dev_or.status().ToString().c_str());
    return 1;
  }
  Device& dev = **dev_or;
  auto arena_or = PinnedArena::Create(&dev, kMax, 1);
  if (!arena_or.ok()) {
    std::fprintf(stderr, "gpu_bench: %s\n", arena_or.status().ToString().c_str());
    return 1;
  }
  auto slot = (*arena_or)->Acquire(std::chrono::seconds(1));
  if (!slot.ok()) return 1;
  auto dbuf = dev.Allocate(kMax);
  if (!dbuf.ok()) return 1;
  auto stream = dev.CreateStream("bench");
  if (!stream.ok()) return 1;
  void* plain_host = nullptr;
  void* plain_dev = nullptr;
  CHECK_CUDA(cudaMallocHost(&plain_host, kMax));
  CHECK_CUDA(cudaMalloc(&plain_dev, kMax));
  cudaStream_t cs;
  CHECK_CUDA(cudaStreamCreate(&cs));
  std::memset(slot->data(), 1, kMax);
  std::memset(plain_host, 1, kMax);

  std::printf("%10s %10s %10s %10s %10s %8s %8s\n", "bytes", "eng_h2d", "plain_h2d", "eng_d2h",
              "plain_d2h", "h2d_x", "d2h_x");
  for (size_t bytes = size_t{1} << 20; bytes <= kMax; bytes <<= 2) {
    std::vector<double> eh, ph, ed, pd;
    for (int r = 0; r <= reps; ++r) {
      const double a = TimeSeconds([&] {
        (void)dev.CopyAsync(*dbuf, slot->data(), bytes, CopyKind::kHostToDevice, *stream);
        (void)dev.SynchronizeStream(*stream);
      });
      const double b = TimeSeconds([&] {
        cudaMemcpyAsync(plain_dev, plain_host, bytes, cudaMemcpyHostToDevice, cs);
        cudaStreamSynchronize(cs);
      });
      const double c = TimeSeconds([&] {
        (void)dev.CopyAsync(slot->data(), *dbuf, bytes, CopyKind::kDeviceToHost, *stream);
        (void)dev.SynchronizeStream(*stream);
      });
      const double d = TimeSeconds([&] {
        cudaMemcpyAsync(plain_host, plain_dev, bytes, cudaMemcpyDeviceToHost, cs);
        cudaStreamSynchronize(cs);
      });
      if (r == 0) continue;
      eh.push_back(a);
      ph.push_back(b);
      ed.push_back(c);
      pd.push_back(d);
    }
    const double g = static_cast<double>(bytes) / 1e9;
    std::printf("%10zu %10.2f %10.2f %10.2f %10.2f %8.2f %8.2f\n", bytes, g / Median(eh),
                g / Median(ph), g / Median(ed), g / Median(pd), Median(ph) / Median(eh),
                Median(pd) / Median(ed));
  }

  // GPU Adam over n parameters vs a D2D copy moving the same bytes.
  const size_t n = size_t{64} << 20;  // 64M parameters: 1.75 GiB of traffic per step
  float *master, *m, *v;
  uint16_t *grad, *out;
  CHECK_CUDA(cudaMalloc(&master, n * 4));
  CHECK_CUDA(cudaMalloc(&m, n * 4));
  CHECK_CUDA(cudaMalloc(&v, n * 4));
  CHECK_CUDA(cudaMalloc(&grad, n * 2));
  CHECK_CUDA(cudaMalloc(&out, n * 2));
  CHECK_CUDA(cudaMemset(master, 0, n * 4));
  CHECK_CUDA(cudaMemset(m, 0, n * 4));
  CHECK_CUDA(cudaMemset(v, 0, n * 4));
  CHECK_CUDA(cudaMemset(grad, 0, n * 2));
  const size_t traffic = n * 28;
  void *src = nullptr, *dst = nullptr;
  CHECK_CUDA(cudaMalloc(&src, traffic / 2));
  CHECK_CUDA(cudaMalloc(&dst, traffic / 2));
  AdamConfig ac;
  ac.adamw = true;
  ac.weight_decay = 0.1f;
  std::vector<double> ta, tc;
  for (int r = 0; r <= reps; ++r) {
    AdamStepOptions so;
    so.step = r + 1;
    AdamBuffers b{master, m, v, grad, DType::kBF16, out, DType::kBF16, n};
    const double a = TimeSeconds([&] {
      (void)GpuAdamStepAsync(ac, so, b, cs);
      cudaStreamSynchronize(cs);
    });
    // A copy of traffic/2 bytes reads and writes `traffic` bytes in all.
    const double c = TimeSeconds([&] {
      cudaMemcpyAsync(dst, src, traffic / 2, cudaMemcpyDeviceToDevice, cs);
      cudaStreamSynchronize(cs);
    });
    if (r == 0) continue;
    ta.push_back(a);
    tc.push_back(c);
  }
  const double adam_gbs = static_cast<double>(traffic) / Median(ta) / 1e9;
  const double copy_gbs = static_cast<double>(traffic) / Median(tc) / 1e9;
  std::printf(
      "GPU Adam: %zu params, %.3f ms, %.0f GB/s (28 B/param); D2D copy of the same bytes "
      "%.0f GB/s; ratio %.2f; %.1f Gparams/s\n",
      n, Median(ta) * 1e3, adam_gbs, copy_gbs, adam_gbs / copy_gbs,
      static_cast<double>(n) / Median(ta) / 1e9);
  return 0;
}
