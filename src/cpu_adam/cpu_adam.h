// CpuAdam: Adam and AdamW over CPU-resident fp32 shards in one fused, vectorised pass per block.
//
// For each element, with g the gradient read as fp32 (from fp32, bf16 or fp16) and t the
// 1-based step, exactly as torch.optim.Adam / torch.optim.AdamW (amsgrad=False, maximize=False):
//
//   g  = grad * grad_scale                    grad_scale = clip_coef / loss_scale
//   g  = g + weight_decay * p                 Adam only (L2 penalty added to the gradient)
//   p  = p * (1 - lr * weight_decay)          AdamW only (decoupled decay), before the update
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g^2
//   p  = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   out = round_to_nearest_even(p) as bf16 or fp16, when an output buffer is given
//
// Arithmetic is fp32 with fused multiply-adds in a fixed order, identical on the scalar, AVX2 and
// AVX-512 paths (they agree bit for bit; the tests check it), except that the AVX512-BF16 path
// converts the output with VCVTNEPS2BF16, which turns fp32 denormal masters into signed zero
// (the last n % 16 elements of a block, done by the scalar tail, are rounded as denormals).
// See Note [One fused pass] in cpu_adam.cc.
//
// Thread-safety: a CpuAdam holds only its configuration and a oneTBB arena; Step, AllFinite and
// SumSquares may be called concurrently from several threads on distinct buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "core/cpu_features.h"
#include "core/state_format.h"
#include "core/status.h"
#include "profiler/observer.h"
#include "tierzero/types.h"

namespace tierzero {

struct AdamConfig {
  float lr = 1e-3f;           // Default: 1e-3
  float beta1 = 0.9f;         // Default: 0.9
  float beta2 = 0.999f;       // Default: 0.999
  float eps = 1e-8f;          // Default: 1e-8
  float weight_decay = 0.0f;  // Default: 0
  bool adamw = false;         // false: Adam (L2 into the gradient); true: AdamW (decoupled)
};

// Validates a config: finite lr >= 0, 0 <= beta < 1, eps > 0, weight_decay >= 0.
Status ValidateAdamConfig(const AdamConfig& config);

struct CpuAdamOptions {
  // Threads for one call; 0 means every CPU the process may use (online, within its cgroup's
  // cpuset), whatever the calling thread's affinity
  // (Note [Threads whatever the caller's affinity] in cpu_adam.cc). Default: 0.
  int threads = 0;
  // Elements per work item. Default: 16384 (~300 KiB of traffic: the block's streams fit in L2).
  size_t block_elems = 16384;
};

// One shard's buffers for a step. All element counts are n.
struct AdamBuffers {
  float* master = nullptr;     // fp32 master weights, updated in place
  float* m = nullptr;          // first moment, updated in place
  float* v = nullptr;          // second moment, updated in place
  const void* grad = nullptr;  // gradient, read only
  DType grad_dtype = DType::kF32;
  void* out = nullptr;  // optional compute-dtype copy of the new master (pinned slot)
  DType out_dtype = DType::kBF16;
  size_t n = 0;
  // Compressed moments (m and v above unused): kBF16, n bf16 values each in m_state and v_state;
  // kInt8, n codes each and StateScaleCount(n) scales each in m_scale and v_scale (blocks from
  // the buffers' start). `rounding_key`: the first element's key for stochastic rounding, unique
  // to its place in the chunk layout (Note [Stochastic rounding of the moments]).
  StateFormat states = StateFormat::kF32;
  void* m_state = nullptr;
  void* v_state = nullptr;
  float* m_scale = nullptr;
  float* v_scale = nullptr;
  uint32_t rounding_key = 0;
};

struct AdamStepOptions {
  int64_t step = 1;         // 1-based step count t, for bias correction
  float grad_scale = 1.0f;  // 1/loss_scale times the clip coefficient
  float lr = -1.0f;         // this step's learning rate (schedules); < 0 uses config.lr
  // Check the gradient for Inf/NaN first and, if any, leave every buffer untouched and return
  // false. Default: false (the engine checks all gradients once before any shard's update).
  bool skip_if_nonfinite = false;
  // When set, every range of blocks a worker thread updates is reported as a span on the
  // optimizer track, lane = the thread's index in the arena + 1 (the report's per-thread CPU Adam
  // rows), labelled with `chunk`. Default: none.
  Observer* observer = nullptr;
  int chunk = -1;
};

// The moments of b.n elements held as `b` holds them (b.states, b.m_state, b.v_state and the
// scales) to fp32 `m` and `v`, and fp32 values back into that form (8-bit: each block's scale from
// its values, codes rounded to nearest): checkpoints and parameter writes see fp32 moments.
// Decoding then encoding gives the same bits back.
void DecodeMoments(const AdamBuffers& b, float* m, float* v);
void EncodeMoments(const float* m, const float* v, const AdamBuffers& b);

// The per-step scalars every Adam path (CPU and GPU) uses: bias corrections, decay, scale.
namespace internal {
struct AdamScalars;
}
internal::AdamScalars MakeAdamScalars(const AdamConfig& config, const AdamStepOptions& step);

class CpuAdam {
 public:
  // InvalidArgument naming the field for a bad config or options.
  static StatusOr<std::unique_ptr<CpuAdam>> Create(const AdamConfig& config,
                                                   const CpuAdamOptions& options = {});
  ~CpuAdam();

  // Runs one Adam/AdamW step over the buffers. Returns true when the step was applied, false
  // when skip_if_nonfinite found a non-finite gradient (nothing was written).
  // InvalidArgument for null buffers, n > 0 with a bad dtype, or step < 1.
  // REQUIRES: master, m, v, grad and out do not overlap.
  StatusOr<bool> Step(const AdamBuffers& buffers, const AdamStepOptions& step);

  // True when every gradient element is finite.
  StatusOr<bool> AllFinite(const void* grad, DType dtype, size_t n);
  // Sum of squares of the gradient, accumulated in double (for the global gradient norm).
  StatusOr<double> SumSquares(const void* grad, DType dtype, size_t n);

  const AdamConfig& config() const { return config_; }
  int threads() const;
  // > 0 when the creating thread was bound to fewer CPUs than threads(): how many. The workers
  // then run on every online CPU (Note [Threads whatever the caller's affinity]).
  int caller_cpus() const;
  // The SIMD path this instance runs (ActiveSimdLevel() at creation).
  SimdLevel simd_level() const { return level_; }
  // True when the output cast uses AVX512-BF16's VCVTNEPS2BF16.
  bool native_bf16() const;

 private:
  CpuAdam(const AdamConfig& config, const CpuAdamOptions& options, SimdLevel level);
  struct Impl;
  AdamConfig config_;
  CpuAdamOptions options_;
  SimdLevel level_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tierzero
