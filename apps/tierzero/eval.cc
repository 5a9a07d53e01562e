// `tierzero eval`: the mean next-token loss (and perplexity) of a model over a token file's
// consecutive windows (docs/data.md), through the engine's tiers like `train`.
//
// Note [Evaluation windows]: each file is a stream of its own; window i of a file holds its tokens
// i x T .. i x T + T (T + 1 tokens: T inputs, each scored on the next), a partial last window is
// dropped, and every scored token weighs the same (the mean over tokens, not over batches). Rows
// are evaluated `train.batch_size` windows at a time; the last batch is filled with rows whose
// mask is 0, which the loss leaves out, so the figure does not depend on the batch size.
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "gpt/data.h"
#include "gpt/hf.h"
#include "gpt/token_data.h"
#include "resume.h"
#include "run_dir.h"
#include "signals.h"
#include "tierzero/files.h"
#include "train.h"

namespace tierzero::app {
namespace fs = std::filesystem;

namespace {

constexpr const char* kEvalHelp =
    R"(usage: tierzero eval (--resume CHECKPOINT | --init-from FILE) --data PATH [options]

Prints the mean next-token loss and perplexity of a model over the consecutive windows of
T + 1 tokens of PATH (llm.c shards, uint16 or Llama 3's uint32, or raw uint16 tokens; a file or
a glob; each file a stream of its own, window i starting at its token i x T, a partial last
window dropped).

