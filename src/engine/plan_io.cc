// A plan's files and renderings (tierzero/plan.h): the warm-up trace and the machine's rates as
// JSON, and the prediction as a terminal table and as the report's "prediction" object.
#include <cinttypes>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "core/bytes.h"
#include "core/file_io.h"
#include "core/json_in.h"
#include "tierzero/plan.h"

namespace tierzero {

using nlohmann::json;

namespace {

constexpr const char* kTraceSchema = "tierzero.trace/1";

StatusOr<json> ParseOutside(const std::string& text, const std::string& source) {
  return ParseOutsideJson(text, source);
}

std::string Mib(uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1 << 20));
  return buf;
}

std::string Ms(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f ms", s * 1e3);
  return buf;
}

// The trace `text` holds (`path` names it in errors), checked as ReadWarmupTrace checks a file.
StatusOr<WarmupTrace> WarmupTraceFromText(const std::string& text, const std::string& path);

}  // namespace

Status WriteWarmupTrace(const WarmupTrace& t, const std::string& path) {
  json params = json::array();
  for (const WarmupTrace::Param& p : t.params)
    params.push_back({{"name", p.name}, {"shape", p.shape}, {"weight_decay", p.weight_decay}});
  json moments = json::array();
  for (const TraceMoment& m : t.moments) {
    moments.push_back({{"params", m.params},
                       {"backward", m.backward},
                       {"activation_bytes", m.activation_bytes},
                       {"activation_peak", m.activation_peak},
                       {"compute_seconds", m.compute_seconds},
                       {"flops", m.flops},
                       {"memory_bytes", m.memory_bytes}});
  }
  const json j = {
      {"schema", kTraceSchema}, {"source", t.source}, {"params", params}, {"moments", moments}};
  // Written only as it reads back: a name that is not UTF-8 (replaced, it read back as another),
  // a NaN (written as null), a moment without parameters... were written over the file and then
  // refused by ReadWarmupTrace (hunt 48).
  std::string text;
  try {
    text = j.dump(1, ' ', false, json::error_handler_t::strict) + "\n";
  } catch (const json::exception&) {
    return InvalidArgumentError("warm-up trace for " + path +
                                ": a parameter name or its source is not UTF-8; nothing written");
  }
  if (auto back = WarmupTraceFromText(text, path); !back.ok())
    return InvalidArgumentError("warm-up trace for " + path + " would not read back (" +
                                std::string(back.status().message()) + "); nothing written");
  return WriteFileAtomically(path, text);
}

StatusOr<WarmupTrace> ReadWarmupTrace(const std::string& path) {
  ASSIGN_OR_RETURN(const std::string text, ReadFileBounded(path, kMaxReportBytes, "warm-up trace"));
  return WarmupTraceFromText(text, path);
}

