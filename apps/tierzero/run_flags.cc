// The command-line flags of `tierzero train` (and plan, eval) over the run config, and loading
// a run's config: the file, the flags, what was asked for, a model directory's shape, and the
// checks of the whole (docs/config.md).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "resume.h"
#include "run_dir.h"
#include "run_fields.h"
#include "tierzero/files.h"
#include "tierzero/utf8.h"
#include "train.h"

namespace tierzero::app {
namespace fs = std::filesystem;
using nlohmann::json;

Status ApplyFlags(const std::vector<std::string>& args, RunConfig& c, std::string* config_path,
                  std::set<std::string>* given, const char* command) {
  // flag -> (section.field, takes a value)
  static const std::map<std::string, std::string> kFlags = {
      {"--steps", "train.steps"},
      {"--batch-size", "train.batch_size"},
      {"--lr", "train.lr"},
      {"--eval-every", "train.eval_every"},
      {"--profile-step", "train.profile_step"},
      {"--log-every", "train.log_every"},
      {"--device", "engine.device"},
      {"--device-budget", "engine.device_budget"},
      {"--host-budget", "engine.host_budget"},
      {"--nvme-budget", "engine.nvme_budget"},
      {"--nvme-path", "engine.nvme_path"},
      {"--dtype", "engine.compute_dtype"},
      {"--grad-accumulation", "engine.grad_accumulation"},
      {"--metrics", "output.metrics"},
      {"--report", "output.report"},
      {"--html", "output.html"},
      {"--trace", "output.trace"},
      {"--run-dir", "output.run_dir"},
      {"--checkpoint", "output.checkpoint_dir"},
      {"--resume", "output.resume"},
      {"--init-from", "output.init_from"},
      {"--plan", "output.plan"},
      {"--text", "data.text_path"},
      {"--data", "data.token_path"},
      {"--seq-len", "model.seq_len"},
      {"--vocab", "model.vocab"},
      {"--seed", "data.seed"},
      {"--layers", "model.n_layer"},
      {"--width", "model.d_model"},
      {"--heads", "model.n_head"},
      {"--activations", "model.activations"},
      {"--arch", "model.arch"},
      {"--kv-heads", "model.n_kv_head"},
      {"--optimizer-states", "engine.optimizer_states"},
  };
  std::string source_flag;  // the last of --text and --data given
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--quiet") {
      c.output.quiet = true;
      continue;
    }
    if (a == "--overwrite") {
      c.output.overwrite = true;
      continue;
    }
    if (a == "--checkpoint-activations" || a == "--no-checkpoint-activations") {
      c.model.activation_checkpointing = a == "--checkpoint-activations";
      if (given != nullptr) given->insert("model.activation_checkpointing");
      continue;
    }
    if (a == "--config") {
      if (i + 1 >= args.size()) return InvalidArgumentError("--config needs a file");
      *config_path = args[++i];
      if (config_path->empty())
        return InvalidArgumentError(
            "--config is empty (an unset shell variable?); name a config file, or leave the "
            "option out for the built-in default");
      continue;
    }
    auto f = kFlags.find(a);
    if (f == kFlags.end())
      return InvalidArgumentError("unknown option '" + a + "' (see tierzero " + command +
                                  " --help)");
    if (i + 1 >= args.size()) return InvalidArgumentError(a + " needs a value");
    const std::string value = args[++i];
    // An option where the value should be (`--run-dir --overwrite`): the value is missing, and
    // the option would be lost (a directory named "--overwrite" made instead).
    if (value.rfind("--", 0) == 0 &&
        (kFlags.count(value) != 0 || value == "--quiet" || value == "--overwrite" ||
         value == "--checkpoint-activations" || value == "--no-checkpoint-activations" ||
         value == "--config"))
      return InvalidArgumentError(a + " needs a value, and " + value +
                                  " follows it (an option): give " + a + " its value");
    // An empty value (an unset shell variable, `--resume $CKPT`) would mean the default: a run
    // from scratch instead of the one asked for.
    if (value.empty())
      return InvalidArgumentError("option " + a +
                                  " is empty (an unset shell variable?); give it a value, or "
                                  "leave the option out for the default");
    // A config is JSON, which holds only UTF-8 text (a path in another encoding cannot be
    // written into the run's config.json, so it could not be resumed).
    if (const int64_t bad = FirstInvalidUtf8(value); bad >= 0)
      return InvalidArgumentError("option " + a + ": the value is not UTF-8 (invalid byte at " +
                                  std::to_string(bad) + ")");
    const std::string section = f->second.substr(0, f->second.find('.'));
    const std::string key = f->second.substr(f->second.find('.') + 1);
    auto fields = Fields(c);
    json v;
    json parsed = json::parse(value, nullptr, false);
    // Numbers and booleans as JSON; anything else (paths, sizes, names) as a string. A field
    // that holds a string (a path, a name) takes the value as it is: `--run-dir 123` is a
    // directory named 123, not the number.
    const bool string_field = fields[section][key].get().is_string();
    // A number a double reads as 0 (1e-400): refused as the config file's is (it trained at lr
    // 0; review 51).
    if (!string_field && parsed.is_number_float() && parsed.get<double>() == 0 &&
        value.substr(0, value.find_first_of("eE")).find_first_of("123456789") != std::string::npos)
      return InvalidArgumentError("option " + a + " is " + value +
                                  ", too small for a double: it would be read as 0 (give 0 if 0 "
                                  "is meant)");
    // A number as a shell user writes it, which JSON does not: ".001", "1.", "+2" (`--lr .001`
    // was refused as out of [0, 10]; hunt 51). Finite, and the whole value.
    if (!string_field && parsed.is_discarded()) {
      const bool plus = value[0] == '+';
      const char* first = value.data() + (plus ? 1 : 0);
      const char* last = value.data() + value.size();
      // (A whole number stays one: "+2" is the integer 2, where --steps takes no 2.0.)
      const json rest = plus && first != last && *first != '-' && *first != '+'
                            ? json::parse(first, last, nullptr, false)
                            : json(json::value_t::discarded);
      double d = 0;
      const auto [end, ec] = std::from_chars(first, last, d);
      if (rest.is_number_integer())
        parsed = rest;
      else if (ec == std::errc() && end == last && std::isfinite(d) && !(plus && *first == '-'))
        parsed = d;
    }
    v = (!string_field && !parsed.is_discarded() && (parsed.is_number() || parsed.is_boolean()))
            ? parsed
            : json(value);
    // One data source: a second one given would silently win.
    if ((a == "--text" || a == "--data") && !source_flag.empty() && source_flag != a)
      return InvalidArgumentError(a + " with " + source_flag +
                                  ": a run trains on one data source; give one of them");
    if (a == "--text" || a == "--data") source_flag = a;
    // The flag chooses the source: a config's path of the other kind goes (an eval of a text
    // run's checkpoint on token files reads that run's config.json).
    if (a == "--text") {
      c.data.kind = "text";
      c.data.token_path.clear();
    }
    if (a == "--data") {
      c.data.kind = "tokens";
      c.data.text_path.clear();
    }
    Status s = fields[section][key].set(v);
    if (!s.ok()) return std::move(s).WithContext("option " + a);
    if (given != nullptr) {
      given->insert(f->second);
      if (a == "--text" || a == "--data") given->insert("data.kind");
    }
  }
  return Status::OK();
}

