// core_bench: fp32 <-> bf16/fp16 conversion throughput next to memcpy, measured in the same
// run and interleaved iteration by iteration, so the ratio means something on a noisy machine.
//
// Counters (per benchmark, medians over its iterations):
//   GBps         bytes read + written by the conversion per second
//   memcpy_GBps  bytes read + written per second by memcpy moving the same total bytes,
//                timed right after each conversion
//   ratio        GBps / memcpy_GBps (target >= 0.70 for large buffers)
//
//   build/bin/core_bench --benchmark_format=json
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/convert.h"

namespace tierzero {
namespace {

using Clock = std::chrono::steady_clock;

enum class Kind { kF32ToBF16, kBF16ToF32, kF32ToF16, kF16ToF32 };

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kF32ToBF16:
      return "f32_to_bf16";
    case Kind::kBF16ToF32:
      return "bf16_to_f32";
    case Kind::kF32ToF16:
      return "f32_to_f16";
    case Kind::kF16ToF32:
      return "f16_to_f32";
  }
  return "?";
}

double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

void BM_Convert(benchmark::State& state, Kind kind, SimdLevel level) {
  const size_t n = static_cast<size_t>(state.range(0));
  const ConvertKernels* k = ConvertKernelsFor(level);
  std::vector<float> f32(n);
  std::vector<uint16_t> h16(n);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-100.0f, 100.0f);
  for (auto& v : f32) v = dist(rng);
  k->f32_to_bf16(f32.data(), h16.data(), n);
  const size_t moved = n * 6;  // 4 bytes one side, 2 the other
  std::vector<uint8_t> copy_src(moved / 2, 1), copy_dst(moved / 2, 0);
  std::vector<double> conv_s, copy_s;
  for (auto _ : state) {
    auto t0 = Clock::now();
    switch (kind) {
      case Kind::kF32ToBF16:
        k->f32_to_bf16(f32.data(), h16.data(), n);
        break;
      case Kind::kBF16ToF32:
        k->bf16_to_f32(h16.data(), f32.data(), n);
        break;
      case Kind::kF32ToF16:
        k->f32_to_f16(f32.data(), h16.data(), n);
        break;
      case Kind::kF16ToF32:
        k->f16_to_f32(h16.data(), f32.data(), n);
        break;
    }
    benchmark::ClobberMemory();
    auto t1 = Clock::now();
    std::memcpy(copy_dst.data(), copy_src.data(), copy_src.size());
    benchmark::ClobberMemory();
    auto t2 = Clock::now();
    const double c = std::chrono::duration<double>(t1 - t0).count();
    conv_s.push_back(c);
    copy_s.push_back(std::chrono::duration<double>(t2 - t1).count());
    state.SetIterationTime(c);
  }
  // Medians: one slow iteration (a page fault storm, a neighbour's burst) must not decide.
  const double gbps = moved / Median(conv_s) / 1e9;
  const double copy_gbps = moved / Median(copy_s) / 1e9;
  const double iters = static_cast<double>(state.iterations());
  state.counters["GBps"] = gbps;
  state.counters["memcpy_GBps"] = copy_gbps;
  state.counters["ratio"] = gbps / copy_gbps;
  state.SetBytesProcessed(static_cast<int64_t>(moved * iters));
}

void RegisterAll() {
  for (SimdLevel level : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (!SimdLevelSupported(level)) continue;
    for (Kind kind : {Kind::kF32ToBF16, Kind::kBF16ToF32, Kind::kF32ToF16, Kind::kF16ToF32}) {
      std::string name =
          std::string("Convert/") + KindName(kind) + "/" + std::string(SimdLevelName(level));
      auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_Convert, kind, level);
      b->UseManualTime()->Unit(benchmark::kMicrosecond);
      // 64 KiB of fp32 (cache resident) up to 256 MiB (memory bound).
      for (int64_t n :
           {int64_t{16} << 10, int64_t{1} << 20, int64_t{16} << 20, int64_t{64} << 20}) {
        b->Arg(n);
      }
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