namespace {
StatusOr<WarmupTrace> WarmupTraceFromText(const std::string& text, const std::string& path) {
  ASSIGN_OR_RETURN(const json j, ParseOutside(text, path));
  const JsonIn in(j, path);
  // A Chrome trace (RUN_DIR/trace.json, train's --trace) is not a warm-up trace.
  if ((j.is_object() && !j.contains("schema") && j.contains("traceEvents")) || j.is_array())
    return in.Error(
        "is a Chrome trace (train --trace, RUN_DIR/trace.json), not a warm-up trace: plan "
        "--trace reads RUN_DIR/warmup_trace.json");
  ASSIGN_OR_RETURN(const std::string schema, in.get<std::string>("schema"));
  if (schema != kTraceSchema)
    return in.Error("schema is \"" + schema + "\"; this tierzero reads \"" + kTraceSchema + "\"");
  WarmupTrace t;
  ASSIGN_OR_RETURN(t.source, in.get_or<std::string>("source", ""));
  // What the engine refuses of a parameter (RegisterParam) is refused here, naming the field: it
  // said "parameter 'wte' is registered twice", naming neither the file nor the field (hunt 49).
  const std::string again =
      " (was it edited? tierzero train records it again: RUN_DIR/warmup_trace.json)";
  ASSIGN_OR_RETURN(const std::vector<JsonIn> params, in.elements("params"));
  std::set<std::string> names;
  for (const JsonIn& p : params) {
    WarmupTrace::Param q;
    ASSIGN_OR_RETURN(q.name, p.get<std::string>("name"));
    if (q.name.empty()) return p.Error("has an empty name" + again);
    if (!names.insert(q.name).second) return p.Error("names '" + q.name + "' again" + again);
    ASSIGN_OR_RETURN(const std::vector<JsonIn> dims, p.elements("shape"));
    if (dims.empty()) return p.Error("has an empty shape" + again);
    int64_t elements = 1;
    for (const JsonIn& d : dims) {
      ASSIGN_OR_RETURN(const int64_t v, d.as<int64_t>());
      if (v < 1) return d.Error("must be a dimension >= 1");
      if (elements > (int64_t{1} << 40) / v)
        return p.Error("has more than 2^40 elements, more than a parameter may" + again);
      elements *= v;
      q.shape.push_back(v);
    }
    ASSIGN_OR_RETURN(q.weight_decay, p.get_or<bool>("weight_decay", true));
    t.params.push_back(std::move(q));
  }
  ASSIGN_OR_RETURN(const std::vector<JsonIn> moments, in.elements("moments"));
  for (const JsonIn& m : moments) {
    TraceMoment tm;
    ASSIGN_OR_RETURN(const std::vector<JsonIn> ids, m.elements("params"));
    std::set<int> seen;
    for (const JsonIn& id : ids) {
      ASSIGN_OR_RETURN(const int v, id.as<int>());
      if (v < 0 || static_cast<size_t>(v) >= t.params.size())
        return id.Error("names no parameter of the " + std::to_string(t.params.size()) + " listed");
      if (!seen.insert(v).second)
        return id.Error("names parameter " + std::to_string(v) + " again" + again);
      tm.params.push_back(v);
    }
    if (tm.params.empty()) return m.Error("acquires no parameter");
    ASSIGN_OR_RETURN(tm.backward, m.get<bool>("backward"));
    ASSIGN_OR_RETURN(tm.activation_bytes, m.get<uint64_t>("activation_bytes"));
    ASSIGN_OR_RETURN(tm.activation_peak,
                     m.get_or<uint64_t>("activation_peak", tm.activation_bytes));
    ASSIGN_OR_RETURN(tm.compute_seconds, m.get_or<double>("compute_seconds", 0.0));
    ASSIGN_OR_RETURN(tm.flops, m.get_or<double>("flops", 0.0));
    ASSIGN_OR_RETURN(tm.memory_bytes, m.get_or<double>("memory_bytes", 0.0));
    // Absurd figures are refused, not summed into a step time of inf or NaN (a plan that prints
    // "-nan ms" and that `train --plan` then refuses): an hour a moment, 1e21 flops or bytes.
    if (!(tm.compute_seconds >= 0 && tm.compute_seconds <= 3600) ||
        !(tm.flops >= 0 && tm.flops <= 1e21) || !(tm.memory_bytes >= 0 && tm.memory_bytes <= 1e21))
      return m.Error(
          "has a compute_seconds, flops or memory_bytes out of range (0..3600 s, 0..1e21)");
    if (tm.activation_bytes > (uint64_t{1} << 60) || tm.activation_peak > (uint64_t{1} << 60))
      return m.Error("has activation bytes beyond 1 EiB");
    t.moments.push_back(std::move(tm));
  }
  if (t.moments.empty()) return in.Error("has no moments");
  return t;
}
}  // namespace

// The rates per second a MachineRates holds, by their JSON names (comm_latency_s is seconds).
constexpr struct {
  const char* key;
  double MachineRates::*field;
} kRateFields[] = {{"cpu_adam_params_per_s", &MachineRates::cpu_adam_params_per_s},
                   {"device_adam_params_per_s", &MachineRates::device_adam_params_per_s},
                   {"h2d_bytes_per_s", &MachineRates::h2d_bytes_per_s},
                   {"d2h_bytes_per_s", &MachineRates::d2h_bytes_per_s},
                   {"nvme_read_bytes_per_s", &MachineRates::nvme_read_bytes_per_s},
                   {"nvme_write_bytes_per_s", &MachineRates::nvme_write_bytes_per_s},
                   {"nvme_duplex_bytes_per_s", &MachineRates::nvme_duplex_bytes_per_s},
                   {"host_clear_bytes_per_s", &MachineRates::host_clear_bytes_per_s},
                   {"device_flops_per_s", &MachineRates::device_flops_per_s},
                   {"device_memory_bytes_per_s", &MachineRates::device_memory_bytes_per_s},
                   {"comm_bytes_per_s", &MachineRates::comm_bytes_per_s}};

std::string MachineRatesToJson(const MachineRates& r) {
  json j = {{"name", r.name},
            {"comm_latency_s", r.comm_latency_s},
            {"device_shares_cpu", r.device_shares_cpu}};
  for (const auto& f : kRateFields) j[f.key] = r.*f.field;
  return j.dump(1, ' ', false, json::error_handler_t::replace) + "\n";
}

