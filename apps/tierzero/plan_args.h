// The flags of `tierzero plan`: its own, and train's it passes on (apps/tierzero/plan.cc).
#pragma once

#include <string>
#include <vector>

#include "tierzero/status.h"

namespace tierzero::app {

extern const char* const kPlanHelp;

struct PlanArgs {
  int ranks = 1, ranks_per_node = 0;
  std::string rates_path, trace_path, json_path;
  bool calibrate = false, advice = true, largest = false;
  bool overwrite = false;         // an existing --json file may be replaced
  std::vector<std::string> rest;  // train's options
};

// InvalidArgument for a flag's missing, empty or out-of-range value.
StatusOr<PlanArgs> ParsePlanArgs(const std::vector<std::string>& args);

}  // namespace tierzero::app
