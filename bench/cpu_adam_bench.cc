// cpu_adam_bench: CpuAdam parameters/second, and the fraction of the machine's bandwidth it
// reaches, measured in the same run with a kernel that moves the same bytes (stream_avx2.cc).
// Each iteration runs, back to back: the fused Adam step (timed for the benchmark) and the
// ceiling kernel over the same buffers, in alternating order (step first in even iterations,
// the ceiling first in odd ones: neither always finds the caches and the memory controller as
// the other left them), and, with copy-out, the two-pass variant (Adam without copy-out, then a
// separate cast of the master into the output, as the leading implementation does). The step
// and its ceiling are a pair measured within a second of each other; the fraction of the
// limit is the median of the pairs' ratios, not a ratio of medians, so a machine whose
// bandwidth drifts between iterations (this one swings 2x over minutes) moves both alike.
//
// Counters (medians over the iterations):
//   params_per_s        parameters updated per second by the fused step
//   GBps                bytes the step must move (28 or 30 B/param with fp32 grads) per second
//   limit_GBps          the ceiling kernel's bytes per second, same bytes, same threads
//   fraction_of_limit   the median over iterations of ceiling time / step time (target >= 0.90
//                       at 128M+ params, all threads)
//   fraction_lo/_hi     the smallest and largest of those per-iteration ratios
//   fused_speedup       two-pass time / fused time (with copy-out; bytes predict 34/30 = 1.13)
//
//
// CpuAdamStates (compressed moments, cpu_adam/state_codes.h; bf16 gradients and copy-out, the
// engine's own case): the same pairing with a ceiling that moves the compressed step's bytes
// (20 B/param for bf16 moments, 16.25 for 8-bit codes), and a third member, the fp32-moment step
// over its own buffers of the same parameters:
//   speedup_vs_fp32     the median over iterations of fp32-moment time / compressed time
//                       (bytes predict 28/20 = 1.4 for bf16, 28/16.25 = 1.72 for 8-bit)
//
//   build/bin/cpu_adam_bench --benchmark_format=json > adam.json
#include <benchmark/benchmark.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench/stream_kernels.h"
#include "core/check.h"
#include "core/convert.h"
#include "cpu_adam/cpu_adam.h"

namespace tierzero {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

template <typename T>
struct FreeDeleter {
  void operator()(T* p) const { std::free(p); }
};
template <typename T>
using Buffer = std::unique_ptr<T[], FreeDeleter<T>>;

template <typename T>
Buffer<T> Allocate(size_t n) {
  void* p = std::aligned_alloc(4096, (n * sizeof(T) + 4095) / 4096 * 4096);
  TZ_CHECK(p != nullptr) << "cannot allocate " << n * sizeof(T) << " bytes";
  return Buffer<T>(static_cast<T*>(p));
}

// Runs fn(begin, end) over [0, n) in blocks on `arena`.
template <typename Fn>
void ParallelBlocks(tbb::task_arena& arena, size_t n, Fn fn) {
  constexpr size_t kBlock = 16384;
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, (n + kBlock - 1) / kBlock),
                      [&](const tbb::blocked_range<size_t>& r) {
                        for (size_t b = r.begin(); b != r.end(); ++b) {
                          fn(b * kBlock, std::min(n, (b + 1) * kBlock));
                        }
                      });
  });
}