StatusOr<MachineRates> MachineRatesFromJson(const std::string& text) {
  ASSIGN_OR_RETURN(const json j, ParseOutside(text, "machine rates"));
  const JsonIn in(j, "machine rates");
  if (!in.is_object()) return in.Error("must be an object");
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    bool known = key == "name" || key == "comm_latency_s" || key == "device_shares_cpu";
    for (const auto& f : kRateFields) known = known || key == f.key;
    if (!known) return in.Error("has an unknown field \"" + key + "\"");
  }
  MachineRates r;
  ASSIGN_OR_RETURN(r.name, in.get_or<std::string>("name", ""));
  // (Printed as it is: a control character would reach the terminal, an escape sequence acting.)
  for (const char c : r.name)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      return in.Error("name holds a control character (" + std::to_string(static_cast<int>(c)) +
                      "): name the rates in printable text");
  for (const auto& f : kRateFields) {
    ASSIGN_OR_RETURN(r.*f.field, in.get_or<double>(f.key, 0.0));
  }
  ASSIGN_OR_RETURN(r.comm_latency_s, in.get_or<double>("comm_latency_s", 0.0));
  ASSIGN_OR_RETURN(r.device_shares_cpu, in.get_or<bool>("device_shares_cpu", false));
  RETURN_IF_ERROR(ValidateMachineRates(r));
  return r;
}

Status ValidateMachineRates(const MachineRates& r) {
  for (const auto& f : kRateFields) {
    const double v = r.*f.field;
    if (!(v == 0 || (v >= 1 && v <= 1e18))) {
      char text[32];
      std::snprintf(text, sizeof text, "%g", v);
      return InvalidArgumentError("machine rates: " + std::string(f.key) + " is " + text +
                                  "; accepted: 0 (unknown) or a rate from 1 to 1e18 per second");
    }
  }
  if (!(r.comm_latency_s >= 0 && r.comm_latency_s <= 3600)) {
    char v[32];
    std::snprintf(v, sizeof v, "%g", r.comm_latency_s);
    return InvalidArgumentError("machine rates: comm_latency_s is " + std::string(v) +
                                "; accepted: 0 to 3600 s");
  }
  return Status::OK();
}

std::string PlanJson(const PlanPrediction& p) {
  auto tier = [](const TierPrediction& t) { return json{{"peak", t.peak}, {"budget", t.budget}}; };
  const json j = {
      {"fits", p.fits},
      {"failing_tier", p.failing_tier},
      {"problem", p.problem},
      {"world_size", p.world_size},
      {"layout",
       {{"chunk_elems", p.chunk_elems},
        {"chunk_bytes", p.chunk_bytes},
        {"shard_bytes", p.shard_bytes},
        {"chunks", p.chunks}}},
      {"placement",
       {{"param_shards",
         {{"device", p.param_shards[0]}, {"host", p.param_shards[1]}, {"nvme", p.param_shards[2]}}},
        {"optimizer_groups",
         {{"device", p.optimizer_groups[0]},
          {"host", p.optimizer_groups[1]},
          {"nvme", p.optimizer_groups[2]}}},
        {"summary", p.placement_summary}}},
      {"memory",
       {{"device", tier(p.device)},
        {"host", tier(p.host)},
        {"nvme", tier(p.nvme)},
        {"device_parts",
         {{"resident", p.device_resident},
          {"slots", p.device_slots},
          {"activations", p.device_activations},
          {"grads", p.device_grads},
          {"update", p.device_update}}},
        {"device_fragmentation_allowance", p.device_fragmentation_allowance},
        {"slots", p.slots}}},
      {"bytes_per_step",
       {{"h2d", p.h2d_bytes},
        {"d2h", p.d2h_bytes},
        {"nvme_read", p.nvme_read_bytes},
        {"nvme_write", p.nvme_write_bytes},
        {"comm", p.comm_bytes},
        {"iteration",
         {{"h2d", p.iteration_h2d_bytes},
          {"d2h", p.iteration_d2h_bytes},
          {"nvme_read", p.iteration_nvme_read_bytes},
          {"comm", p.iteration_comm_bytes}}}}},
      {"optimizer",
       {{"cpu", p.optimizer_cpu},
        {"device_resident", p.optimizer_resident},
        {"device_streamed", p.optimizer_streamed},
        {"reason", p.optimizer_reason}}},
      {"time",
       {{"step_s", p.step_s},
        {"compute_s", p.compute_s},
        {"param_wait_s", p.param_wait_s},
        {"optimizer_s", p.optimizer_s},
        {"optimizer_nvme_s", p.optimizer_nvme_s},
        {"transfer_s", p.transfer_s},
        {"comm_s", p.comm_s},
        {"collectives", p.collectives},
        {"other_s", p.other_s},
        {"tokens_per_step", p.tokens_per_step}}},
      {"rates", p.rates_name},
      {"assumed_rates", p.assumed_rates}};
  return j.dump(1, ' ', false, json::error_handler_t::replace);
}