  --resume DIR           a checkpoint: the model it records; its run's DIR/../config.json, where
                         that is beside it, gives the budgets and data (else: the machine's
                         budgets, and the token files it records); a flag or --config naming
                         another model is refused
  --init-from FILE|DIR   a safetensors file (tierzero's export records its model; another's is
                         of the model --config and flags describe), or a Hugging Face model
                         directory (config.json and safetensors; docs/models.md)
  --data PATH            the token files (with --resume, default: the ones its run read, where
                         its path is known)
  --split validation|all what of the files is scored: the validation split a run of them
                         validates on (the last file, or one file's last 10%), or all of them
                         (default: validation for --resume without --data, the run's own data,
                         whose other tokens it trained on; else all)
  --seq-len T            tokens scored per window (default: the model's context, model.seq_len)
  --batch-size N         windows per forward pass (default: the config's train.batch_size)
  --config FILE, --dtype, --device, --device-budget, --host-budget, --nvme-budget, --nvme-path,
  --layers, --width, --heads, --vocab, --activations, --arch, --kv-heads: as for `tierzero train`
)";

int EvalFail(const Status& s) {
  std::fprintf(stderr, "error: %s\n", ForOneProcess(s, /*forward_only=*/true).ToString().c_str());
  return 1;
}

// The model, loaded, and the loss over every window. `context`: the model's seq_len before a
// longer window within its positions raised it (the checkpoint's model is that one: a window is
// not another model).
Status RunEval(const RunConfig& cfg, int window, int context, bool validation, bool vocab_fixed,
               const std::string& nvme_dir) {
  const OutputOptions& out = cfg.output;
  if (!out.resume.empty()) {
    TZ_ASSIGN_OR_RETURN(const CheckpointInfo info, ReadCheckpointInfo(out.resume));
    RunConfig checked = cfg;
    checked.model.seq_len = context;
    TZ_RETURN_IF_ERROR(CheckSameModel(info.user_state, checked, out.resume, /*trains=*/false));
  }
  TZ_ASSIGN_OR_RETURN(const auto shards,
                      gpt::TokenShards::Open(cfg.data.token_path, cfg.model.vocab, 0,
                                             uint64_t{4} << 30, vocab_fixed));
  const uint64_t windows = shards->NumEvalWindows(window, validation);
  if (windows == 0)
    return InvalidArgumentError(
        "'" + cfg.data.token_path + "' has no window of " + std::to_string(window + 1) +
        " tokens (--seq-len " + std::to_string(window) + ")" +
        (validation ? " in its validation split, " + shards->DescribeValidation() +
                          " (--split all scores every file)"
                    : std::string()));
  EngineConfig ec = cfg.engine;
  NeverSteps(ec);
  if (ec.nvme_path.empty()) ec.nvme_path = nvme_dir;
  TZ_ASSIGN_OR_RETURN(auto engine, Engine::Create(ec));
  TZ_ASSIGN_OR_RETURN(auto model, gpt::Gpt::Create(*engine, cfg.model));
  TZ_RETURN_IF_ERROR(engine->Finalize());
  std::string init_note;
  if (!out.init_from.empty()) {
    TZ_ASSIGN_OR_RETURN(init_note, LoadInitFrom(*engine, cfg));
  }
  if (!out.resume.empty()) TZ_RETURN_IF_ERROR(engine->LoadCheckpoint(out.resume).status());
  std::printf("tierzero eval: %s %d layers x %d wide, %lld parameters, from %s\n",
              gpt::ModelName(cfg.model), cfg.model.n_layer, cfg.model.d_model,
              static_cast<long long>(model->num_params()),
              (out.resume.empty() ? init_note : out.resume).c_str());
  std::printf("  data: %s; %s%llu windows of %d + 1 tokens\n",
              shards->Describe(/*split=*/false).c_str(),
              validation ? ("scored: its validation split, " + shards->DescribeValidation() +
                            " (--split all scores every file); ")
                               .c_str()
                         : "",
              static_cast<unsigned long long>(windows), window);
  std::fflush(stdout);
  // Note [Evaluation windows]
  // (No more rows than windows: a huge --batch-size on a small file allocates nothing extra.)
  const int rows =
      static_cast<int>(std::min<uint64_t>(static_cast<uint64_t>(cfg.train.batch_size), windows));
  gpt::Batch b;
  b.batch = rows;
  b.seq = window;
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(window);
  b.tokens.resize(n);
  b.targets.resize(n);
  b.mask.resize(n);
  double loss_sum = 0, scored = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t first = 0; first < windows; first += static_cast<uint64_t>(rows)) {
    int real = 0;
    for (int r = 0; r < rows; ++r) {
      const uint64_t w = first + static_cast<uint64_t>(r);
      const size_t o = static_cast<size_t>(r) * static_cast<size_t>(window);
      // Past the last window: a copy of the first, masked out.
      TZ_RETURN_IF_ERROR(
          shards->EvalWindow(w < windows ? w : 0, window, &b.tokens[o], &b.targets[o], validation));
      const float m = w < windows ? 1.0f : 0.0f;
      std::fill(b.mask.begin() + static_cast<std::ptrdiff_t>(o),
                b.mask.begin() + static_cast<std::ptrdiff_t>(o) + window, m);
      real += w < windows;
    }
    TZ_ASSIGN_OR_RETURN(const double mean, model->Evaluate(b, nullptr));
    // A loss that is not a number is no score: said, with the windows, not printed as "-nan" and
    // exit 0 (weights finite when loaded, whose products overflow: hunt 46).
    if (!std::isfinite(mean))
      return DataLossError(
          "the loss over windows " + std::to_string(first) + ".." +
          std::to_string(first + static_cast<uint64_t>(real) - 1) + " is " +
          (std::isnan(mean) ? "not a number" : "infinite") +
          ": the model's arithmetic overflows on them (weights too large for " +
          std::string(DTypeName(cfg.engine.compute_dtype)) +
          "? a model saved after its run diverged?); the model has no score on this data");
    const double tokens = static_cast<double>(real) * window;
    loss_sum += mean * tokens;
    scored += tokens;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double loss = loss_sum / scored;
  std::printf(
      "eval: mean loss %.6f | perplexity %.4f | %.0f tokens scored in %.1f s (%.0f tok/s)\n", loss,
      std::exp(loss), scored, s, s > 0 ? scored / s : 0.0);
  return Status::OK();
}

}  // namespace

int Eval(const std::vector<std::string>& args) {
  if (int rc = RefuseUnderLauncher("eval"); rc != 0) return rc;
  // SIGINT and SIGTERM end the evaluation at once, with a message (nothing to save).
  GracefulInterrupts interrupts(
      /*during_setup=*/true,
      "during the evaluation: it stops now (it writes nothing: nothing is lost)");
  std::vector<std::string> rest;
  int window = 0;
  int batch = 0;      // --batch-size: windows a pass (0: the config's train.batch_size)
  std::string split;  // --split: "validation", "all", or "" (by whether --data is given)
  bool has_config = false, has_nvme_path = false, has_data = false;
  std::string resume, init_from, config_given;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "-h" || args[i] == "--help") {
      std::fputs(kEvalHelp, stdout);
      return 0;
    }
    if (args[i] == "--seq-len") {  // eval's window, not the model's context
      if (i + 1 >= args.size()) return EvalFail(InvalidArgumentError("--seq-len needs a value"));
      char* end = nullptr;
      const long v = std::strtol(args[i + 1].c_str(), &end, 10);
      if (end == args[i + 1].c_str() || *end != '\0' || v < 1 || v > 65536)
        return EvalFail(InvalidArgumentError("--seq-len is '" + args[i + 1] +
                                             "'; accepted: an integer in 1..65536"));
      window = static_cast<int>(v);
      ++i;
      continue;
    }
    if (args[i] == "--split") {
      if (i + 1 >= args.size() || (args[i + 1] != "validation" && args[i + 1] != "all"))
        return EvalFail(InvalidArgumentError(
            "--split is '" + (i + 1 < args.size() ? args[i + 1] : std::string()) +
            "'; accepted: validation (the split a run of the files validates on) or all"));
      split = args[i + 1];
      ++i;
      continue;
    }
    if (args[i] == "--batch-size") {  // windows a pass: checked with the window, below
      if (i + 1 >= args.size()) return EvalFail(InvalidArgumentError("--batch-size needs a value"));
      char* end = nullptr;
      const long v = std::strtol(args[i + 1].c_str(), &end, 10);
      if (end == args[i + 1].c_str() || *end != '\0' || v < 1 || v > (1L << 24))
        return EvalFail(InvalidArgumentError("--batch-size is '" + args[i + 1] +
                                             "'; accepted: an integer in 1..16777216"));
      batch = static_cast<int>(v);
      ++i;
      continue;
    }
    // Flags of `train` that mean nothing here are refused, not silently ignored.
    for (const char* train_only : {"--steps",
                                   "--lr",
                                   "--eval-every",
                                   "--profile-step",
                                   "--grad-accumulation",
                                   "--metrics",
                                   "--report",
                                   "--html",
                                   "--trace",
                                   "--run-dir",
                                   "--checkpoint",
                                   "--plan",
                                   "--overwrite",
                                   "--log-every",
                                   "--text",
                                   "--seed",
                                   "--checkpoint-activations",
                                   "--no-checkpoint-activations",
                                   "--quiet",
                                   "--optimizer-states"}) {
      if (args[i] == train_only)
        return EvalFail(InvalidArgumentError("option " + args[i] +
                                             " is one of tierzero train's; eval --help lists "
                                             "eval's"));
    }
    has_config = has_config || args[i] == "--config";
    if (args[i] == "--config" && i + 1 < args.size()) config_given = args[i + 1];
    has_nvme_path = has_nvme_path || args[i] == "--nvme-path";
    has_data = has_data || args[i] == "--data";
    if (args[i] == "--resume" && i + 1 < args.size()) resume = args[i + 1];
    if (args[i] == "--init-from" && i + 1 < args.size()) init_from = args[i + 1];
    rest.push_back(args[i]);
  }
  // A model directory's context is what it is asked for, up to its positions (MergeHfModel):
  // the window is that context, so config.json's limits (its positions, a sliding window) are
  // checked against the window scored.
  if (window > 0 && !init_from.empty() && gpt::IsHfDir(init_from))
    rest.insert(rest.end(), {"--seq-len", std::to_string(window)});
  // A checkpoint's model is the one it records; its run's config.json beside it, as `export`
  // reads it, gives the rest (Note [The checkpoint's model]).
  if (Status s = CheckCheckpointArgument(resume, "--resume"); !s.ok()) return EvalFail(s);
  // Without --config, the checkpoint first: a path that is none is said as such, not as the
  // config beside it missing.
  // Then the run's config beside it, or the model the checkpoint records (Note [The
  // checkpoint's model]: a checkpoint saved outside its run directory).
  std::string records;  // the checkpoint's user state, where its records stand for a config
  std::string state;    // the checkpoint's user state (its records of the data, below)
  if (!resume.empty() && !has_config) {
    auto info = ReadCheckpointInfo(resume);
    if (!info.ok()) return EvalFail(info.status());
    state = info->user_state;
    const std::string run_config = RunConfigBeside(resume, *info);
    if (run_config.empty()) records = info->user_state;
    if (!run_config.empty()) {
      // An older checkpoint's, which records no model: without it the shape would be guessed.
      auto text = ReadFileBounded(run_config, kMaxConfigBytes, "run config");
      if (!text.ok())
        return EvalFail(std::move(text).status().WithContext(
            "the config of the checkpoint's run (written by tierzero train beside it); pass "
            "--config"));
      rest.insert(rest.begin(), {"--config", run_config});
    }
  }
  auto cfg = LoadRunConfig(rest, nullptr, /*checkpoints_model=*/true, "eval");
  if (!cfg.ok()) return EvalFail(cfg.status());
  if (cfg->output.resume.empty() == cfg->output.init_from.empty())
    return EvalFail(InvalidArgumentError(
        "tierzero eval needs exactly one model: --resume CHECKPOINT or --init-from FILE|DIR"));
  // Without --data, the token files the checkpoint records its run read: absolute (DataJson), as
  // from anywhere they name the same files. A relative path is relative to where that run ran,
  // and from elsewhere names another file or none (a run under a directory whose name is not
  // UTF-8 records the path as given: another data.bin here was scored, silently): refused. The
  // run's config.json beside the checkpoint records the path as the user gave it; a relative one
  // there is the checkpoint's absolute one.
  if (!has_data && !has_config) {
    // (What the checkpoint itself records: an older one's records made from its run's config
    // would make the config's relative path absolute from here, another file: review 46.)
    nlohmann::json u = nlohmann::json::parse(state, nullptr, /*allow_exceptions=*/false);
    if (!u.is_object()) u = nlohmann::json::object();
    const nlohmann::json d = u.value("data", nlohmann::json::object());
    const nlohmann::json path =
        d.is_object() ? d.value("path", nlohmann::json()) : nlohmann::json();
    const bool tokens = path.is_string() && d.value("kind", nlohmann::json()) == "tokens";
    const std::string recorded = tokens ? path.get<std::string>() : "";
    const bool relative = cfg->data.token_path.empty() || cfg->data.token_path[0] != '/';
    if (tokens && (!records.empty() || relative)) {
      cfg->data.kind = "tokens";
      cfg->data.token_path = recorded;
      if (!recorded.empty() && recorded[0] == '/')
        std::fprintf(stderr, "note: scoring the token files the checkpoint's run read: %s\n",
                     recorded.c_str());
    }
    if (cfg->data.kind == "tokens" &&
        (cfg->data.token_path.empty() || cfg->data.token_path[0] != '/'))
      return EvalFail(InvalidArgumentError(
          "tierzero eval needs the token files to score: --data PATH (the checkpoint's run read '" +
          cfg->data.token_path + "', a path relative to where it ran)"));
  }
  if (cfg->data.kind != "tokens")
    return EvalFail(InvalidArgumentError("tierzero eval needs token files: --data PATH"));
  if (window == 0) window = cfg->model.seq_len;
  // (--batch-size is eval's own: a run's config checks its micro-batch against the model's
  // context, and a batch of shorter windows is no micro-batch of it: hunt 50.)
  if (batch > 0) cfg->train.batch_size = batch;
  // Windows up to the positions the model knows (a Hugging Face model's max_position_embeddings).
  const int context = cfg->model.seq_len;
  if (window > cfg->model.seq_len && window <= cfg->model.positions()) cfg->model.seq_len = window;
  // (The run's config checked its micro-batch against the context it had; a longer window
  // makes longer rows: host arrays sized before any budget applies.)
  if (int64_t{cfg->train.batch_size} * window > (int64_t{1} << 24))
    return EvalFail(InvalidArgumentError("a batch of " + std::to_string(cfg->train.batch_size) +
                                         " windows of " + std::to_string(window) +
                                         " tokens (--batch-size x --seq-len) is more than 2^24 "
                                         "tokens: give a smaller --batch-size"));
  if (window > cfg->model.seq_len) {
    // A safetensors file another program wrote records no context: it is the config's (the
    // run's, or the default). tierzero's export records its model's (Note [A safetensors file
    // that records its model], hf_io.cc).
    bool file = !cfg->output.init_from.empty() && !gpt::IsHfDir(cfg->output.init_from);
    if (file) {
      auto metadata = ReadSafetensorsMetadata(cfg->output.init_from);
      file = !metadata.ok() || metadata->count("tierzero.model") == 0;
    }
    return EvalFail(InvalidArgumentError(
        "--seq-len " + std::to_string(window) +
        " is longer than the model's context (model.seq_len " + std::to_string(cfg->model.seq_len) +
        ")" +
        (file && !has_config
             ? "; a safetensors file without tierzero's model record (another program's, or an "
               "older tierzero's export) does not record its model's context: "
               "give a config whose model.seq_len is the model's (--config FILE: the run's "
               "RUN_DIR/config.json, or {\"model\": {\"seq_len\": " +
                   std::to_string(window) + "}} with the shape flags)"
             : std::string())));
  }
  // NVMe swap space of its own when the budgets need it: a directory made and removed here (the
  // run's recorded nvme_path is the live run's, and relative to where it ran), unless given.
  ScratchDir nvme_dir;
  if (!has_nvme_path) cfg->engine.nvme_path.clear();
  if (cfg->engine.nvme_budget > 0 && cfg->engine.nvme_path.empty()) {
    if (Status s = nvme_dir.Create("tierzero-eval"); !s.ok()) return EvalFail(s);
  }
  // A --nvme-path that is not there is a directory made for the swap (as train makes one),
  // removed again at the end: the swap in it has no name, so a SIGKILL leaves at most the empty
  // directory. Taken as a file's name, a killed evaluation left a 256 MiB file, and the rerun
  // was refused for it (hunt 50).
  MadeDirs made_nvme(/*under_locks_kept=*/true);  // (Note [Directories another process took])
  if (has_nvme_path && cfg->engine.nvme_budget > 0) {
    std::error_code ec;
    if (!std::filesystem::exists(std::filesystem::symlink_status(cfg->engine.nvme_path, ec))) {
      made_nvme.Create(cfg->engine.nvme_path, ec);
      if (ec)
        return EvalFail(IoError("creating the NVMe directory " + cfg->engine.nvme_path +
                                " (--nvme-path): " + ec.message()));
    }
  }
  // Note [What eval scores by default]
  // Without --data the files are the run's own, 90% of whose tokens (or all files but the last)
  // it trained on: scored whole, a run's "mean loss 1.2" on data whose validation loss was 7.7
  // read as the model's (hunt 52). Its validation split is what the run's own val loss
  // samples; --data names other files, scored whole.
  // The run's own data: a checkpoint's, without --data, and read from its records or its run's
  // config.json beside it (a user's --config naming token files is data of the user's, whole).
  bool runs_data = !has_data && !resume.empty();
  if (runs_data && has_config) {
    std::error_code ec;
    fs::path ck = fs::path(resume).lexically_normal();
    if (ck.has_parent_path() && ck.filename().empty()) ck = ck.parent_path();
    runs_data = fs::equivalent(config_given, ck.parent_path() / "config.json", ec) && !ec;
  }
  const bool validation = split.empty() ? runs_data : split == "validation";
  // The model's vocabulary is its own where a checkpoint, a model directory or tierzero's export
  // records it; a safetensors file of another program's is of the model --config describes.
  bool vocab_fixed = !cfg->output.resume.empty() || gpt::IsHfDir(cfg->output.init_from);
  if (!vocab_fixed && !cfg->output.init_from.empty()) {
    auto metadata = ReadSafetensorsMetadata(cfg->output.init_from);
    vocab_fixed = metadata.ok() && metadata->count("tierzero.model") != 0;
  }
  const Status s = RunEval(*cfg, window, context, validation, vocab_fixed, nvme_dir.path());
  return s.ok() ? 0 : EvalFail(nvme_dir.path().empty() ? s : ScratchAdvice(s, nvme_dir.path()));
}

}  // namespace tierzero::app
