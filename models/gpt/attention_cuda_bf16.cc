// gpt/attention_cuda_bf16.h: which attention the bf16 backend runs, shape by shape.
//
// Note [Which attention runs]
// TZ_GPT_ATTENTION picks the bf16 backend's attention: "auto" (the default) runs cuDNN's fused
// attention (gpt/cudnn_attention.h) with its repeatable backward for every shape it has a plan
// for, and the fused kernels (gpt/flash_attention_cuda.h) where cuDNN cannot be loaded, has no
// GPU handle, refuses the shape, fails to run it or disagrees with the kernels (below); "cudnn"
// insists on cuDNN (each of those an error naming what went wrong), "cudnn-fast" too, with the
// backward that accumulates dQ with atomics (faster, not bit-for-bit repeatable); "kernels" runs
// the fused kernels. The two keep the same state (log-sum-exps), so the choice is per shape and
// both directions of a shape take the same one, and a shape can leave cuDNN between its forward
// and its backward. The run's summary and report say which ran (Backend::AttentionSummary).
//
// Note [cuDNN checked against the fused kernels]
// cuDNN's attention is a graph we build by hand (gpt/cudnn_graph.cc), run by engines chosen at
// run time from whatever cuDNN the machine has; a mistake in a stride or a mask would not fail,
// it would train on wrong numbers. So the first forward and the first backward of each shape
// also run the fused kernels (proved against fp64 on the GPU) into buffers of their own, and
// compare norm-wise: ||cuDNN - kernels|| / ||kernels|| at most 3e-2 for the output and each
// gradient and 1e-3 for the log-sum-exps (each side is within 8e-3 of fp64 in the tests; a
// wrong stride, head or mask is off by order 1). Where they disagree, the kernels' results
// replace cuDNN's before anything reads them, the shape runs the kernels from then on, and the
// summary gives the figures. The check costs one more attention and a wait for the GPU, once
// per shape in the first iteration (never again: the iteration that follows has no host round
// trip); its largest differences are in the run's closing `compute:` line. A device too full
// for the check's buffers (about the size of q, k, v and out) runs cuDNN unchecked and says so.
#include "gpt/attention_cuda_bf16.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "gpt/backend.h"
#include "gpt/distance_cuda.h"
#ifdef TZ_GPT_CUDNN
#include "gpt/cudnn_attention.h"
#endif

namespace tierzero::gpt::cuda {

#ifndef TZ_GPT_CUDNN
// This build has no cuDNN attention (the toolkit lacked cuDNN 9's headers): never created.
class CudnnAttention {
 public:
  Status Prepare(const FlashShape&) { return UnavailableError("built without cuDNN"); }
  Status Forward(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*,
                 float*, const FlashShape&) {
    return UnavailableError("built without cuDNN");
  }
  Status Backward(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                  const __nv_bfloat16*, const __nv_bfloat16*, const float*, __nv_bfloat16*,
                  __nv_bfloat16*, __nv_bfloat16*, const FlashShape&) {
    return UnavailableError("built without cuDNN");
  }
  std::string Version() const { return {}; }
};
#endif

namespace {

using bf16 = __nv_bfloat16;

constexpr double kOutputTolerance = 3e-2;  // the output and each gradient, norm-wise
constexpr double kStateTolerance = 1e-3;   // the log-sum-exps

// ||a - b|| / ||b|| from the two sums; a NaN or infinity is infinitely far.
double Relative(double diff, double ref) {
  if (!std::isfinite(diff) || !std::isfinite(ref)) return INFINITY;
  if (ref <= 0) return diff <= 0 ? 0.0 : INFINITY;
  return std::sqrt(diff / ref);
}

std::string Figure(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1e", x);
  return b;
}

std::string Describe(const FlashShape& s) {
  return "B " + std::to_string(s.batch) + " T " + std::to_string(s.seq) + " heads " +
         std::to_string(s.heads) + "/" + std::to_string(s.kv_heads) + " x " +
         std::to_string(s.head_dim);
}

// The check's device memory, freed when it goes out of scope. Not stream-ordered: the check waits
// for the stream anyway, and memory left in the stream's pool would shrink what the next shape's
// plan sees free in the same iteration. cudaFree waits for the device.
class Temp {
 public:
  Temp() = default;
  Temp(const Temp&) = delete;
  Temp& operator=(const Temp&) = delete;
  ~Temp() {
    if (p_ != nullptr) cudaFree(p_);
  }
  template <typename T>
  T* Get(int64_t bytes) {
    if (cudaMalloc(&p_, static_cast<size_t>(bytes)) != cudaSuccess) {
      cudaGetLastError();
      p_ = nullptr;
    }
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::OK();
  return InternalError(std::string(what) + ": " + cudaGetErrorString(e));
}

// Reads n sums back (the stream waits for everything enqueued before).
Status ReadSums(const double* device, double* host, int n, cudaStream_t stream) {
  TZ_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(host, device, sizeof(double) * n, cudaMemcpyDeviceToHost, stream),
                 "attention check: reading the sums"));
  return CudaStatus(cudaStreamSynchronize(stream), "attention check");
}

// rows of `width` bf16 elements, `ld` apart.
Status Copy2D(bf16* dst, const bf16* src, int64_t ld, int64_t width, int64_t rows,
              cudaStream_t stream) {
  const size_t pitch = sizeof(bf16) * static_cast<size_t>(ld);
  return CudaStatus(cudaMemcpy2DAsync(dst, pitch, src, pitch, sizeof(bf16) * width, rows,
                                      cudaMemcpyDeviceToDevice, stream),
                    "attention check: taking the kernels' results");
}

}  // namespace