std::string PlanTable(const PlanPrediction& p) {
  std::string s;
  // Each line whole, however long (a placement failure's message runs to several hundred bytes).
  auto add = [&](const char* fmt, auto... args) {
    const int n = std::snprintf(nullptr, 0, fmt, args...);
    if (n <= 0) return;
    std::string line(static_cast<size_t>(n) + 1, '\0');
    std::snprintf(line.data(), line.size(), fmt, args...);
    line.resize(static_cast<size_t>(n));
    s += line;
  };
  add("layout: %d chunks of %s (%" PRIu64 " elements), %d rank%s\n", p.chunks,
      FormatBytes(p.chunk_bytes).c_str(), p.chunk_elems, p.world_size,
      p.world_size == 1 ? "" : "s");
  if (!p.placement_summary.empty()) add("placement: %s\n", p.placement_summary.c_str());
  if (!p.problem.empty()) add("DOES NOT FIT (%s): %s\n", p.failing_tier.c_str(), p.problem.c_str());
  if (p.device.budget == 0 && p.host.peak == 0) return s;  // placement failed: nothing more
  add("\n%-8s %14s %14s %8s\n", "memory", "peak", "budget", "used");
  auto row = [&](const char* name, const TierPrediction& t) {
    add("%-8s %14s %14s %7.0f%%\n", name, Mib(t.peak).c_str(),
        t.budget > 0 ? Mib(t.budget).c_str() : "-",
        t.budget > 0 ? 100.0 * static_cast<double>(t.peak) / static_cast<double>(t.budget) : 0.0);
  };
  row("device", p.device);
  row("host", p.host);
  row("nvme", p.nvme);
  add("  device: its budget is its capacity (the budgets and a margin of four chunks and 1 MiB); "
      "resident %s, %d slots %s, activations %s, gradient chunks %s, update %s; kept "
      "free against fragmentation %s\n",
      Mib(p.device_resident).c_str(), p.slots, Mib(p.device_slots).c_str(),
      Mib(p.device_activations).c_str(), Mib(p.device_grads).c_str(), Mib(p.device_update).c_str(),
      Mib(p.device_fragmentation_allowance).c_str());
  add("\nper step: H2D %s, D2H %s, NVMe read %s, write %s", Mib(p.h2d_bytes).c_str(),
      Mib(p.d2h_bytes).c_str(), Mib(p.nvme_read_bytes).c_str(), Mib(p.nvme_write_bytes).c_str());
  if (p.world_size > 1) add(", collectives %s", Mib(p.comm_bytes).c_str());
  add("\noptimizer: %d groups on the CPU, %d resident on the device, %d streamed to it\n",
      p.optimizer_cpu, p.optimizer_resident, p.optimizer_streamed);
  add("\nstep %s = compute %s + waits for parameters %s + optimizer %s (of it NVMe %s)",
      Ms(p.step_s).c_str(), Ms(p.compute_s).c_str(), Ms(p.param_wait_s).c_str(),
      Ms(p.optimizer_s).c_str(), Ms(p.optimizer_nvme_s).c_str());
  if (p.comm_s > 0) add(" + collectives %s", Ms(p.comm_s).c_str());
  add(" + other %s\n", Ms(p.other_s).c_str());
  if (p.collectives > 0) add("  %d collectives per step\n", p.collectives);
  if (p.tokens_per_step > 0 && p.step_s > 0) add("  %.0f tokens/s\n", p.tokens_per_step / p.step_s);
  if (!p.rates_name.empty()) add("  rates: %s\n", p.rates_name.c_str());
  if (!p.assumed_rates.empty()) {
    std::string names;
    for (const std::string& n : p.assumed_rates) names += (names.empty() ? "" : ", ") + n;
    add("  (times assume these rates, not given: %s)\n", names.c_str());
  }
  return s;
}

}  // namespace tierzero
