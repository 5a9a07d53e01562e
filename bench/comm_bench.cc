// Collective throughput of a communicator, as NCCL's tests report it, next to this machine's
// memcpy bandwidth measured in the same run (the ceiling for ranks that share memory).
//
//   mpirun -np 2 build/bin/comm_bench [--reps=5]      (bench/RESULTS.md)
//
// For each size (the whole gathered / reduced buffer, 1 MiB .. 256 MiB of fp32): the median time
// of all_gather, reduce_scatter and all_to_all over the repetitions, algbw = size / time and busbw
// = algbw x (W-1)/W (the bytes each rank must move, independent of the algorithm). memcpy moves the
// same size once per repetition on rank 0, interleaved with the collectives.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "tierzero/communicator.h"

namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 5;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--reps=", 7) == 0) reps = std::max(1, std::atoi(argv[i] + 7));
  }
  auto comm_or = tierzero::Communicator::Mpi();
  if (!comm_or.ok()) {
    std::fprintf(stderr, "comm_bench: %s\n", comm_or.status().ToString().c_str());
    return 1;
  }
  tierzero::Communicator& c = **comm_or;
  const int w = c.size();
  if (c.rank() == 0) {
    std::printf("comm_bench: %s, %d ranks, fp32, median of %d\n", c.backend().c_str(), w, reps);
    std::printf("%10s %9s %9s %9s %9s %9s %9s %11s %s\n", "bytes", "ag_ms", "ag_busbw", "rs_ms",
                "rs_busbw", "a2a_ms", "a2a_busbw", "memcpy_GBps", "busbw/memcpy (ag, rs)");
  }
  for (size_t bytes = size_t{1} << 20; bytes <= size_t{256} << 20; bytes <<= 2) {
    const size_t total = bytes / 4 / static_cast<size_t>(w) * static_cast<size_t>(w);
    const size_t per = total / static_cast<size_t>(w);
    std::vector<float> full(total, 1.0f), part(per, 2.0f), copy(total);
    std::vector<double> ag, rs, a2a, mc;
    for (int r = 0; r < reps + 1; ++r) {  // the first repetition warms up (page faults)
      (void)c.Barrier();
      auto t0 = std::chrono::steady_clock::now();
      auto a = c.AllGather(part.data(), full.data(), per, tierzero::DType::kF32);
      if (!a.ok() || !(*a)->Wait().ok()) return 1;
      const double ta = Seconds(t0);
      (void)c.Barrier();
      t0 = std::chrono::steady_clock::now();
      auto s = c.ReduceScatter(full.data(), part.data(), per, tierzero::DType::kF32,
                               tierzero::ReduceOp::kSum);
      if (!s.ok() || !(*s)->Wait().ok()) return 1;
      const double ts = Seconds(t0);
      (void)c.Barrier();
      t0 = std::chrono::steady_clock::now();
      auto x = c.AllToAll(full.data(), copy.data(), per, tierzero::DType::kF32);
      if (!x.ok() || !(*x)->Wait().ok()) return 1;
      const double tx = Seconds(t0);
      (void)c.Barrier();
      t0 = std::chrono::steady_clock::now();
      if (c.rank() == 0) std::memcpy(copy.data(), full.data(), total * 4);
      const double tm = Seconds(t0);
      if (r == 0) continue;
      ag.push_back(ta);
      rs.push_back(ts);
      a2a.push_back(tx);
      mc.push_back(tm);
    }
    if (c.rank() == 0) {
      const double b = static_cast<double>(total) * 4, f = (w - 1.0) / w;
      const double ag_bus = b / Median(ag) * f / 1e9, rs_bus = b / Median(rs) * f / 1e9;
      const double a2a_bus = b / Median(a2a) * f / 1e9;
      const double mcpy = b / Median(mc) / 1e9;
      std::printf("%10zu %9.3f %9.2f %9.3f %9.2f %9.3f %9.2f %11.2f %6.2f %5.2f\n", total * 4,
                  Median(ag) * 1e3, ag_bus, Median(rs) * 1e3, rs_bus, Median(a2a) * 1e3, a2a_bus,
                  mcpy, ag_bus / mcpy, rs_bus / mcpy);
    }
  }
  return 0;
}
