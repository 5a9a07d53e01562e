// The renderings of the memory placement report (tierzero/report.h).
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/file_io.h"
#include "core/json_in.h"
#include "profiler/json_schema.h"
#include "profiler/observer.h"
#include "profiler/report_numbers.h"
#include "tierzero/report.h"

namespace tierzero {

using json = nlohmann::json;

// Note [A report's numbers in range]
// Every number a report holds is a count, a size, a time or a rate, none negative (but the events'
// moment and chunk, -1 for "none") and none beyond 2^62 (4.6e18: budgets are at most 2^60 bytes
// each, so their sums fit; a century is 3e9 seconds): a
// report edited or corrupted to hold -5 or 1e300 rendered charts and summaries of nonsense ("-0.0
// MiB", bars off the page). Such a report is refused with the field named, before anything renders.
// A seed (the config's model.seed, data.seed) is no quantity: any 64-bit value (a run with
// model.seed 2^62 trained, saved, then failed writing its report: hunt 50).
// report_numbers.h
Status CheckReportNumbers(const json& r, const std::string& what) {
  struct Item {
    const json* v;
    std::string path;
  };
  std::vector<Item> stack = {{&r, ""}};
  while (!stack.empty()) {
    const Item it = stack.back();
    stack.pop_back();
    if (it.v->is_object()) {
      for (auto c = it.v->begin(); c != it.v->end(); ++c)
        stack.push_back({&c.value(), it.path.empty() ? c.key() : it.path + "." + c.key()});
      continue;
    }
    if (it.v->is_array()) {
      for (size_t i = 0; i < it.v->size(); ++i)
        stack.push_back({&(*it.v)[i], it.path + "[" + std::to_string(i) + "]"});
      continue;
    }
    if (!it.v->is_number()) continue;
    const double v = it.v->get<double>();
    const size_t dot = it.path.find_last_of('.');
    const std::string key = dot == std::string::npos ? it.path : it.path.substr(dot + 1);
    if (key == "seed") continue;  // a name for a sequence, not a quantity: any 64-bit value
    const double least = key == "moment" || key == "chunk" ? -1 : 0;
    if (!(v >= least && v <= 4.6e18)) {
      return InvalidArgumentError(what + ": " + it.path + " is " + it.v->dump() +
                                  "; a report's counts, sizes, times and rates lie in [" +
                                  (least < 0 ? "-1" : "0") +
                                  ", 4.6e18] (Note [A report's numbers in range])");
    }
  }
  return Status::OK();
}

namespace {

StatusOr<json> ParseReport(const std::string& text) {
  ASSIGN_OR_RETURN(json r, ParseOutsideJson(text, "the report"));
  if (!r.is_object()) return InvalidArgumentError("the report is not a JSON object");
  const JsonIn in(r, "report");
  RETURN_IF_ERROR(CheckReportNumbers(r));
  const StatusOr<std::string> schema = in.get_or<std::string>("schema", "");
  if (!schema.ok() || *schema != "tierzero-report")
    return InvalidArgumentError("not a tierzero report (schema is not \"tierzero-report\")");
  ASSIGN_OR_RETURN(const int64_t version, in.get<int64_t>("version"));
  if (version != 2)
    return InvalidArgumentError("report version " + std::to_string(version) +
                                "; this tierzero reads version 2 (write it again with this build)");
  // Note [A report checked against its schema] (json_schema.h): every field the summary, the page
  // and the trace read is there and of its type before any renders.
  if (Status s = CheckAgainstSchema(r, ReportSchema()); !s.ok()) {
    if (s.code() == StatusCode::kInternal) return s;
    return InvalidArgumentError(
        std::string(s.message()) +
        "; the report does not follow its schema (docs/report.schema.json): was it edited, or "
        "written by another tool? `tierzero train` writes it whole");
  }
  return r;
}

}  // namespace

Status WriteTextFile(const std::string& path, const std::string& text) {
  return WriteFileAtomically(path, text);
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
  return ReadFileBounded(path, kMaxReportBytes, "report");
}

// Several ranks: the bytes of each use of the collectives, and how many crossed nodes (reports
// from before ZeRO++ have no bytes_by_use: nothing is said).
// The last step's update phase: where the groups updated, and its predicted and measured time.
Status SummariseUpdate(const JsonIn& in, std::ostringstream& o) {
  if (!in.has("optimizer")) return Status::OK();
  ASSIGN_OR_RETURN(const JsonIn opt, in.at("optimizer"));
  if (!opt.has("update_phase")) return Status::OK();
  ASSIGN_OR_RETURN(const JsonIn u, opt.at("update_phase"));
  ASSIGN_OR_RETURN(const std::vector<JsonIn> groups, opt.elements("sub_groups"));
  int cpu = 0, resident = 0, streamed = 0;
  for (const JsonIn& g : groups) {
    ASSIGN_OR_RETURN(const std::string where, g.get_or<std::string>("update", "cpu"));
    cpu += where == "cpu";
    resident += where == "device";
    streamed += where == "device-streamed";
  }
  ASSIGN_OR_RETURN(std::string mode, u.get<std::string>("mode"));
  ASSIGN_OR_RETURN(const std::string moments, u.get_or<std::string>("moments", "fp32"));
  if (moments != "fp32") mode += ", " + moments + " moments";
  ASSIGN_OR_RETURN(const double predicted, u.get<double>("predicted_seconds"));
  ASSIGN_OR_RETURN(const double measured, u.get<double>("measured_median_seconds"));
  ASSIGN_OR_RETURN(const int64_t phases, u.get<int64_t>("phases"));
  ASSIGN_OR_RETURN(const JsonIn r, u.at("rates"));
  ASSIGN_OR_RETURN(const bool modelled, r.get_or<bool>("device_adam_modelled", false));
  char line[512];
  std::snprintf(line, sizeof line,
                "optimizer (%s): %d groups on the CPU, %d resident on the device, %d streamed to "
                "it; update phase %s (median of %lld steps; predicted %s%s)\n",
                mode.c_str(), cpu, resident, streamed, Ms(measured).c_str(),
                static_cast<long long>(phases), Ms(predicted).c_str(),
                modelled ? ", device Adam a model" : "");
  o << line;
  if (u.has("speculative_start")) {
    ASSIGN_OR_RETURN(const JsonIn sp, u.at("speculative_start"));
    ASSIGN_OR_RETURN(const int64_t used, sp.get_or<int64_t>("steps", 0));
    ASSIGN_OR_RETURN(const int64_t back, sp.get_or<int64_t>("rollbacks", 0));
    if (used + back > 0) {
      std::snprintf(line, sizeof line,
                    "  speculative start: used in %lld steps, rolled back in %lld (clipping, a "
                    "non-finite gradient or other step options)\n",
                    static_cast<long long>(used), static_cast<long long>(back));
      o << line;
    }
  }
  return Status::OK();
}

Status SummariseCollectives(const JsonIn& in, std::ostringstream& o) {
  if (!in.has("ranks")) return Status::OK();
  ASSIGN_OR_RETURN(const JsonIn ranks, in.at("ranks"));
  ASSIGN_OR_RETURN(const int64_t world, ranks.get<int64_t>("world_size"));
  if (world <= 1 || !ranks.has("bytes_by_use")) return Status::OK();
  ASSIGN_OR_RETURN(const JsonIn uses, ranks.at("bytes_by_use"));
  o << "collectives (bytes on the wire of bytes before quantization, across nodes):";
  const char* sep = " ";
  for (const auto& [key, name] :
       {std::pair{"param_gather", "forward gathers"}, std::pair{"param_regather", "later gathers"},
        std::pair{"grad_reduce", "gradient reductions"}}) {
    ASSIGN_OR_RETURN(const JsonIn u, uses.at(key));
    ASSIGN_OR_RETURN(const double before, u.get<double>("bytes_before_quantization"));
    ASSIGN_OR_RETURN(const double wire, u.get<double>("bytes_on_wire"));
    ASSIGN_OR_RETURN(const double cross, u.get<double>("bytes_cross_node"));
    o << sep << name << " " << Mib(wire) << " of " << Mib(before) << " (" << Mib(cross) << ")";
    sep = "; ";
  }
  o << "\n";
  return Status::OK();
}

// A plan's prediction (WithPrediction): a line per row, predicted / measured.
Status SummarisePrediction(const JsonIn& in, std::ostringstream& o) {
  if (!in.has("prediction")) return Status::OK();
  ASSIGN_OR_RETURN(const JsonIn p, in.at("prediction"));
  ASSIGN_OR_RETURN(const std::vector<JsonIn> rows, p.elements("compared"));
  o << "predicted by tierzero plan / measured:\n";
  for (const JsonIn& row : rows) {
    ASSIGN_OR_RETURN(const std::string what, row.get<std::string>("what"));
    ASSIGN_OR_RETURN(const std::string unit, row.get<std::string>("unit"));
    ASSIGN_OR_RETURN(const double predicted, row.get<double>("predicted"));
    ASSIGN_OR_RETURN(const double measured, row.get<double>("measured"));
    if (unit != "bytes" && unit != "seconds" && unit != "count")
      return row.Error("has an unknown unit " + JsonIn::Shown(unit));
    auto show = [&](double v) {
      char b[32];
      if (unit == "count") std::snprintf(b, sizeof b, "%.0f", v);
      return unit == "bytes" ? Mib(v) : unit == "seconds" ? Ms(v) : std::string(b);
    };
    char line[384];
    std::snprintf(line, sizeof line, "  %-42s %12s / %-12s", what.c_str(), show(predicted).c_str(),
                  show(measured).c_str());
    o << line;
    if (measured > 0 && unit != "count") {
      std::snprintf(line, sizeof line, " %+6.1f%%", 100.0 * (predicted - measured) / measured);
      o << line;
    }
    o << "\n";
  }
  return Status::OK();
}

StatusOr<std::string> ReportSummary(const std::string& text) {
  ASSIGN_OR_RETURN(const json r, ParseReport(text));
  // Every field is read through JsonIn (Note [Reading outside JSON]): a report edited by hand or
  // written by another tool gets an error naming the field, never an exception.
  const JsonIn in(r, "report");
  ASSIGN_OR_RETURN(const JsonIn t, in.at("tiers"));
  ASSIGN_OR_RETURN(const JsonIn dev, t.at("device"));
  ASSIGN_OR_RETURN(const JsonIn host, t.at("host"));
  ASSIGN_OR_RETURN(const JsonIn nvme, t.at("nvme"));
  ASSIGN_OR_RETURN(const double dev_peak, dev.get<double>("peak"));
  ASSIGN_OR_RETURN(const double dev_cap, dev.get<double>("capacity"));
  ASSIGN_OR_RETURN(const double host_used, host.get<double>("used"));
  ASSIGN_OR_RETURN(const double host_budget, host.get<double>("budget"));
  ASSIGN_OR_RETURN(const double nvme_used, nvme.get<double>("used"));
  ASSIGN_OR_RETURN(const double nvme_budget, nvme.get<double>("budget"));
  ASSIGN_OR_RETURN(const JsonIn c, in.at("counters"));
  ASSIGN_OR_RETURN(const double h2d, c.get<double>("h2d_bytes"));
  ASSIGN_OR_RETURN(const double d2h, c.get<double>("d2h_bytes"));
  ASSIGN_OR_RETURN(const double nvme_read, c.get<double>("nvme_read_bytes"));
  ASSIGN_OR_RETURN(const double nvme_write, c.get<double>("nvme_write_bytes"));
  std::ostringstream o;
  auto pct = [](double a, double b) { return b > 0 ? 100.0 * a / b : 0.0; };
  char line[512];
  std::snprintf(
      line, sizeof line, "memory: device peak %s of %s (%.0f%%), host %s of %s, NVMe %s of %s\n",
      Mib(dev_peak).c_str(), Mib(dev_cap).c_str(), pct(dev_peak, dev_cap), Mib(host_used).c_str(),
      Mib(host_budget).c_str(), Mib(nvme_used).c_str(), Mib(nvme_budget).c_str());
  o << line;
  std::snprintf(line, sizeof line, "moved: H2D %s, D2H %s, NVMe read %s, NVMe write %s\n",
                Mib(h2d).c_str(), Mib(d2h).c_str(), Mib(nvme_read).c_str(),
                Mib(nvme_write).c_str());
  o << line;
  RETURN_IF_ERROR(SummariseCollectives(in, o));
  RETURN_IF_ERROR(SummariseUpdate(in, o));
  RETURN_IF_ERROR(SummarisePrediction(in, o));
  ASSIGN_OR_RETURN(const JsonIn p, in.at("profile"));
  ASSIGN_OR_RETURN(const bool available, p.get_or<bool>("available", false));
  if (!available) {
    o << "no profiled iteration (the run ended before its first planned iteration)\n";
    return o.str();
  }
  ASSIGN_OR_RETURN(const JsonIn b, p.at("breakdown"));
  ASSIGN_OR_RETURN(const double fwd, b.get<double>("forward_seconds"));
  ASSIGN_OR_RETURN(const double bwd, b.get<double>("backward_seconds"));
  ASSIGN_OR_RETURN(const double wait, b.get<double>("parameter_wait_seconds"));
  ASSIGN_OR_RETURN(const double stall, b.get<double>("stall_seconds"));
  ASSIGN_OR_RETURN(const double opt, b.get<double>("optimizer_seconds"));
  ASSIGN_OR_RETURN(const double io, b.get<double>("optimizer_io_wait_seconds"));
  // Reports before the field lack it.
  ASSIGN_OR_RETURN(const double probe, b.get_or<double>("optimizer_rate_probe_seconds", 0.0));
  ASSIGN_OR_RETURN(const int64_t iteration, p.get<int64_t>("iteration"));
  const double total = fwd + bwd + wait + opt;
  const std::string probe_text =
      probe > 0 ? "; measuring the update's rates, once, " + Ms(probe) : std::string();
  std::snprintf(line, sizeof line,
                "profiled iteration %lld: forward %s, backward %s, waiting for parameters %s "
                "(%.1f%%; device stalls %s), optimizer %s (NVMe waits %s%s)\n",
                static_cast<long long>(iteration), Ms(fwd).c_str(), Ms(bwd).c_str(),
                Ms(wait).c_str(), pct(wait, total), Ms(stall).c_str(), Ms(opt).c_str(),
                Ms(io).c_str(), probe_text.c_str());
  o << line;
  // Note [The compute stream's idle time] (report_json.cc); reports before it lack the field.
  ASSIGN_OR_RETURN(const double idle, b.get_or<double>("compute_idle_seconds", -1.0));
  ASSIGN_OR_RETURN(const double span, b.get_or<double>("compute_span_seconds", 0.0));
  if (idle >= 0) {
    std::string largest;
    if (b.has("largest_compute_idle_moment")) {
      ASSIGN_OR_RETURN(const double secs, b.get<double>("largest_compute_idle_seconds"));
      ASSIGN_OR_RETURN(const int64_t before, b.get<int64_t>("largest_compute_idle_moment"));
      largest = "; the largest " + Ms(secs) + " before moment " + std::to_string(before);
    }
    std::snprintf(line, sizeof line,
                  "compute stream idle between moments: %s (%.1f%% of the span from the first "
                  "moment to the last%s)\n",
                  Ms(idle).c_str(), pct(idle, span > 0 ? span : fwd + bwd + idle), largest.c_str());
    o << line;
  }
  struct Moment {
    int64_t index;
    bool backward;
    double cost;
  };
  std::vector<Moment> ms;
  ASSIGN_OR_RETURN(const std::vector<JsonIn> moments, p.elements("moments"));
  for (const JsonIn& m : moments) {
    ASSIGN_OR_RETURN(const int64_t index, m.get<int64_t>("index"));
    ASSIGN_OR_RETURN(const bool backward, m.get<bool>("backward"));
    ASSIGN_OR_RETURN(const double mwait, m.get<double>("wait_seconds"));
    ASSIGN_OR_RETURN(const double mstall, m.get<double>("stall_seconds"));
    ms.push_back({index, backward, std::max(mwait, mstall)});
  }
  std::stable_sort(ms.begin(), ms.end(),
                   [](const Moment& a, const Moment& b) { return a.cost > b.cost; });
  o << "worst stalls:";
  for (size_t i = 0; i < std::min<size_t>(3, ms.size()); ++i) {
    std::snprintf(line, sizeof line, "%s moment %lld (%s) %s", i ? "," : "",
                  static_cast<long long>(ms[i].index), ms[i].backward ? "backward" : "forward",
                  Ms(ms[i].cost).c_str());
    o << line;
  }
  o << "\n";
  return o.str();
}

Status WriteChromeTrace(const std::string& text, const std::string& path) {
  ASSIGN_OR_RETURN(const std::string trace, RenderChromeTrace(text));
  return WriteTextFile(path, trace);
}

StatusOr<std::string> RenderChromeTrace(const std::string& text) {
  ASSIGN_OR_RETURN(const json r, ParseReport(text));
  // The summary reads (and checks) the rest of the report.
  RETURN_IF_ERROR(ReportSummary(text).status());
  ASSIGN_OR_RETURN(const JsonIn pin, JsonIn(r, "report").at("profile"));
  ASSIGN_OR_RETURN(const bool available, pin.get_or<bool>("available", false));
  if (!available) return FailedPreconditionError("the report has no profiled iteration to trace");
  ASSIGN_OR_RETURN(const int64_t iteration, pin.get<int64_t>("iteration"));
  // One thread per track, in a fixed order.
  std::vector<std::string> tracks;
  for (int t = 0; t < kNumTracks; ++t) tracks.emplace_back(TrackName(static_cast<Track>(t)));
  // (Sorted by `order`: a track's own rows at 10 x its index, a row under it just after.)
  auto thread = [](json& events, int tid, const std::string& name, int order) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", tid},
                      {"args", {{"name", name}}}});
    events.push_back({{"name", "thread_sort_index"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", tid},
                      {"args", {{"sort_index", order}}}});
  };
  json events = json::array();
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", 1},
                    {"tid", 0},
                    {"args", {{"name", "tierzero iteration " + std::to_string(iteration)}}}});
  for (size_t i = 0; i < tracks.size(); ++i)
    thread(events, static_cast<int>(i), tracks[i], 10 * static_cast<int>(i));
  // CPU Adam's worker threads: lanes 1..N of the optimizer track, one thread each after it.
  constexpr int kLaneTid = 100;
  std::set<int> lanes;
  ASSIGN_OR_RETURN(const std::vector<JsonIn> report_events, pin.elements("events"));
  for (const JsonIn& e : report_events) {
    ASSIGN_OR_RETURN(const std::string track, e.get<std::string>("track"));
    const auto it = std::find(tracks.begin(), tracks.end(), track);
    if (it == tracks.end()) return e.Error("is on an unknown track " + JsonIn::Shown(track));
    ASSIGN_OR_RETURN(const int lane, e.get_or<int>("lane", 0));
    int tid = static_cast<int>(it - tracks.begin());
    if (lane > 0 && track == TrackName(Track::kOptimizer)) {
      if (lane > 4096) return e.Error("has a CPU Adam lane out of range: " + std::to_string(lane));
      tid = kLaneTid + lane;
      if (lanes.insert(lane).second)
        thread(events, tid, "CPU Adam thread " + std::to_string(lane - 1),
               10 * static_cast<int>(it - tracks.begin()) + 1 + lane);
    } else if (lane > 0) {
      // A stream's work that did not cross its link (TimelineEvent::lane): a row under it.
      if (lane > 1) return e.Error("has a lane out of range on its track: " + std::to_string(lane));
      const int order = 10 * tid + 1;
      tid = kLaneTid / 2 + tid;
      if (lanes.insert(-tid).second) thread(events, tid, track + " (on the device)", order);
    }
    ASSIGN_OR_RETURN(const std::string name, e.get<std::string>("name"));
    ASSIGN_OR_RETURN(const int64_t moment, e.get<int64_t>("moment"));
    ASSIGN_OR_RETURN(const int64_t chunk, e.get<int64_t>("chunk"));
    ASSIGN_OR_RETURN(const uint64_t bytes, e.get<uint64_t>("bytes"));
    ASSIGN_OR_RETURN(const double start, e.get<double>("start"));
    ASSIGN_OR_RETURN(const double dur, e.get<double>("dur"));
    json args = json::object();
    if (moment >= 0) args["moment"] = moment;
    if (chunk >= 0) args["chunk"] = chunk;
    if (bytes > 0) args["bytes"] = bytes;
    events.push_back({{"name", name},
                      {"cat", track},
                      {"ph", "X"},
                      {"ts", start * 1e6},
                      {"dur", dur * 1e6},
                      {"pid", 1},
                      {"tid", tid},
                      {"args", args}});
  }
  json trace = {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  return trace.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace tierzero

namespace tierzero {
namespace {

// The page (src/profiler/report_page.html), made a string literal at configure time.
constexpr const char kPage[] =
#include "report_page.inc"
    ;

}  // namespace

Status WriteHtmlReport(const std::string& text, const std::string& path) {
  ASSIGN_OR_RETURN(const std::string page, RenderHtmlReport(text));
  return WriteTextFile(path, page);
}

StatusOr<std::string> RenderHtmlReport(const std::string& text) {
  ASSIGN_OR_RETURN(const json r, ParseReport(text));
  // The page draws the fields the summary reads: a report they are malformed in is refused here.
  RETURN_IF_ERROR(ReportSummary(text).status());
  // Inside <script>, "</script" would end the element and "<!--" can keep the page's own
  // "</script>" from ending it, so no '<' goes in as itself: outside strings JSON has none, and
  // inside them "\u003c" is the same character.
  const std::string dumped = r.dump(-1, ' ', false, json::error_handler_t::replace);
  std::string data;
  data.reserve(dumped.size());
  for (char ch : dumped) {
    if (ch == '<') {
      data += "\\u003c";
    } else {
      data += ch;
    }
  }
  std::string page = kPage;
  const std::string marker = "@REPORT_JSON@";
  const size_t at = page.find(marker);
  if (at == std::string::npos) return InternalError("the report page has no data marker");
  page.replace(at, marker.size(), data);
  return page;
}

}  // namespace tierzero
