#include "report.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "engine/file_io.h"

namespace tierzero::app {
namespace {

using json = nlohmann::json;

StatusOr<json> ParseReport(const std::string& text) {
  json r = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (r.is_discarded() || !r.is_object()) return InvalidArgumentError("the report is not JSON");
  if (r.value("schema", "") != "tierzero-report")
    return InvalidArgumentError("not a tierzero report (schema is not \"tierzero-report\")");
  if (r.value("version", 0) != 2)
    return InvalidArgumentError("report version " + std::to_string(r.value("version", 0)) +
                                "; this tierzero reads version 2 (write it again with this build)");
  return r;
}

}  // namespace

Status WriteTextFile(const std::string& path, const std::string& text) {
  // Written whole or not at all, and durable once this returns (the engine's AtomicFile).
  ASSIGN_OR_RETURN(AtomicFile f, AtomicFile::Create(path));
  RETURN_IF_ERROR(f.Write(text.data(), text.size()));
  return f.Commit();
}

namespace {

std::string Mib(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f MiB", bytes / 1048576.0);
  return b;
}
std::string Ms(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f ms", s * 1e3);
  return b;
}

}  // namespace

StatusOr<std::string> ReadReportFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return NotFoundError("cannot open report " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

StatusOr<std::string> ReportSummary(const std::string& text) {
  ASSIGN_OR_RETURN(json r, ParseReport(text));
  const json& t = r["tiers"];
  const json& c = r["counters"];
  std::ostringstream o;
  auto pct = [](double a, double b) { return b > 0 ? 100.0 * a / b : 0.0; };
  char line[512];
  std::snprintf(
      line, sizeof line, "memory: device peak %s of %s (%.0f%%), host %s of %s, NVMe %s of %s\n",
      Mib(t["device"]["peak"].get<double>()).c_str(),
      Mib(t["device"]["capacity"].get<double>()).c_str(),
      pct(t["device"]["peak"].get<double>(), t["device"]["capacity"].get<double>()),
      Mib(t["host"]["used"].get<double>()).c_str(), Mib(t["host"]["budget"].get<double>()).c_str(),
      Mib(t["nvme"]["used"].get<double>()).c_str(), Mib(t["nvme"]["budget"].get<double>()).c_str());
  o << line;
  std::snprintf(line, sizeof line, "moved: H2D %s, D2H %s, NVMe read %s, NVMe write %s\n",
                Mib(c["h2d_bytes"].get<double>()).c_str(),
                Mib(c["d2h_bytes"].get<double>()).c_str(),
                Mib(c["nvme_read_bytes"].get<double>()).c_str(),
                Mib(c["nvme_write_bytes"].get<double>()).c_str());
  o << line;
  const json& p = r["profile"];
  if (!p.value("available", false)) {
    o << "no profiled iteration (the run ended before its first planned iteration)\n";
    return o.str();
  }
  const json& b = p["breakdown"];
  const double fwd = b["forward_seconds"], bwd = b["backward_seconds"],
               wait = b["parameter_wait_seconds"], stall = b["stall_seconds"],
               opt = b["optimizer_seconds"], io = b["optimizer_io_wait_seconds"];
  const double total = fwd + bwd + wait + opt;
  std::snprintf(line, sizeof line,
                "profiled iteration %lld: forward %s, backward %s, waiting for parameters %s "
                "(%.1f%%; device stalls %s), optimizer %s (NVMe waits %s)\n",
                p["iteration"].get<long long>(), Ms(fwd).c_str(), Ms(bwd).c_str(), Ms(wait).c_str(),
                pct(wait, total), Ms(stall).c_str(), Ms(opt).c_str(), Ms(io).c_str());
  o << line;
  std::vector<const json*> ms;
  for (const json& m : p["moments"]) ms.push_back(&m);
  auto cost = [](const json* m) {
    return std::max((*m)["wait_seconds"].get<double>(), (*m)["stall_seconds"].get<double>());
  };
  std::stable_sort(ms.begin(), ms.end(),
                   [&](const json* a, const json* b) { return cost(a) > cost(b); });
  o << "worst stalls:";
  for (size_t i = 0; i < std::min<size_t>(3, ms.size()); ++i) {
    const json& m = *ms[i];
    std::snprintf(line, sizeof line, "%s moment %d (%s) %s", i ? "," : "", m["index"].get<int>(),
                  m["backward"].get<bool>() ? "backward" : "forward", Ms(cost(ms[i])).c_str());
    o << line;
  }
  o << "\n";
  return o.str();
}

Status WriteChromeTrace(const std::string& text, const std::string& path) {
  ASSIGN_OR_RETURN(json r, ParseReport(text));
  const json& p = r["profile"];
  if (!p.value("available", false))
    return FailedPreconditionError("the report has no profiled iteration to trace");
  // One thread per track, in a fixed order.
  const std::vector<std::string> tracks = {"compute",    "H2D",       "D2H", "NVMe read",
                                           "NVMe write", "optimizer", "comm"};
  auto thread = [](json& events, int tid, const std::string& name) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", tid},
                      {"args", {{"name", name}}}});
    events.push_back({{"name", "thread_sort_index"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", tid},
                      {"args", {{"sort_index", tid}}}});
  };
  json events = json::array();
  events.push_back(
      {{"name", "process_name"},
       {"ph", "M"},
       {"pid", 1},
       {"tid", 0},
       {"args",
        {{"name", "tierzero iteration " + std::to_string(p["iteration"].get<long long>())}}}});
  for (size_t i = 0; i < tracks.size(); ++i) thread(events, static_cast<int>(i), tracks[i]);
  // CPU Adam's worker threads: lanes 1..N of the optimizer track, one thread each after it.
  constexpr int kLaneTid = 100;
  std::set<int> lanes;
  for (const json& e : p["events"]) {
    const std::string track = e["track"];
    const auto it = std::find(tracks.begin(), tracks.end(), track);
    if (it == tracks.end())
      return InvalidArgumentError("report event on unknown track '" + track + "'");
    const int lane = e.value("lane", 0);
    int tid = static_cast<int>(it - tracks.begin());
    if (lane > 0) {
      tid = kLaneTid + lane;
      if (lanes.insert(lane).second)
        thread(events, tid, "CPU Adam thread " + std::to_string(lane - 1));
    }
    json args = json::object();
    if (e["moment"].get<int>() >= 0) args["moment"] = e["moment"];
    if (e["chunk"].get<int>() >= 0) args["chunk"] = e["chunk"];
    if (e["bytes"].get<uint64_t>() > 0) args["bytes"] = e["bytes"];
    events.push_back({{"name", e["name"]},
                      {"cat", track},
                      {"ph", "X"},
                      {"ts", e["start"].get<double>() * 1e6},
                      {"dur", e["dur"].get<double>() * 1e6},
                      {"pid", 1},
                      {"tid", tid},
                      {"args", args}});
  }
  json trace = {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  return WriteTextFile(path, trace.dump());
}

}  // namespace tierzero::app