Bf16Attention::Bf16Attention(cudaStream_t stream, Choice choice,
                             std::unique_ptr<CudnnAttention> cudnn, std::string no_cudnn)
    : stream_(stream), choice_(choice), cudnn_(std::move(cudnn)), no_cudnn_(std::move(no_cudnn)) {}

Bf16Attention::~Bf16Attention() = default;

StatusOr<std::unique_ptr<Bf16Attention>> Bf16Attention::Create(cudaStream_t stream) {
  TZ_ASSIGN_OR_RETURN(const std::string v, AttentionChoice());  // (gpt/backend.h)
  const Choice choice = v == "cudnn"        ? Choice::kCudnn
                        : v == "cudnn-fast" ? Choice::kCudnnFast
                        : v == "kernels"    ? Choice::kKernels
                                            : Choice::kAuto;
  std::unique_ptr<CudnnAttention> cudnn;
  std::string no_cudnn = "TZ_GPT_ATTENTION=kernels";
  if (choice != Choice::kKernels) {
#ifdef TZ_GPT_CUDNN
    auto c = CudnnAttention::Create(stream, choice != Choice::kCudnnFast);
    if (c.ok()) {
      cudnn = std::move(*c);
    } else {
      if (choice != Choice::kAuto)
        return c.status().WithContext("TZ_GPT_ATTENTION asks for cuDNN's attention");
      no_cudnn = c.status().ToString();
    }
#else
    if (choice != Choice::kAuto)
      return UnsupportedError(
          "TZ_GPT_ATTENTION asks for cuDNN's attention; this build has none "
          "(the CUDA Toolkit it was built with lacked cuDNN 9's headers)");
    no_cudnn = "this build has no cuDNN attention";
#endif
  }
  return std::unique_ptr<Bf16Attention>(
      new Bf16Attention(stream, choice, std::move(cudnn), std::move(no_cudnn)));
}

StatusOr<Bf16Attention::Use*> Bf16Attention::Choose(const FlashShape& s) {
  const auto key = std::make_tuple(s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, s.ld_q, s.ld_k,
                                   s.ld_v, s.ld_o);
  if (auto it = shapes_.find(key); it != shapes_.end()) return &it->second;
  Use use;
  if (cudnn_ != nullptr) {
    const auto t0 = std::chrono::steady_clock::now();
    const Status st = cudnn_->Prepare(s);
    plan_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!st.ok() && choice_ != Choice::kAuto)
      return st.WithContext("TZ_GPT_ATTENTION asks for cuDNN's attention");
    if (!st.ok() && left_.empty()) left_ = st.ToString();
    use.cudnn = st.ok();
  }
  ++(use.cudnn ? cudnn_shapes_ : kernel_shapes_);
  return &shapes_.emplace(key, use).first->second;
}

