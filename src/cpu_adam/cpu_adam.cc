// Note [One fused pass]
// An offloaded optimizer step is bound by memory bandwidth: per parameter it must read param,
// grad, m, v and write param, m, v, plus the 2-byte compute-dtype copy that goes to the GPU —
// 30 bytes with fp32 gradients. Each block is therefore processed once: the gradient is read in
// its own dtype (no separate unscale or cast pass), scaled by the combined loss-scale and clip
// factor, and the bf16/fp16 copy is written while the new master is still in a register, so
// nothing is read twice. Blocks are independent, so oneTBB spreads them over the arena's
// threads with no fork/join per tile; the block size keeps each work item's streams inside L2.
#include "cpu_adam/cpu_adam.h"

#include <sched.h>
#include <sys/sysinfo.h>
#include <tbb/blocked_range.h>
#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/parallel_reduce.h>
#include <tbb/task_arena.h>
#include <tbb/task_scheduler_observer.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "core/logging.h"
#include "cpu_adam/adam_kernels.h"
#include "tierzero/types.h"

namespace tierzero {

using internal::AdamBlock;
using internal::AdamKernels;
using internal::AdamScalars;

namespace {

const AdamKernels& KernelsFor(SimdLevel level, bool* native_bf16) {
  *native_bf16 = false;
  switch (level) {
    case SimdLevel::kAvx512:
      if (GetCpuFeatures().avx512_bf16) {
        *native_bf16 = true;
        return internal::kAdamAvx512Bf16;
      }
      return internal::kAdamAvx512;
    case SimdLevel::kAvx2:
      return internal::kAdamAvx2;
    case SimdLevel::kScalar:
      break;
  }
  return internal::kAdamScalar;
}

const void* Offset(const void* p, DType t, size_t i) {
  return static_cast<const uint8_t*>(p) + DTypeBytes(t, i);
}

Status CheckGradDtype(DType t) {
  if (!IsFloatType(t)) {
    return InvalidArgumentError("CpuAdam gradients must be fp32, bf16 or fp16, not " +
                                std::string(DTypeName(t)));
  }
  return Status::OK();
}

}  // namespace

Status ValidateAdamConfig(const AdamConfig& c) {
  auto bad = [](const char* field, double value, const char* range) {
    return InvalidArgumentError(std::string("adam.") + field + " = " + std::to_string(value) +
                                " is out of range; expected " + range);
  };
  if (!(c.lr >= 0) || !std::isfinite(c.lr)) return bad("lr", c.lr, "a finite value >= 0");
  if (!(c.beta1 >= 0 && c.beta1 < 1)) return bad("beta1", c.beta1, "0 <= beta1 < 1");
  if (!(c.beta2 >= 0 && c.beta2 < 1)) return bad("beta2", c.beta2, "0 <= beta2 < 1");
  if (!(c.eps > 0) || !std::isfinite(c.eps)) return bad("eps", c.eps, "a finite value > 0");
  if (!(c.weight_decay >= 0) || !std::isfinite(c.weight_decay)) {
    return bad("weight_decay", c.weight_decay, "a finite value >= 0");
  }
  return Status::OK();
}

// Note [Threads whatever the caller's affinity]
// Embedded next to OpenMP (PyTorch, or any trainer run with OMP_PROC_BIND), the process's main
// thread is bound to one core before main(). oneTBB sizes its worker pool from the creating
// thread's affinity mask, so it would give the arena no worker at all, and every worker it did
// create would inherit that one-core mask: CPU Adam would run single-threaded while saying it
// has `threads`. When the calling thread may run on fewer CPUs than the arena's threads, the
// arena therefore (1) raises oneTBB's worker limit to its thread count with a global_control
// (only then: such a control also caps any other oneTBB user in the process at the smallest
// value set), and (2) moves each worker that enters it onto every CPU the process may use (the
// online ones within the cgroup's cpuset: UsableCpus, which also sizes the default thread
// count). The calling thread keeps its own mask.
class SpreadWorkers final : public tbb::task_scheduler_observer {
 public:
  SpreadWorkers(tbb::task_arena& arena, const cpu_set_t& cpus)
      : tbb::task_scheduler_observer(arena), cpus_(cpus) {
    observe(true);
  }
  ~SpreadWorkers() override { observe(false); }
  void on_scheduler_entry(bool is_worker) override {
    if (is_worker) (void)sched_setaffinity(0, sizeof(cpus_), &cpus_);
  }