void BM_CpuAdam(benchmark::State& state, int threads, DType grad_dtype, bool copy_out) {
  const size_t n = static_cast<size_t>(state.range(0));
  const bool bf16_grad = grad_dtype == DType::kBF16;
  CpuAdamOptions options;
  options.threads = threads;
  auto adam = std::move(CpuAdam::Create(AdamConfig{}, options)).value();
  tbb::task_arena arena(adam->threads());

  auto p = Allocate<float>(n), m = Allocate<float>(n), v = Allocate<float>(n);
  auto g32 = Allocate<float>(bf16_grad ? 0 : n);
  auto g16 = Allocate<uint16_t>(bf16_grad ? n : 0);
  auto out = Allocate<uint16_t>(n);
  // First touch in parallel, with values that keep every step finite.
  ParallelBlocks(arena, n, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      const float x = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
      p[i] = x;
      m[i] = 1e-3f * x;
      v[i] = 1e-4f + 1e-5f * x;
      if (bf16_grad) {
        g16[i] = F32ToBF16Scalar(0.01f * x);
      } else {
        g32[i] = 0.01f * x;
      }
      out[i] = 0;
    }
  });
  AdamBuffers buf;
  buf.master = p.get();
  buf.m = m.get();
  buf.v = v.get();
  buf.grad = bf16_grad ? static_cast<const void*>(g16.get()) : g32.get();
  buf.grad_dtype = grad_dtype;
  buf.out = copy_out ? out.get() : nullptr;
  buf.out_dtype = DType::kBF16;
  buf.n = n;

  const double bytes_per_param = (bf16_grad ? 26.0 : 28.0) + (copy_out ? 2.0 : 0.0);
  std::vector<double> fused_s, limit_s, two_pass_s, ratio;
  int64_t step = 0;
  auto ceiling = [&] {
    const auto t0 = Clock::now();
    ParallelBlocks(arena, n, [&](size_t b, size_t e) {
      bench::StreamLikeAdamAvx2(p.get() + b, m.get() + b, v.get() + b,
                                bf16_grad ? static_cast<const void*>(g16.get() + b)
                                          : static_cast<const void*>(g32.get() + b),
                                bf16_grad, copy_out ? out.get() + b : nullptr, e - b);
    });
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  for (auto _ : state) {
    AdamStepOptions opt;
    opt.step = ++step;
    const bool ceiling_first = fused_s.size() % 2 == 1;
    const double limit_first = ceiling_first ? ceiling() : 0.0;
    auto t0 = Clock::now();
    TZ_CHECK_OK(adam->Step(buf, opt).status());
    auto t1 = Clock::now();
    const double limit = ceiling_first ? limit_first : ceiling();
    if (copy_out) {
      AdamBuffers no_out = buf;
      no_out.out = nullptr;
      opt.step = ++step;
      auto t3 = Clock::now();
      TZ_CHECK_OK(adam->Step(no_out, opt).status());
      ParallelBlocks(arena, n, [&](size_t b, size_t e) {
        ConvertF32ToBF16(p.get() + b, out.get() + b, e - b);
      });
      two_pass_s.push_back(std::chrono::duration<double>(Clock::now() - t3).count());
    }
    const double fused = std::chrono::duration<double>(t1 - t0).count();
    fused_s.push_back(fused);
    limit_s.push_back(limit);
    ratio.push_back(limit / fused);
    state.SetIterationTime(fused);
  }
  const double fused = Median(fused_s), limit = Median(limit_s);
  state.counters["params_per_s"] = n / fused;
  state.counters["GBps"] = n * bytes_per_param / fused / 1e9;
  state.counters["limit_GBps"] = n * bytes_per_param / limit / 1e9;
  state.counters["fraction_of_limit"] = Median(ratio);
  state.counters["fraction_lo"] = *std::min_element(ratio.begin(), ratio.end());
  state.counters["fraction_hi"] = *std::max_element(ratio.begin(), ratio.end());
  state.counters["threads"] = adam->threads();
  if (copy_out) state.counters["fused_speedup"] = Median(two_pass_s) / fused;
}