Status Bf16Attention::LeaveCudnn(Use& use, const Status& why) {
  if (choice_ != Choice::kAuto)
    return why.WithContext("TZ_GPT_ATTENTION asks for cuDNN's attention");
  if (use.cudnn) {
    use.cudnn = false;
    --cudnn_shapes_;
    ++kernel_shapes_;
  }
  if (left_.empty()) left_ = why.ToString();
  return Status::OK();
}

Status Bf16Attention::KernelsForward(const bf16* q, const bf16* k, const bf16* v, bf16* out,
                                     float* lse, const FlashShape& s) {
  return CudaStatus(FlashAttentionForward(q, k, v, out, lse, s, stream_),
                    "FlashAttentionForward (bf16)");
}

Status Bf16Attention::KernelsBackward(const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                                      const bf16* out, const float* lse, bf16* dq, bf16* dk,
                                      bf16* dv, const FlashShape& s) {
  Status err;
  float* rowdot = rowdot_.Get(s.batch * s.heads * s.seq, stream_, &err);
  if (rowdot == nullptr) return err;
  return CudaStatus(FlashAttentionBackward(dout, q, k, v, out, lse, rowdot, dq, dk, dv, s, stream_),
                    "FlashAttentionBackward (bf16)");
}

Status Bf16Attention::Forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse,
                              const FlashShape& s) {
  TZ_ASSIGN_OR_RETURN(Use * chosen, Choose(s));
  Use& use = *chosen;
  if (use.cudnn) {
    const Status st = cudnn_->Forward(q, k, v, out, lse, s);
    if (!st.ok()) {
      TZ_RETURN_IF_ERROR(
          LeaveCudnn(use, st.WithContext("cuDNN's attention forward at " + Describe(s))));
    } else if (!use.forward_checked) {
      use.forward_checked = true;
      return CheckForward(use, q, k, v, out, lse, s);
    } else {
      return Status::OK();
    }
  }
  return KernelsForward(q, k, v, out, lse, s);
}

Status Bf16Attention::Backward(const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                               const bf16* out, const float* lse, bf16* dq, bf16* dk, bf16* dv,
                               const FlashShape& s) {
  TZ_ASSIGN_OR_RETURN(Use * chosen, Choose(s));
  Use& use = *chosen;
  if (use.cudnn) {
    const Status st = cudnn_->Backward(dout, q, k, v, out, lse, dq, dk, dv, s);
    if (!st.ok()) {
      TZ_RETURN_IF_ERROR(
          LeaveCudnn(use, st.WithContext("cuDNN's attention backward at " + Describe(s))));
    } else if (!use.backward_checked) {
      use.backward_checked = true;
      return CheckBackward(use, dout, q, k, v, out, lse, dq, dk, dv, s);
    } else {
      return Status::OK();
    }
  }
  return KernelsBackward(dout, q, k, v, out, lse, dq, dk, dv, s);
}