namespace {

// A data path the run's data.kind does not read would be ignored silently (a config that sets
// text_path and forgets the kind trained on addition). Checked once the flags are applied:
// --text and --data set the kind.
Status CheckDataSource(const RunConfig& c, const std::set<std::string>& asked_in_file) {
  const std::string& kind = c.data.kind;
  if (!c.data.text_path.empty() && kind != "text")
    return InvalidArgumentError("config field 'data.text_path' is set (" + c.data.text_path +
                                ") but data.kind is \"" + kind +
                                "\", which does not read it: set data.kind \"text\" (or "
                                "train with --text FILE), or remove text_path");
  if (!c.data.token_path.empty() && kind != "tokens")
    return InvalidArgumentError("config field 'data.token_path' is set (" + c.data.token_path +
                                ") but data.kind is \"" + kind +
                                "\", which does not read it: set data.kind \"tokens\" (or "
                                "train with --data PATH), or remove token_path");
  // The addition task's settings a user's config asks of text or tokens, other than their
  // defaults, would be read by nothing (hunt 47).
  const gpt::DataConfig d = DefaultRunConfig().data;
  const bool differ[] = {c.data.digits != d.digits, c.data.reverse_answer != d.reverse_answer,
                         c.data.pad_operands != d.pad_operands};
  const char* fields[] = {"data.digits", "data.reverse_answer", "data.pad_operands"};
  for (int i = 0; i < 3 && kind != "addition"; ++i)
    if (differ[i] && asked_in_file.count(fields[i]) != 0)
      return InvalidArgumentError("config field '" + std::string(fields[i]) +
                                  "' is the addition task's, but data.kind is \"" + kind +
                                  "\", which does not read it: remove it");
  return Status::OK();
}

// A rotary field a user's config file sets for a GPT-2, whose positions are learned, would be
// read by nothing (a Llama config that left out "arch" trained a GPT-2 without a word: hunt 47).
// Checked once a model directory has given its architecture (--init-from a Llama's makes the
// run one); a model recorded by a checkpoint, an export or a run's config.json is as it was.
Status CheckGpt2Rope(const RunConfig& c, const std::set<std::string>& asked_in_file) {
  if (c.model.arch != gpt::Arch::kGpt2) return Status::OK();
  const gpt::GptConfig d;
  const gpt::GptConfig& m = c.model;
  const std::pair<const char*, bool> fields[] = {
      {"rope_theta", m.rope_theta != d.rope_theta},
      {"rope_factor", m.rope_factor != d.rope_factor},
      {"rope_low_freq_factor", m.rope_low_freq_factor != d.rope_low_freq_factor},
      {"rope_high_freq_factor", m.rope_high_freq_factor != d.rope_high_freq_factor},
      {"rope_original_positions", m.rope_original_positions != d.rope_original_positions}};
  for (const auto& [field, differs] : fields)
    if (differs && asked_in_file.count(std::string("model.") + field) != 0)
      return InvalidArgumentError(
          "config field 'model." + std::string(field) +
          "' is set for arch \"gpt2\", whose positions are learned, not rotary: nothing reads "
          "it. Leave it out, or give arch \"llama\" for rotary embeddings");
  return Status::OK();
}

}  // namespace

