// Renderings of the memory placement report (docs/report.md): the console summary printed at the
// end of every run, the Chrome trace (Trace Event Format: loads in Perfetto and
// chrome://tracing) and the self-contained HTML page (`tierzero report R.json -o report.html`).
#pragma once

#include <string>
#include <vector>

#include "tierzero/status.h"

namespace tierzero::app {

// A report file's text (the renderings below check it: schema "tierzero-report", version 2).
StatusOr<std::string> ReadReportFile(const std::string& path);

// Writes `text` to `path` through a temporary file and a rename (never half a file).
Status WriteTextFile(const std::string& path, const std::string& text);

// A few lines: peak per tier, bytes moved, stall share, the three worst stalls.
StatusOr<std::string> ReportSummary(const std::string& report_json);

// The profiled iteration's events, one track (thread) per stream.
Status WriteChromeTrace(const std::string& report_json, const std::string& path);

// One self-contained HTML file (inline SVG and script; no network access) with the charts.
Status WriteHtmlReport(const std::string& report_json, const std::string& path);

// `tierzero report R.json [-o report.html] [--trace trace.json]`.
int ReportCommand(const std::vector<std::string>& args);

}  // namespace tierzero::app