Status Bf16Attention::CheckForward(Use& use, const bf16* q, const bf16* k, const bf16* v, bf16* out,
                                   float* lse, const FlashShape& s) {
  const int64_t rows = s.batch * s.seq, width = s.heads * s.head_dim;
  const int64_t states = s.batch * s.heads * s.seq;
  Temp out_t, lse_t, sums_t;
  bf16* kout = out_t.Get<bf16>(static_cast<int64_t>(sizeof(bf16)) * rows * s.ld_o);
  float* klse = lse_t.Get<float>(static_cast<int64_t>(sizeof(float)) * states);
  double* sums = sums_t.Get<double>(4 * sizeof(double));
  if (kout == nullptr || klse == nullptr || sums == nullptr) {
    if (unchecked_.empty()) unchecked_ = "no device memory for it at " + Describe(s);
    return Status::OK();
  }
  TZ_RETURN_IF_ERROR(KernelsForward(q, k, v, kout, klse, s));
  TZ_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(sums, 0, 4 * sizeof(double), stream_),
                                "attention check: clearing the sums"));
  TZ_RETURN_IF_ERROR(
      CudaStatus(AddSquaredDistance(out, s.ld_o, kout, s.ld_o, rows, width, sums, stream_),
                 "attention check"));
  TZ_RETURN_IF_ERROR(
      CudaStatus(AddSquaredDistance(lse, states, klse, states, 1, states, sums + 2, stream_),
                 "attention check"));
  double h[4];
  TZ_RETURN_IF_ERROR(ReadSums(sums, h, 4, stream_));
  if (!std::isfinite(h[1]) || !std::isfinite(h[3])) {
    // The kernels' own result is not finite (so are the inputs, most likely): nothing to judge
    // cuDNN by.
    if (unchecked_.empty()) unchecked_ = "the kernels' own result is not finite at " + Describe(s);
    return Status::OK();
  }
  const double d_out = Relative(h[0], h[1]), d_lse = Relative(h[2], h[3]);
  if (d_out <= kOutputTolerance && d_lse <= kStateTolerance) {
    forward_checks_ = true;
    worst_forward_ = std::max({worst_forward_, d_out, d_lse});
    return Status::OK();
  }
  // The kernels' results replace cuDNN's (stream-ordered before anything reads them).
  TZ_RETURN_IF_ERROR(Copy2D(out, kout, s.ld_o, width, rows, stream_));
  TZ_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(lse, klse, sizeof(float) * states, cudaMemcpyDeviceToDevice, stream_),
      "attention check: taking the kernels' results"));
  return LeaveCudnn(
      use,
      InternalError("cuDNN's attention forward at " + Describe(s) +
                    " disagrees with the fused kernels: relative difference " + Figure(d_out) +
                    " in the output (at most " + Figure(kOutputTolerance) + "), " + Figure(d_lse) +
                    " in the log-sum-exps (at most " + Figure(kStateTolerance) + ")"));
}

