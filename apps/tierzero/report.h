// `tierzero report R.json [-o report.html] [--trace trace.json]`: the renderings of the memory
// placement report (tierzero/report.h) from the command line.
#pragma once

#include <string>
#include <vector>

namespace tierzero::app {

int ReportCommand(const std::vector<std::string>& args);

}  // namespace tierzero::app
