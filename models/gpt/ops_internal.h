// What the CPU ops' files share (ops.cc, attention_ops.cc, llama_ops.cc): rows over oneTBB and
// the single-threaded sgemm of Note [Matrix products under oneTBB]. Not part of gpt/ops.h.
#pragma once

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cstdint>

namespace tierzero::gpt::cpu {

// Rows per task: enough work to amortise scheduling, few enough to balance two cores.
template <typename F>
void ParallelRows(int64_t rows, int64_t cost_per_row, F&& f) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, cost_per_row));
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, rows, grain),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      for (int64_t i = r.begin(); i != r.end(); ++i) f(i);
                    });
}

namespace detail {
// One single-threaded sgemm on the calling (oneTBB) thread; a failure is a bug (bad arguments).
void SgemmOnThisThread(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                       const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                       float* c, int64_t ldc);
}  // namespace detail

}  // namespace tierzero::gpt::cpu
