#include "cpu_adam/device_adam.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "cpu_adam/gpu_adam.h"

namespace tierzero {

// Note [A modelled device Adam]
// On the simulated device a step is CpuAdam on the stream's thread, so its time is a CPU
// core's, and on this machine's two cores it competes with the CPU's own updates: schedules that
// overlap CPU and device updates cannot be studied with it. With a model rate the step takes
// max(its own time, n / rate): a stand-in for a GPU kernel that costs the host nothing beyond
// the real computation (which still runs, so results stay exact). It is a model, used by tests
// and benchmarks only (engine.host_device_adam_rate), and every figure from it is labelled.

struct DeviceAdam::Errors {
  Mutex mu;
  Status first TZ_GUARDED_BY(mu);
  void Add(Status s) {
    MutexLock l(mu);
    if (first.ok()) first = std::move(s);
  }
};

DeviceAdam::DeviceAdam(Device& device, const AdamConfig& config, const DeviceAdamOptions& options)
    : device_(device), config_(config), options_(options), errors_(std::make_shared<Errors>()) {}

DeviceAdam::~DeviceAdam() = default;

StatusOr<std::unique_ptr<DeviceAdam>> DeviceAdam::Create(Device& device, const AdamConfig& config,
                                                         const DeviceAdamOptions& options) {
  RETURN_IF_ERROR(ValidateAdamConfig(config));
  if (!(options.model_params_per_second >= 0)) {
    return InvalidArgumentError("device Adam's model rate must be >= 0");
  }
  std::unique_ptr<DeviceAdam> a(new DeviceAdam(device, config, options));
  if (device.info().kind == DeviceKind::kCuda) {
    if (options.model_params_per_second > 0) {
      return InvalidArgumentError("a modelled device Adam rate is for the simulated device only");
    }
    if (!GpuAdamBuilt()) return UnavailableError("this build has no CUDA: no GPU Adam");
    return a;
  }
  CpuAdamOptions co;
  co.threads = 1;
  ASSIGN_OR_RETURN(a->host_, CpuAdam::Create(config, co));
  return a;
}

Status DeviceAdam::StepAsync(const AdamBuffers& b, const AdamStepOptions& step,
                             StreamHandle stream) {
  if (step.step < 1) return InvalidArgumentError("adam step must be >= 1");
  if (b.n == 0) return Status::OK();
  if (b.master == nullptr || b.grad == nullptr || b.states == StateFormat::kNone ||
      (b.states == StateFormat::kF32 && (b.m == nullptr || b.v == nullptr)))
    return InvalidArgumentError("device Adam needs master, m, v and grad buffers");
  if (host_ == nullptr) return GpuAdamStepAsync(config_, step, b, stream.impl);
  AdamStepOptions so = step;
  so.observer = nullptr;  // spans are the caller's, from events
  so.skip_if_nonfinite = false;
  const double model_s =
      options_.model_params_per_second > 0
          ? std::min(1e9, b.n / options_.model_params_per_second)  // (the clock's range)
          : 0;
  return device_.LaunchHostFunc(stream, [adam = host_.get(), errors = errors_, b, so, model_s] {
    const auto t0 = std::chrono::steady_clock::now();
    // (A host function must not throw, Device::LaunchHostFunc: oneTBB's exception when a worker
    // it wakes cannot start, under `ulimit -u`, is the step's error.)
    StatusOr<bool> r = false;
    try {
      r = adam->Step(b, so);
    } catch (...) {
      r = StatusOfCurrentException();
    }
    if (!r.ok()) errors->Add(std::move(r).status().WithContext("device Adam"));
    if (model_s > 0) {
      std::this_thread::sleep_until(t0 +
                                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                        std::chrono::duration<double>(model_s)));
    }
  });
}

Status DeviceAdam::SumSquaresAsync(const void* grad, DType dtype, size_t n, double* parts,
                                   StreamHandle stream) {
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16)
    return InvalidArgumentError("a gradient's sum of squares takes fp32, bf16 or fp16");
  if (parts == nullptr || (n > 0 && grad == nullptr))
    return InvalidArgumentError("a sum of squares needs a gradient and its parts' buffer");
  if (host_ == nullptr) return GpuSumSquaresAsync(grad, dtype, n, parts, kSumParts, stream.impl);
  return device_.LaunchHostFunc(
      stream, [adam = host_.get(), errors = errors_, grad, dtype, n, parts] {
        StatusOr<double> r = 0.0;
        try {
          r = adam->SumSquares(grad, dtype, n);
        } catch (...) {
          r = StatusOfCurrentException();
        }
        if (!r.ok()) errors->Add(std::move(r).status().WithContext("device sum of squares"));
        parts[0] = r.ok() ? *r : 0.0;
        for (int i = 1; i < kSumParts; ++i) parts[i] = 0.0;
      });
}

Status DeviceAdam::TakeError() {
  MutexLock l(errors_->mu);
  Status s = std::move(errors_->first);
  errors_->first = Status::OK();
  return s;
}

}  // namespace tierzero
