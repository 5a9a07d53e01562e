// The flags of `tierzero plan` (its own; the rest are train's) and its help.
#include "plan_args.h"

#include <cstdlib>

namespace tierzero::app {

const char* const kPlanHelp =
    R"(usage: tierzero plan [--config FILE] [train options] [plan options]

Predicts the run `tierzero train` would make with the same config and options: whether it fits
the device, host and NVMe budgets, the peak of each, the bytes per step on each link, where the
optimizer runs, and the step time with its breakdown. Nothing is allocated for the model.

plan options:
  --ranks N             plan for N ranks (default 1; mpirun -np N tierzero train runs it)
  --ranks-per-node N    ranks per node (default: all on one)
  --rates FILE          the machine's rates (JSON, docs/plan.md): this machine's cached
                        calibration, or another machine's numbers (a GPU node)
  --calibrate           measure this machine's rates again (about 10 s) and cache them;
                        under mpirun (mpirun -np N tierzero plan --calibrate) the
                        communicator's latency and rate, which plans of N ranks use
  --trace FILE          plan a trainer's own model from its recorded trace (train writes
                        RUN_DIR/warmup_trace.json) instead of the built-in GPT
  --json FILE           also write the prediction as JSON; `tierzero train --plan FILE` then
                        shows it beside what the run measures (report and page)
  --overwrite           replace an existing --json file (without it, one is refused)
  --no-advice           when it does not fit, skip the search for what would make it fit
  --largest             the largest GPT (or Llama, with --arch llama) these budgets train at
                        this batch, sequence length and engine.optimizer_states, over widths
                        128 to 12288 (heads 64 wide, at most d_model / 64 layers), with where
                        every byte of it would live

The calibration runs on the device the run computes on (a GPU for --device cuda, or auto on a
machine with one). Its cache is $TZ_RATES_FILE, else $XDG_CACHE_HOME/tierzero/rates.json
(rates-gpu.json for a GPU's), else the same names under ~/.cache/tierzero/.
)";

StatusOr<PlanArgs> ParsePlanArgs(const std::vector<std::string>& args) {
  PlanArgs a;
  auto int_arg = [&](size_t& i, const char* name, int lo, int hi) -> StatusOr<int> {
    if (i + 1 >= args.size()) return InvalidArgumentError(std::string(name) + " needs a value");
    const std::string& v = args[++i];
    char* end = nullptr;
    const long n = std::strtol(v.c_str(), &end, 10);
    if (end == v.c_str() || *end != '\0' || n < lo || n > hi)
      return InvalidArgumentError(std::string(name) + " is '" + v +
                                  "'; accepted: " + std::to_string(lo) + ".." + std::to_string(hi));
    return static_cast<int>(n);
  };
  auto str_arg = [&](size_t& i, const char* name) -> StatusOr<std::string> {
    if (i + 1 >= args.size()) return InvalidArgumentError(std::string(name) + " needs a value");
    if (args[i + 1].empty())
      return InvalidArgumentError(std::string(name) +
                                  " is empty (an unset shell variable?); give it a value, or "
                                  "leave the option out");
    return args[++i];
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& x = args[i];
    if (x == "--ranks") {
      TZ_ASSIGN_OR_RETURN(a.ranks, int_arg(i, "--ranks", 1, 65536));
    } else if (x == "--ranks-per-node") {
      TZ_ASSIGN_OR_RETURN(a.ranks_per_node, int_arg(i, "--ranks-per-node", 1, 65536));
    } else if (x == "--rates") {
      TZ_ASSIGN_OR_RETURN(a.rates_path, str_arg(i, "--rates"));
    } else if (x == "--trace") {
      TZ_ASSIGN_OR_RETURN(a.trace_path, str_arg(i, "--trace"));
    } else if (x == "--json") {
      TZ_ASSIGN_OR_RETURN(a.json_path, str_arg(i, "--json"));
    } else if (x == "--overwrite") {
      a.overwrite = true;
    } else if (x == "--calibrate") {
      a.calibrate = true;
    } else if (x == "--no-advice") {
      a.advice = false;
    } else if (x == "--largest") {
      a.largest = true;
    } else {
      a.rest.push_back(x);
    }
  }
  return a;
}

}  // namespace tierzero::app