 private:
  cpu_set_t cpus_;
};

// The CPUs this process may use whatever a thread's own mask: the online ones, within the
// cgroup's cpuset when one is set (a container or a batch job given 8 of 64 CPUs must not get
// 64 threads).
cpu_set_t UsableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  const int n = std::min(get_nprocs_conf(), CPU_SETSIZE);
  for (int c = 0; c < n; ++c) CPU_SET(c, &set);
  std::FILE* f = std::fopen("/sys/fs/cgroup/cpuset.cpus.effective", "r");
  if (f == nullptr) return set;
  char buf[4096] = {};
  const bool got = std::fgets(buf, sizeof buf, f) != nullptr;
  std::fclose(f);
  if (!got) return set;
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  for (char* p = buf; *p != '\0' && *p != '\n';) {  // "0-3,8,10-11"
    char* end = nullptr;
    const long lo = std::strtol(p, &end, 10);
    if (end == p) break;
    long hi = lo;
    p = end;
    if (*p == '-') {
      hi = std::strtol(p + 1, &end, 10);
      p = end;
    }
    for (long c = std::max(lo, 0L); c <= hi && c < CPU_SETSIZE; ++c) {
      CPU_SET(static_cast<int>(c), &allowed);
    }
    if (*p == ',') ++p;
  }
  cpu_set_t both;
  CPU_AND(&both, &set, &allowed);
  return CPU_COUNT(&both) > 0 ? both : set;  // an unreadable list: the online CPUs
}

struct CpuAdam::Impl {
  Impl(int threads, const cpu_set_t& usable) : arena(threads) {
    cpu_set_t mine;
    CPU_ZERO(&mine);
    const int bound = sched_getaffinity(0, sizeof(mine), &mine) == 0 ? CPU_COUNT(&mine) : threads;
    if (bound >= threads) return;
    caller_cpus = bound;
    if (tbb::info::default_concurrency() < threads) {
      limit = std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism,
                                                    static_cast<size_t>(threads));
    }
    arena.initialize();
    spread = std::make_unique<SpreadWorkers>(arena, usable);
  }
  ~Impl() { spread.reset(); }  // stops observing before the arena goes
  std::unique_ptr<tbb::global_control> limit;
  tbb::task_arena arena;
  std::unique_ptr<SpreadWorkers> spread;
  int caller_cpus = 0;  // > 0: the caller's mask had this many CPUs, workers were spread
  const AdamKernels* kernels = nullptr;
  bool native_bf16 = false;
};

StatusOr<std::unique_ptr<CpuAdam>> CpuAdam::Create(const AdamConfig& config,
                                                   const CpuAdamOptions& options) {
  RETURN_IF_ERROR(ValidateAdamConfig(config));
  if (options.threads < 0) {
    return InvalidArgumentError("cpu_adam threads = " + std::to_string(options.threads) +
                                " is out of range; expected 0 (all) or more");
  }
  if (options.block_elems < 64 || options.block_elems % 64 != 0) {
    return InvalidArgumentError("cpu_adam block_elems = " + std::to_string(options.block_elems) +
                                " is out of range; expected a multiple of 64, at least 64");
  }
  return std::unique_ptr<CpuAdam>(new CpuAdam(config, options, ActiveSimdLevel()));
}

CpuAdam::CpuAdam(const AdamConfig& config, const CpuAdamOptions& options, SimdLevel level)
    : config_(config), options_(options), level_(level) {
  const cpu_set_t usable = UsableCpus();
  const int threads = options.threads > 0 ? options.threads : std::max(1, CPU_COUNT(&usable));
  impl_ = std::make_unique<Impl>(threads, usable);
  impl_->kernels = &KernelsFor(level, &impl_->native_bf16);
  TZ_LOG(kDebug, kAdam) << "CpuAdam: " << SimdLevelName(level)
                        << (impl_->native_bf16 ? "+bf16" : "") << ", " << threads << " threads";
}

CpuAdam::~CpuAdam() = default;

int CpuAdam::threads() const { return impl_->arena.max_concurrency(); }
int CpuAdam::caller_cpus() const { return impl_->caller_cpus; }
bool CpuAdam::native_bf16() const { return impl_->native_bf16; }

void DecodeMoments(const AdamBuffers& b, float* m, float* v) {
  using internal::kStateBlockElems;
  if (b.states == StateFormat::kNone) {  // none held: as a run that has not stepped
    std::fill(m, m + b.n, 0.0f);
    std::fill(v, v + b.n, 0.0f);
    return;
  }
  for (size_t i = 0; i < b.n; ++i) {
    if (b.states == StateFormat::kBF16) {
      m[i] = BF16ToF32Scalar(static_cast<const uint16_t*>(b.m_state)[i]);
      v[i] = BF16ToF32Scalar(static_cast<const uint16_t*>(b.v_state)[i]);
    } else if (b.states == StateFormat::kInt8) {
      m[i] = internal::DecodeM(static_cast<const uint8_t*>(b.m_state)[i],
                               b.m_scale[i / kStateBlockElems]);
      v[i] = internal::DecodeV(static_cast<const uint8_t*>(b.v_state)[i],
                               b.v_scale[i / kStateBlockElems]);
    } else {
      m[i] = b.m[i];
      v[i] = b.v[i];
    }
  }
}

