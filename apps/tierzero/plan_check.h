// Whether a `tierzero plan --json` file is of the run it is given with (Note [A plan of another
// run], plan_check.cc). Part of `tierzero train` and `tierzero report`.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "train.h"

namespace tierzero::app {

// OK when `plan_config` (the config a `tierzero plan --json` file records) plans the run of
// `run`: the same model, batch, budgets, placement and engine settings; FailedPrecondition
// naming the first fields that differ otherwise. Hyperparameters, data and outputs, which do not
// change what the plan predicts, may differ. `of_trace`: the plan is of a recorded trace
// (`plan --trace`), whose model and batch are the trace's: only the engine's settings compare.
Status CheckPlanConfig(const nlohmann::json& plan_config, const RunConfig& run, bool of_trace);
// `plan` is one `plan --trace` wrote: it names its trace, and its config leaves out the model and
// the batch, which the trace fixes.
bool IsATracesPlan(const nlohmann::json& plan);

// OK when the plan (a `tierzero plan --json` file's text) records a config that agrees with what
// the report (a report.json's text) records of its run; FailedPrecondition naming the first
// fields that differ otherwise, or when the plan records no config (it cannot be checked). Either
// text malformed is left to WithPrediction to say.
Status CheckPlanOfReport(const std::string& report_text, const std::string& plan_text);

// What `tierzero train` refuses at set-up in the run `plan` is asked to plan, refused by `plan`
// too (Note [What the plan of a run train refuses says], plan_check.cc): a --profile-step that
// profiles nothing, an NVMe path that is a file, and --init-from a model directory's weights
// file alone. An --init-from that is not here is a note (the run may be planned elsewhere).
Status CheckPlannable(RunConfig& cfg);

}  // namespace tierzero::app
