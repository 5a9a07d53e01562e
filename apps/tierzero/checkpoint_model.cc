// resume.h: a checkpoint's model against a run's (Note [A checkpoint resumes its own model], Note
// [The checkpoint's model]): the model section as recorded and as it computes, the comparison,
// what eval and export take from a checkpoint, and the run's config.json beside it. The rest of
// what a resumed run reads back is resume.cc.
#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <system_error>

#include "resume.h"

namespace tierzero::app {
namespace fs = std::filesystem;
using nlohmann::json;

json ModelJson(const RunConfig& cfg) {
  return json::parse(RunConfigToJson(cfg), nullptr, /*allow_exceptions=*/false)["model"];
}

// resume.h
json EffectiveModel(const json& model) {
  json m = model;
  if (!m.is_object()) return m;
  gpt::GptConfig g;
  auto take = [&](const char* key, int& into) {
    const auto it = m.find(key);
    if (it != m.end() && it->is_number_integer()) into = it->get<int>();
  };
  take("d_model", g.d_model);
  take("d_ff", g.d_ff);
  take("n_head", g.n_head);
  take("n_kv_head", g.n_kv_head);
  const auto arch = m.find("arch");
  g.arch = arch != m.end() && *arch == "llama" ? gpt::Arch::kLlama : gpt::Arch::kGpt2;
  if (m.contains("n_kv_head") && g.n_head > 0) m["n_kv_head"] = g.kv_heads();
  if (m.contains("d_ff") && g.d_model > 0) m["d_ff"] = g.ffn();
  return m;
}

std::string ModelValueShown(const json& model, const std::string& key) {
  const json raw = model.is_object() ? model.value(key, json()) : json();
  const json effective = EffectiveModel(model).value(key, json());
  return raw.dump() + (raw == effective ? "" : " (" + effective.dump() + " as it computes)");
}

bool HowTheModelComputes(const std::string& key) {
  return key == "seed" || key == "activation_checkpointing" || key == "activations";
}

// resume.h
bool RecordedBeside(const std::string& key) { return key == "token_ids"; }

namespace {

// Note [A checkpoint resumes its own model]
// The checkpoint's user state records the whole model section; a resumed run's must agree on
// every field that shapes the computation (a different --heads has the same parameter shapes and
// loaded silently, then computed another model). The seed (initialisation only) and activation
// checkpointing (memory, not arithmetic) may change. Checkpoints from before this was recorded
// are checked by their parameters' shapes only.
// `trains`: the command trains on (its advice names --run-dir), else it reads the model alone.
Status CheckSameModelJson(const json& user, const json& now, const std::string& dir,
                          bool trains = true) {
  if (!user.is_object() || !user.contains("model") || !user["model"].is_object())
    return Status::OK();
  static const std::map<std::string, std::string> kFlag = {
      {"n_layer", "--layers"}, {"d_model", "--width"},      {"n_head", "--heads"},
      {"arch", "--arch"},      {"n_kv_head", "--kv-heads"}, {"seq_len", "--seq-len"},
      {"vocab", "--vocab"}};
  // (Compared as they compute: n_kv_head 0 is n_head's, d_ff 0 the default width, as a run
  // seeded from a model directory records them.)
  const json was = EffectiveModel(user["model"]), is = EffectiveModel(now);
  // The fields d_ff and n_kv_head compute from last: a checkpoint of another --width was said
  // to differ in "d_ff 0 (512 as it computes)", from 0 (hunt 47).
  std::vector<std::string> keys;
  for (const auto& [key, then] : was.items())
    if (key != "d_ff" && key != "n_kv_head") keys.push_back(key);
  keys.insert(keys.end(), {"d_ff", "n_kv_head"});
  for (const std::string& key : keys) {
    if (HowTheModelComputes(key) || RecordedBeside(key) || !was.contains(key))
      continue;  // (what it is may not change)
    const json& then = was[key];
    const auto it = is.find(key);
    if (it == is.end() || *it == then) continue;
    const auto flag = kFlag.find(key);
    // The run's config beside the checkpoint, with the directory it is in now: a run directory
    // moved since records its old path, and its config alone continued the run there, a copy
    // (hunt 51).
    std::error_code ec;
    fs::path ck = fs::path(dir).lexically_normal();
    if (ck.has_parent_path() && ck.filename().empty()) ck = ck.parent_path();
    fs::path run = ck.parent_path();
    if (run.empty()) run = ".";
    const bool beside = fs::is_regular_file(run / "config.json", ec);
    return FailedPreconditionError(
        "the checkpoint " + dir + " is of a model with model." + key + " " +
        ModelValueShown(user["model"], key) + "; this run's is " + ModelValueShown(now, key) +
        " (from " + (flag == kFlag.end() ? std::string() : flag->second + ", ") +
        "--config or the built-in default). A checkpoint " +
        (trains
             ? "resumes its own model: give the " +
                   (beside ? "run's config and directory (--config " +
                                 (run / "config.json").string() + " --run-dir " + run.string() + ")"
                           : std::string("run's config (--config RUN_DIR/config.json)")) +
                   " and drop any override"
             : "holds its own model: drop the override, or give its run's config (--config " +
                   (beside ? (run / "config.json").string() : std::string("RUN_DIR/config.json")) +
                   ")"));
  }
  return Status::OK();
}

}  // namespace

Status CheckSameModel(const std::string& user_state, const RunConfig& cfg, const std::string& dir,
                      bool trains) {
  return CheckSameModelJson(CheckpointRecords(user_state, dir, /*say=*/LaunchedRanks().rank == 0),
                            ModelJson(cfg), dir, trains);
}

// resume.h
bool IsCheckpointOf(const std::string& user_state, const RunConfig& cfg, const std::string& dir) {
  return CheckSameModelJson(CheckpointRecords(user_state, dir, /*say=*/false), ModelJson(cfg), dir)
      .ok();
}

// Note [The checkpoint's model]
// A checkpoint records its whole model section (and its compute type), so eval and export take
// that model where no flag and no field of a config file names it: a checkpoint saved outside
// its run directory (--checkpoint PATH), with no config.json of its run beside it, was refused
// for that config.json, though it says what it is; a partial --config (budgets alone) was
// refused as the built-in default's model. Without a config file, the budgets are the machine's
// (Note [Budgets of a model brought from a directory], hf_io.cc: the built-in ones are the toy
// model's). What a flag or a config file names and is another model is refused (CheckSameModel:
// a wrong file is likelier than a wish). The config.json beside a checkpoint is read only when it
// is that checkpoint's run's (RunConfigBeside): another run's budgets and data are not this
// model's. How the model computes, not what it is (seed, activation checkpointing,
// activations), stays the command's.
// `train --resume` does not take it (review 44): its data, schedule and batch would fall back to
// the built-in defaults' (a moved run directory, whose config.json is not taken in place, trained
// on the addition task and saved over its checkpoint), so a model that is not the checkpoint's is
// refused there, naming the config to give.
// resume.h
Status TakeCheckpointsModel(RunConfig& cfg, const std::string& checkpoint,
                            const std::set<std::string>& asked, bool say) {
  if (checkpoint.empty()) return Status::OK();
  const StatusOr<CheckpointInfo> info = ReadCheckpointInfo(checkpoint);
  if (!info.ok()) return Status::OK();  // (said where it loads)
  const json u = CheckpointRecords(info->user_state, checkpoint, /*say=*/false);
  if (!u.is_object() || !u.contains("model") || !u["model"].is_object()) return Status::OK();
  json model = json::object();
  const json now = ModelJson(cfg);
  std::string taken;
  for (const auto& [key, then] : u["model"].items()) {
    if (HowTheModelComputes(key)) continue;
    const auto it = now.find(key);
    if (it == now.end() || *it == then || asked.count("model." + key) != 0) continue;
    model[key] = then;
    taken += (taken.empty() ? "" : ", ") + ("model." + key + " " + then.dump());
  }
  json engine = json::object();
  if (const auto t = u.find("compute_dtype");
      t != u.end() && t->is_string() && asked.count("engine.compute_dtype") == 0 &&
      *t != std::string(DTypeName(cfg.engine.compute_dtype))) {
    engine["compute_dtype"] = *t;
    taken +=
        (taken.empty() ? "" : ", ") + ("engine.compute_dtype \"" + t->get<std::string>() + "\"");
  }
  // What a flag asked for that is not the checkpoint's model is refused here, as the load would,
  // before the two are merged into a model neither describes.
  json wanted = now;
  wanted.update(model);
  TZ_RETURN_IF_ERROR(CheckSameModelJson(u, wanted, checkpoint, /*trains=*/false));
  if (taken.empty()) return Status::OK();
  json over = json::object();
  if (!model.empty()) over["model"] = model;
  if (!engine.empty()) over["engine"] = engine;
  if (StatusOr<RunConfig> alone =
          ParseRunConfig(json{{"model", u["model"]}}.dump(), DefaultRunConfig());
      !alone.ok())
    return Status(StatusCode::kDataLoss, std::string(alone.status().message()))
        .WithContext("the model the checkpoint " + checkpoint +
                     " records (its manifest was edited or damaged)");
  StatusOr<RunConfig> merged = ParseRunConfig(over.dump(), cfg);
  if (!merged.ok())
    return std::move(merged).status().WithContext("with the model the checkpoint " + checkpoint +
                                                  " records");
  cfg = std::move(*merged);  // (its `given` is cfg's)
  if (say) std::fprintf(stderr, "note: the checkpoint's model: %s\n", taken.c_str());
  return Status::OK();
}

// resume.h
std::set<std::string> ModelFieldsNamedIn(const std::string& config_text) {
  std::set<std::string> named;
  const json j =
      json::parse(config_text, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
  if (!j.is_object()) return named;
  if (const auto m = j.find("model"); m != j.end() && m->is_object())
    for (const auto& [key, value] : m->items()) named.insert("model." + key);
  if (const auto e = j.find("engine");
      e != j.end() && e->is_object() && e->contains("compute_dtype"))
    named.insert("engine.compute_dtype");
  return named;
}

// resume.h
std::string RunConfigBeside(const std::string& checkpoint_dir, const CheckpointInfo& info) {
  std::error_code ec;
  fs::path dir = fs::absolute(checkpoint_dir, ec).lexically_normal();
  if (dir.has_parent_path() && dir.filename().empty()) dir = dir.parent_path();
  const std::string there = (dir.parent_path() / "config.json").string();
  const json u = json::parse(info.user_state, nullptr, /*allow_exceptions=*/false);
  if (!u.is_object() || !u.contains("model") || !u["model"].is_object()) return there;
  std::optional<RunConfig> cfg = ConfigTrainWrote(there);
  if (!cfg || !KeepsItsCheckpointIn(*cfg, dir)) return "";
  // And of the model the checkpoint records (a checkpoint copied into another run's directory).
  return CheckSameModelJson(u, ModelJson(*cfg), there).ok() ? there : "";
}

}  // namespace tierzero::app
