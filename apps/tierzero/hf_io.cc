// --init-from a Hugging Face model directory, and `export --format hf` (train.h; the format's
// details in models/gpt/hf.h, docs/models.md).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "gpt/hf.h"
#include "resume.h"
#include "run_dir.h"
#include "tierzero/devices.h"
#include "tierzero/files.h"
#include "train.h"

namespace tierzero::app {
namespace {

// The fields of the model's shape: config.json sets them, flags and configs may only agree.
struct ShapeField {
  const char* key;
  const char* flag;
  std::string (*get)(const gpt::GptConfig&);
};

std::string Num(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

const ShapeField kShape[] = {
    {"arch", " (--arch)",
     [](const gpt::GptConfig& c) { return std::string(gpt::ArchName(c.arch)); }},
    {"vocab", " (--vocab)", [](const gpt::GptConfig& c) { return std::to_string(c.vocab); }},
    {"d_model", " (--width)", [](const gpt::GptConfig& c) { return std::to_string(c.d_model); }},
    {"n_layer", " (--layers)", [](const gpt::GptConfig& c) { return std::to_string(c.n_layer); }},
    {"n_head", " (--heads)", [](const gpt::GptConfig& c) { return std::to_string(c.n_head); }},
    {"n_kv_head", " (--kv-heads)",
     [](const gpt::GptConfig& c) { return std::to_string(c.n_kv_head); }},
    {"d_ff", "", [](const gpt::GptConfig& c) { return std::to_string(c.d_ff); }},
    {"max_positions", "", [](const gpt::GptConfig& c) { return std::to_string(c.max_positions); }},
    {"tie_embeddings", "",
     [](const gpt::GptConfig& c) { return std::string(c.tie_embeddings ? "true" : "false"); }},
    {"attention_bias", "",
     [](const gpt::GptConfig& c) { return std::string(c.attention_bias ? "true" : "false"); }},
    {"rope_theta", "", [](const gpt::GptConfig& c) { return Num(c.rope_theta); }},
    {"rope_factor", "", [](const gpt::GptConfig& c) { return Num(c.rope_factor); }},
    {"rope_low_freq_factor", "",
     [](const gpt::GptConfig& c) { return Num(c.rope_low_freq_factor); }},
    {"rope_high_freq_factor", "",
     [](const gpt::GptConfig& c) { return Num(c.rope_high_freq_factor); }},
    {"rope_original_positions", "",
     [](const gpt::GptConfig& c) { return std::to_string(c.rope_original_positions); }},
    {"norm_eps", "", [](const gpt::GptConfig& c) { return Num(c.norm_eps); }},
};

}  // namespace

// train.h
Status MergeHfModel(RunConfig& cfg) {
  const std::string& dir = cfg.output.init_from;
  struct stat st {};
  if (!dir.empty() && !gpt::IsHfDir(dir) && ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    // A directory that is no model directory: said before anything is built.
    if (::stat((dir + "/manifest.json").c_str(), &st) == 0)
      return InvalidArgumentError("--init-from " + dir +
                                  " is a tierzero checkpoint, not a model directory: --resume " +
                                  dir + " continues or evaluates it (tierzero export " + dir +
                                  " --format hf -o DIR makes a model directory of it)");
    // A config.json that is a link to nothing (a pruned or half-downloaded hub cache, whose
    // snapshots link into blobs/) or a loop of links is there, and said as such.
    const std::string config = dir + "/config.json";
    if (::lstat(config.c_str(), &st) == 0 && ::stat(config.c_str(), &st) != 0)
      return InvalidArgumentError("--init-from " + dir + ": " + config +
                                  " cannot be read: " + std::strerror(errno) +
                                  " (a link to a file that is gone, or a loop of links?); "
                                  "download the model again, or mend the link");
    // A directory this user may not search (its config.json may well be there).
    if (errno = 0; ::stat(config.c_str(), &st) != 0 && errno == EACCES)
      return IoError("--init-from " + dir + ": " + config +
                     " cannot be read: this user may not search " + dir +
                     " (its permissions); make it readable, or run as its owner");
    return InvalidArgumentError(
        "--init-from " + dir +
        " is a directory without config.json: --init-from takes a safetensors file or a Hugging "
        "Face model directory (config.json and its model*.safetensors)");
  }
  if (dir.empty() || !gpt::IsHfDir(dir)) return Status::OK();
  // The defaults of the architecture the run names (--arch llama sets Llama's).
  gpt::GptConfig defaults = DefaultRunConfig().model;
  if (cfg.model.arch == gpt::Arch::kLlama) defaults = gpt::AsLlama(defaults);
  gpt::GptConfig base = cfg.model;
  // The context: the one asked for, else 1024 tokens (or the model's positions when fewer).
  const bool asked = cfg.given.count("model.seq_len") != 0;
  if (!asked) base.seq_len = 1024;
  TZ_ASSIGN_OR_RETURN(const gpt::HfModel hf, gpt::ReadHfDir(dir, base));
  // Every shape field the run sets (Note [Asked for, not different from the default]; or
  // otherwise than its default, through an --arch) must agree with config.json.
  for (const ShapeField& f : kShape) {
    const std::string user = f.get(cfg.model), dflt = f.get(defaults), file = f.get(hf.config);
    // n_kv_head 0 means n_head: config.json's key/value heads equal to its heads agree with it.
    const bool same_heads =
        std::string(f.key) == "n_kv_head" && user == "0" && hf.config.n_kv_head == hf.config.n_head;
    const bool set = user != dflt || cfg.given.count("model." + std::string(f.key)) != 0;
    if (set && user != file && !same_heads)
      return InvalidArgumentError(
          "model." + std::string(f.key) + " is " + user + " (" +
          (f.flag[0] != '\0' ? std::string(f.flag).substr(2, std::strlen(f.flag) - 3) + " or "
                             : std::string()) +
          "the config file), but " + dir + "/config.json makes it " + file +
          ": a model directory sets its own shape; drop the setting");
  }
  // (ReadHfDir takes the positions for a longer context: a context asked for is not cut short.)
  if (asked && cfg.model.seq_len > hf.config.positions())
    return InvalidArgumentError("model.seq_len " + std::to_string(cfg.model.seq_len) +
                                " (--seq-len or the config file) is longer than the " +
                                std::to_string(hf.config.positions()) + " positions " + dir +
                                "/config.json gives the model");
  cfg.model = hf.config;
  SizeBudgetsToTheMachine(cfg);
  return Status::OK();
}

// Note [A safetensors file that records its model]
// A safetensors file holds tensors, not the model they belong to: a GPT with 4 heads has the
// tensors of one with 2, and `--init-from model.safetensors --heads 4` loaded and computed
// another model without a word. `tierzero export` records the model section in the file's
// metadata ("tierzero.model"); --init-from such a file takes its model from there, as from a
// model directory's config.json: a field the run asks for (a flag, --config) must agree, except
// the context (model.seq_len: the run's, up to the positions the file records) and what changes
// how it computes, not what it is (seed, activation_checkpointing, activations). A file another
// program wrote records nothing: its model is the run's config, as before.
Status MergeRecordedModel(RunConfig& cfg) {
  using nlohmann::json;
  const std::string& file = cfg.output.init_from;
  struct stat st {};
  // (A file that is not there is said where the weights load, as before: `plan` of a run's
  // config.json loads none, and plans the model that config describes.)
  if (file.empty() || ::stat(file.c_str(), &st) != 0 || S_ISDIR(st.st_mode)) return Status::OK();
  auto metadata = ReadSafetensorsMetadata(file);
  if (!metadata.ok()) return std::move(metadata).status().WithContext("--init-from " + file);
  const auto it = metadata->find("tierzero.model");
  if (it == metadata->end()) return Status::OK();
  // Outside JSON: parsed strictly, its depth bounded before anything recurses over it.
  const std::string source = "--init-from " + file + "'s metadata tierzero.model";
  if (Status s = CheckOutsideJson(it->second, source); !s.ok())
    return Status(StatusCode::kDataLoss, std::string(s.message()));
  const json recorded = json::parse(it->second, nullptr, /*allow_exceptions=*/false);
  if (!recorded.is_object())
    return DataLossError("--init-from " + file +
                         ": its metadata's tierzero.model is not a JSON object (the file was "
                         "edited or damaged)");
  // Every field tierzero's export records (all of them, since it began to): one missing was
  // taken from the run's config or the built-in default, so an edited record without n_head
  // loaded the tensors as another model, silently. (A field added later must be let through
  // here for the files before it.)
  const json run_model = ModelJson(cfg);  // (a local: a range over a temporary's items dangles)
  std::string missing;
  for (const auto& [key, value] : run_model.items()) {
    if (!HowTheModelComputes(key) && !RecordedBeside(key) && !recorded.contains(key))
      missing += (missing.empty() ? "" : ", ") + key;
  }
  if (!missing.empty())
    return DataLossError(source + " lacks " + missing +
                         " (the file was edited or damaged): export the model again, or "
                         "write a safetensors file without tierzero.model and give its model in "
                         "the config");
  auto merged = ParseRunConfig(json{{"model", recorded}}.dump(), cfg);
  if (!merged.ok())
    return std::move(merged).status().WithContext("--init-from " + file +
                                                  ": the model its metadata records");
  // The recorded model with what the run names over it, each compared as it computes (a named
  // --kv-heads 0 is the recorded n_head's count).
  json named = recorded;
  for (const auto& [key, value] : run_model.items())
    if (cfg.given.count("model." + key) != 0) named[key] = value;
  const json asked = EffectiveModel(named);
  const json effective = EffectiveModel(recorded);
  for (const auto& [key, then] : effective.items()) {
    if (HowTheModelComputes(key) || RecordedBeside(key) || key == "seq_len") continue;
    const auto now = asked.find(key);
    if (cfg.given.count("model." + key) == 0 || now == asked.end() || *now == then) continue;
    return InvalidArgumentError("model." + key + " is " + ModelValueShown(named, key) +
                                " (a flag or the config file), but --init-from " + file +
                                " records a model with " + ModelValueShown(recorded, key) +
                                ": the file's tensors are that model's; drop the setting");
  }
  gpt::GptConfig m = merged->model;
  m.seed = cfg.model.seed;
  m.activation_checkpointing = cfg.model.activation_checkpointing;
  m.activations = cfg.model.activations;
  // Another context: up to the positions the tensors hold (a GPT-2's wpe has a row for each;
  // recorded as 0, they are its context's).
  if (cfg.given.count("model.seq_len") != 0 && cfg.model.seq_len != m.seq_len) {
    if (m.max_positions == 0) m.max_positions = m.seq_len;
    if (cfg.model.seq_len > m.positions())
      return InvalidArgumentError("model.seq_len " + std::to_string(cfg.model.seq_len) +
                                  " (--seq-len or the config file) is longer than the " +
                                  std::to_string(m.positions()) + " positions --init-from " + file +
                                  " records for its model");
    m.seq_len = cfg.model.seq_len;
  }
  cfg.model = m;
  return Status::OK();
}

// Note [Budgets of a model brought from a directory]
// The built-in defaults (a 12 MiB device, 16 MiB of host memory, 256 MiB of NVMe) are sized to
// show the toy addition model crossing every tier; a Hugging Face model outgrows them at once,
// and `tierzero eval --init-from DIR` of a 500k-parameter Llama ran out of its device. When the
// run sets none of the four budgets, a model from a directory gets the machine's: on a GPU 55%
// of its free memory for chunks and activations and 30% for resident shards (the rest to
// cuBLAS, cuDNN and the CUDA context); on the simulated device an eighth of physical memory for
// each; half of the memory the process may use (a cgroup's limit when lower than physical memory)
// for the host tier. NVMe stays as it is: swap space is the user's to give. A run that sets any
// budget keeps all of them as given. Several ranks on a machine share it: ShareMachineBudgets
// divides each rank's by the ranks on its node (a GPU's by the ranks on that GPU, whose free memory
// each reads from the GPU it will run on) and takes the smallest across ranks, so the ranks'
// configs agree (hunt 40: three ranks each planned half of the machine's memory, and every rank
// sized its device from GPU 0).
void SizeBudgetsToTheMachine(RunConfig& cfg) {
  const EngineConfig dflt = DefaultRunConfig().engine;
  EngineConfig& e = cfg.engine;
  if (e.device_budget != dflt.device_budget || e.device_shard_budget != dflt.device_shard_budget ||
      e.host_budget != dflt.host_budget || e.nvme_budget != dflt.nvme_budget)
    return;
  // (Or given at the defaults' values: Note [Asked for, not different from the default].)
  for (const char* f : {"engine.device_budget", "engine.device_shard_budget", "engine.host_budget",
                        "engine.nvme_budget"})
    if (cfg.given.count(f) != 0) return;
  // The memory this process may use: a container's or a job's cgroup limit when lower than the
  // machine's (Note [The memory a process may use]).
  const uint64_t memory = ReadHostMemory().limit;
  const uint64_t mib = uint64_t{1} << 20;
  const bool gpu =
      e.device == DeviceChoice::kCuda || (e.device == DeviceChoice::kAuto && GpuCount() > 0);
  // The GPU this rank will run on (Engine: the node's local rank modulo the GPUs), as the
  // launcher numbers it before the communicator exists.
  int local_rank = 0;
  for (const char* v :
       {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "PMIX_LOCAL_RANK"}) {
    if (const char* x = std::getenv(v); x != nullptr) {
      local_rank = std::max(0, std::atoi(x));
      break;
    }
  }
  const int gpus = gpu ? GpuCount() : 0;
  const uint64_t free = gpus > 0 ? GpuFreeBytes(local_rank % gpus) : 0;
  if (free > 0) {
    e.device_budget = std::max(dflt.device_budget, free / 100 * 55 / mib * mib);
    e.device_shard_budget = free / 100 * 30 / mib * mib;
  } else if (!gpu) {
    e.device_budget = std::max(dflt.device_budget, memory / 8 / mib * mib);
    e.device_shard_budget = memory / 8 / mib * mib;
  }
  e.host_budget = std::max(dflt.host_budget, memory / 2 / mib * mib);
  cfg.machine_budgets = true;
}

// train.h
Status ShareMachineBudgets(Communicator& comm, RunConfig& cfg) {
  // A collective whenever there are several ranks, whether or not this rank sized its budgets
  // (one whose --init-from is missing did not: AgreeOnRunConfig then names the path).
  if (comm.size() <= 1) return Status::OK();
  EngineConfig& e = cfg.engine;
  const Topology t = comm.topology();
  const int gpus = GpuCount();
  const bool cuda =
      e.device == DeviceChoice::kCuda || (e.device == DeviceChoice::kAuto && gpus > 0);
  // Which ranks share what: the machine (its host name: ranks_per_node may emulate nodes on
  // one), and on it the GPU (the Engine's ordinal, local rank modulo the GPUs this rank sees,
  // among the GPUs CUDA_VISIBLE_DEVICES shows it: one GPU a rank under per-rank isolation).
  char host[256] = {};
  (void)::gethostname(host, sizeof host - 1);
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const int ordinal = gpus > 0 ? t.local_rank % gpus : 0;
  struct Share {
    uint64_t machine, gpu;
    uint64_t device, shard, host;
    uint64_t sized;
  };
  const uint64_t machine = std::hash<std::string>{}(host);
  const Share mine{machine,
                   std::hash<std::string>{}(std::string(visible != nullptr ? visible : "*") + "#" +
                                            std::to_string(ordinal)),
                   e.device_budget,
                   e.device_shard_budget,
                   e.host_budget,
                   cfg.machine_budgets ? 1u : 0u};
  TZ_ASSIGN_OR_RETURN(const std::vector<Share> all, AllGatherValue(comm, mine));
  if (!std::all_of(all.begin(), all.end(), [](const Share& a) { return a.sized != 0; }))
    return Status::OK();
  // Each rank's share (its machine's memory among the ranks on it, its device's among the ranks
  // on that device: the simulated device is the machine's memory), the smallest of them all, so
  // the configs agree.
  MachineShare share{UINT64_MAX, UINT64_MAX, UINT64_MAX};
  for (const Share& a : all) {
    uint64_t on_machine = 0, on_device = 0;
    for (const Share& b : all) {
      on_machine += b.machine == a.machine;
      on_device += b.machine == a.machine && (!cuda || b.gpu == a.gpu);
    }
    EngineConfig theirs = e;
    theirs.device_budget = a.device;
    theirs.device_shard_budget = a.shard;
    theirs.host_budget = a.host;
    const MachineShare s = ShareOf(theirs, on_machine, on_device);
    share = {std::min(share.device, s.device), std::min(share.shard, s.shard),
             std::min(share.host, s.host)};
  }
  ApplyShare(share, DeviceCollectivesChosen(e, cuda, t.local_size, comm.asynchronous()), e);
  return Status::OK();
}

// train.h
MachineShare ShareOf(const EngineConfig& e, uint64_t ranks_on_machine, uint64_t ranks_on_device) {
  const uint64_t mib = uint64_t{1} << 20;
  ranks_on_machine = std::max<uint64_t>(1, ranks_on_machine);
  ranks_on_device = std::max<uint64_t>(1, ranks_on_device);
  return {e.device_budget / ranks_on_device / mib * mib,
          e.device_shard_budget / ranks_on_device / mib * mib,
          e.host_budget / ranks_on_machine / mib * mib};
}

// train.h
bool DeviceCollectivesChosen(const EngineConfig& e, bool cuda, int ranks_per_node,
                             bool asynchronous) {
  // The Engine's rule (ChooseCollectivePath): NCCL wants a GPU for each rank of a node; the
  // simulated device a communicator that progresses on its own.
  return e.collectives == CollectivePath::kDevice ||
         (e.collectives == CollectivePath::kAuto &&
          (cuda ? GpuCount() >= ranks_per_node : asynchronous));
}

// train.h
void ApplyShare(const MachineShare& share, bool device_collectives, EngineConfig& e) {
  const EngineConfig dflt = DefaultRunConfig().engine;
  e.device_budget = std::max(dflt.device_budget, share.device);
  // Parameter shards on the device with several ranks need the device collectives.
  e.device_shard_budget = device_collectives ? share.shard : 0;
  e.host_budget = std::max(dflt.host_budget, share.host);
}

namespace {

// Note [A tied head beside its own weights]
// A model whose config ties its head to the embedding (tie_word_embeddings; GPT-2 always) has no
// head tensor of its own, and a file's lm_head.weight is skipped. Where that tensor holds other
// values than the embedding, transformers 5 does not tie (it warns, and its head is
// lm_head.weight) while 4.x ties (the head is the embedding): the file means two models. Taken as
// tied, tierzero scored another loss than transformers 5 without a word (hunt 48: 5e-3 to 1e-2
// relative), so it is refused, saying how to choose; equal values (a head saved beside its tie)
// load as tied.
Status CheckTiedHead(const gpt::HfModel& hf, const gpt::GptConfig& model, const std::string& dir) {
  const bool gpt2 = model.arch == gpt::Arch::kGpt2;
  if (!gpt2 && !model.tie_embeddings) return Status::OK();
  const std::string head = "lm_head.weight";
  if (!std::binary_search(hf.tensors.begin(), hf.tensors.end(), head)) return Status::OK();
  const std::string embedding = gpt2 ? gpt::HfTensorNames(model, hf.tensors)("wte")
                                     : std::string("model.embed_tokens.weight");
  StatusOr<bool> same = SafetensorsTensorsEqual(hf.files, embedding, head);
  if (!same.ok() && same.status().code() == StatusCode::kUnsupported)
    return Status(StatusCode::kUnsupported,
                  "--init-from " + dir + ": config.json ties the head to the embedding, and the " +
                      "weights hold a " + head + " beside it that cannot be compared with it (" +
                      std::string(same.status().message()) + "): remove " + head +
                      " from the weights to load the tied model");
  TZ_RETURN_IF_ERROR(same.status());
  if (*same) return Status::OK();
  return InvalidArgumentError(
      "--init-from " + dir + ": config.json ties the head to the embedding" +
      (gpt2 ? std::string(" (GPT-2's is always tied)") : " (tie_word_embeddings true)") +
      ", but the weights hold a " + head + " with other values than " + embedding +
      ": transformers 5 then uses " + head + " as an untied head, 4.x the embedding. " +
      (gpt2 ? "tierzero's GPT-2 ties its head: remove " + head +
                  " from the weights to load the tied model"
            : "Set \"tie_word_embeddings\": false in " + dir +
                  "/config.json to train the untied "
                  "head, or remove " +
                  head + " from the weights to tie it"));
}

}  // namespace

// train.h
std::string WeightsFileOfAModelDirectory(const std::string& file) {
  std::string parent = std::filesystem::path(file).parent_path().string();
  if (parent.empty()) parent = ".";
  if (gpt::IsHfDir(parent))
    return "It is a weights file of the Hugging Face model directory " + parent +
           ": give the directory (--init-from " + parent + "), whose config.json says the model";
  // Copied out, its config.json left behind: its names are transformers'.
  if (gpt::HasHfTensorNames(file))
    return "Its tensors are named as a Hugging Face model's: it is the weights file of a model "
           "directory; give that directory (--init-from DIR, with the config.json that says the "
           "model beside this file)";
  return "";
}

// train.h
StatusOr<std::string> LoadInitFrom(Engine& engine, const RunConfig& cfg) {
  const std::string& from = cfg.output.init_from;
  // Weights holding NaN or infinities compute NaN losses: every step would be skipped (a run
  // that trains nothing and exits 0) and eval would print "loss nan". Refused, naming them.
  std::vector<std::string> non_finite;
  auto refuse_non_finite = [&]() -> Status {
    if (non_finite.empty()) return Status::OK();
    std::string list;
    for (size_t i = 0; i < non_finite.size() && i < 3; ++i)
      list += (i == 0 ? "" : ", ") + non_finite[i];
    if (non_finite.size() > 3) list += " and " + std::to_string(non_finite.size() - 3) + " more";
    return DataLossError("--init-from " + from + ": tensors hold NaN or infinite values: " + list +
                         ". A model with them computes NaN; the file is damaged, or was saved "
                         "after a run diverged");
  };
  if (!gpt::IsHfDir(from)) {
    std::vector<std::string> skipped;
    if (Status s = engine.LoadSafetensors({from}, nullptr, &skipped, &non_finite); !s.ok()) {
      // The weights file of a model directory, given alone: the directory's config.json says
      // its model (shape, names), which the run's flags only guess at.
      if (s.code() == StatusCode::kNotFound || s.code() == StatusCode::kInvalidArgument) {
        if (const std::string advice = WeightsFileOfAModelDirectory(from); !advice.empty())
          return Status(s.code(),
                        "--init-from " + from + ": " + std::string(s.message()) + ". " + advice);
      }
      // A file without tierzero's model record (another program's, or an export of a tierzero
      // before it wrote one: hunt 41) is read as the flags' model: say where the shape comes from.
      if (s.code() == StatusCode::kInvalidArgument) {
        auto metadata = ReadSafetensorsMetadata(from);
        if (metadata.ok() && metadata->count("tierzero.model") == 0)
          return Status(s.code(),
                        "--init-from " + from + ": " + std::string(s.message()) +
                            ". The file records no model (another program's, or an older "
                            "tierzero's export): it is read as the model the flags and config "
                            "give; give its run's config (--config RUN_DIR/config.json) or the "
                            "shape flags it was trained with");
      }
      return std::move(s).WithContext("--init-from " + from);
    }
    TZ_RETURN_IF_ERROR(refuse_non_finite());
    // Note [A weights file holding more than the model]
    // One file is one model's weights: tensors the run's model has no parameter for mean the file
    // is another model (more layers, or an untied head beside a config that ties it), and were
    // skipped without a word: a 2-layer Llama read as 1 layer scored a loss, exit 0 (hunt 51).
    // (A model directory's config.json says its model, so its files' extra tensors are said and
    // skipped.) The buffers old GPT-2 and Llama files carry (the causal mask, the rotary
    // frequencies) are no parameters of any model, and are skipped.
    std::erase_if(skipped, [](const std::string& n) {
      for (const char* buffer : {".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq"})
        if (n.ends_with(buffer)) return true;
      return false;
    });
    if (!skipped.empty())
      return InvalidArgumentError(
          "--init-from " + from + " holds " + std::to_string(skipped.size()) + " tensor" +
          (skipped.size() == 1 ? "" : "s") + " the model has no parameter for (" + skipped.front() +
          (skipped.size() > 1 ? ", ..." : "") +
          "): it is another model than the config and flags give (more layers? an untied "
          "head?), and loading it would drop them. Give its model: its run's config (--config "
          "RUN_DIR/config.json), the shape flags it was trained with, or its model directory");
    // (Without tierzero's model record its tensors fit any model of their shapes, another
    // --heads too: said, hunt 41.)
    auto metadata = ReadSafetensorsMetadata(from);
    if (metadata.ok() && metadata->count("tierzero.model") == 0)
      return "weights from " + from +
             " (it records no model: read as the model the flags and config give, heads and "
             "norms included)";
    return "weights from " + from;
  }
  TZ_ASSIGN_OR_RETURN(const gpt::HfModel hf, gpt::ReadHfDir(from, cfg.model));
  TZ_RETURN_IF_ERROR(CheckTiedHead(hf, cfg.model, from));
  std::vector<std::string> skipped;
  TZ_RETURN_IF_ERROR(engine.LoadSafetensors(hf.files, gpt::HfTensorNames(cfg.model, hf.tensors),
                                            &skipped, &non_finite));
  TZ_RETURN_IF_ERROR(refuse_non_finite());
  std::string note = hf.source + " from " + from + " (" + std::to_string(hf.files.size()) +
                     (hf.files.size() == 1 ? " file" : " files");
  if (!skipped.empty())
    note += "; " + std::to_string(skipped.size()) + " tensors not in the model skipped, e.g. " +
            skipped.front();
  if (!hf.dropout.empty())
    note += "; its config's dropout (" + hf.dropout +
            ") is not applied: tierzero trains without dropout";
  return note + ")";
}

// train.h
// Note [What a stopped export leaves]
// An export killed (SIGKILL, a power cut) leaves in its directory what it had made: its lock
// file, a partial file under a temporary name, the shards it had committed, and no config.json
// (written last). Such a directory is refused as any directory holding files (its files are no
// longer this process's to remove), but the refusal says what they are and what to do: it said
// only "holds files", of files the user never saw (the dot files are hidden from `ls`).
std::string HfOutputHoldsFiles(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string holds = "-o " + dir +
                            " is a directory that holds files; --format hf writes into a new or "
                            "empty directory";
  std::error_code ec;
  bool left = false;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    const bool temporary =
        n.size() > 5 && n[0] == '.' && n.find(".tz-") != std::string::npos && n.ends_with(".tmp");
    const bool weights = n.starts_with("model") &&
                         (n.ends_with(".safetensors") || n == "model.safetensors.index.json");
    if (n == "config.json" || !(n == kLockFileName || temporary || weights)) return holds;
    left = left || n == kLockFileName || temporary;
  }
  if (!left) return holds;
  return "-o " + dir + " holds what an export stopped before its end left (its lock file " +
         kLockFileName +
         ", partial weights, no config.json); unless an export is writing there "
         "now, remove the directory (rm -r " +
         dir + ") and export again";
}

// train.h
Status ExportHf(Engine& engine, const RunConfig& cfg, const std::string& dir, DType dtype,
                uint64_t max_shard_bytes, std::string* summary) {
  namespace fs = std::filesystem;
  // A directory of its own: made here, or one that exists empty (never one holding files the
  // export did not write).
  std::error_code ec;
  bool made = false;
  if (fs::exists(dir, ec)) {
    if (!fs::is_directory(dir, ec))
      return InvalidArgumentError("-o " + dir +
                                  " exists and is not a directory; --format hf "
                                  "writes a directory");
    if (!fs::is_empty(dir, ec)) return InvalidArgumentError(HfOutputHoldsFiles(dir));
  } else if (fs::is_symlink(fs::symlink_status(dir, ec))) {
    return InvalidArgumentError("-o " + dir +
                                " is a link to nothing (a dangling symbolic link); --format hf "
                                "writes a new or empty directory: remove the link or name another");
  } else {
    // Registered before it is made (Note [Nothing made after the last clean-up]).
    RemoveOnSignalExit(dir);
    if (!fs::create_directory(dir, ec) && !ec) {
      // (Made by another process since it was looked for: "cannot make ...: Success".)
      KeepOnSignalExit(dir);
      return FailedPreconditionError("-o " + dir +
                                     " was made by another process while this export began "
                                     "(another export to it?); it is kept: name another directory");
    }
    if (ec) {
      KeepOnSignalExit(dir);
      return IoError("cannot make the directory " + dir + ": " + ec.message() +
                     (ec == std::errc::no_such_file_or_directory ? " (its parent must exist)"
                      : ec == std::errc::read_only_file_system   ? " (a read-only file system)"
                                                                 : ""));
    }
    made = true;
  }
  // Note [An output checked is the output replaced] (src/core/file_io.cc): two exports into one
  // empty directory both passed the check above, and wrote the same names, the later one's
  // files replacing the other's, both ending 0 (hunt 51). The directory is locked while it is
  // written (its lock file removed at the end), and checked empty again once it is.
  RunDirLock lock;
  if (Status s = lock.Acquire(dir, "output directory",
                              "one export writes a directory; name another directory, or wait "
                              "for that export to end");
      !s.ok()) {
    if (made) {
      KeepOnSignalExit(dir);
      ::rmdir(dir.c_str());
    }
    return s;
  }
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().filename() == kLockFileName) continue;
    lock.Release();
    return InvalidArgumentError("-o " + dir +
                                " is a directory that holds files (written since this export "
                                "looked); --format hf writes into a new or empty directory");
  }
  // Note [A model directory whole or not at all]: the directory was empty, so every file of the
  // model's names in it is this export's. A failure (a full disk before the index or config.json)
  // removes them and a directory made here, so the retry is not refused for a directory holding
  // files; a signal's exit does the same (RemoveOnSignalExit) for the files named so far.
  std::vector<std::string> ours;
  auto own = [&](const std::string& path) {
    ours.push_back(path);
    RemoveOnSignalExit(path);
  };
  if (made) own(dir);
  // Undone only in the directory it wrote into, and only the files it named: a directory moved
  // away mid-export and another made at its path lost the user's config.json and weights to an
  // undo that removed every file of the model's names there.
  struct stat dir_st {};
  const bool identified = ::stat(dir.c_str(), &dir_st) == 0;
  auto undo = [&](Status s) {
    struct stat now {};
    const bool same = identified && ::stat(dir.c_str(), &now) == 0 && now.st_dev == dir_st.st_dev &&
                      now.st_ino == dir_st.st_ino;
    for (const std::string& p : ours) KeepOnSignalExit(p);
    if (!same)
      return std::move(s).WithContext(
          "the export to " + dir + " failed, and " + dir +
          " is no longer the directory it wrote into (moved or replaced): nothing there was "
          "removed; what it wrote is wherever that directory went");
    for (const std::string& p : ours) {
      struct stat st {};
      if (p != dir && ::lstat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode)) ::unlink(p.c_str());
    }
    lock.Release();
    if (made) ::rmdir(dir.c_str());  // only when empty
    return std::move(s).WithContext("the export to " + dir + " was undone");
  };
  // Each file registered before it is written (its commit, an fsync and a rename, takes time).
  auto shards = engine.ExportSafetensorsShards(
      dir, "model", dtype, gpt::HfTensorNames(cfg.model, {}), max_shard_bytes,
      [&](const std::vector<Engine::SafetensorsShard>& planned) {
        for (const Engine::SafetensorsShard& sh : planned) own(dir + "/" + sh.file);
      });
  if (!shards.ok()) return undo(shards.status());
  if (shards->size() > 1) {
    own(dir + "/model.safetensors.index.json");
    if (Status s =
            WriteFileAtomically(dir + "/model.safetensors.index.json", gpt::HfIndexJson(*shards));
        !s.ok())
      return undo(s);
  }
  own(dir + "/config.json");
  if (Status s = WriteFileAtomically(dir + "/config.json", gpt::HfConfigJson(cfg.model, dtype));
      !s.ok())
    return undo(s);
  for (const std::string& p : ours) KeepOnSignalExit(p);
  lock.Release();
  *summary = std::to_string(shards->size()) + (shards->size() == 1 ? " file" : " files") +
             " and config.json (" + gpt::ModelName(cfg.model) + ", Hugging Face's layout)";
  return Status::OK();
}

}  // namespace tierzero::app
