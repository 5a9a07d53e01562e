// A plan from a recorded trace (plan_trace.cc; docs/plan.md).
#pragma once

#include <string>
#include <vector>

#include "tierzero/plan.h"
#include "tierzero/status.h"

namespace tierzero::app {

// Note [A trace plans its own model]: InvalidArgument for a flag among `rest` (train's options)
// that shapes the built-in GPT, or `largest`, when `trace_path` is given.
Status CheckTraceFlags(const std::string& trace_path, const std::vector<std::string>& rest,
                       bool largest);
// Whether a trace's moments carry their measured compute (a trainer's warm-up records it).
bool TraceTimed(const WarmupTrace& t);

}  // namespace tierzero::app
