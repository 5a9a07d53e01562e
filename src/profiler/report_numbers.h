// The range every number of a report holds (Note [A report's numbers in range],
// report_render.cc), checked of a report, and of a plan's prediction before it joins one.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "core/status.h"

namespace tierzero {

// InvalidArgument naming `what` and the field's path where a number is negative (but a moment
// or chunk of -1) or beyond 4.6e18.
Status CheckReportNumbers(const nlohmann::json& r, const std::string& what = "report");

}  // namespace tierzero
