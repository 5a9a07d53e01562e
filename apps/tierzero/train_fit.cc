// What a run on the simulated device will need, predicted at its set-up from the model's own
// trace (Note [A run that cannot fit, said at its set-up]).
#include <algorithm>
#include <string>

#include "plan_search.h"
#include "tierzero/bytes.h"
#include "tierzero/devices.h"
#include "tierzero/plan.h"
#include "train.h"

namespace tierzero::app {

// Note [A run that cannot fit, said at its set-up]
// A device budget too small for the model's activations was found at the first training
// iteration: after the step-0 evaluation and a warm-up forward and backward (seconds to hours),
// with the same words `tierzero plan` says in a tenth of a second (hunt 49). And on the
// simulated device, whose memory is host memory, a run whose activations pass a memory limit
// (a cgroup's) was ended by the kernel's OOM killer without a word: the engine's own count
// (Note [Host memory within the process's limit], src/engine/setup.cc) knows the chunks, not
// the activations. So train plans its own run (Engine::Plan on the model's derived trace, as
// `tierzero plan` does) before it evaluates, and refuses:
// - a run whose device cannot hold one iteration: the plan's own error, where it failed to
//   schedule the iteration or its peak is past the device's capacity (not where only the room a
//   plan keeps against fragmentation is short: such a run often trains);
// - a run whose host tier and simulated device together pass the process's limit (on several
//   ranks, the ranks on this machine together: two ranks each within the limit, together past
//   it, were ended by the OOM killer).
// Only on the simulated device: its memory does not depend on the rates (auto streams nothing
// to it), and a GPU's activations are the GPU backend's, not yet proven against a plan. A plan
// that cannot be made says nothing here: the run finds what it finds.
Status CheckPredictedFit(const RunConfig& cfg, int world, int local_ranks) {
  const bool sim = cfg.engine.device == DeviceChoice::kHost ||
                   (cfg.engine.device == DeviceChoice::kAuto && GpuCount() == 0);
  if (!sim) return Status::OK();
  // (Memory alone is read: any rates will do. The simulated device shares the CPU's cores.)
  MachineRates rates;
  rates.name = "set-up check";
  rates.cpu_adam_params_per_s = rates.device_adam_params_per_s = 1e9;
  rates.h2d_bytes_per_s = rates.d2h_bytes_per_s = 1e10;
  rates.nvme_read_bytes_per_s = rates.nvme_write_bytes_per_s = 1e9;
  rates.device_shares_cpu = true;
  // As `tierzero plan` plans it (Planner::Run: the model's derived trace, Engine::Plan).
  const Planner planner{cfg.ranks.ranks_per_node, rates, {}, 0.0, nullptr, cfg, {}};
  const StatusOr<PlanPrediction> p = planner.Run(cfg, world);
  if (!p.ok()) return Status::OK();
  const std::string after =
      " (predicted at set-up from the model's own trace, as `tierzero plan` with the same flags "
      "predicts it: the run would fail at its first step, after its step-0 evaluation)";
  if (p->failing_tier == "device" && (p->device.peak == 0 || p->device.peak > p->device.budget)) {
    std::string problem = p->problem;  // (a Status's text: its code first)
    if (problem.rfind("OutOfMemory: ", 0) == 0) problem.erase(0, 13);
    return OutOfMemoryError(problem + after);
  }
  // Ranks on one machine share its memory (Note [Host memory within the process's limit]: the
  // engine's count adds theirs together too): `local_ranks` of them each need this rank's peak.
  if (!p->fits) return Status::OK();
  const HostMemory hm = ReadHostMemory();
  const uint64_t each = p->host.peak + p->device.peak;
  const uint64_t need = each * static_cast<uint64_t>(std::max(1, local_ranks));
  if (need <= hm.limit) return Status::OK();
  const std::string whose =
      local_ranks > 1
          ? "these " + std::to_string(local_ranks) + " ranks on this machine need about " +
                FormatBytes(need) + " of host memory together at their peak (each " +
                FormatBytes(each) + ": "
          : "this run needs about " + FormatBytes(need) + " of host memory at its peak (";
  return OutOfMemoryError(
      whose + "the host tier " + FormatBytes(p->host.peak) + ", and the simulated device's " +
      FormatBytes(p->device.peak) + ", its activations " + FormatBytes(p->device_activations) +
      ", host memory too), more than this process may use: " + FormatBytes(hm.limit) + " (" +
      hm.limit_source +
      "); past it the kernel would end the process without a word. Give a smaller batch "
      "(--batch-size), device budget (--device-budget) or host budget (--host-budget)" +
      (local_ranks > 1 ? ", fewer ranks on this machine" : "") +
      ", or run where more memory is allowed");
}

}  // namespace tierzero::app