namespace tierzero::app {
namespace {

// The page (apps/tierzero/report_page.html), made a string literal at configure time.
constexpr const char kPage[] =
#include "report_page.inc"
    ;

}  // namespace

Status WriteHtmlReport(const std::string& text, const std::string& path) {
  ASSIGN_OR_RETURN(json r, ParseReport(text));
  // Inside <script>, "</" could end the element: JSON allows "\/" for "/" in strings.
  std::string data = r.dump();
  for (size_t at = 0; (at = data.find("</", at)) != std::string::npos; at += 3)
    data.replace(at, 2, "<\\/");
  std::string page = kPage;
  const std::string marker = "@REPORT_JSON@";
  const size_t at = page.find(marker);
  if (at == std::string::npos) return InternalError("the report page has no data marker");
  page.replace(at, marker.size(), data);
  return WriteTextFile(path, page);
}

int ReportCommand(const std::vector<std::string>& args) {
  std::string input, html, trace;
  for (size_t i = 0; i < args.size(); ++i) {
    if ((args[i] == "-o" || args[i] == "--output") && i + 1 < args.size()) {
      html = args[++i];
    } else if (args[i] == "--trace" && i + 1 < args.size()) {
      trace = args[++i];
    } else if (args[i] == "-h" || args[i] == "--help") {
      std::printf(
          "usage: tierzero report REPORT.json [-o report.html] [--trace trace.json]\n"
          "  prints the summary; -o writes the HTML page (self-contained), --trace the Chrome\n"
          "  trace of the profiled iteration (open it in Perfetto or chrome://tracing)\n");
      return 0;
    } else if (input.empty() && !args[i].empty() && args[i][0] != '-') {
      input = args[i];
    } else {
      std::fprintf(stderr, "error: unknown argument '%s' (tierzero report --help)\n",
                   args[i].c_str());
      return 2;
    }
  }
  if (input.empty()) {
    std::fprintf(stderr, "error: no report given (tierzero report REPORT.json -o report.html)\n");
    return 2;
  }
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  };
  auto text = ReadReportFile(input);
  if (!text.ok()) return fail(text.status());
  auto summary = ReportSummary(*text);
  if (!summary.ok()) return fail(summary.status());
  std::fputs(summary->c_str(), stdout);
  if (!html.empty()) {
    if (Status s = WriteHtmlReport(*text, html); !s.ok()) return fail(s);
    std::printf("html: %s\n", html.c_str());
  }
  if (!trace.empty()) {
    if (Status s = WriteChromeTrace(*text, trace); !s.ok()) return fail(s);
    std::printf("trace: %s\n", trace.c_str());
  }
  return 0;
}

}  // namespace tierzero::app