void EncodeMoments(const float* m, const float* v, const AdamBuffers& b) {
  using internal::kStateBlockElems;
  constexpr uint32_t kHalf = 0x8000;           // half a step of random bits: round to nearest
  if (b.states == StateFormat::kNone) return;  // none held
  if (b.states == StateFormat::kF32) {
    std::copy(m, m + b.n, b.m);
    std::copy(v, v + b.n, b.v);
    return;
  }
  if (b.states == StateFormat::kBF16) {
    for (size_t i = 0; i < b.n; ++i) {
      static_cast<uint16_t*>(b.m_state)[i] = internal::Bf16Stochastic(m[i], kHalf);
      static_cast<uint16_t*>(b.v_state)[i] = internal::Bf16Stochastic(v[i], kHalf);
    }
    return;
  }
  for (size_t begin = 0; begin < b.n; begin += kStateBlockElems) {
    const size_t end = std::min(b.n, begin + kStateBlockElems);
    float am = 0, av = 0;
    for (size_t i = begin; i < end; ++i) {
      am = std::max(am, internal::AbsBits(m[i]));
      av = std::max(av, v[i]);
    }
    float mi, vi;
    const size_t k = begin / kStateBlockElems;
    internal::BlockScale(am, &b.m_scale[k], &mi);
    internal::BlockScale(av, &b.v_scale[k], &vi);
    for (size_t i = begin; i < end; ++i) {
      static_cast<uint8_t*>(b.m_state)[i] = internal::EncodeM(m[i], mi, kHalf);
      static_cast<uint8_t*>(b.v_state)[i] = internal::EncodeV(v[i], vi, kHalf);
    }
  }
}

internal::AdamScalars MakeAdamScalars(const AdamConfig& config, const AdamStepOptions& opt) {
  const float lr = opt.lr >= 0 ? opt.lr : config.lr;
  const double t = static_cast<double>(opt.step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(config.beta1), t);
  const double bc2 = 1.0 - std::pow(static_cast<double>(config.beta2), t);
  AdamScalars s;
  s.grad_scale = opt.grad_scale;
  s.beta1 = config.beta1;
  s.beta2 = config.beta2;
  s.one_minus_beta1 = 1.0f - config.beta1;
  s.one_minus_beta2 = 1.0f - config.beta2;
  s.eps = config.eps;
  s.step_size = static_cast<float>(lr / bc1);
  s.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  s.adamw = config.adamw;
  s.l2 = config.adamw ? 0.0f : config.weight_decay;
  s.decay = config.adamw ? 1.0f - lr * config.weight_decay : 1.0f;
  return s;
}