// Note [A run's config from another working directory]
// A run's config.json records its paths as they were given, relative to the directory the run
// started in ("run_dir": "run"). Given from anywhere else (`--config w/run/config.json --resume
// w/run/checkpoint`, as a refusal advised), they named directories under the new working
// directory: the run trained on into a new ./run, the run it continued left at its step (hunt
// 42). So where the config is RUN_DIR/config.json and the directory it lies in ends with the
// recorded run directory, the directory the run started in is known, and every relative path the
// config records is taken from there; the flags' paths stay the working directory's.
// train.h
void RebaseOnItsRunDir(RunConfig& cfg, const std::string& config_path) {
  const fs::path recorded = fs::path(cfg.output.run_dir).lexically_normal();
  if (cfg.output.run_dir.empty() || recorded.is_absolute()) return;
  if (fs::path(config_path).filename() != "config.json") return;
  std::error_code ec;
  const fs::path dir = fs::absolute(config_path, ec).lexically_normal().parent_path();
  if (ec) return;
  std::vector<fs::path> r, d;
  for (const fs::path& c : recorded)
    if (!c.empty() && c != ".") r.push_back(c);
  for (const fs::path& c : dir)
    if (!c.empty()) d.push_back(c);
  if (r.empty() || r.size() >= d.size()) return;
  for (size_t i = 0; i < r.size(); ++i) {
    if (r[i] == ".." || r[i] != d[d.size() - r.size() + i]) return;
  }
  fs::path base;
  for (size_t i = 0; i + r.size() < d.size(); ++i) base /= d[i];
  const fs::path cwd = fs::current_path(ec);
  if (ec || base == cwd.lexically_normal()) return;
  for (std::string* p :
       {&cfg.output.run_dir, &cfg.output.metrics, &cfg.output.report, &cfg.output.html,
        &cfg.output.trace, &cfg.output.checkpoint_dir, &cfg.output.resume, &cfg.output.init_from,
        &cfg.output.plan, &cfg.engine.nvme_path, &cfg.data.text_path, &cfg.data.token_path}) {
    if (p->empty() || *p == "none" || *p == "-" || (*p)[0] == '/') continue;
    const fs::path given(*p);
    *p = JoinKeepingParentSteps(base, given).string();
    if (p == &cfg.data.token_path) {
      const std::string escaped = EscapedTokenPattern(base, given.string());
      if (!escaped.empty()) *p = escaped;
    }
  }
}