void BM_CpuAdamStates(benchmark::State& state, int threads, StateFormat format) {
  const size_t n = static_cast<size_t>(state.range(0));
  CpuAdamOptions options;
  options.threads = threads;
  auto adam = std::move(CpuAdam::Create(AdamConfig{}, options)).value();
  tbb::task_arena arena(adam->threads());
  const size_t w = format == StateFormat::kBF16 ? 2 : 1;
  const size_t blocks = StateScaleCount(n);
  auto p = Allocate<float>(n), p32 = Allocate<float>(n), m32 = Allocate<float>(n),
       v32 = Allocate<float>(n);
  auto mq = Allocate<uint8_t>(n * w), vq = Allocate<uint8_t>(n * w);
  auto ms = Allocate<float>(blocks), vs = Allocate<float>(blocks);
  auto g = Allocate<uint16_t>(n), out = Allocate<uint16_t>(n);
  ParallelBlocks(arena, n, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      const float x = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
      p[i] = p32[i] = x;
      m32[i] = 1e-3f * x;
      v32[i] = 1e-4f + 1e-5f * x;
      g[i] = F32ToBF16Scalar(0.01f * x);
      out[i] = 0;
      if (w == 2) {
        reinterpret_cast<uint16_t*>(mq.get())[i] = F32ToBF16Scalar(m32[i]);
        reinterpret_cast<uint16_t*>(vq.get())[i] = F32ToBF16Scalar(v32[i]);
      } else {
        mq[i] = static_cast<uint8_t>(0x40 + i % 60);  // mid-range codes
        vq[i] = static_cast<uint8_t>(0xC0 + i % 60);
        if (i % 64 == 0) ms[i / 64] = vs[i / 64] = 1e-3f;
      }
    }
  });
  AdamBuffers buf;
  buf.master = p.get();
  buf.grad = g.get();
  buf.grad_dtype = DType::kBF16;
  buf.out = out.get();
  buf.out_dtype = DType::kBF16;
  buf.n = n;
  buf.states = format;
  buf.m_state = mq.get();
  buf.v_state = vq.get();
  buf.m_scale = ms.get();
  buf.v_scale = vs.get();
  AdamBuffers f32 = buf;
  f32.states = StateFormat::kF32;
  f32.master = p32.get();
  f32.m = m32.get();
  f32.v = v32.get();
  const double bytes_per_param = 4 * 2 + 2 + 2 + 2.0 * MomentBytes(format, n) / n * 2;
  std::vector<double> step_s, limit_s, ratio, speedup;
  int64_t step = 0;
  auto ceiling = [&] {
    const auto t0 = Clock::now();
    ParallelBlocks(arena, n, [&](size_t b, size_t e) {
      bench::StreamLikeAdamStatesAvx2(p.get() + b, mq.get() + b * w, vq.get() + b * w,
                                      ms.get() + b / 64, vs.get() + b / 64, g.get() + b,
                                      out.get() + b, e - b, static_cast<int>(w));
    });
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  auto timed = [&](const AdamBuffers& b) {
    AdamStepOptions opt;
    opt.step = ++step;
    const auto t0 = Clock::now();
    TZ_CHECK_OK(adam->Step(b, opt).status());
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  for (auto _ : state) {
    // The three in a rotating order, so none always follows the same one.
    double t = 0, limit = 0, fp32 = 0;
    switch (step_s.size() % 3) {
      case 0:
        t = timed(buf), limit = ceiling(), fp32 = timed(f32);
        break;
      case 1:
        limit = ceiling(), fp32 = timed(f32), t = timed(buf);
        break;
      default:
        fp32 = timed(f32), t = timed(buf), limit = ceiling();
        break;
    }
    step_s.push_back(t);
    limit_s.push_back(limit);
    ratio.push_back(limit / t);
    speedup.push_back(fp32 / t);
    state.SetIterationTime(t);
  }
  const double t = Median(step_s), limit = Median(limit_s);
  state.counters["params_per_s"] = n / t;
  state.counters["GBps"] = n * bytes_per_param / t / 1e9;
  state.counters["limit_GBps"] = n * bytes_per_param / limit / 1e9;
  state.counters["fraction_of_limit"] = Median(ratio);
  state.counters["fraction_lo"] = *std::min_element(ratio.begin(), ratio.end());
  state.counters["fraction_hi"] = *std::max_element(ratio.begin(), ratio.end());
  state.counters["speedup_vs_fp32"] = Median(speedup);
  state.counters["threads"] = adam->threads();
}

void RegisterAll() {
  TZ_CHECK(SimdLevelSupported(SimdLevel::kAvx2)) << "cpu_adam_bench's ceiling kernel needs AVX2";
  const int all = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int threads : {1, all}) {
    for (DType g : {DType::kF32, DType::kBF16}) {
      for (bool copy_out : {false, true}) {
        std::string name = "CpuAdam/threads:" + std::to_string(threads) +
                           "/grad:" + std::string(DTypeName(g)) +
                           (copy_out ? "/copy_out" : "/no_copy");
        auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_CpuAdam, threads, g, copy_out);
        b->UseManualTime()->Unit(benchmark::kMillisecond);
        b->Arg(int64_t{1} << 20)->Arg(int64_t{16} << 20);
        // Large sizes: a few iterations are plenty (each moves gigabytes) and keep the run short.
        b = benchmark::RegisterBenchmark(name.c_str(), BM_CpuAdam, threads, g, copy_out);
        b->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(6);
        b->Arg(int64_t{128} << 20)->Arg(int64_t{512} << 20);
      }
    }
    for (StateFormat f : {StateFormat::kBF16, StateFormat::kInt8}) {
      std::string name = "CpuAdamStates/threads:" + std::to_string(threads) +
                         "/states:" + std::string(StateFormatName(f));
      auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_CpuAdamStates, threads, f);
      b->UseManualTime()->Unit(benchmark::kMillisecond);
      b->Arg(int64_t{1} << 20)->Arg(int64_t{16} << 20);
      b = benchmark::RegisterBenchmark(name.c_str(), BM_CpuAdamStates, threads, f);
      b->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(9);
      b->Arg(int64_t{128} << 20);
    }
  }
}

}  // namespace
}  // namespace tierzero

int main(int argc, char** argv) {
  tierzero::RegisterAll();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
