// `tierzero export`: a checkpoint to one consolidated safetensors file, or to a Hugging Face model
// directory (--format hf: hf_io.cc) (train.h).
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "resume.h"
#include "run_dir.h"
#include "signals.h"
#include "tierzero/bytes.h"
#include "tierzero/files.h"
#include "train.h"

namespace tierzero::app {
namespace fs = std::filesystem;

namespace {

int Fail(const Status& s) {
  std::fprintf(stderr, "error: %s\n", ForOneProcess(s, /*forward_only=*/false).ToString().c_str());
  return 1;
}

}  // namespace

int Export(const std::vector<std::string>& args) {
  if (int rc = RefuseUnderLauncher("export"); rc != 0) return rc;
  // A signal ends the export at once, with a message (nothing to save; what it was writing is
  // removed: Note [Signals on one thread of ours], signals.h).
  GracefulInterrupts interrupts(
      /*during_setup=*/true,
      "during the export: it stops now (what it was writing is removed; the checkpoint is "
      "unchanged)");
  std::string ckpt, output, config_path;
  DType dtype = DType::kF32;
  bool dtype_given = false, hf = false;
  uint64_t max_shard = 5000000000;  // transformers' save_pretrained default: "5GB", 5 x 10^9 bytes
  bool max_shard_given = false;
  bool overwrite = false;  // an existing -o file may be replaced
  // Budgets of this process's own, in place of the run's (its ranks' together).
  std::optional<uint64_t> host_budget, nvme_budget;
  for (size_t i = 0; i < args.size(); ++i) {
    // An option of export's at the end, its value missing.
    for (const char* takes : {"-o", "--output", "--dtype", "--format", "--max-shard-size",
                              "--config", "--host-budget", "--nvme-budget"}) {
      if (args[i] == takes && i + 1 >= args.size())
        return Fail(InvalidArgumentError(args[i] + " needs a value"));
    }
    if ((args[i] == "-o" || args[i] == "--output") && i + 1 < args.size()) {
      output = args[++i];
    } else if (args[i] == "--dtype" && i + 1 < args.size()) {
      auto d = ParseDType(args[++i]);
      if (!d.ok() || !IsFloatType(*d))
        return Fail(InvalidArgumentError("--dtype must be fp32, bf16 or fp16"));
      dtype = *d;
      dtype_given = true;
    } else if (args[i] == "--format" && i + 1 < args.size()) {
      const std::string f = args[++i];
      if (f != "hf" && f != "safetensors")
        return Fail(InvalidArgumentError("--format is '" + f + "'; accepted: safetensors, hf"));
      hf = f == "hf";
    } else if (args[i] == "--max-shard-size" && i + 1 < args.size()) {
      auto b = ParseByteSize(args[++i]);
      if (!b.ok()) return Fail(b.status().WithContext("--max-shard-size"));
      max_shard = *b;
      max_shard_given = true;
    } else if ((args[i] == "--host-budget" || args[i] == "--nvme-budget") && i + 1 < args.size()) {
      const std::string flag = args[i];
      auto b = ParseByteSize(args[++i]);
      if (!b.ok()) return Fail(b.status().WithContext(flag));
      (flag == "--host-budget" ? host_budget : nvme_budget) = *b;
    } else if (args[i] == "--config" && i + 1 < args.size()) {
      config_path = args[++i];
      if (config_path.empty())
        return Fail(InvalidArgumentError(
            "--config is empty (an unset shell variable?); name the run's config, or leave it "
            "out for the checkpoint's own (../config.json)"));
    } else if (args[i] == "--overwrite") {
      overwrite = true;
    } else if (args[i] == "-h" || args[i] == "--help") {
      std::puts(
          "usage: tierzero export CHECKPOINT_DIR -o model.safetensors [--dtype fp32|bf16]\n"
          "       tierzero export CHECKPOINT_DIR --format hf -o DIR [--dtype fp32|bf16|fp16]\n"
          "         [--max-shard-size SIZE]  (a Hugging Face model directory, new or empty: "
          "config.json\n"
          "         and safetensors in the model's names; dtype: the run's compute dtype; shards "
          "of\n"
          "         at most 5 GB (5 x 10^9 bytes) by default, 0 for one file; with\n"
          "         model.safetensors.index.json when several)\n"
          "  the model: the one the checkpoint records (a --config naming another is refused)\n"
          "  [--config RUN_DIR/config.json]  (default: CHECKPOINT_DIR/../config.json, where it "
          "is\n"
          "         the checkpoint's run's)\n"
          "  [--host-budget SIZE] [--nvme-budget SIZE]  (default: the run's, its ranks' "
          "together, or\n"
          "         without its config the machine's; what the host budget does not hold goes "
          "to NVMe\n"
          "         swap space in $TMPDIR)\n"
          "  [--overwrite]  (replace an existing -o file; without it an existing file is "
          "refused)\n"
          "  (-o and --output are the same; -o - writes the safetensors file to standard output)");
      return 0;
    } else if (ckpt.empty() && args[i] == "--" && i + 1 < args.size()) {
      ckpt = args[++i];  // (a checkpoint whose path begins with '-')
    } else if (ckpt.empty() && args[i][0] != '-') {
      ckpt = args[i];
    } else if (!ckpt.empty() && args[i][0] != '-') {
      return Fail(InvalidArgumentError("export reads one checkpoint; it was given " + ckpt +
                                       " and " + args[i] + " (export each alone)"));
    } else {
      return Fail(InvalidArgumentError(
          "unknown export option '" + args[i] + "'" +
          (args[i].find('/') != std::string::npos
               ? " (a path that begins with '-': write ./" + args[i] + ", or -- before it)"
               : std::string())));
    }
  }
  if (ckpt.empty() || output.empty())
    return Fail(InvalidArgumentError("usage: tierzero export CHECKPOINT_DIR -o FILE.safetensors"));
  if (max_shard_given && !hf)
    return Fail(InvalidArgumentError(
        "--max-shard-size shards a Hugging Face directory (--format hf); a safetensors export "
        "is one file"));
  if (Status s = CheckCheckpointArgument(ckpt, "the checkpoint"); !s.ok()) return Fail(s);
  // "-o -" is standard output, as tools take it (it wrote a file named "-"; hunt 51).
  if (output == "-") {
    if (hf)
      return Fail(InvalidArgumentError(
          "-o -: --format hf writes a directory (config.json and the weights), not a stream; "
          "name a new or empty directory"));
    output = "/dev/stdout";
  }
  // Note [Data on standard output] (run_dir.h): "exported ..." then goes to standard error.
  const std::string output_to = hf ? output : TakeStdoutForData(output);
  // The run directory is the checkpoint directory's parent, however the directory is written
  // ("run/checkpoint/", ".", "checkpoint/.").
  std::error_code fec;
  fs::path ckpt_dir = fs::absolute(ckpt, fec).lexically_normal();
  if (ckpt_dir.has_parent_path() && ckpt_dir.filename().empty()) ckpt_dir = ckpt_dir.parent_path();
  // Without --config, the checkpoint first: a path that is none is said as such, not as the
  // config beside it missing.
  StatusOr<CheckpointInfo> info =
      config_path.empty() ? ReadCheckpointInfo(ckpt) : StatusOr<CheckpointInfo>(CheckpointInfo{});
  if (!info.ok()) return Fail(info.status());
  // The run's config beside it, or the model the checkpoint records (Note [The checkpoint's
  // model]: a checkpoint saved outside its run directory).
  if (config_path.empty()) config_path = RunConfigBeside(ckpt, *info);
  StatusOr<RunConfig> cfg = DefaultRunConfig();
  std::set<std::string> asked;  // the model fields the config names
  if (!config_path.empty()) {
    auto text = ReadFileBounded(config_path, kMaxConfigBytes, "run config");
    if (!text.ok()) {
      if (text.status().code() == StatusCode::kNotFound)
        return Fail(NotFoundError("cannot open " + config_path +
                                  " (the run's config, written by tierzero train; pass --config)"));
      return Fail(text.status());
    }
    cfg = ParseRunConfig(*text, DefaultRunConfig());
    if (!cfg.ok()) return Fail(std::move(cfg).status().WithContext(config_path));
    asked = ModelFieldsNamedIn(*text);
  }
  info = ReadCheckpointInfo(ckpt);
  if (!info.ok()) return Fail(info.status());
  if (Status s = TakeCheckpointsModel(*cfg, ckpt, asked, /*say=*/true); !s.ok()) return Fail(s);
  // Without a config, the machine's budgets (Note [Budgets of a model brought from a directory]):
  // the built-in ones are the toy model's.
  // (Sized for the host, where export computes: a GPU's would be simulated in host memory.)
  if (config_path.empty()) {
    cfg->engine.device = DeviceChoice::kHost;
    SizeBudgetsToTheMachine(*cfg);
  }
  // The config must be the checkpoint's model's (Note [A checkpoint resumes its own model]): a
  // --config of another shape whose tensors happen to match (other heads) exported a
  // config.json that describes another model.
  if (Status s = CheckSameModel(info->user_state, *cfg, ckpt, /*trains=*/false); !s.ok())
    return Fail(config_path.empty() ? s : std::move(s).WithContext("--config " + config_path));
  if (hf && !dtype_given) dtype = cfg->engine.compute_dtype;  // the model's dtype
  if (!hf && dtype == DType::kF16)
    return Fail(
        InvalidArgumentError("--dtype fp16 is for --format hf; safetensors export "
                             "writes fp32 or bf16"));
  // A path no file can be written to is refused before the checkpoint loads.
  if (!hf) {
    if (Status s = CheckOutputPath(output, "-o"); !s.ok()) return Fail(s);
    if (Status s = CheckOutputDirectory(output, "-o"); !s.ok()) return Fail(s);
  } else {
    std::error_code dec;
    if (fs::exists(output, dec) && !fs::is_directory(output, dec))
      return Fail(InvalidArgumentError(
          "-o " + output +
          " exists and is not a directory; --format hf writes into a new or empty directory"));
    if (fs::is_directory(output, dec) && !fs::is_empty(output, dec))
      return Fail(InvalidArgumentError(HfOutputHoldsFiles(output)));
  }
  // Nothing the export reads is written over (its checkpoint's files, its config).
  std::vector<InputPath> inputs = {{"checkpoint", ckpt_dir.string(), true}};
  if (!config_path.empty()) inputs.push_back({"config", config_path, false});
  if (Status s = CheckNotAnInput(output, "-o", inputs); !s.ok()) return Fail(s);
  // A file export did not make is not replaced unasked (as train's outputs: --overwrite; a device
  // or pipe, /dev/stdout, is written to, not replaced): an -o naming a user's file, through a link,
  // or another model's weights had replaced it.
  if (Status s = CheckNotReplacedUnasked(output, "-o", "export", overwrite); !s.ok())
    return Fail(s);
  // The run's budgets (NVMe included, so a model larger than memory exports too).
  EngineConfig ec = cfg->engine;
  ec.device = DeviceChoice::kHost;
  NeverSteps(ec);
  {
    // One process holds what the checkpoint's ranks held: their budgets together.
    // (The machine's budgets are this process's already.)
    const uint64_t ranks =
        cfg->machine_budgets ? 1 : static_cast<uint64_t>(std::clamp(info->world_size, 1, 1 << 16));
    auto times = [&](uint64_t b) {  // saturating: a budget near 2^64 must not wrap
      return b > std::numeric_limits<uint64_t>::max() / ranks ? std::numeric_limits<uint64_t>::max()
                                                              : b * ranks;
    };
    ec.host_budget = times(ec.host_budget);
    ec.nvme_budget = times(ec.nvme_budget);
  }
  if (host_budget) ec.host_budget = *host_budget;
  if (nvme_budget) ec.nvme_budget = *nvme_budget;
  // NVMe swap space of its own (a directory made here and removed at the end): the run's recorded
  // nvme_path is relative to where that run ran, and a live run may be swapping there.
  ScratchDir nvme_dir;
  ec.nvme_path.clear();
  if (ec.nvme_budget > 0) {
    if (Status s = nvme_dir.Create("tierzero-export"); !s.ok()) return Fail(s);
    ec.nvme_path = nvme_dir.path();
  }
  auto engine = Engine::Create(ec);
  if (!engine.ok()) return Fail(engine.status());
  auto model = gpt::Gpt::Create(**engine, cfg->model);
  if (!model.ok()) return Fail(model.status());
  if (Status s = (*engine)->Finalize(); !s.ok()) return Fail(ScratchAdvice(s, ec.nvme_path));
  if (auto u = (*engine)->LoadCheckpoint(ckpt); !u.ok()) return Fail(u.status());
  if (hf) {
    std::string summary;
    if (Status s = ExportHf(**engine, *cfg, output, dtype, max_shard, &summary); !s.ok())
      return Fail(s);
    std::printf("exported %d tensors (%lld parameters, %s) to %s: %s\n", (*engine)->num_params(),
                static_cast<long long>((*model)->num_params()),
                std::string(DTypeName(dtype)).c_str(), output.c_str(), summary.c_str());
    return 0;
  }
  // The model the tensors are (Note [A safetensors file that records its model], hf_io.cc).
  if (Status s = (*engine)->ExportSafetensors(output_to, dtype,
                                              {{"tierzero.model", ModelJson(*cfg).dump()}});
      !s.ok()) {
    // Said as the user named it: standard output's copy is /dev/fd/N (Note [Data on standard
    // output]).
    std::string said(s.message());
    for (size_t at; output_to != output && (at = said.find(output_to)) != std::string::npos;)
      said.replace(at, output_to.size(), output);
    return Fail(Status(s.code(), said));
  }
  std::printf("exported %d tensors (%lld parameters, %s) to %s\n", (*engine)->num_params(),
              static_cast<long long>((*model)->num_params()), std::string(DTypeName(dtype)).c_str(),
              output.c_str());
  return 0;
}

}  // namespace tierzero::app
