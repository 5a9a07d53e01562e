// GPU figures for issue 9 (bench/RESULTS.md; run on the GPU machine through .device/run bench):
//   1. H2D and D2H bandwidth of the engine's copies (CudaDevice::CopyAsync from the pinned arena,
//      the chunk manager's path) against a plain cudaMemcpyAsync from cudaMallocHost memory, same
//      sizes, interleaved;
//   2. fused GPU Adam (bf16 gradients, bf16 copy-out: 4+4+4 read+written, 2 read, 2 written =
//      28 B/param) in GB/s against a device-to-device cudaMemcpy of the same bytes.
//   3. the GPT's products on bf16 tensor cores (gpt/tensor_core_cuda.h): cuBLAS alone on bf16
//      operands (the ceiling) against CudaOps::Gemm with tensor cores (fp32 in and out, the
//      operands rounded first), 8192^3; attention forward + backward at batch 8, seq 1024,
//      width 2048, 16 heads, tensor cores against the fp32 kernels (causal FLOPs counted).
//   4. bf16 attention forward + backward (the bf16 backend's): cuDNN's fused attention
//      (gpt/cudnn_attention.h; repeatable, and with dQ accumulated by atomics) against the fused
//      kernels (gpt/flash_attention_cuda.h), GPT-2's [q | k | v] rows at the 1.21B GPT's shape and
//      Llama 8B's grouped-query heads at seq 2048.
// Medians of --reps (default 10) after a warm-up. Exits 0 with a message without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cpu_adam/gpu_adam.h"
#include "gpt/cublas_api.h"
#ifdef TZ_GPT_CUDNN
#include "gpt/cudnn_attention.h"
#endif
#include "gpt/flash_attention_cuda.h"
#include "gpt/ops_cuda.h"
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

