// A plan's prediction beside the run it predicted (tierzero/report.h, docs/plan.md): checked to
// be of this run, then compared row by row with what the report measured. The comparison is
// written into the report ("prediction": {"plan", "compared"}) so the summary and the page show
// it without a second copy of the rules.
#include <cmath>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/json_in.h"
#include "profiler/report_numbers.h"
#include "tierzero/report.h"

namespace tierzero {
namespace {

using json = nlohmann::json;

struct Row {
  std::string what, unit;  // unit: "bytes", "seconds", "count"
  double predicted = 0, measured = 0;
  std::string note;
};

StatusOr<double> Get(const JsonIn& in, std::initializer_list<const char*> path) {
  JsonIn at = in;
  const char* const* last = path.end() - 1;
  for (const char* const* k = path.begin(); k != last; ++k) {
    ASSIGN_OR_RETURN(at, at.at(*k));
  }
  return at.get<double>(*last);
}

// Every figure of the plan a comparison may read, read whole before any is compared: read
// only where the run had what it predicts (a profiled iteration, an update phase), a plan
// missing one was passed at train's set-up and refused after the run, its report lost (hunt 49).
struct PlanFigures {
  int64_t world = 0, chunks = 0, chunk_bytes = 0;
  double dev = 0, host = 0, nvme = 0;
  double shards[3] = {0, 0, 0};     // parameter shards on the device, in host memory, on NVMe
  double optimizer[3] = {0, 0, 0};  // groups on the CPU, resident on the device, streamed
  double step = 0, compute = 0, wait = 0, update = 0, comm = 0;
  bool has_iteration = false;
  double iteration[4] = {0, 0, 0, 0};  // H2D, D2H, NVMe reads, collectives, per iteration
};

const char* const kTiers[3] = {"device", "host", "nvme"};
const char* const kPlaces[3] = {"cpu", "device_resident", "device_streamed"};
const char* const kIterationLinks[4] = {"h2d", "d2h", "nvme_read", "comm"};

StatusOr<PlanFigures> ReadPlanFigures(const JsonIn& p) {
  PlanFigures f;
  ASSIGN_OR_RETURN(f.world, p.get<int64_t>("world_size"));
  ASSIGN_OR_RETURN(const JsonIn pl, p.at("layout"));
  ASSIGN_OR_RETURN(f.chunks, pl.get<int64_t>("chunks"));
  ASSIGN_OR_RETURN(f.chunk_bytes, pl.get<int64_t>("chunk_bytes"));
  ASSIGN_OR_RETURN(f.dev, Get(p, {"memory", "device", "peak"}));
  ASSIGN_OR_RETURN(f.host, Get(p, {"memory", "host", "peak"}));
  ASSIGN_OR_RETURN(f.nvme, Get(p, {"memory", "nvme", "peak"}));
  for (int t = 0; t < 3; ++t) {
    ASSIGN_OR_RETURN(f.shards[t], Get(p, {"placement", "param_shards", kTiers[t]}));
    ASSIGN_OR_RETURN(f.optimizer[t], Get(p, {"optimizer", kPlaces[t]}));
    // (Counts: 6.5 shards was shown as "6 / 7".)
    if (f.shards[t] != std::floor(f.shards[t]))
      return p.Error(std::string("placement.param_shards.") + kTiers[t] + " must be a whole count");
    if (f.optimizer[t] != std::floor(f.optimizer[t]))
      return p.Error(std::string("optimizer.") + kPlaces[t] + " must be a whole count");
  }
  ASSIGN_OR_RETURN(const JsonIn time, p.at("time"));
  ASSIGN_OR_RETURN(f.step, time.get<double>("step_s"));
  ASSIGN_OR_RETURN(f.compute, time.get<double>("compute_s"));
  ASSIGN_OR_RETURN(f.wait, time.get<double>("param_wait_s"));
  ASSIGN_OR_RETURN(f.update, time.get<double>("optimizer_s"));
  ASSIGN_OR_RETURN(f.comm, time.get_or<double>("comm_s", 0.0));
  ASSIGN_OR_RETURN(const JsonIn bytes, p.at("bytes_per_step"));
  if (!bytes.is_object()) return bytes.Error("must be an object");
  f.has_iteration = bytes.has("iteration");
  if (f.has_iteration) {
    ASSIGN_OR_RETURN(const JsonIn pi, bytes.at("iteration"));
    for (int l = 0; l < 4; ++l) {
      ASSIGN_OR_RETURN(f.iteration[l], pi.get<double>(kIterationLinks[l]));
    }
  }
  return f;
}

// The run's own numbers for each row the plan predicts.
StatusOr<std::vector<Row>> Compare(const JsonIn& r, const PlanFigures& f) {
  std::vector<Row> rows;
  // Which run: the plan of another config or rank count is refused, not compared.
  const int64_t world = f.world, chunks = f.chunks, chunk_bytes = f.chunk_bytes;
  int64_t run_world = 1;
  if (r.has("ranks")) {
    ASSIGN_OR_RETURN(const JsonIn ranks, r.at("ranks"));
    ASSIGN_OR_RETURN(run_world, ranks.get<int64_t>("world_size"));
  }
  ASSIGN_OR_RETURN(const JsonIn layout, r.at("layout"));
  ASSIGN_OR_RETURN(const std::vector<JsonIn> run_chunks, layout.elements("chunks"));
  ASSIGN_OR_RETURN(const int64_t run_chunk_bytes, layout.get<int64_t>("chunk_bytes"));
  if (world != run_world || chunks != static_cast<int64_t>(run_chunks.size()) ||
      chunk_bytes != run_chunk_bytes) {
    return FailedPreconditionError(
        "the plan is of " + std::to_string(chunks) + " chunks of " + std::to_string(chunk_bytes) +
        " bytes on " + std::to_string(world) + " rank(s); this run has " +
        std::to_string(run_chunks.size()) + " of " + std::to_string(run_chunk_bytes) + " on " +
        std::to_string(run_world) + ": plan with the run's config and --ranks");
  }

  // Memory per tier.
  const double dev = f.dev, host = f.host, nvme = f.nvme;
  ASSIGN_OR_RETURN(const double dev_m, Get(r, {"tiers", "device", "peak"}));
  ASSIGN_OR_RETURN(const double host_m, Get(r, {"tiers", "host", "used"}));
  ASSIGN_OR_RETURN(const double nvme_m, Get(r, {"tiers", "nvme", "used"}));
  rows.push_back({"device peak", "bytes", dev, dev_m, ""});
  rows.push_back({"host", "bytes", host, host_m, ""});
  rows.push_back({"NVMe", "bytes", nvme, nvme_m, ""});

  // Placement: parameter shards per tier, optimizer groups per place.
  double shards_m[3] = {0, 0, 0};
  for (const JsonIn& c : run_chunks) {
    ASSIGN_OR_RETURN(const std::string t, c.get<std::string>("param_tier"));
    shards_m[t == "device" ? 0 : t == "host" ? 1 : 2] += 1;
  }
  const char* tier_names[3] = {"the device", "host memory", "NVMe"};
  for (int t = 0; t < 3; ++t) {
    const double shards = f.shards[t];
    if (shards > 0 || shards_m[t] > 0)
      rows.push_back(
          {std::string("parameter shards in ") + tier_names[t], "count", shards, shards_m[t], ""});
  }
  ASSIGN_OR_RETURN(const JsonIn opt, r.at("optimizer"));
  ASSIGN_OR_RETURN(const std::vector<JsonIn> groups, opt.elements("sub_groups"));
  double where_m[3] = {0, 0, 0};
  for (const JsonIn& g : groups) {
    ASSIGN_OR_RETURN(const std::string w, g.get_or<std::string>("update", "cpu"));
    where_m[w == "cpu" ? 0 : w == "device" ? 1 : 2] += 1;
  }
  const char* place_names[3] = {"optimizer groups on the CPU",
                                "optimizer groups resident on the device",
                                "optimizer groups streamed to the device"};
  for (int w = 0; w < 3; ++w) {
    const double n = f.optimizer[w];
    if (n > 0 || where_m[w] > 0) rows.push_back({place_names[w], "count", n, where_m[w], ""});
  }

  // Time.
  const double step = f.step, compute = f.compute, wait = f.wait, optimizer = f.update,
               comm = f.comm;
  ASSIGN_OR_RETURN(const JsonIn counters, r.at("counters"));
  ASSIGN_OR_RETURN(const double step_m, counters.get_or<double>("step_seconds_median", 0.0));
  ASSIGN_OR_RETURN(const double steps, counters.get<double>("steps"));
  ASSIGN_OR_RETURN(const double accum, Get(r, {"config", "grad_accumulation"}));
  if (accum < 1) return r.Error("config.grad_accumulation must be >= 1");
  if (step_m > 0)
    rows.push_back({"step", "seconds", step, step_m, "the median of the run's last 256 steps"});
  if (opt.has("update_phase")) {
    ASSIGN_OR_RETURN(const double phase_m, Get(opt, {"update_phase", "measured_median_seconds"}));
    rows.push_back({"update phase", "seconds", optimizer, phase_m, ""});
  }
  ASSIGN_OR_RETURN(const double skipped, counters.get_or<double>("skipped_steps", 0.0));
  if (comm > 0 && steps + skipped > 0 && r.has("ranks")) {
    // The training iterations' collectives over every step the loop took (a skipped one's
    // iterations ran them too); a report of an older tierzero has the whole run's only.
    ASSIGN_OR_RETURN(const JsonIn ranks, r.at("ranks"));
    const bool train_only = ranks.has("train_comm_seconds");
    ASSIGN_OR_RETURN(const double comm_m,
                     ranks.get<double>(train_only ? "train_comm_seconds" : "comm_seconds"));
    rows.push_back({"collectives per step", "seconds", comm, comm_m / (steps + skipped),
                    train_only ? "measured: the training iterations' average, warm-up included"
                               : "measured: the run's average, warm-up and evaluations included"});
  }

  // The profiled iteration: its compute, waits and bytes per link.
  ASSIGN_OR_RETURN(const JsonIn prof, r.at("profile"));
  ASSIGN_OR_RETURN(const bool available, prof.get_or<bool>("available", false));
  if (available) {
    ASSIGN_OR_RETURN(const double fwd, Get(prof, {"breakdown", "forward_seconds"}));
    ASSIGN_OR_RETURN(const double bwd, Get(prof, {"breakdown", "backward_seconds"}));
    ASSIGN_OR_RETURN(const double wait_m, Get(prof, {"breakdown", "parameter_wait_seconds"}));
    const std::string it = "the profiled iteration";
    rows.push_back({"compute per iteration", "seconds", compute / accum, fwd + bwd, it});
    rows.push_back({"waits for parameters per iteration", "seconds", wait / accum, wait_m, it});
    if (f.has_iteration) {
      ASSIGN_OR_RETURN(const JsonIn links, prof.at("links"));
      struct Link {
        const char* link;
        const char* field;
        const char* name;
      } ls[4] = {{"h2d", "bytes", "H2D per iteration"},  // (kIterationLinks' order)
                 {"d2h", "bytes", "D2H per iteration"},
                 {"nvme_read", "bytes", "NVMe reads of parameters per iteration"},
                 // The plan predicts the collectives' payload; ZeRO++'s quantization sends less
                 // (the report's bytes_on_wire beside it).
                 {"collective", "bytes_before_quantization",
                  "collectives' bytes per iteration (before quantization)"}};
      for (int i = 0; i < 4; ++i) {
        const Link& l = ls[i];
        const double b = f.iteration[i];
        double b_m = 0;
        if (links.has(l.link)) {
          ASSIGN_OR_RETURN(b_m, Get(links, {l.link, l.field}));
        }
        if (b > 0 || b_m > 0) rows.push_back({l.name, "bytes", b, b_m, it});
      }
    }
  }
  // A row of nothing on either side (no NVMe in the run and none predicted) says nothing.
  std::erase_if(rows, [](const Row& row) { return row.predicted == 0 && row.measured == 0; });
  return rows;
}

}  // namespace

StatusOr<std::string> WithPrediction(const std::string& report_json, const std::string& plan_json) {
  // Note [A plan the report can hold]: the report holds the plan two levels down
  // (prediction.plan), and re-indented. A plan nested 64 deep passed the depth bound of outside
  // JSON and made a report 65 deep that no command could read again; one of 8.6 MiB of nested
  // arrays a report of 279 MB, over a report's bound (hunt 49). A plan is a few KiB and 4 deep.
  if (plan_json.size() > kMaxPlanBytes)
    return InvalidArgumentError("the plan is " + std::to_string(plan_json.size()) +
                                " bytes, more than any plan (tierzero plan --json writes a few "
                                "KiB; the most taken is " +
                                std::to_string(kMaxPlanBytes) + ")");
  ASSIGN_OR_RETURN(json r, ParseOutsideJson(report_json, "the report"));
  if (!r.is_object()) return InvalidArgumentError("the report is not a JSON object");
  ASSIGN_OR_RETURN(json plan, ParseOutsideJson(plan_json, "the plan"));
  if (!plan.is_object())
    return InvalidArgumentError("the plan is not a JSON object (tierzero plan --json writes one)");
  const JsonIn rin(r, "report");
  const JsonIn pin(plan, "plan");
  RETURN_IF_ERROR(rin.CheckDepth(kMaxJsonDepth));
  RETURN_IF_ERROR(pin.CheckDepth(kMaxJsonDepth - 2));
  // A `tierzero plan --json` file, or the prediction object alone (PlanJson).
  json prediction = plan;
  // (A plan file with its schema removed is not the prediction object alone: said so, not
  // "fits is missing" of a plan that has it.)
  if (!plan.contains("schema") && plan.contains("prediction"))
    return pin.Error(
        "has no schema (a tierzero plan --json file has \"schema\": \"tierzero.plan/1\"): was it "
        "edited? make it again with tierzero plan ... --json FILE");
  if (plan.contains("schema")) {
    ASSIGN_OR_RETURN(const std::string schema, pin.get<std::string>("schema"));
    if (schema != "tierzero.plan/1")
      return pin.Error("schema is \"" + schema + "\"; this tierzero reads \"tierzero.plan/1\"");
    ASSIGN_OR_RETURN(const JsonIn inner, pin.at("prediction"));
    prediction = inner.raw();
  }
  // Its numbers in a report's range, said of the plan: a plan edited to hold -1 or 1e300 joined
  // the run's report, which the run then could not render at its end, nor `report` ever after
  // (hunt 46).
  RETURN_IF_ERROR(CheckReportNumbers(prediction, "the plan: prediction"));
  const JsonIn p(prediction, "plan: prediction");
  ASSIGN_OR_RETURN(const bool fits, p.get<bool>("fits"));
  // (FailedPrecondition, as report.h says: a plan of a run that does not fit is a plan, well
  // formed, of another case than this run's; hunt 48.)
  if (!fits)
    return FailedPreconditionError("the plan says the run does not fit: nothing to compare with");
  ASSIGN_OR_RETURN(const PlanFigures figures, ReadPlanFigures(p));
  ASSIGN_OR_RETURN(const std::vector<Row> rows, Compare(rin, figures));
  json compared = json::array();
  for (const Row& row : rows) {
    json c = {{"what", row.what},
              {"unit", row.unit},
              {"predicted", row.predicted},
              {"measured", row.measured}};
    if (!row.note.empty()) c["note"] = row.note;
    compared.push_back(std::move(c));
  }
  r["prediction"] = {{"plan", prediction}, {"compared", compared}};
  return r.dump(1, ' ', false, json::error_handler_t::replace);
}

}  // namespace tierzero
