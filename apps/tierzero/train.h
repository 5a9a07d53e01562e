// `tierzero train`, `tierzero export`: the GPT trainer on the public engine API.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <set>
#include <string>
#include <vector>

#include "gpt/data.h"
#include "gpt/gpt.h"
#include "tierzero/engine.h"

namespace tierzero::app {

struct TrainOptions {
  int steps = 300;
  int batch_size = 32;  // rows per micro-batch
  float lr = 3e-3f;     // peak learning rate
  float min_lr = 3e-4f;
  int warmup_steps = 20;
  int eval_every = 50;  // 0: only at the end
  int eval_batches = 4;
  int checkpoint_every = 0;  // 0: only at the end (and on Ctrl-C)
  int profile_step = 0;      // the step whose iteration the report profiles; 0: the first planned
  int log_every = 0;  // without a terminal, a step line every N steps; 0: about 20 over the run
};

struct OutputOptions {
  std::string run_dir = "runs/default";
  std::string metrics;         // JSON lines; default <run_dir>/metrics.jsonl
  std::string report;          // default <run_dir>/report.json
  std::string html;            // the report as an HTML page; "" (default): RUN_DIR/report.html;
                               // "none": not written
  std::string trace;           // the profiled iteration as a Chrome trace; "" (default):
                               // RUN_DIR/trace.json; "none": not written
  std::string checkpoint_dir;  // default <run_dir>/checkpoint
  std::string resume;          // a checkpoint directory to continue from
  std::string init_from;       // a safetensors file to start from
  std::string plan;            // a `tierzero plan --json` file of this run: the report shows its
                               // prediction beside what the run measured
  bool quiet = false;          // no per-step lines
  bool overwrite = false;      // --overwrite: replace another run's outputs (not a config field)
};

// Several ranks (mpirun, srun): read only when the run has more than one.
struct RanksOptions {
  int ranks_per_node = 0;               // 0: MPI's shared-memory split; N: emulate N per node
  double collective_timeout_s = 300.0;  // a collective unfinished after this fails the job
};

struct RunConfig {
  gpt::GptConfig model;
  gpt::DataConfig data;
  TrainOptions train;
  EngineConfig engine;
  OutputOptions output;
  RanksOptions ranks;
  // "section.field" of every field the config file or a flag set (LoadRunConfig), whatever its
  // value: a value asked for that equals the default is still asked for (Note [Asked for, not
  // different from the default], run_config.cc).
  std::set<std::string> given;
  // The engine's budgets were sized to this machine (Note [Budgets of a model brought from a
  // directory], hf_io.cc): with several ranks, shared among a node's ranks (ShareMachineBudgets).
  bool machine_budgets = false;
};

// On the simulated device, the run planned from the model's own trace: an error where its device
// cannot hold an iteration, or its host tier and device (times `local_ranks`, the ranks on this
// machine) pass the process's memory limit (Note [A run that cannot fit, said at its set-up],
// train_fit.cc). OK elsewhere.
Status CheckPredictedFit(const RunConfig& cfg, int world, int local_ranks);

// The built-in default run (docs/config.md): a GPT whose model states are several times the
// device budget and larger than the host budget, on the synthetic addition task.
RunConfig DefaultRunConfig();

// The learning rate of 0-based step `step`: linear warm-up over warmup_steps, then a cosine from
// lr to min_lr over the rest of `steps`.
double LearningRate(const TrainOptions& t, int step);

// Parses a JSON config over the defaults. InvalidArgument naming the field, the bad value and
// the accepted range; unknown fields are errors (they are usually typos).
StatusOr<RunConfig> ParseRunConfig(const std::string& json_text, RunConfig base);
// Note [A floor below the rate asked for] (run_config.cc): min_lr, where no config or flag
// names it, a tenth of a rate below it.
void LowerDefaultFloor(RunConfig& config);

// What no single field can check (the model's shape, min_lr <= lr). ParseRunConfig runs it; a
// run runs it again after the flags, so it never starts with a config it could not load back
// (the config.json beside its checkpoint).
Status ValidateRunConfig(const RunConfig& config);
// The config as JSON (every field, with its value).
std::string RunConfigToJson(const RunConfig& config);

// `tierzero train --help`'s text.
const char* TrainHelp();

// The built-in default, the config file of --config over it, then the flags, then the checks
// no single field can make (`train` and `plan` read their config so).
// `config_path`, when given, receives --config's path ("" without one).
// `checkpoints_model` (eval): a --resume checkpoint's recorded model where no flag or config field
// names one, and the machine's budgets without a config file (Note [The checkpoint's model]).
// `command` names the command whose --help an unknown option points to.
StatusOr<RunConfig> LoadRunConfig(const std::vector<std::string>& args,
                                  std::string* config_path = nullptr,
                                  bool checkpoints_model = false, const char* command = "train");

// --init-from DIR, a Hugging Face model directory (hf_io.cc, docs/models.md): its config.json
// sets the model's shape; a shape field the run sets otherwise is an error naming it. Nothing
// for a safetensors file. What the run asked for is `config.given`.
Status MergeHfModel(RunConfig& config);
// A run's own config.json (at `config_path`) read from another working directory: its relative
// paths taken from the directory the run started in, where that is known (Note [A run's config
// from another working directory], run_flags.cc).
void RebaseOnItsRunDir(RunConfig& cfg, const std::string& config_path);
// --init-from FILE, a safetensors file: the model tierzero's export recorded in it, as
// MergeHfModel takes a directory's (Note [A safetensors file that records its model], hf_io.cc).
Status MergeRecordedModel(RunConfig& config);

// For --init-from FILE, a weights file of a Hugging Face model directory given alone (its
// directory's config.json beside it, or tensors named as transformers names them): what to give
// instead, one sentence; empty otherwise. (train after a failed load, plan before it.)
std::string WeightsFileOfAModelDirectory(const std::string& file);
// The machine's budgets for a model from a directory when the run sets none (Note [Budgets of
// a model brought from a directory], hf_io.cc).
void SizeBudgetsToTheMachine(RunConfig& config);
// Loads --init-from (a safetensors file of the model, or a Hugging Face directory, streamed
// tensor by tensor) and says what loaded.
StatusOr<std::string> LoadInitFrom(Engine& engine, const RunConfig& config);
// `export --format hf`: the directory `dir` (new or empty) with the weights in `dtype` as
// safetensors of at most about `max_shard_bytes` each (0: one file; several: with
// model.safetensors.index.json) and config.json. `summary` says what was written.
Status ExportHf(Engine& engine, const RunConfig& config, const std::string& dir, DType dtype,
                uint64_t max_shard_bytes, std::string* summary);
// Why `export --format hf -o dir` refuses a directory holding files: what a stopped export left
// there said as such (Note [What a stopped export leaves], hf_io.cc).
std::string HfOutputHoldsFiles(const std::string& dir);

// Applies command-line overrides (--steps N, ...) in order. InvalidArgument for an unknown flag
// or a bad value. Checks each value alone: ValidateRunConfig checks the result as a whole.
// `given`, when not null, receives the "section.field" of each field a flag set.
Status ApplyFlags(const std::vector<std::string>& flags, RunConfig& config,
                  std::string* config_path, std::set<std::string>* given = nullptr,
                  const char* command = "train");

// Keeps the lines of the metrics file `path` whose step is at most `step` (a resumed run drops
// what was written after its checkpoint); lines that are not a metrics object are dropped too.
// The file is rewritten atomically; a missing file is an empty one. Then `unwritten` (lines the
// checkpoint's run computed and could not write: Note [Metrics lines a stop left unwritten] in
// train.cc) are appended, each that the kept lines do not already hold.
// `appended` (when not null) says whether they were: not into a stream or a file that is not
// there, where the caller writes them.
Status TrimMetrics(const std::string& path, int step,
                   const std::vector<std::string>& unwritten = {}, bool* appended = nullptr);

// A whole file's text, at most 64 MiB (a plan, rates): NotFound when it does not exist, an error
// naming it (`what`: "plan file") for a directory, a socket or a larger file.
StatusOr<std::string> ReadTextFile(const std::string& path, const std::string& what);

// Under a launcher (mpirun, srun with PMIx) the ranks are MPI's; otherwise one process.
StatusOr<std::shared_ptr<Communicator>> RunCommunicator(const RanksOptions& ranks);
// The rank and number of ranks a launcher (mpirun, srun) started this process as, from its
// environment ({0, 1} when none did): known before any communicator exists.
struct LauncherRanks {
  int rank = 0, size = 1;
};
LauncherRanks LaunchedRanks();
// A command that runs in one process (export, eval) started as several ranks: each would do the
// whole job and race for its output. 2, with rank 0's message; 0 when one process runs it.
int RefuseUnderLauncher(const char* command,
                        const char* why = "it loads a checkpoint of any number of ranks");
// The engine's error as a one-process command (export, eval) says it: without its advice to use
// more ranks (they run without mpirun), and for eval's forward alone without the advice to
// checkpoint activations (eval refuses --checkpoint-activations: it keeps no activations for a
// backward). cli_trust `one_process_advice` checks the phrases it drops are gone.
Status ForOneProcess(const Status& s, bool forward_only);
// An engine config for a command that reads a model's weights and never steps (eval, export):
// Note [The states of a command that never steps] in command_paths.cc.
void NeverSteps(EngineConfig& ec);
// Ends the command on an error that escaped as an exception (main's last net): as any failure
// of `train` ends, every rank of several told at once (Note [A failing rank ends the run]).
int FailUncaught(const Status& s);
// One rank's share of budgets sized to its machine: the host's among the ranks on the machine,
// the device's among the ranks on the device, each rounded down to the MiB.
struct MachineShare {
  uint64_t device, shard, host;
};
MachineShare ShareOf(const EngineConfig& engine, uint64_t ranks_on_machine,
                     uint64_t ranks_on_device);
// Whether the ranks' collectives will run on the device (asked for, or what `auto` chooses).
bool DeviceCollectivesChosen(const EngineConfig& engine, bool cuda, int ranks_per_node,
                             bool asynchronous);
// The share as the engine's budgets: no less than the defaults, no resident shards without the
// device collectives (those refuse them).
void ApplyShare(const MachineShare& share, bool device_collectives, EngineConfig& engine);

// Several ranks whose budgets were all sized to the machine (RunConfig::machine_budgets): each
// rank's share (the host's memory among the ranks with its host name, a GPU's among the ranks on
// it), the smallest any rank computed (so the configs agree), and no device-resident parameter
// shards where the collectives run on the host (they are refused there). A collective whenever
// there are several ranks (whether this one sized its budgets or not); nothing on one.
Status ShareMachineBudgets(Communicator& comm, RunConfig& config);

// Several ranks: OK when every rank's resolved config is the same (Note [Ranks agree before they
// compute], agree.cc); otherwise InvalidArgument on every rank, naming the ranks and fields that
// differ from rank 0's. Before that, every rank must read --init-from's path, and after it, the
// same weights there (Note [Ranks agree on the weights they start from]). One rank: NotFound when
// --init-from names nothing. A collective: every rank calls it before any other.
Status AgreeOnRunConfig(Communicator& comm, const RunConfig& config);

// OK unless the checkpoint's user state (`user_state`, saved by `tierzero train`) records a model
// that differs from `config.model` in a field that shapes the computation: FailedPrecondition
// naming the field and both values (Note [A checkpoint resumes its own model], resume.cc).
// Checkpoints that record no model pass. `trains`: the command trains on from it (its advice
// names the run directory too), else it reads the model alone (eval, export).
Status CheckSameModel(const std::string& user_state, const RunConfig& config,
                      const std::string& dir, bool trains = true);

// Runs training; returns the process exit code (0 also after Ctrl-C, once the checkpoint is
// saved).
int Train(const std::vector<std::string>& args);
int Export(const std::vector<std::string>& args);
// `tierzero eval` (eval.cc): the mean next-token loss of a model over a token file's windows.
int Eval(const std::vector<std::string>& args);

}  // namespace tierzero::app
