// Block quantization (src/kernels/quantize.h) next to memcpy, measured in the same run.
//
//   build/bin/quant_bench [--reps=7] [--elems=33554432] [--block=256]
//
// For each input dtype and format: quantize, dequantize and the fused sum-requantize of two
// inputs over one layout of `elems` elements (runs of 1M elements, blocks of `block`), on one
// thread and on all of oneTBB's, interleaved with a memcpy of the quantized input's bytes on as
// many threads. Bandwidth counts the bytes each pass touches (read + written), memcpy's twice its
// size, so the ratio is the fraction of the copy bandwidth the kernel reaches (the goal:
// >= 0.7). Medians over the repetitions.
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/convert.h"
#include "core/cpu_features.h"
#include "kernels/quantize.h"

namespace {

using tierzero::DType;
namespace k = tierzero::kernels;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Time(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// memcpy split into as many pieces as the arena allows threads (one piece per thread).
void Copy(void* dst, const void* src, size_t bytes, int threads) {
  const size_t piece = (bytes / static_cast<size_t>(threads) + 4095) / 4096 * 4096;
  tbb::parallel_for(0, threads, [&](int t) {
    const size_t off = std::min(bytes, piece * static_cast<size_t>(t));
    std::memcpy(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off,
                std::min(piece, bytes - off));
  });
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 7;
  uint64_t elems = uint64_t{32} << 20;
  uint64_t block = 256;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--reps=", 7) == 0) reps = std::max(1, std::atoi(argv[i] + 7));
    if (std::strncmp(argv[i], "--elems=", 8) == 0) elems = std::strtoull(argv[i] + 8, nullptr, 10);
    if (std::strncmp(argv[i], "--block=", 8) == 0) block = std::strtoull(argv[i] + 8, nullptr, 10);
  }
  std::printf("quant_bench: %llu elements, runs of 1M, block %llu, SIMD %s, median of %d\n",
              static_cast<unsigned long long>(elems), static_cast<unsigned long long>(block),
              std::string(tierzero::SimdLevelName(tierzero::ActiveSimdLevel())).c_str(), reps);
  std::printf("%-7s %-5s %-4s %7s | %9s %6s | %9s %6s | %9s %6s | %11s\n", "input", "bits", "thr",
              "", "quant_GBs", "ratio", "deq_GBs", "ratio", "sum2_GBs", "ratio", "memcpy_GBs");
  std::vector<uint64_t> runs(elems / (1 << 20), 1 << 20);
  if (elems % (1 << 20)) runs.push_back(elems % (1 << 20));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> values(elems);
  for (float& v : values) v = normal(rng);
  const int all = tbb::this_task_arena::max_concurrency();
  for (DType t : {DType::kBF16, DType::kF32}) {
    const size_t in_bytes = tierzero::DTypeBytes(t, elems);
    auto src = tierzero::AlignedBuffer::Allocate(in_bytes);
    auto out = tierzero::AlignedBuffer::Allocate(in_bytes);
    auto copy = tierzero::AlignedBuffer::Allocate(in_bytes);
    if (!tierzero::Convert(values.data(), DType::kF32, src.data(), t, elems).ok()) return 1;
    for (int bits : {8, 4}) {
      auto layout = k::QuantLayout::Create({bits, static_cast<uint32_t>(block)}, runs);
      if (!layout.ok()) {
        std::fprintf(stderr, "quant_bench: %s\n", layout.status().ToString().c_str());
        return 1;
      }
      auto q = tierzero::AlignedBuffer::Allocate(layout->bytes());
      auto q2 = tierzero::AlignedBuffer::Allocate(layout->bytes());
      auto fused = tierzero::AlignedBuffer::Allocate(layout->bytes());
      if (!k::Quantize(*layout, src.data(), t, q2.data()).ok()) return 1;
      const std::vector<const void*> inputs = {q.data(), q2.data()};
      for (int threads : {1, all}) {
        tbb::global_control limit(tbb::global_control::max_allowed_parallelism,
                                  static_cast<size_t>(threads));
        std::vector<double> tq, td, ts, tm;
        for (int r = 0; r < reps + 1; ++r) {  // the first repetition warms up (page faults)
          const double a = Time([&] { (void)k::Quantize(*layout, src.data(), t, q.data()); });
          const double m = Time([&] { Copy(copy.data(), src.data(), in_bytes, threads); });
          const double d = Time([&] { (void)k::Dequantize(*layout, q.data(), out.data(), t); });
          const double s =
              Time([&] { (void)k::DequantizeSumRequantize(*layout, inputs, fused.data()); });
          if (r == 0) continue;
          tq.push_back(a), tm.push_back(m), td.push_back(d), ts.push_back(s);
        }
        const double gb = 1e9;
        const double memcpy_bw = 2.0 * in_bytes / Median(tm) / gb;
        const double quant_bw = (in_bytes + layout->bytes()) / Median(tq) / gb;
        const double deq_bw = (in_bytes + layout->bytes()) / Median(td) / gb;
        const double sum_bw = 3.0 * layout->bytes() / Median(ts) / gb;
        std::printf("%-7s int%-2d %-4d %7s | %9.2f %6.2f | %9.2f %6.2f | %9.2f %6.2f | %11.2f\n",
                    std::string(tierzero::DTypeName(t)).c_str(), bits, threads, "", quant_bw,
                    quant_bw / memcpy_bw, deq_bw, deq_bw / memcpy_bw, sum_bw, sum_bw / memcpy_bw,
                    memcpy_bw);
      }
    }
  }
  return 0;
}
