// Whether a `tierzero plan --json` file is of this run: `train --plan` checks the config it
// records against the run's before the engine is built, `report --plan` against what the report
// records of the run. A plan of another config is refused, naming the fields that differ: its
// predictions shown beside the run would pass for the run's (Note [A plan of another run]).
#include "plan_check.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gpt/hf.h"
#include "resume.h"
#include "tierzero/bytes.h"
#include "tierzero/files.h"

namespace tierzero::app {

using json = nlohmann::json;

namespace {

// The refusal of a plan whose fields differ from the run's: `differ` lists the first three of
// the `n` that do (OK when none).
Status AnotherConfig(const std::string& differ, int n) {
  if (n == 0) return Status::OK();
  return FailedPreconditionError(
      "the plan is of another config (" + differ +
      (n > 3 ? ", and " + std::to_string(n - 3) + " more" : "") +
      "): its predictions are not this run's. Plan the run's config (tierzero plan with its "
      "--config and flags, --json FILE) and give that");
}

}  // namespace

// plan_check.h
namespace {

Status NotTheConfigPlanWrites(const json& plan_config) {
  std::string shown = plan_config.is_array()
                          ? "an array"
                          : plan_config.dump(-1, ' ', false, json::error_handler_t::replace);
  if (shown.size() > 40) shown = shown.substr(0, 37) + "...";
  return FailedPreconditionError("the plan's config is " + shown +
                                 ", not the object tierzero plan writes (edited?), so the plan "
                                 "cannot be checked to be this run's: make it again with tierzero "
                                 "plan (the run's config and options) --json FILE");
}

}  // namespace

// plan_check.h
bool IsATracesPlan(const json& plan) {
  if (!plan.is_object() || !plan.contains("trace")) return false;
  const auto cfg = plan.find("config");
  // (`plan --trace` leaves out the model and the train sections: the trace fixes them. A plan
  // with a "trace" added and its config whole is checked as any plan is.)
  return cfg == plan.end() || !cfg->is_object() ||
         (!cfg->contains("model") && !cfg->contains("train"));
}

Status CheckPlanConfig(const json& plan_config, const RunConfig& run, bool of_trace) {
  const json ran = json::parse(RunConfigToJson(run), nullptr, /*allow_exceptions=*/false);
  // (A plan with no config at all is an older tierzero's: its caller says so.)
  if (!plan_config.is_object()) return NotTheConfigPlanWrites(plan_config);
  // What shapes the prediction: the model but its seed; the batch; every engine setting but
  // Adam's hyperparameters and where NVMe lives; ZeRO++; how the ranks talk.
  const std::vector<std::pair<std::string, std::string>> fields = [&] {
    std::vector<std::pair<std::string, std::string>> f;
    // (A trace's plan is of the trace's model at its batch: train --plan checks its layout.)
    for (const char* section : {"model", "engine", "zeropp"}) {
      if (!ran.contains(section) || (of_trace && std::string(section) == "model")) continue;
      for (const auto& [k, v] : ran[section].items()) f.emplace_back(section, k);
    }
    if (!of_trace) f.emplace_back("train", "batch_size");
    f.emplace_back("ranks", "collectives");
    return f;
  }();
  const std::vector<std::string> skip = {
      "model.seed",
      "model.token_ids",  // a record (Note [Special tokens
                          // carried]); a plan before it has none
      "engine.beta1", "engine.beta2", "engine.eps", "engine.weight_decay", "engine.clip_grad_norm",
      "engine.nvme_path", "engine.initial_loss_scale", "engine.loss_scale_window"};
  bool sized_to_machine = !run.output.init_from.empty();
  for (const char* f : {"engine.device_budget", "engine.device_shard_budget", "engine.host_budget",
                        "engine.nvme_budget"})
    sized_to_machine &= run.given.count(f) == 0;
  // A resume of such a run records the budgets it was given (shared among its ranks), and takes
  // no --init-from: the planned run's did (hunt 40: its resume was refused as another config).
  const auto planned_out = plan_config.find("output");
  if (!run.output.resume.empty() && planned_out != plan_config.end() && planned_out->is_object() &&
      planned_out->contains("init_from") && (*planned_out)["init_from"].is_string() &&
      !(*planned_out)["init_from"].get<std::string>().empty())
    sized_to_machine = true;
  std::string differ;
  int n = 0;
  // (The models compared as they compute: n_kv_head 0 and n_head's count are one model.)
  const auto planned_model = plan_config.find("model");
  const json ran_model = EffectiveModel(ran["model"]);
  const json plan_model =
      planned_model != plan_config.end() ? EffectiveModel(*planned_model) : json::object();
  for (const auto& [section, key] : fields) {
    const std::string name = section + "." + key;
    if (std::find(skip.begin(), skip.end(), name) != skip.end()) continue;
    const bool model = section == "model" && plan_model.is_object();
    const json& now = model ? ran_model[key] : ran[section][key];
    const auto s = plan_config.find(section);
    const json planned = model ? plan_model.value(key, json())
                         : s != plan_config.end() && s->is_object() && s->contains(key) ? (*s)[key]
                                                                                        : json();
    // (A device left to "auto" is the one the other names, on the machine both ran on.)
    if (name == "engine.device" && (now == "auto" || planned == "auto")) continue;
    // Budgets a model brought from a directory was given from the machine's free memory (Note
    // [Budgets of a model brought from a directory]): they drift between the plan and the run.
    if (sized_to_machine && section == "engine" && key.ends_with("_budget")) continue;
    if (planned == now) continue;
    if (++n <= 3)
      differ += (differ.empty() ? "" : ", ") + name + " " + planned.dump() + " in the plan, " +
                now.dump() + " here";
  }
  return AnotherConfig(differ, n);
}

// Note [A plan of another run]
// A plan predicts one config: its model (but the seed), batch, budgets, accumulation, optimizer
// placement and moments, ZeRO++ and ranks. Shown beside a run of another config, its figures
// pass for that run's prediction, so either command refuses it, naming what differs:
// - `train --plan` has the run's whole config (CheckPlanConfig). A plan of a recorded trace
//   (`plan --trace`) records the engine's settings it was made with but no model or batch: the
//   trace's model is checked by its layout, which the trace fixes, and its batch is the trace's.
// - `report --plan` has what the report records of the run (CheckPlanOfReport): its model
//   section and batch, budgets, accumulation, compute dtype, optimizer mode and moments and ZeRO++
//   (the layout and rank count are compared in WithPrediction, src/profiler/report_prediction.cc).
//   The batch is the report's `model.batch_size` (reports from before 2026-11-29 lack it).
// Budgets a model brought from a directory was given from the machine's free memory drift
// between the plan and the run (Note [Budgets of a model brought from a directory]): they are
// not compared for such a plan.
Status CheckPlanOfReport(const std::string& report_text, const std::string& plan_text) {
  // Outside JSON: its depth bounded before anything copies or recurses over it (a plan or report
  // nested 500000 deep overflowed the stack: review 47, as train's in hunt 45).
  TZ_RETURN_IF_ERROR(CheckOutsideJson(report_text, "the report"));
  TZ_RETURN_IF_ERROR(CheckOutsideJson(plan_text, "the plan"));
  const json report = json::parse(report_text, nullptr, /*allow_exceptions=*/false);
  const json plan = json::parse(plan_text, nullptr, /*allow_exceptions=*/false);
  if (!report.is_object() || !plan.is_object()) return Status::OK();  // (WithPrediction says)
  const auto cfg = plan.find("config");
  // A plan that records no config cannot be checked to be the report's run (an older
  // tierzero's, or edited): `train --plan` refuses it, and so does this (hunt 49: a plan of
  // another batch, its config removed, was shown beside the run).
  if (cfg == plan.end())
    return FailedPreconditionError(
        "the plan records no config (an older tierzero wrote it, or it was edited), so it cannot "
        "be checked to be this run's: make it again with tierzero plan (the run's config and "
        "options) --json FILE");
  if (!cfg->is_object()) return NotTheConfigPlanWrites(*cfg);
  const bool of_trace = IsATracesPlan(plan);
  auto section = [](const json& j, const char* key) {
    const auto it = j.find(key);
    return it != j.end() && it->is_object() ? *it : json::object();
  };
  std::string differ;
  int n = 0;
  auto compare = [&](const std::string& name, const json& planned, const json& ran) {
    if (planned.is_null() || ran.is_null() || planned == ran) return;
    if (++n <= 3)
      differ += (differ.empty() ? "" : ", ") + name + " " + planned.dump() + " in the plan, " +
                ran.dump() + " in the report";
  };
  // What the report records and the plan does not is another config too: a plan's config names
  // every field, and an older report's missing ones are passed over.
  auto compare_all = [&](const std::string& name, const json& planned, const json& ran) {
    if (ran.is_null() || planned == ran) return;
    if (++n <= 3)
      differ += (differ.empty() ? "" : ", ") + name + " " + planned.dump() + " in the plan, " +
                ran.dump() + " in the report";
  };
  // The model, as it computes (n_kv_head 0 is n_head's), but its seed; and the batch (a report of
  // an older tierzero does not record it). A trace's plan is of the trace's (Note [A plan of
  // another run]): the layout, compared in WithPrediction, is what checks it.
  if (!of_trace) {
    const json planned_model = EffectiveModel(section(*cfg, "model"));
    const json ran_model = EffectiveModel(section(section(report, "model"), "config"));
    for (const auto& [key, value] : ran_model.items())
      if (key != "seed" && !RecordedBeside(key))
        compare_all("model." + key, planned_model.value(key, json()), value);
    compare_all("train.batch_size", section(*cfg, "train").value("batch_size", json()),
                section(report, "model").value("batch_size", json()));
  }
  // The engine's settings the report records.
  const json engine = section(*cfg, "engine");
  const json ran = section(report, "config");
  const json init_from = section(*cfg, "output").value("init_from", json());
  if (!init_from.is_string() || init_from.get<std::string>().empty()) {
    for (const char* key : {"device_budget", "device_shard_budget", "host_budget", "nvme_budget"}) {
      const json v = engine.value(key, json());
      std::optional<uint64_t> planned;
      if (v.is_number_unsigned()) planned = v.get<uint64_t>();
      if (v.is_string())
        if (auto b = ParseByteSize(v.get<std::string>()); b.ok()) planned = *b;
      const json r = ran.value(key, json());
      if (planned && r.is_number_unsigned() && *planned != r.get<uint64_t>())
        compare(std::string("engine.") + key, json(FormatBytes(*planned)),
                json(FormatBytes(r.get<uint64_t>())));
    }
  }
  for (const char* key : {"grad_accumulation", "compute_dtype"})
    compare(std::string("engine.") + key, engine.value(key, json()), ran.value(key, json()));
  const json phase = section(section(report, "optimizer"), "update_phase");
  // (A device fraction is recorded as "device fraction", not its value.)
  const json optimizer = engine.value("optimizer", json());
  compare("engine.optimizer", optimizer.is_number() ? json("device fraction") : optimizer,
          phase.value("mode", json()));
  compare("engine.optimizer_states", engine.value("optimizer_states", json()),
          phase.value("moments", json()));
  // (ZeRO++ is off on one rank, whatever its config asks: the report says what ran.)
  const json ranks = section(report, "ranks");
  const json zeropp =
      ranks.value("world_size", json(1)) == json(1) ? json::object() : section(ranks, "zeropp");
  const json planned_zeropp = section(*cfg, "zeropp");
  for (const auto& [key, value] : planned_zeropp.items())
    if (zeropp.contains(key)) compare("zeropp." + key, value, zeropp[key]);
  return AnotherConfig(differ, n);
}

// Note [What the plan of a run train refuses says]
// `plan` exits 0 with a plan of the run it is given; a run `train` refuses at set-up has no such
// plan (hunt 48: a plan "fits" and exit 0 for each of the cases below, then train refused). What
// is on another machine is only said: a run is often planned where it will not run (its data and
// its --init-from, as the data's note says).
Status CheckPlannable(RunConfig& cfg) {
  // (The checkpoint's step is not read here: a resume past the step only gets train's note.)
  if (cfg.output.resume.empty()) TZ_RETURN_IF_ERROR(CheckProfileStep(cfg, 0, /*say=*/false));
  struct stat st {};
  if (cfg.engine.nvme_budget > 0 && !cfg.engine.nvme_path.empty() &&
      ::stat(cfg.engine.nvme_path.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
    return InvalidArgumentError("nvme_path (--nvme-path) " + cfg.engine.nvme_path + " is " +
                                FileKindName(st.st_mode) +
                                ", not a directory: the NVMe tier's swap files go in a "
                                "directory (`tierzero train` refuses it)");
  const std::string& from = cfg.output.init_from;
  if (from.empty()) return Status::OK();
  if (::stat(from.c_str(), &st) != 0) {
    std::fprintf(stderr,
                 "note: the run's --init-from %s is not here (%s): planned the model the config "
                 "and flags give; `tierzero train` needs it, and takes its model from it\n",
                 from.c_str(), std::strerror(errno));
    return Status::OK();
  }
  // (A file with tierzero's model record is its model's, whatever its tensors' names.)
  if (!S_ISDIR(st.st_mode) && gpt::HasHfTensorNames(from)) {
    auto metadata = ReadSafetensorsMetadata(from);
    if (metadata.ok() && metadata->count("tierzero.model") == 0)
      return InvalidArgumentError("--init-from " + from + ": " +
                                  WeightsFileOfAModelDirectory(from));
  }
  return Status::OK();
}

}  // namespace tierzero::app
