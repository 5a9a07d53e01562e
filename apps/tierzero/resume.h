// What a checkpoint records of the run that saved it (its user state: the loop's step, the
// model section, the global batch, the data seed) and what a resumed run checks against it
// (Note [A checkpoint resumes its own model]); and the run's own config a resume in place
// takes (Note [A resumed run's own config]). Part of `tierzero train` (train.cc).
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "train.h"

namespace tierzero::app {

// The model section of a config as JSON (what a checkpoint records of the model).
nlohmann::json ModelJson(const RunConfig& cfg);
// A model section with n_kv_head and d_ff as they compute (0: n_head's, and the architecture's
// default width), so one model written two ways compares equal.
nlohmann::json EffectiveModel(const nlohmann::json& model);
// `model`'s field `key` as written, and as it computes where that differs ("0 (2 as it
// computes)"): what a refusal quotes.
std::string ModelValueShown(const nlohmann::json& model, const std::string& key);
// A model field that says how the model computes, not what it is (seed, activation
// checkpointing, activations): it may differ between a checkpoint, or a file that records its
// model, and the run that reads it.
bool HowTheModelComputes(const std::string& key);
// A model field that records something of the model without being it (model.token_ids: Note
// [Special tokens carried], models/gpt/hf.cc): never compared, and a record without it (an
// older one) is whole.
bool RecordedBeside(const std::string& key);
// What a checkpoint records of AdamW's settings (betas, eps, weight decay, clipping) and of
// ZeRO++ (the zeropp section): a resume that changes them says so.
nlohmann::json AdamWJson(const RunConfig& cfg);
nlohmann::json ZeroPPJson(const RunConfig& cfg);

// The loop's step a checkpoint's user state records (Note [The loop's step, not the applied
// count], train.cc), or `applied` (the optimizer steps the engine counted) when it records none.
int64_t CheckpointStep(const std::string& user_state, int64_t applied);

// The training micro-batches the run of a checkpoint at `step` took (Note [The data continues
// where the checkpoint's run stopped], resume.cc); from its ranks and accumulation, or this
// run's `world` and `accum`, where it records none.
uint64_t CheckpointMicroBatches(const std::string& user_state, int64_t step, int world, int accum);

// OK when train.profile_step names a step this run profiles, starting at step `start` (0-based:
// a resumed checkpoint's); InvalidArgument when a fresh run was asked for its warm-up; otherwise
// 0 in its place and a note on stdout when `say` (Note [A step the report cannot profile]).
Status CheckProfileStep(RunConfig& cfg, int64_t start, bool say);

// What a checkpoint records of the learning-rate schedule and of the data it trained on.
nlohmann::json ScheduleJson(const TrainOptions& t);
nlohmann::json DataJson(const gpt::DataConfig& d);

// A resumed run that no longer repeats what the checkpoint's run would have done says how on
// stdout: its global batch (rows per micro-batch x accumulation x ranks), data seed, data,
// learning-rate schedule (the rate at the resumed step, then and now), compute type, AdamW's
// settings, ZeRO++, or (with compressed moments) the chunk layout differs.
// `step`: the resumed step (0-based: the next one trained).
// `fingerprint`: the data's (Dataset::Fingerprint), compared with the one the checkpoint records.
// An older checkpoint's missing records come from its run's config.json (Note [An older
// checkpoint's records]).
// `activations`: the type the model computes in now (model.activations resolved), compared with
// the one the checkpoint's run computed in where it records it.
void ReportRunChanges(const std::string& user_state, const std::string& checkpoint_dir,
                      const RunConfig& cfg, int world, int step, uint64_t fingerprint,
                      DType activations);
// The checkpoint's user state with what an older build's lacks taken from its run's config.json
// beside it (Note [An older checkpoint's records]); `say`: a note on stdout of where they came
// from, or that they are missing.
nlohmann::json CheckpointRecords(const std::string& user_state, const std::string& checkpoint_dir,
                                 bool say);
// engine.optimizer_states as the config and the checkpoint's user state spell it.
std::string MomentFormatText(MomentFormat f);
// A data fingerprint as the checkpoint records it (16 hex digits: JSON numbers lose 64 bits).
std::string FingerprintText(uint64_t fingerprint);

// For eval and export: the model (and compute type) the checkpoint at `checkpoint` records, over
// what `cfg` has where nothing `asked` names it ("model.n_head", "engine.compute_dtype": the
// flags and the fields a config file names), and refused (FailedPrecondition) where what was
// asked is another model (Note [The checkpoint's model]); `say`: a note on stderr of what was
// taken. Nothing when it records no model or is not there (said where it loads).
Status TakeCheckpointsModel(RunConfig& cfg, const std::string& checkpoint,
                            const std::set<std::string>& asked, bool say);
// The config.json at `path` when it is one train wrote, its paths as they resolve from where its
// run ran; nothing otherwise (Note [A config train wrote]).
std::optional<RunConfig> ConfigTrainWrote(const std::string& path);
// `a` and `b` name one directory (through links), both there.
bool SameDirectory(const std::string& a, const std::string& b);
// `pattern` (relative: a token file, or a glob of them, as --data takes it) under directory
// `base`: base / pattern, with base's glob characters escaped where pattern names no file there
// (a glob matches base as a pattern too, and "br[1]" would match no "br[1]"). "" where base has
// none, for the caller's own join.
std::string EscapedTokenPattern(const std::filesystem::path& base, const std::string& pattern);
// `base` / `p` (relative), cut lexically unless p steps up (".."): after a link that is its
// target's parent, which only the file system knows ("lnk/../tokens.bin" read real/tokens.bin;
// cut to tokens.bin it named another file: hunt 52).
std::filesystem::path JoinKeepingParentSteps(const std::filesystem::path& base,
                                             const std::filesystem::path& p);
bool StepsUp(const std::filesystem::path& p);
// `cfg` (ConfigTrainWrote's) kept its checkpoints in `checkpoint`: it names that directory as
// resolved from here, or (its run directory moved) it kept them in its own run directory and
// `checkpoint` is a run directory's "checkpoint".
bool KeepsItsCheckpointIn(const RunConfig& cfg, const std::filesystem::path& checkpoint);
// The same, saying why not: NotFound when nothing is there, else what is wrong with the file.
StatusOr<RunConfig> ReadConfigTrainWrote(const std::string& path);
// The checkpoint whose user state is `user_state` (at `dir`) is of cfg's model, as a resume
// checks it (CheckSameModel), without a word on stdout.
bool IsCheckpointOf(const std::string& user_state, const RunConfig& cfg, const std::string& dir);
// The model fields ("model.KEY") and "engine.compute_dtype" a config file's text names.
std::set<std::string> ModelFieldsNamedIn(const std::string& config_text);

// For a command that loads a checkpoint without --config (eval, export): the config.json beside
// it, in the run directory that holds it, when it is the one train wrote for this checkpoint's
// run, or whatever is there when the checkpoint records no model (an older build's: that config
// is needed, and its errors said); "" when the checkpoint's records give its model and no config
// of its run is beside it (Note [The checkpoint's model]).
std::string RunConfigBeside(const std::string& checkpoint_dir, const CheckpointInfo& info);

// `train`'s arguments with `--config RUN_DIR/config.json` first when they resume a run in place
// without --config and that config is provably the run's (Note [A resumed run's own config]);
// otherwise as given; an error when that config is there but cannot be read (Note [A resumed
// run's broken config]).
StatusOr<std::vector<std::string>> WithResumedRunsConfig(const std::vector<std::string>& args);

}  // namespace tierzero::app