Status Bf16Attention::CheckBackward(Use& use, const bf16* dout, const bf16* q, const bf16* k,
                                    const bf16* v, const bf16* out, const float* lse, bf16* dq,
                                    bf16* dk, bf16* dv, const FlashShape& s) {
  const int64_t rows = s.batch * s.seq;
  const int64_t wq = s.heads * s.head_dim, wkv = s.kv_heads * s.head_dim;
  // The three gradients' extents; GPT-2's are views of one [dq | dk | dv] buffer, which the
  // kernels' copy then mirrors (one buffer the size of the real one, not three).
  struct Extent {
    bf16* p;
    int64_t ld, width, bytes;
  };
  auto extent = [&](bf16* p, int64_t ld, int64_t width) {
    return Extent{p, ld, width, static_cast<int64_t>(sizeof(bf16)) * ((rows - 1) * ld + width)};
  };
  const Extent e[3] = {extent(dq, s.ld_q, wq), extent(dk, s.ld_k, wkv), extent(dv, s.ld_v, wkv)};
  auto lo = reinterpret_cast<uintptr_t>(e[0].p), hi = lo;
  int64_t total = 0;
  for (const Extent& x : e) {
    lo = std::min(lo, reinterpret_cast<uintptr_t>(x.p));
    hi = std::max(hi, reinterpret_cast<uintptr_t>(x.p) + static_cast<uintptr_t>(x.bytes));
    total += x.bytes;
  }
  Temp one, t0, t1, t2, sums_t;
  bf16* kq = nullptr;
  bf16* kk = nullptr;
  bf16* kv = nullptr;
  if (static_cast<int64_t>(hi - lo) <= total) {
    if (auto* base = one.Get<char>(static_cast<int64_t>(hi - lo)); base != nullptr) {
      kq = reinterpret_cast<bf16*>(base + (reinterpret_cast<uintptr_t>(dq) - lo));
      kk = reinterpret_cast<bf16*>(base + (reinterpret_cast<uintptr_t>(dk) - lo));
      kv = reinterpret_cast<bf16*>(base + (reinterpret_cast<uintptr_t>(dv) - lo));
    }
  } else {
    kq = t0.Get<bf16>(e[0].bytes);
    kk = t1.Get<bf16>(e[1].bytes);
    kv = t2.Get<bf16>(e[2].bytes);
  }
  double* sums = sums_t.Get<double>(6 * sizeof(double));
  if (kq == nullptr || kk == nullptr || kv == nullptr || sums == nullptr) {
    if (unchecked_.empty()) unchecked_ = "no device memory for it at " + Describe(s);
    return Status::OK();
  }
  TZ_RETURN_IF_ERROR(KernelsBackward(dout, q, k, v, out, lse, kq, kk, kv, s));
  TZ_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(sums, 0, 6 * sizeof(double), stream_),
                                "attention check: clearing the sums"));
  bf16* const mine[3] = {kq, kk, kv};
  for (int i = 0; i < 3; ++i)
    TZ_RETURN_IF_ERROR(CudaStatus(AddSquaredDistance(e[i].p, e[i].ld, mine[i], e[i].ld, rows,
                                                     e[i].width, sums + 2 * i, stream_),
                                  "attention check"));
  double h[6];
  TZ_RETURN_IF_ERROR(ReadSums(sums, h, 6, stream_));
  if (!std::isfinite(h[1]) || !std::isfinite(h[3]) || !std::isfinite(h[5])) {
    if (unchecked_.empty()) unchecked_ = "the kernels' own result is not finite at " + Describe(s);
    return Status::OK();
  }
  const double d[3] = {Relative(h[0], h[1]), Relative(h[2], h[3]), Relative(h[4], h[5])};
  if (d[0] <= kOutputTolerance && d[1] <= kOutputTolerance && d[2] <= kOutputTolerance) {
    backward_checks_ = true;
    worst_backward_ = std::max({worst_backward_, d[0], d[1], d[2]});
    return Status::OK();
  }
  for (int i = 0; i < 3; ++i)
    TZ_RETURN_IF_ERROR(Copy2D(e[i].p, mine[i], e[i].ld, e[i].width, rows, stream_));
  return LeaveCudnn(
      use, InternalError("cuDNN's attention backward at " + Describe(s) +
                         " disagrees with the fused kernels: relative difference " + Figure(d[0]) +
                         " in dq, " + Figure(d[1]) + " in dk, " + Figure(d[2]) +
                         " in dv (at most " + Figure(kOutputTolerance) + ")"));
}

std::string Bf16Attention::Summary() const {
  if (cudnn_ == nullptr) return "the fused attention kernels (" + no_cudnn_ + ")";
  if (cudnn_shapes_ == 0 && kernel_shapes_ == 0)
    return cudnn_->Version() + " fused attention where cuDNN has a plan, else the fused kernels";
  if (cudnn_shapes_ == 0) return "the fused attention kernels (" + left_ + ")";
  std::string out = cudnn_->Version() + " fused attention";
  if (choice_ == Choice::kCudnnFast) out += " (dQ accumulated with atomics: not repeatable)";
  char planned[64];
  std::snprintf(planned, sizeof planned, ", %d shape%s planned in %.1f s", cudnn_shapes_,
                cudnn_shapes_ == 1 ? "" : "s", plan_seconds_);
  out += planned;
  if (forward_checks_ || backward_checks_) {
    out += ", agreeing with the fused kernels at first use (relative difference ";
    if (forward_checks_) out += Figure(worst_forward_) + " forward";
    if (forward_checks_ && backward_checks_) out += ", ";
    if (backward_checks_) out += Figure(worst_backward_) + " backward";
    out += ")";
  }
  if (!unchecked_.empty()) out += "; a check skipped (" + unchecked_ + ")";
  if (kernel_shapes_ > 0) out += "; the fused kernels elsewhere (" + left_ + ")";
  return out;
}

}  // namespace tierzero::gpt::cuda