// Median seconds of fn() on `stream` over reps, timed with events after one warm-up call.
template <typename F>
double EventSeconds(cudaStream_t stream, int reps, F&& fn) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<double> t;
  for (int r = 0; r <= reps; ++r) {
    cudaEventRecord(a, stream);
    fn();
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    if (r > 0) t.push_back(ms * 1e-3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return Median(t);
}

// Section 3; returns nonzero on a CUDA or cuBLAS failure.
int TensorCores(int reps) {
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreate(&s));
  auto api = gpt::cuda::LoadCublas();
  auto tc = gpt::cuda::CudaOps::Create(s, true);
  auto fp = gpt::cuda::CudaOps::Create(s, false);
  auto fu = gpt::cuda::CudaOps::Create(s, true, /*fused_attention=*/true);
  if (!api.ok() || !tc.ok() || !fp.ok() || !fu.ok()) {
    std::fprintf(stderr, "cuBLAS or CudaOps unavailable\n");
    return 1;
  }
  const int64_t n = 8192;
  float *a, *b, *c;
  void *a16, *b16;
  CHECK_CUDA(cudaMalloc(&a, n * n * 4));
  CHECK_CUDA(cudaMalloc(&b, n * n * 4));
  CHECK_CUDA(cudaMalloc(&c, n * n * 4));
  CHECK_CUDA(cudaMalloc(&a16, n * n * 2));
  CHECK_CUDA(cudaMalloc(&b16, n * n * 2));
  // Random-looking operands (never zeros: they run faster than data).
  std::vector<float> h(n * n);
  uint32_t x = 12345;
  for (float& v : h) {
    x = x * 1664525u + 1013904223u;
    v = static_cast<float>(x >> 8) / 16777216.0f - 0.5f;
  }
  CHECK_CUDA(cudaMemcpy(a, h.data(), n * n * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b, h.data(), n * n * 4, cudaMemcpyHostToDevice));
  std::vector<uint16_t> h16(n * n);
  for (size_t i = 0; i < h.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &h[i], 4);
    h16[i] = static_cast<uint16_t>(u >> 16);
  }
  CHECK_CUDA(cudaMemcpy(a16, h16.data(), n * n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b16, h16.data(), n * n * 2, cudaMemcpyHostToDevice));
  cublasHandle_t handle;
  (*api)->Create(&handle);
  (*api)->SetStream(handle, s);
  const float one = 1, zero = 0;
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  const double raw = EventSeconds(s, reps, [&] {
    st = (*api)->GemmStridedBatchedEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, b16,
                                      CUDA_R_16BF, n, 0, a16, CUDA_R_16BF, n, 0, &zero, c,
                                      CUDA_R_32F, n, 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  });
  const double ours = EventSeconds(
      s, reps, [&] { (*tc)->Gemm(false, false, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n); });
  const double fp32 = EventSeconds(
      s, reps, [&] { (*fp)->Gemm(false, false, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n); });
  (*api)->Destroy(handle);
  const double flops = 2.0 * n * n * n;
  std::printf(
      "products %ld^3: cuBLAS bf16 alone %.0f TFLOP/s; Gemm on tensor cores (fp32 in and out, "
      "operands rounded) %.0f TFLOP/s, ratio %.2f; fp32 Gemm %.0f TFLOP/s%s\n",
      static_cast<long>(n), flops / raw / 1e12, flops / ours / 1e12, raw / ours,
      flops / fp32 / 1e12, st == CUBLAS_STATUS_SUCCESS ? "" : " (cuBLAS FAILED)");

  const int64_t B = 8, T = 1024, C = 2048, H = 16;
  float *qkv, *out, *probs, *dout, *dqkv;
  CHECK_CUDA(cudaMalloc(&qkv, B * T * 3 * C * 4));
  CHECK_CUDA(cudaMalloc(&out, B * T * C * 4));
  CHECK_CUDA(cudaMalloc(&dout, B * T * C * 4));
  CHECK_CUDA(cudaMalloc(&dqkv, B * T * 3 * C * 4));
  CHECK_CUDA(cudaMalloc(&probs, B * H * T * T * 4));
  CHECK_CUDA(cudaMemcpy(qkv, a, B * T * 3 * C * 4, cudaMemcpyDeviceToDevice));
  CHECK_CUDA(cudaMemcpy(dout, b, B * T * C * 4, cudaMemcpyDeviceToDevice));
  // Causal attention: forward 2 x 2 x T^2/2 x C per sequence, backward twice that.
  const double attn_flops = 3.0 * 2 * 2 * (T * T / 2.0) * C * B;
  // Batched products on the tensor cores, fp32 kernels, fused kernels (state: log-sum-exps).
  double times[3];
  for (int k = 0; k < 3; ++k) {
    gpt::cuda::CudaOps& ops = k == 0 ? **tc : k == 1 ? **fp : **fu;
    times[k] = EventSeconds(s, std::max(1, reps / 3), [&] {
      ops.AttentionForward(qkv, out, probs, B, T, C, H);
      ops.AttentionBackward(dout, qkv, out, probs, dqkv, B, T, C, H);
    });
  }
  std::printf(
      "attention B %ld T %ld C %ld H %ld, forward + backward: fused kernels %.2f ms (%.0f "
      "TFLOP/s causal), batched products on tensor cores %.2f ms (%.0f TFLOP/s, fused %.2fx "
      "faster), fp32 kernels %.2f ms (%.1f TFLOP/s)\n",
      static_cast<long>(B), static_cast<long>(T), static_cast<long>(C), static_cast<long>(H),
      times[2] * 1e3, attn_flops / times[2] / 1e12, times[0] * 1e3, attn_flops / times[0] / 1e12,
      times[0] / times[2], times[1] * 1e3, attn_flops / times[1] / 1e12);
  if (const Status e3 = (*fu)->status(); !e3.ok()) {
    std::fprintf(stderr, "%s\n", e3.ToString().c_str());
    return 1;
  }
  const Status e1 = (*tc)->status(), e2 = (*fp)->status();
  if (!e1.ok() || !e2.ok()) {
    std::fprintf(stderr, "%s %s\n", e1.ToString().c_str(), e2.ToString().c_str());
    return 1;
  }
  for (void* p : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(c), a16, b16,
                  static_cast<void*>(qkv), static_cast<void*>(out), static_cast<void*>(probs),
                  static_cast<void*>(dout), static_cast<void*>(dqkv)})
    cudaFree(p);
  return 0;
}

