// resume.h: the checkpoint's user state, read back, and what a resumed run checks against it (a
// run's own config.json, as a resume in place takes it: resume_config.cc).
#include "resume.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <system_error>

#include "tierzero/files.h"
#include "tierzero/utf8.h"

namespace tierzero::app {
namespace fs = std::filesystem;
using nlohmann::json;

// resume.h
bool SameDirectory(const std::string& a, const std::string& b) {
  struct stat sa {};
  struct stat sb {};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && S_ISDIR(sa.st_mode) &&
         sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

namespace {

// An integer field of a JSON object this program wrote (a metrics line, the checkpoint's
// user_state); nullopt when it is absent, not an integer, or out of range for T.
template <typename T>
std::optional<T> IntegerField(const json& j, const char* key) {
  if (!j.is_object()) return std::nullopt;
  const auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer()) return std::nullopt;
  if (it->is_number_unsigned()) {
    const uint64_t v = it->get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<T>::max())) return std::nullopt;
    return static_cast<T>(v);
  }
  const int64_t v = it->get<int64_t>();
  if (v < static_cast<int64_t>(std::numeric_limits<T>::min())) return std::nullopt;
  if (v > 0 && static_cast<uint64_t>(v) > static_cast<uint64_t>(std::numeric_limits<T>::max()))
    return std::nullopt;
  return static_cast<T>(v);
}

}  // namespace

int64_t CheckpointStep(const std::string& user_state, int64_t applied) {
  const json u = json::parse(user_state, nullptr, /*allow_exceptions=*/false);
  const std::optional<int> at = IntegerField<int>(u, "step");
  return at && *at >= 0 ? *at : applied;
}

// Note [The data continues where the checkpoint's run stopped]
// A step's micro-batches are numbered in one stream: step s of a run of W ranks accumulating A
// takes numbers s*W*A .. (s+1)*W*A - 1, rank r the r-th run of A (Dataset::Fetch draws each
// micro-batch's rows from its number). Numbered from the step alone, a resume under another
// split replayed or skipped data: 6 steps on 2 ranks resumed on 1 took steps 4..6's
// micro-batches again, in order (hunt 47). So a checkpoint records the micro-batches its run
// took ("micro_batches"), and a resumed run numbers its own after them: unchanged splits number
// as before (resumes stay bit for bit), changed ones neither repeat nor skip. A checkpoint of an
// older build records none: its step times its recorded ranks and accumulation, which is what it
// took unless it was itself resumed under another split.
uint64_t CheckpointMicroBatches(const std::string& user_state, int64_t step, int world, int accum) {
  const json u = json::parse(user_state, nullptr, /*allow_exceptions=*/false);
  if (const auto taken = IntegerField<uint64_t>(u, "micro_batches")) return *taken;
  const auto ranks = IntegerField<int64_t>(u, "ranks");
  const auto accumulated = IntegerField<int64_t>(u, "grad_accumulation");
  constexpr int64_t kMost = std::numeric_limits<int32_t>::max();
  const bool recorded = ranks && accumulated && *ranks > 0 && *accumulated > 0 && *ranks <= kMost &&
                        *accumulated <= kMost;
  return static_cast<uint64_t>(std::max<int64_t>(step, 0)) *
         static_cast<uint64_t>(recorded ? *ranks : world) *
         static_cast<uint64_t>(recorded ? *accumulated : accum);
}

// Note [A step the report cannot profile]
// A run's first iteration, fresh or resumed, is its warm-up: it records the access pattern the
// plan is made from and is not profiled. `train.profile_step` is profiled by the next planned
// iteration from that step's start, so a step the run never starts (at or before a resumed
// checkpoint's) and, accumulating one micro-batch, the run's first step were silently the first
// planned iteration's (hunt 47).
// - A fresh run asked for its first step (a flag, or a config file naming the field) is refused,
//   before it trains: every rank decides alike, from the config.
// - A resume says so in a note and profiles the first planned iteration: its config (the run's
//   own, or the file it started from) names the step the first run profiled.
Status CheckProfileStep(RunConfig& cfg, int64_t start, bool say) {
  const int64_t at = cfg.train.profile_step;
  const int accum = cfg.engine.grad_accumulation;
  const bool past = at > 0 && at <= start;
  const bool warm_up = at == start + 1 && accum == 1;
  if (!past && !warm_up) return Status::OK();
  const std::string why =
      past ? "is at or before the resumed checkpoint's step " + std::to_string(start)
           : "is this run's first step, whose one micro-batch is its warm-up iteration (it "
             "records the access pattern and is not profiled)";
  if (start > 0 || cfg.given.count("train.profile_step") == 0) {
    if (say)
      std::printf(
          "  note: train.profile_step %lld %s: the report profiles the first planned "
          "iteration\n",
          static_cast<long long>(at), why.c_str());
    cfg.train.profile_step = 0;
    return Status::OK();
  }
  const int steps = cfg.train.steps;
  return InvalidArgumentError(
      "train.profile_step (--profile-step) " + std::to_string(at) + " " + why +
      (steps >= 2 ? "; give 2.." + std::to_string(steps) + ", or 0 for the first planned iteration"
                  : "; a run of one step accumulating one micro-batch profiles no iteration: "
                    "leave it out (0), or accumulate two (--grad-accumulation 2)"));
}

