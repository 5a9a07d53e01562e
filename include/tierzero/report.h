// The memory placement report (docs/report.md), rendered. Engine::ReportJson gives the report's
// JSON; these turn it into what `tierzero train` and `tierzero report` write, so a trainer that
// embeds the engine writes the same summary, page and trace without the CLI:
//
//   auto json = engine->ReportJson();                    // or ReadReportFile("report.json")
//   tierzero::WriteHtmlReport(*json, "report.html");     // open it in a browser
//
// Each checks the report first (schema "tierzero-report", version 2; every field it reads has the
// type it needs): a report from another version or edited by hand gets InvalidArgument naming
// the field, never a crash. Files are written through a temporary name and a rename.
//
// Thread-safety: reentrant.
#pragma once

#include <cstddef>
#include <string>

#include "tierzero/status.h"

namespace tierzero {

// A report file's text.
StatusOr<std::string> ReadReportFile(const std::string& path);

// A few lines: peak per tier, bytes moved, stall share, the three worst stalls.
StatusOr<std::string> ReportSummary(const std::string& report_json);

// The profiled iteration's events, one track (thread) per stream, in the Trace Event Format
// (loads in Perfetto and chrome://tracing). FailedPrecondition when nothing was profiled.
Status WriteChromeTrace(const std::string& report_json, const std::string& path);
// The trace's text, written nowhere (a command with several outputs renders them all before it
// writes any: a report that cannot be traced replaces no page).
StatusOr<std::string> RenderChromeTrace(const std::string& report_json);

// One self-contained HTML file (inline SVG and script; no network access) with the charts.
Status WriteHtmlReport(const std::string& report_json, const std::string& path);
StatusOr<std::string> RenderHtmlReport(const std::string& report_json);

// The report with a plan's prediction beside what it measured (docs/plan.md): `plan_json` is a
// `tierzero plan --json` file's text (schema "tierzero.plan/1") or PlanJson's object. Adds
// "prediction": {"plan": the prediction, "compared": rows of {what, unit, predicted, measured}}
// which the summary and the page show. FailedPrecondition when the plan is of another layout or
// rank count (another config), or says the run does not fit; InvalidArgument naming the field
// for a malformed plan, or one over kMaxPlanBytes or nested past what the report can hold.
inline constexpr size_t kMaxPlanBytes = size_t{1} << 20;  // a plan is a few KiB
StatusOr<std::string> WithPrediction(const std::string& report_json, const std::string& plan_json);

// Writes `text` to `path` through a temporary file, fsync and a rename: whole or not at all.
Status WriteTextFile(const std::string& path, const std::string& text);

}  // namespace tierzero
