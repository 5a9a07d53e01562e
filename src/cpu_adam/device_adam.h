// DeviceAdam: one Adam/AdamW step over buffers in a Device's memory, queued on one of its streams
// (DESIGN.md section 7: sub-groups updated on the device). On a GPU it is the CUDA kernel of
// gpu_adam.h; on the simulated device (HostSim) it is CpuAdam run by the stream's own thread, so
// the engine's update schedule (copies, events, buffer reuse) is the same code on both. Every
// path has CpuAdam's element math, so a group updated here equals one updated on the CPU bit for
// bit (one exception, from cpu_adam.h: the AVX512-BF16 CPU path turns denormal masters into zero
// in the bf16 copy; the GPU kernel rounds them as the scalar path does).
//
// A model for studying schedules (HostSim only, Note [A modelled device Adam]): with
// `model_params_per_second` > 0 each step occupies its stream for at least n / rate seconds, as
// a GPU's kernel would, whatever the host thread took. Figures that depend on it say so.
//
// Thread-safety: StepAsync may be called from any thread; the steps run on their streams.
#pragma once

#include <memory>

#include "core/mutex.h"
#include "core/status.h"
#include "cpu_adam/cpu_adam.h"
#include "offload/device.h"

namespace tierzero {

struct DeviceAdamOptions {
  // HostSim only: a modelled device rate in parameters per second (0: the stream thread's own
  // speed). Unsupported on a GPU. Default: 0.
  double model_params_per_second = 0;
};

class DeviceAdam {
 public:
  // Unavailable on a CUDA device in a build without CUDA; InvalidArgument for a bad config or a
  // model rate on a GPU.
  static StatusOr<std::unique_ptr<DeviceAdam>> Create(Device& device, const AdamConfig& config,
                                                      const DeviceAdamOptions& options = {});
  ~DeviceAdam();

  // Queues one step over `buffers` (every pointer in device memory; master, m, v, grad and out do
  // not overlap) on `stream`. InvalidArgument before anything is queued for bad buffers or
  // options; a failure while it runs comes back from TakeError after the stream is synchronised.
  Status StepAsync(const AdamBuffers& buffers, const AdamStepOptions& step, StreamHandle stream);
  // The sum of squares of grad[0, n) (fp32, bf16 or fp16 in device memory; for the global
  // gradient norm of gradient shards kept on the device), queued on `stream` as kSumParts
  // doubles written to `parts` (device memory) whose sum in index order is the result: fixed
  // partial sums, the same on every run (on the simulated device the first holds CpuAdam's
  // SumSquares, the others 0). InvalidArgument for a bad dtype or null buffers.
  static constexpr int kSumParts = 256;
  Status SumSquaresAsync(const void* grad, DType dtype, size_t n, double* parts,
                         StreamHandle stream);
  // The first error a queued step met since the last call (OK when none).
  Status TakeError();

  const AdamConfig& config() const { return config_; }

 private:
  DeviceAdam(Device& device, const AdamConfig& config, const DeviceAdamOptions& options);
  Device& device_;
  AdamConfig config_;
  DeviceAdamOptions options_;
  std::unique_ptr<CpuAdam> host_;  // HostSim: one thread, on the stream's own thread
  struct Errors;
  std::shared_ptr<Errors> errors_;
};

}  // namespace tierzero