// train.h
StatusOr<RunConfig> LoadRunConfig(const std::vector<std::string>& args, std::string* path,
                                  bool checkpoints_model, const char* command) {
  RunConfig cfg = DefaultRunConfig();
  std::string config_path;
  RunConfig flags = cfg;  // the command line's alone
  std::set<std::string> flagged;
  TZ_RETURN_IF_ERROR(ApplyFlags(args, flags, &config_path, &flagged, command));
  // Note [A resumed run's weights]: a resumed run's weights are its checkpoint's. The
  // --init-from that seeded it when it started (its config.json records it) is not read again (a
  // model directory moved since would stop the resume, and its weights would be loaded only to be
  // replaced; the config's model fields hold its shape); one given with --resume is refused.
  const bool init_from_flag = !flags.output.init_from.empty();
  if (init_from_flag && !flags.output.resume.empty())
    return InvalidArgumentError(
        "--init-from and --resume together: a resumed run takes its weights from its checkpoint; "
        "drop --init-from (the weights it seeded the run with are in the checkpoint already)");
  if (path != nullptr) *path = config_path;
  // Note [Asked for, not different from the default]
  // What the run asked for is the fields its config file names and its flags set, whatever
  // their values: a model directory's shape and the machine-sized budgets give way to what was
  // asked (telling "asked" by "differs from the default" let `--layers 5` or `--device-budget
  // 12MiB`, the defaults' values, be replaced silently).
  std::set<std::string> given;
  std::set<std::string> model_named;  // the model fields the config file names
  // The config file is a run's own config.json, of this build or an older one that recorded
  // fewer fields: it records every value, asked for or not, so a field in it is not a user's ask
  // the checks below refuse or keep (review 47: an older text run's recorded data.digits
  // refused its resume).
  bool runs_config = false;
  bool floor_named = false;  // the config file names train.min_lr
  if (!config_path.empty()) {
    TZ_ASSIGN_OR_RETURN(const std::string text,
                        ReadFileBounded(config_path, kMaxConfigBytes, "config file"));
    auto parsed = ParseRunConfig(text, cfg);
    if (!parsed.ok()) return parsed.status().WithContext(config_path);
    cfg = *parsed;
    model_named = ModelFieldsNamedIn(text);
    // (Comments allowed, as ParseRunConfig allows them.)
    const json j = json::parse(text, nullptr, /*allow_exceptions=*/false,
                               /*ignore_comments=*/true);
    std::set<std::string> named;
    if (j.is_object()) {
      for (const auto& [section, fields] : j.items()) {
        if (!fields.is_object()) continue;
        for (const auto& [key, value] : fields.items()) named.insert(section + "." + key);
      }
    }
    floor_named = named.count("train.min_lr") != 0;
    // Every config.json train has written, since its first build, names these 41 fields: a
    // user's config file does not (it names what it changes).
    static constexpr const char* kEveryRunsConfigNames[] = {"data.digits",
                                                            "data.kind",
                                                            "data.seed",
                                                            "data.text_path",
                                                            "engine.chunk_elems",
                                                            "engine.clip_grad_norm",
                                                            "engine.compute_dtype",
                                                            "engine.cpu_threads",
                                                            "engine.device",
                                                            "engine.device_budget",
                                                            "engine.device_shard_budget",
                                                            "engine.eps",
                                                            "engine.grad_accumulation",
                                                            "engine.host_budget",
                                                            "engine.host_link_bandwidth",
                                                            "engine.initial_loss_scale",
                                                            "engine.loss_scale_window",
                                                            "engine.nvme_budget",
                                                            "engine.nvme_path",
                                                            "engine.weight_decay",
                                                            "model.activation_checkpointing",
                                                            "model.d_model",
                                                            "model.n_head",
                                                            "model.n_layer",
                                                            "model.seed",
                                                            "model.seq_len",
                                                            "model.vocab",
                                                            "output.checkpoint_dir",
                                                            "output.init_from",
                                                            "output.metrics",
                                                            "output.report",
                                                            "output.resume",
                                                            "output.run_dir",
                                                            "train.batch_size",
                                                            "train.checkpoint_every",
                                                            "train.eval_batches",
                                                            "train.eval_every",
                                                            "train.lr",
                                                            "train.min_lr",
                                                            "train.steps",
                                                            "train.warmup_steps"};
    runs_config = std::all_of(std::begin(kEveryRunsConfigNames), std::end(kEveryRunsConfigNames),
                              [&](const char* f) { return named.count(f) != 0; });
    // A config that names every field is a run's own config.json (RunConfigToJson), given as a
    // template: it records every value, asked for or not, so only its context counts as asked
    // (as before the note); its other fields give way where a value at the default's would.
    RunConfig all = DefaultRunConfig();
    bool complete = true;
    // (A field added later, a record only, is not required: a run's config.json of the build
    // before it names everything else; review 52.)
    for (const auto& [section, fields] : Fields(all))
      for (const auto& [key, field] : fields)
        complete = complete && (named.count(section + "." + key) != 0 ||
                                (section == "model" && RecordedBeside(key)));
    if (complete) {
      named = {"model.seq_len"};
      RebaseOnItsRunDir(cfg, config_path);  // Note [A run's config from another working directory]
    }
    given.insert(named.begin(), named.end());
  }
  const std::string config_run_dir = config_path.empty() ? "" : cfg.output.run_dir;
  std::string ignored;
  // The fields a user's config file asks for (none of a run's own config.json).
  const std::set<std::string> asked_in_file = runs_config ? std::set<std::string>() : given;
  const gpt::GptConfig file_model = cfg.model;
  TZ_RETURN_IF_ERROR(ApplyFlags(args, cfg, &ignored, &given));
  // --arch sets its architecture's defaults (ArchField); the fields a config file names are
  // asked for all the same, so they stay (a config's tie_embeddings was reset by --arch llama
  // without a word: hunt 47); one the architecture cannot have is then refused by name.
  if (cfg.model.arch != file_model.arch) {
    if (asked_in_file.count("model.tie_embeddings") != 0)
      cfg.model.tie_embeddings = file_model.tie_embeddings;
    if (asked_in_file.count("model.attention_bias") != 0)
      cfg.model.attention_bias = file_model.attention_bias;
    if (cfg.model.arch == gpt::Arch::kGpt2 &&
        (!cfg.model.tie_embeddings || !cfg.model.attention_bias))
      return InvalidArgumentError(
          std::string("the config file sets model.") +
          (!cfg.model.tie_embeddings ? "tie_embeddings" : "attention_bias") +
          " false, which --arch gpt2 cannot have (GPT-2 ties its head and has every bias): drop "
          "one of them");
  }
  // Note [A floor below the rate asked for] (run_config.cc): of the rate the flags leave, where
  // neither the file (a run's own config.json included) nor a flag names the floor; the file's
  // lowering, of the file's rate, undone first (a file's lr 5e-5 with --lr 1e-3 kept 5e-6).
  if (!floor_named && given.count("train.min_lr") == 0) {
    cfg.train.min_lr = DefaultRunConfig().train.min_lr;
    LowerDefaultFloor(cfg);
  }
  cfg.given = std::move(given);
  // Note [A config's outputs follow --run-dir]
  // A run's config.json records every output resolved (RUN_DIR/metrics.jsonl, RUN_DIR/checkpoint,
  // RUN_DIR/nvme...). Given as a template with another --run-dir (a new run like it, or the run
  // directory moved and resumed where it is now), those paths still named the old directory:
  // the new run was refused as "another run's outputs", and --overwrite then wrote over the old
  // run's metrics and checkpoint. Each output the config places inside its own run directory,
  // and no flag names, follows --run-dir, as the defaults do.
  if (!config_run_dir.empty() && flagged.count("output.run_dir") != 0 &&
      cfg.output.run_dir != config_run_dir) {
    const std::string from = config_run_dir + "/";
    for (const auto& [field, path] :
         {std::pair<const char*, std::string*>{"output.metrics", &cfg.output.metrics},
          {"output.report", &cfg.output.report},
          {"output.html", &cfg.output.html},
          {"output.trace", &cfg.output.trace},
          {"output.checkpoint_dir", &cfg.output.checkpoint_dir},
          {"engine.nvme_path", &cfg.engine.nvme_path}}) {
      if (flagged.count(field) == 0 && path->compare(0, from.size(), from) == 0)
        *path = cfg.output.run_dir + "/" + path->substr(from.size());
    }
  }
  // (train resumes another run's checkpoint with its config: Note [The checkpoint's model].)
  TZ_RETURN_IF_ERROR(
      CheckCheckpointArgument(cfg.output.resume, "--resume", /*with_config=*/!checkpoints_model));
  if (!cfg.output.resume.empty() && !cfg.output.init_from.empty()) {
    if (init_from_flag)
      return InvalidArgumentError(
          "--init-from with a config that resumes (output.resume " + cfg.output.resume +
          "): a resumed run takes its weights from its checkpoint; drop one of them");
    cfg.output.init_from.clear();  // Note [A resumed run's weights]
  }
  TZ_RETURN_IF_ERROR(MergeHfModel(cfg));
  TZ_RETURN_IF_ERROR(MergeRecordedModel(cfg));
  // eval: the checkpoint's model where neither a flag nor the config file names it, and without
  // a config file the machine's budgets (Note [The checkpoint's model], resume.cc).
  if (checkpoints_model && !cfg.output.resume.empty()) {
    std::set<std::string> asked = cfg.given;
    asked.insert(model_named.begin(), model_named.end());
    TZ_RETURN_IF_ERROR(TakeCheckpointsModel(cfg, cfg.output.resume, asked, /*say=*/true));
    if (config_path.empty()) SizeBudgetsToTheMachine(cfg);
  }
  TZ_RETURN_IF_ERROR(CheckDataSource(cfg, asked_in_file));
  TZ_RETURN_IF_ERROR(CheckGpt2Rope(cfg, asked_in_file));
  // A profile step the resumed run's config records, past the steps this resume ends at: the
  // run's, not this command's; its profile goes to the first planned iteration, said (a resume
  // with fewer --steps was refused for a field it never gave; hunt 51).
  if (!cfg.output.resume.empty() && cfg.given.count("train.profile_step") == 0 &&
      cfg.train.profile_step > cfg.train.steps) {
    if (LaunchedRanks().rank == 0)
      std::printf(
          "note: the run's profile step %d is past this run's last step %d: the report "
          "profiles the first planned iteration (--profile-step N names another)\n",
          cfg.train.profile_step, cfg.train.steps);
    cfg.train.profile_step = 0;
  }
  TZ_RETURN_IF_ERROR(ValidateRunConfig(cfg));
  return cfg;
}

}  // namespace tierzero::app
