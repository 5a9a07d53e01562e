// A plan from a recorded trace (`tierzero plan --trace FILE`): the flags it refuses, and whether
// its moments carry their compute.
#include "plan_trace.h"

#include <string>
#include <vector>

namespace tierzero::app {

// Note [A trace plans its own model]
// `plan --trace FILE` plans the model a trainer recorded: its parameters, and its moments'
// activations at the batch it ran. Flags that shape the built-in GPT or its batch would change
// nothing in that plan, so they are refused rather than ignored (a plan of 40 layers that is the
// trace's 2 would pass for a prediction). A config file's model section is only noted: a run's
// own config is naturally given with its trace. The engine's settings (budgets, accumulation,
// ranks) apply to either.
Status CheckTraceFlags(const std::string& trace_path, const std::vector<std::string>& rest,
                       bool largest) {
  if (trace_path.empty()) return Status::OK();
  static constexpr const char* kShaping[] = {"--layers",
                                             "--width",
                                             "--heads",
                                             "--kv-heads",
                                             "--arch",
                                             "--seq-len",
                                             "--vocab",
                                             "--batch-size",
                                             "--checkpoint-activations",
                                             "--no-checkpoint-activations",
                                             "--activations",
                                             "--init-from",
                                             "--text",
                                             "--data"};
  for (const std::string& a : rest) {
    for (const char* f : kShaping) {
      if (a == f)
        return InvalidArgumentError(
            std::string(f) + " shapes the built-in GPT, and --trace plans the model its trace " +
            "recorded (its parameters, and its activations at the batch it ran): leave " + f +
            " out, record a trace of the model meant (`tierzero train` writes " +
            "RUN_DIR/warmup_trace.json), or plan the built-in GPT without --trace");
    }
  }
  if (largest)
    return InvalidArgumentError(
        "--largest searches the built-in GPT's shapes, and --trace plans the model its trace "
        "recorded: give one or the other");
  return Status::OK();
}

// Whether a trace's moments carry their measured compute (a trainer's warm-up records it).
bool TraceTimed(const WarmupTrace& t) {
  for (const auto& m : t.moments)
    if (m.compute_seconds > 0) return true;
  return false;
}

}  // namespace tierzero::app
