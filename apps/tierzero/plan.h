// `tierzero plan`: a run predicted before it starts (docs/plan.md).
#pragma once

#include <string>
#include <vector>

#include "train.h"

namespace tierzero::app {

// Returns the process exit code.
int Plan(const std::vector<std::string>& args);

}  // namespace tierzero::app