// Section 4; returns nonzero on a failure of the kernels (cuDNN's refusals are printed).
int Bf16Attention(int reps) {
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreate(&s));
  struct Case {
    const char* name;
    gpt::cuda::FlashShape shape;
  };
  const Case cases[] = {
      {"GPT 1.21B (B 8, T 1024, 16 heads of 128, [q|k|v] rows)",
       {8, 1024, 16, 16, 128, 3 * 2048, 3 * 2048, 3 * 2048, 2048}},
      {"Llama 8B (B 2, T 2048, 32 heads of 128 over 8)",
       {2, 2048, 32, 8, 128, 4096, 1024, 1024, 4096}},
  };
  for (const Case& c : cases) {
    const gpt::cuda::FlashShape& f = c.shape;
    const int64_t rows = f.batch * f.seq;
    const bool fused = f.ld_q == f.ld_k;
    const int64_t qn = rows * f.ld_q, kn = fused ? 0 : rows * f.ld_k, on = rows * f.ld_o;
    // q (and k, v after it when separate), their gradients, out, dout, lse, rowdot.
    const int64_t n16 = 2 * (qn + 2 * kn) + 2 * on;
    uint16_t* mem;
    float *lse, *rowdot;
    CHECK_CUDA(cudaMalloc(&mem, n16 * 2));
    CHECK_CUDA(cudaMalloc(&lse, rows * f.heads * 4));
    CHECK_CUDA(cudaMalloc(&rowdot, rows * f.heads * 4));
    std::vector<uint16_t> h(static_cast<size_t>(n16));
    uint32_t x = 777;
    for (uint16_t& v : h) {  // bf16 of uniform(-1, 1)
      x = x * 1664525u + 1013904223u;
      const float u = static_cast<float>(x >> 8) / 8388608.0f - 1.0f;
      uint32_t b;
      std::memcpy(&b, &u, 4);
      v = static_cast<uint16_t>(b >> 16);
    }
    CHECK_CUDA(cudaMemcpy(mem, h.data(), n16 * 2, cudaMemcpyHostToDevice));
    using bf16 = __nv_bfloat16;
    bf16* q = reinterpret_cast<bf16*>(mem);
    bf16* k = fused ? q + f.heads * f.head_dim : q + qn;
    bf16* v = fused ? q + 2 * f.heads * f.head_dim : q + qn + kn;
    bf16* dq = q + qn + 2 * kn;
    bf16* dk = fused ? dq + f.heads * f.head_dim : dq + qn;
    bf16* dv = fused ? dq + 2 * f.heads * f.head_dim : dq + qn + kn;
    bf16* out = dq + qn + 2 * kn;
    bf16* dout = out + on;
    // Causal: forward 2 x 2 x T^2/2 x H x D per sequence, backward 2.5x that (5 products).
    const double fwd_flops = 2.0 * 2 * (f.seq * f.seq / 2.0) * f.heads * f.head_dim * f.batch;
    const double flops = 3.5 * fwd_flops;
    cudaError_t ke = cudaSuccess;
    const double kern = EventSeconds(s, reps, [&] {
      ke = gpt::cuda::FlashAttentionForward(q, k, v, out, lse, f, s);
      if (ke == cudaSuccess)
        ke = gpt::cuda::FlashAttentionBackward(dout, q, k, v, out, lse, rowdot, dq, dk, dv, f, s);
    });
    if (ke != cudaSuccess) {
      std::fprintf(stderr, "fused attention kernels: %s\n", cudaGetErrorString(ke));
      return 1;
    }
    const double kern_fwd = EventSeconds(
        s, reps, [&] { ke = gpt::cuda::FlashAttentionForward(q, k, v, out, lse, f, s); });
    std::printf(
        "bf16 attention, %s, forward + backward (%.1f GFLOP, causal): fused kernels "
        "%.2f ms (%.0f TFLOP/s; forward %.0f TFLOP/s)",
        c.name, flops / 1e9, kern * 1e3, flops / kern / 1e12, fwd_flops / kern_fwd / 1e12);
#ifdef TZ_GPT_CUDNN
    for (const bool deterministic : {true, false}) {
      auto cu = gpt::cuda::CudnnAttention::Create(s, deterministic);
      Status st = cu.ok() ? (*cu)->Prepare(f) : cu.status();
      if (!st.ok()) {
        std::printf("; cuDNN%s: %s", deterministic ? "" : " (atomic dQ)", st.ToString().c_str());
        continue;
      }
      const double t = EventSeconds(s, reps, [&] {
        if (st.ok()) st = (*cu)->Forward(q, k, v, out, lse, f);
        if (st.ok()) st = (*cu)->Backward(dout, q, k, v, out, lse, dq, dk, dv, f);
      });
      const double t_fwd = EventSeconds(s, reps, [&] {
        if (st.ok()) st = (*cu)->Forward(q, k, v, out, lse, f);
      });
      if (!st.ok()) {
        std::printf("; cuDNN%s failed: %s", deterministic ? "" : " (atomic dQ)",
                    st.ToString().c_str());
        continue;
      }
      std::printf("; %s%s %.2f ms (%.0f TFLOP/s, %.2fx the kernels; forward %.0f TFLOP/s)",
                  (*cu)->Version().c_str(), deterministic ? "" : " with atomic dQ", t * 1e3,
                  flops / t / 1e12, kern / t, fwd_flops / t_fwd / 1e12);
    }
#else
    std::printf("; cuDNN: not in this build");
#endif
    std::printf("\n");
    cudaFree(mem);
    cudaFree(lse);
    cudaFree(rowdot);
  }
  CHECK_CUDA(cudaStreamDestroy(s));
  return 0;
}

int main(int argc, char** argv) {
  int reps = 10;
  bool attention_only = false;  // --only=attention: section 4 alone
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--reps=", 7) == 0) reps = std::max(1, std::atoi(argv[i] + 7));
    if (std::strcmp(argv[i], "--only=attention") == 0) attention_only = true;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("gpu_bench: no GPU here; nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("gpu_bench: %s, median of %d\n", prop.name, reps);
  if (attention_only) return Bf16Attention(reps);

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
  const int products = TensorCores(reps);
  return Bf16Attention(reps) != 0 ? 1 : products;
}