StatusOr<bool> CpuAdam::Step(const AdamBuffers& b, const AdamStepOptions& opt) {
  if (opt.step < 1) {
    return InvalidArgumentError("adam step = " + std::to_string(opt.step) + "; steps count from 1");
  }
  RETURN_IF_ERROR(CheckGradDtype(b.grad_dtype));
  if (b.out != nullptr && b.out_dtype != DType::kBF16 && b.out_dtype != DType::kF16) {
    return InvalidArgumentError("CpuAdam output copy must be bf16 or fp16, not " +
                                std::string(DTypeName(b.out_dtype)));
  }
  if (std::isnan(opt.lr) || std::isinf(opt.lr)) {
    return InvalidArgumentError("adam step lr = " + std::to_string(opt.lr) +
                                " is not finite (use a negative value for the configured lr)");
  }
  if (!std::isfinite(opt.grad_scale)) {
    return InvalidArgumentError("adam grad_scale = " + std::to_string(opt.grad_scale) +
                                " is not finite");
  }
  if (b.n == 0) return true;
  if (b.master == nullptr || b.grad == nullptr) {
    return InvalidArgumentError("CpuAdam::Step needs master and grad buffers");
  }
  switch (b.states) {
    case StateFormat::kF32:
      if (b.m == nullptr || b.v == nullptr)
        return InvalidArgumentError("CpuAdam::Step with fp32 moments needs m and v");
      break;
    case StateFormat::kBF16:
    case StateFormat::kInt8:
      if (b.m_state == nullptr || b.v_state == nullptr ||
          (b.states == StateFormat::kInt8 && (b.m_scale == nullptr || b.v_scale == nullptr))) {
        return InvalidArgumentError("CpuAdam::Step with " + std::string(StateFormatName(b.states)) +
                                    " moments needs their buffers" +
                                    (b.states == StateFormat::kInt8 ? " and scales" : ""));
      }
      break;
    default:
      return InvalidArgumentError("CpuAdam::Step: unknown moment format");
  }
  if (opt.skip_if_nonfinite) {
    ASSIGN_OR_RETURN(bool finite, AllFinite(b.grad, b.grad_dtype, b.n));
    if (!finite) return false;
  }

  const AdamScalars s = MakeAdamScalars(config_, opt);

  const AdamKernels& k = *impl_->kernels;
  const size_t block = options_.block_elems;
  const size_t blocks = (b.n + block - 1) / block;
  const uint32_t step_mix = internal::StepMix(opt.step);
  Observer* tl = opt.observer;
  impl_->arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, blocks), [&](const tbb::blocked_range<size_t>& r) {
          const double t0 = tl != nullptr ? tl->Now() : 0.0;
          uint64_t elems = 0;
          for (size_t blk = r.begin(); blk != r.end(); ++blk) {
            const size_t begin = blk * block;
            elems += std::min(block, b.n - begin);
            AdamBlock ab;
            ab.master = b.master + begin;
            ab.m = b.m == nullptr ? nullptr : b.m + begin;
            ab.v = b.v == nullptr ? nullptr : b.v + begin;
            ab.grad = Offset(b.grad, b.grad_dtype, begin);
            ab.grad_dtype = b.grad_dtype;
            ab.out = b.out == nullptr ? nullptr : static_cast<uint16_t*>(b.out) + begin;
            ab.out_dtype = b.out_dtype;
            ab.n = std::min(block, b.n - begin);
            ab.key = b.rounding_key + static_cast<uint32_t>(begin);
            ab.step_mix = step_mix;
            switch (b.states) {
              case StateFormat::kF32:
                k.step(ab, s);
                break;
              case StateFormat::kBF16:
                ab.qm = static_cast<uint16_t*>(b.m_state) + begin;
                ab.qv = static_cast<uint16_t*>(b.v_state) + begin;
                k.step_bf16_states(ab, s);
                break;
              case StateFormat::kInt8:
                // block is a multiple of kStateBlockElems: every 8-bit block is one call's.
                ab.qm = static_cast<uint8_t*>(b.m_state) + begin;
                ab.qv = static_cast<uint8_t*>(b.v_state) + begin;
                ab.m_scale = b.m_scale + begin / internal::kStateBlockElems;
                ab.v_scale = b.v_scale + begin / internal::kStateBlockElems;
                k.step_int8_states(ab, s);
                break;
              case StateFormat::kNone:  // (refused above)
                break;
            }
          }
          if (tl != nullptr) {
            TimelineEvent e;
            e.track = Track::kOptimizer;
            e.name = "Adam chunk " + std::to_string(opt.chunk);
            e.start_s = t0;
            e.dur_s = tl->Now() - t0;
            e.chunk = opt.chunk;
            e.bytes = elems * 4 + 2 * MomentBytes(b.states, elems);  // master, m, v
            e.lane = tbb::this_task_arena::current_thread_index() + 1;
            tl->OnSpan(std::move(e));
          }
        });
  });
  return true;
}

StatusOr<bool> CpuAdam::AllFinite(const void* grad, DType dtype, size_t n) {
  RETURN_IF_ERROR(CheckGradDtype(dtype));
  if (n == 0) return true;
  if (grad == nullptr) return InvalidArgumentError("AllFinite on a null gradient");
  const AdamKernels& k = *impl_->kernels;
  const size_t block = options_.block_elems * 4;
  const size_t blocks = (n + block - 1) / block;
  std::atomic<bool> finite{true};
  impl_->arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, blocks), [&](const tbb::blocked_range<size_t>& r) {
          for (size_t blk = r.begin(); blk != r.end() && finite.load(std::memory_order_relaxed);
               ++blk) {
            const size_t begin = blk * block;
            if (!k.all_finite(Offset(grad, dtype, begin), dtype, std::min(block, n - begin))) {
              finite.store(false, std::memory_order_relaxed);
            }
          }
        });
  });
  return finite.load();
}

StatusOr<double> CpuAdam::SumSquares(const void* grad, DType dtype, size_t n) {
  RETURN_IF_ERROR(CheckGradDtype(dtype));
  if (n == 0) return 0.0;
  if (grad == nullptr) return InvalidArgumentError("SumSquares on a null gradient");
  const AdamKernels& k = *impl_->kernels;
  const size_t block = options_.block_elems * 4;
  const size_t blocks = (n + block - 1) / block;
  // Per-block partial sums added in block order: the result does not depend on the thread count.
  std::vector<double> partial(blocks);
  impl_->arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, blocks), [&](const tbb::blocked_range<size_t>& r) {
          for (size_t blk = r.begin(); blk != r.end(); ++blk) {
            const size_t begin = blk * block;
            partial[blk] =
                k.sum_squares(Offset(grad, dtype, begin), dtype, std::min(block, n - begin));
          }
        });
  });
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace tierzero
