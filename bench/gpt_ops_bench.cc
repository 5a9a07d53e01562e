// The GPT's CPU ops at one shape, each against the time its FLOPs would take at the rate of one
// large product measured in the same run (the ceiling): where a step's time goes, op by op.
//   build/bin/gpt_ops_bench [--benchmark_filter=...]   (shape: batch 8 x 128 tokens, 256 wide,
//   8 heads, the wide shape of bench/torch_compare.sh)
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "gpt/ops.h"

namespace tierzero::gpt::cpu {
namespace {

constexpr int64_t kBatch = 8, kSeq = 128, kC = 256, kHeads = 8, kRows = kBatch * kSeq;

std::vector<float> Random(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

void SetFlops(benchmark::State& state, double flops) {
  state.counters["GFLOP/s"] = benchmark::Counter(
      flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}

// The ceiling: one 1024 x 1024 x 1024 product through the same Gemm.
void BM_GemmCeiling(benchmark::State& state) {
  const int64_t n = 1024;
  auto a = Random(n * n, 1), b = Random(n * n, 2), c = Random(n * n, 3);
  for (auto _ : state)
    Gemm<float>(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  SetFlops(state, 2.0 * n * n * n);
}

// A block's four linear layers, forward and backward (the products of a training step).
void BM_LinearFwdBwd(benchmark::State& state) {
  const int64_t in = state.range(0), out = state.range(1);
  auto x = Random(kRows * in, 4), w = Random(in * out, 5), bias = Random(out, 6);
  auto y = Random(kRows * out, 7), dy = Random(kRows * out, 8), dx = Random(kRows * in, 9);
  auto dw = Random(in * out, 10), db = Random(out, 11);
  for (auto _ : state) {
    LinearForward<float>(x.data(), w.data(), bias.data(), y.data(), kRows, in, out);
    LinearBackward<float>(dy.data(), x.data(), w.data(), dx.data(), dw.data(), db.data(), kRows, in,
                          out);
  }
  SetFlops(state, 6.0 * kRows * in * out);
}
BENCHMARK(BM_GemmCeiling)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LinearFwdBwd)
    ->Args({kC, 3 * kC})
    ->Args({kC, kC})
    ->Args({kC, 4 * kC})
    ->Args({4 * kC, kC})
    ->Unit(benchmark::kMillisecond);

// Causal attention, forward and backward; FLOPs counted for the causal triangle only (what an
// ideal kernel would do), so the rate shows what computing the full square costs.
void BM_AttentionFwdBwd(benchmark::State& state) {
  auto qkv = Random(kRows * 3 * kC, 12), out = Random(kRows * kC, 13);
  auto probs = Random(kBatch * kHeads * kSeq * kSeq, 14), dout = Random(kRows * kC, 15);
  auto dqkv = Random(kRows * 3 * kC, 16);
  for (auto _ : state) {
    AttentionForward<float>(qkv.data(), out.data(), probs.data(), kBatch, kSeq, kC, kHeads);
    AttentionBackward<float>(dout.data(), qkv.data(), probs.data(), dqkv.data(), kBatch, kSeq, kC,
                             kHeads);
  }
  const double hd = static_cast<double>(kC) / kHeads;
  SetFlops(state, 6.0 * kBatch * kHeads * (kSeq * (kSeq + 1) / 2.0) * hd * 2);
}
BENCHMARK(BM_AttentionFwdBwd)->Unit(benchmark::kMillisecond);

void BM_GeluFwdBwd(benchmark::State& state) {
  const int64_t n = kRows * 4 * kC;
  auto x = Random(n, 17), y = Random(n, 18), dy = Random(n, 19), dx = Random(n, 20);
  for (auto _ : state) {
    GeluForward<float>(x.data(), y.data(), n);
    GeluBackward<float>(dy.data(), x.data(), dx.data(), n);
  }
  state.SetBytesProcessed(state.iterations() * n * 5 * 4);
}
BENCHMARK(BM_GeluFwdBwd)->Unit(benchmark::kMillisecond);

void BM_LayerNormFwdBwd(benchmark::State& state) {
  auto x = Random(kRows * kC, 21), g = Random(kC, 22), b = Random(kC, 23),
       y = Random(kRows * kC, 24);
  auto mean = Random(kRows, 25), rstd = Random(kRows, 26), dy = Random(kRows * kC, 27);
  auto dx = Random(kRows * kC, 28), dg = Random(kC, 29), db = Random(kC, 30);
  for (auto _ : state) {
    LayerNormForward<float>(x.data(), g.data(), b.data(), y.data(), mean.data(), rstd.data(), kRows,
                            kC);
    LayerNormBackward<float>(dy.data(), x.data(), g.data(), mean.data(), rstd.data(), dx.data(),
                             dg.data(), db.data(), kRows, kC);
  }
}
BENCHMARK(BM_LayerNormFwdBwd)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace tierzero::gpt::cpu

BENCHMARK_MAIN();