// resume.h
bool StepsUp(const std::filesystem::path& p) {
  return std::any_of(p.begin(), p.end(), [](const fs::path& e) { return e == ".."; });
}

// resume.h
std::filesystem::path JoinKeepingParentSteps(const std::filesystem::path& base,
                                             const std::filesystem::path& p) {
  return StepsUp(p) ? base / p : (base / p).lexically_normal();
}

// resume.h
std::string EscapedTokenPattern(const std::filesystem::path& base, const std::string& pattern) {
  const std::string b = base.string();
  std::error_code ec;
  if (b.find_first_of("*?[]\\") == std::string::npos || fs::exists(base / pattern, ec)) return "";
  std::string out;
  for (char ch : b) {
    if (ch == '*' || ch == '?' || ch == '[' || ch == ']' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "/" + pattern;
}

json ScheduleJson(const TrainOptions& t) {
  return {{"lr", t.lr}, {"min_lr", t.min_lr}, {"warmup_steps", t.warmup_steps}, {"steps", t.steps}};
}

json DataJson(const gpt::DataConfig& d) {
  // Paths made absolute: the same file named from another directory is the same data. A ".."
  // after a symbolic link is the link's target's parent, which only the file system knows
  // ("lnk/../tokens.bin" read real/tokens.bin; cut lexically to tokens.bin it named another
  // file, which eval --resume then scored: hunt 52): such a path is resolved, not cut.
  auto absolute = [](const std::string& p) {
    std::error_code ec;
    std::filesystem::path a = std::filesystem::absolute(p, ec);
    if (!ec) a = StepsUp(p) ? std::filesystem::weakly_canonical(a, ec) : a.lexically_normal();
    // (Under a working directory whose name is not UTF-8 the absolute path cannot be JSON, and
    // the checkpoint's user state failed to serialise: the path as given, which is UTF-8.)
    if (ec || FirstInvalidUtf8(a.string()) >= 0) return p;
    return a.string();
  };
  json j = {{"kind", d.kind}};
  if (d.kind == "text") j["path"] = absolute(d.text_path);
  if (d.kind == "tokens") {
    std::error_code ec;
    const std::string escaped = d.token_path.empty() || d.token_path[0] == '/'
                                    ? std::string()
                                    : EscapedTokenPattern(fs::current_path(ec), d.token_path);
    j["path"] =
        !escaped.empty() && FirstInvalidUtf8(escaped) < 0 ? escaped : absolute(d.token_path);
  }
  if (d.kind == "addition") {
    j["digits"] = d.digits;
    j["reverse_answer"] = d.reverse_answer;
    j["pad_operands"] = d.pad_operands;
  }
  return j;
}

namespace {

std::string Rate(double lr) {
  char b[32];
  std::snprintf(b, sizeof b, "%.4g", lr);
  return b;
}

std::string Exact(double lr) {
  char b[32];
  std::snprintf(b, sizeof b, "%.9g", lr);
  return b;
}

// Note [A resumed run's schedule]
// The learning rate follows the run's schedule (train.steps, lr, min_lr, warmup_steps): a run
// continued with more --steps than it was started with (the way to train on) decays over the new
// horizon, so its rates from the resumed step on are not the ones the first run would have
// used, nor an uninterrupted run's of the old length. That is what the user asked for, and not
// an error, but it is not silent: the note names what changed and the rate at the resumed step
// under both schedules.
void ReportScheduleChange(const json& u, const TrainOptions& now, int step) {
  const auto it = u.find("schedule");
  if (it == u.end() || !it->is_object()) return;
  const json& s = *it;
  const auto steps = IntegerField<int>(s, "steps");
  const auto warmup = IntegerField<int>(s, "warmup_steps");
  if (!steps || !warmup || !s.contains("lr") || !s["lr"].is_number() || !s.contains("min_lr") ||
      !s["min_lr"].is_number())
    return;
  TrainOptions then = now;
  then.steps = *steps;
  then.warmup_steps = *warmup;
  then.lr = s["lr"].get<float>();
  then.min_lr = s["min_lr"].get<float>();
  std::string changed;
  auto note = [&](const char* field, const std::string& a, const std::string& b) {
    if (a == b) return;
    changed += (changed.empty() ? "" : ", ") + std::string(field) + " " + a + " -> " + b;
  };
  // A rate compared as it is, not as printed (0.0030004 printed as 0.003 was no change).
  auto rate = [&](const char* field, float a, float b) {
    if (a == b) return;
    const bool same = Rate(a) == Rate(b);
    note(field, same ? Exact(a) : Rate(a), same ? Exact(b) : Rate(b));
  };
  note("train.steps", std::to_string(then.steps), std::to_string(now.steps));
  rate("lr", then.lr, now.lr);
  rate("min_lr", then.min_lr, now.min_lr);
  note("warmup_steps", std::to_string(then.warmup_steps), std::to_string(now.warmup_steps));
  if (changed.empty()) return;
  // Only when a step this run trains gets another rate than the checkpoint's schedule gives it
  // (more --steps inside the warm-up changes nothing yet).
  int first = -1;
  for (int k = step; k < now.steps && first < 0; ++k)
    if (LearningRate(then, k) != LearningRate(now, k)) first = k;
  if (first < 0) return;
  const double a = LearningRate(then, step), b = LearningRate(now, step);
  if (a == b)
    std::printf(
        "  note: the learning-rate schedule changes (%s): step %d's rate is %s under both, "
        "from step %d on they differ\n",
        changed.c_str(), step + 1, Rate(b).c_str(), first + 1);
  else {
    const bool close = Rate(a) == Rate(b);  // printed alike: said to more digits
    std::printf(
        "  note: the learning-rate schedule changes (%s): step %d's rate is %s (%s under "
        "the checkpoint's schedule)\n",
        changed.c_str(), step + 1, (close ? Exact(b) : Rate(b)).c_str(),
        (close ? Exact(a) : Rate(a)).c_str());
  }
}

}  // namespace

// A resumed run whose global batch (rows per micro-batch x accumulation x ranks), data seed,
// data, schedule or compute type differs from the checkpoint's says so: the run goes on
// (resharding to another number of ranks is supported), but it no longer repeats what an
// uninterrupted run would have done, and the note says how to keep the global batch.
// Checkpoints written before a field was recorded say nothing of it.
std::string MomentFormatText(MomentFormat f) {
  return f == MomentFormat::kF32 ? "fp32" : f == MomentFormat::kBF16 ? "bf16" : "int8";
}

std::string FingerprintText(uint64_t fingerprint) {
  char b[24];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(fingerprint));
  return b;
}

// resume.h
bool KeepsItsCheckpointIn(const RunConfig& cfg, const std::filesystem::path& checkpoint) {
  const bool own = checkpoint.filename() == "checkpoint" &&
                   fs::path(cfg.output.checkpoint_dir).lexically_normal() ==
                       (fs::path(cfg.output.run_dir) / "checkpoint").lexically_normal();
  return own || SameDirectory(cfg.output.checkpoint_dir, checkpoint.string());
}

// Note [An older checkpoint's records]
// Checkpoints of tierzero builds before 2026-11-26 record of their run only the step, the batch,
// the ranks and the data seed: not the model, nor what a resume compares (the schedule, the
// data, the compute type, the moments' format, AdamW's settings, ZeRO++). Their model was checked
// by its tensors' shapes alone, so a resume under another --heads (the same shapes) trained a
// different model without a word, and no change was noted (hunt 41). Such a checkpoint takes the
// missing records from its run's config.json: the one beside it (in the run directory that holds
// it) that train wrote and that names this very checkpoint directory. What is still missing is
// said once: checked by shapes only, changes not noted.
json CheckpointRecords(const std::string& user_state, const std::string& checkpoint_dir, bool say) {
  json u = json::parse(user_state, nullptr, /*allow_exceptions=*/false);
  if (!u.is_object()) u = json::object();
  static const char* const kRecords[] = {"model",     "schedule",      "data",
                                         "data_seed", "compute_dtype", "optimizer_states",
                                         "adamw",     "zeropp",        "chunk_elems"};
  bool complete = true;
  for (const char* k : kRecords) complete = complete && u.contains(k);
  if (complete) return u;  // this build's
  const bool had_model = u.contains("model");
  std::error_code ec;
  const fs::path checkpoint = fs::canonical(checkpoint_dir, ec);
  std::optional<RunConfig> run;
  std::string run_config;
  if (!ec) {
    run_config = (checkpoint.parent_path() / "config.json").string();
    // Its run's (hunt 41, N1: a run moved, or used from another working directory).
    run = ConfigTrainWrote(run_config);
    if (run && !KeepsItsCheckpointIn(*run, checkpoint)) run.reset();
  }
  if (run) {
    const json from = {{"model", ModelJson(*run)},
                       {"schedule", ScheduleJson(run->train)},
                       {"data", DataJson(run->data)},
                       {"data_seed", run->data.seed},
                       {"compute_dtype", std::string(DTypeName(run->engine.compute_dtype))},
                       {"optimizer_states", MomentFormatText(run->engine.optimizer_states)},
                       {"adamw", AdamWJson(*run)},
                       {"zeropp", ZeroPPJson(*run)},
                       {"chunk_elems", run->engine.chunk_elems}};
    for (const auto& [key, value] : from.items())
      if (!u.contains(key)) u[key] = value;
    if (say)
      std::fprintf(stderr,
                   "note: the checkpoint %s (an older tierzero's) records %s: taken from its "
                   "run's %s\n",
                   checkpoint_dir.c_str(),
                   had_model ? "not all of its settings" : "no model or settings",
                   run_config.c_str());
  } else if (say) {
    std::fprintf(stderr,
                 "note: the checkpoint %s (an older tierzero's) records %s, and no config.json of "
                 "its run is beside it: %schanges to the schedule, data or settings are not "
                 "noted\n",
                 checkpoint_dir.c_str(), had_model ? "not all of its settings" : "no model",
                 had_model ? ""
                           : "its model is checked by its tensors' shapes only (give the "
                             "run's config: --config RUN_DIR/config.json), and ");
  }
  return u;
}

void ReportRunChanges(const std::string& user_state, const std::string& checkpoint_dir,
                      const RunConfig& cfg, int world, int step, uint64_t fingerprint,
                      DType activations) {
  const json u = CheckpointRecords(user_state, checkpoint_dir, /*say=*/false);
  if (!u.is_object()) return;
  ReportScheduleChange(u, cfg.train, step);
  const auto f = u.find("data_fingerprint");
  const bool same_files = f != u.end() && f->is_string() && *f == FingerprintText(fingerprint);
  if (const auto d = u.find("data"); d != u.end() && d->is_object() && *d != DataJson(cfg.data)) {
    // Another path to the same files (a copy, a link, the run moved): said as that, not as a
    // change of the data (hunt 51).
    json was = *d, now = DataJson(cfg.data);
    was.erase("path");
    now.erase("path");
    if (same_files && was == now)
      std::printf(
          "  note: the data is read at %s now (%s before): the same files, by their "
          "sizes and ends\n",
          DataJson(cfg.data).value("path", std::string("?")).c_str(),
          d->contains("path") && (*d)["path"].is_string() ? (*d)["path"].get<std::string>().c_str()
                                                          : "?");
    else
      std::printf("  note: the data changes from %s to %s\n", d->dump().c_str(),
                  DataJson(cfg.data).dump().c_str());
  } else if (f != u.end() && f->is_string() && !same_files) {
    // The same path, other files: regenerated in place, or a glob that matches more or fewer.
    std::printf(
        "  note: the data at %s is not what the checkpoint's run read (its files' sizes, ends or "
        "number differ: regenerated, or a glob matching other files?); the run goes on with it\n",
        DataJson(cfg.data).value("path", std::string("the same path")).c_str());
  }
  if (const auto t = u.find("compute_dtype"); t != u.end() && t->is_string()) {
    const std::string now(DTypeName(cfg.engine.compute_dtype));
    if (t->get<std::string>() != now)
      std::printf("  note: the compute type changes from %s to %s%s\n",
                  t->get<std::string>().c_str(), now.c_str(),
                  now == "fp16" ? " (the loss scale starts at engine.initial_loss_scale)" : "");
  }
  // The activations' type rounds every step otherwise (a resume that changed it changed the
  // losses without a word; hunt 51). (Checkpointing them recomputes the same values.) The type
  // each computed in where the checkpoint records it: "auto" is fp32 on the CPU, and a resume
  // from "auto" to "fp32" there changes nothing (it was said to change the steps).
  const std::string now_ran(DTypeName(activations));
  if (const auto r = u.find("activations_ran"); r != u.end() && r->is_string()) {
    if (r->get<std::string>() != now_ran)
      std::printf(
          "  note: the activations change from %s to %s (model.activations %s): the steps "
          "differ from the checkpoint's run's\n",
          r->get<std::string>().c_str(), now_ran.c_str(),
          ModelJson(cfg).value("activations", json("auto")).dump().c_str());
  } else if (const auto m = u.find("model");
             m != u.end() && m->is_object() && m->contains("activations")) {
    const json now = ModelJson(cfg).value("activations", json());
    if ((*m)["activations"] != now)
      std::printf(
          "  note: the activations change from %s to %s (model.activations): the steps "
          "differ from the checkpoint's run's\n",
          (*m)["activations"].dump().c_str(), now.dump().c_str());
  }
  if (const auto o = u.find("optimizer_states"); o != u.end() && o->is_string()) {
    const std::string now = MomentFormatText(cfg.engine.optimizer_states);
    if (o->get<std::string>() != now)
      std::printf(
          "  note: the optimizer states change from %s to %s: converted as they load (rounded to "
          "the narrower format where it is one), so the steps differ from the checkpoint's run's\n",
          o->get<std::string>().c_str(), now.c_str());
  }
  const auto batch = IntegerField<int64_t>(u, "batch_size");
  const auto accum = IntegerField<int64_t>(u, "grad_accumulation");
  const auto ranks = IntegerField<int64_t>(u, "ranks");
  // (Each in the range its config field allows, so the product cannot overflow.)
  constexpr int64_t kMost = std::numeric_limits<int32_t>::max();
  if (batch && accum && ranks && *batch > 0 && *accum > 0 && *ranks > 0 && *batch <= kMost &&
      *accum <= kMost && *ranks <= kMost) {
    const int64_t then = *batch * *accum * *ranks;
    const int64_t now = int64_t{cfg.train.batch_size} * cfg.engine.grad_accumulation * world;
    // A step's rows are chosen per micro-batch: another number of rows per micro-batch takes
    // other rows of the data even at the same global batch (ranks and accumulation trade
    // exactly). What keeps both: the checkpoint's rows per micro-batch, accumulated to its
    // global batch over this run's ranks.
    const bool rows = *batch != cfg.train.batch_size;
    if (then != now || rows) {
      if (then != now)
        std::printf(
            "  note: the global batch changes from %lld rows (%lld per micro-batch x %lld "
            "accumulated x %lld ranks) to %lld (%d x %d x %d)%s",
            static_cast<long long>(then), static_cast<long long>(*batch),
            static_cast<long long>(*accum), static_cast<long long>(*ranks),
            static_cast<long long>(now), cfg.train.batch_size, cfg.engine.grad_accumulation, world,
            rows ? ", and the steps take other rows of the data" : "");
      else
        std::printf(
            "  note: the rows per micro-batch change from %lld to %d (the global batch stays %lld "
            "rows): the steps take other rows of the data than the checkpoint's run would have",
            static_cast<long long>(*batch), cfg.train.batch_size, static_cast<long long>(then));
      const int64_t per = *batch * world;
      if (then % per == 0)
        std::printf("; %s--grad-accumulation %lld keeps %s",
                    rows ? ("--batch-size " + std::to_string(*batch) + " ").c_str() : "",
                    static_cast<long long>(then / per), rows ? "both" : "it");
      std::printf("\n");
    }
  }
  // Settings a checkpoint's steps depend on that a resume may change (hunt 39: none was said).
  auto changes = [](const json& then, const json& now) {
    std::string list;
    if (!then.is_object() || !now.is_object()) return list;
    for (const auto& [k, v] : now.items()) {
      const auto it = then.find(k);
      if (it == then.end() || *it == v) continue;
      // (fp32 fields as the config reads them, 0.95; with more digits where 7 show no change:
      // "clip_grad_norm 1 -> 1" for 1.0000001, hunt 51.)
      auto shown = [](const json& x, int digits) {
        if (!x.is_number_float()) return x.dump();
        char b[40];
        std::snprintf(b, sizeof b, "%.*g", digits, x.get<double>());
        return std::string(b);
      };
      const int digits = shown(*it, 7) == shown(v, 7) ? 9 : 7;
      list += (list.empty() ? "" : ", ") + k + " " + shown(*it, digits) + " -> " + shown(v, digits);
    }
    return list;
  };
  // (ZeRO++ changes only collectives: on one rank, then and now, it changes nothing.)
  const bool collectives = (ranks && *ranks > 1) || world > 1;
  const struct {
    const char* key;
    json now;
    const char *head, *tail;
    bool said;
  } sections[] = {{"adamw", AdamWJson(cfg), "AdamW's settings change", "", true},
                  {"zeropp", ZeroPPJson(cfg), "ZeRO++ changes",
                   " its collectives round otherwise, so", collectives}};
  for (const auto& sec : sections) {
    const auto then = u.find(sec.key);
    if (!sec.said || then == u.end()) continue;
    json was = *then, is = sec.now;
    if (std::string(sec.key) == "zeropp" && was.is_object() && is.is_object()) {
      // Only what rounds otherwise: a quantization's bits while it is off, its blocks and hpZ's
      // secondary copy while neither quantizes (hpZ gathers the same values), change no number
      // (hpZ turned on was said to change the steps, and they were the same; hunt 51).
      auto on = [&](const char* k) {  // (a value of another type, in an edited manifest: on)
        for (const json* j : {&was, &is})
          if (j->contains(k) && (*j)[k] != false) return true;
        return false;
      };
      auto drop = [&](const char* k) {
        was.erase(k);
        is.erase(k);
      };
      if (!on("qwz")) drop("qwz_bits");
      if (!on("qgz")) drop("qgz_bits");
      if (!on("qwz") && !on("qgz")) {
        drop("block_elems");
        drop("hpz");
      }
    }
    const std::string list = changes(was, is);
    if (!list.empty())
      std::printf("  note: %s (%s %s):%s the steps differ from the checkpoint's run's\n", sec.head,
                  sec.key, list.c_str(), sec.tail);
  }
  // Compressed moments follow the layout: their blocks are cut per shard and their stochastic
  // rounding is keyed by the element's place in the chunks (Note [Stochastic rounding of the
  // moments]); another layout rounds otherwise from the first step.
  const auto elems = IntegerField<uint64_t>(u, "chunk_elems");
  const bool relaid = (elems && *elems != cfg.engine.chunk_elems) || (ranks && *ranks != world);
  if (cfg.engine.optimizer_states != MomentFormat::kF32 && relaid)
    std::printf(
        "  note: the chunk layout changes (%s) and the optimizer's moments are %s: their "
        "blocks and stochastic rounding follow the layout, so the steps continue within "
        "the moments' rounding of the checkpoint's run's, not as it would have\n",
        elems && *elems != cfg.engine.chunk_elems
            ? ("engine.chunk_elems " + std::to_string(*elems) + " -> " +
               std::to_string(cfg.engine.chunk_elems))
                  .c_str()
            : ("ranks " + std::to_string(*ranks) + " -> " + std::to_string(world)).c_str(),
        MomentFormatText(cfg.engine.optimizer_states).c_str());
  const auto seed = IntegerField<uint64_t>(u, "data_seed");
  if (seed && *seed != cfg.data.seed)
    std::printf("  note: the data seed changes from %llu to %llu\n",
                static_cast<unsigned long long>(*seed),
                static_cast<unsigned long long>(cfg.data.seed));
}

json AdamWJson(const RunConfig& cfg) {
  const json engine =
      json::parse(RunConfigToJson(cfg), nullptr, /*allow_exceptions=*/false)["engine"];
  json out = json::object();
  for (const char* k : {"beta1", "beta2", "eps", "weight_decay", "clip_grad_norm"})
    if (engine.is_object() && engine.contains(k)) out[k] = engine[k];
  return out;
}

json ZeroPPJson(const RunConfig& cfg) {
  return json::parse(RunConfigToJson(cfg), nullptr, /*allow_exceptions=*/false)["zeropp"];
}

}  // namespace tierzero::app
