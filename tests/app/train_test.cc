// tierzero train as a user runs it: config parsing errors, the flags the README relies on, a
// short run whose accuracy rises well above chance, resume, and export.
#include "train.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tierzero::app {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

class TempDir {
 public:
  TempDir() {
    std::string t = (fs::temp_directory_path() / "tz_train_XXXXXX").string();
    path_ = mkdtemp(t.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void ExpectConfigError(const std::string& text, const std::string& field,
                       const std::string& more = "") {
  auto c = ParseRunConfig(text, DefaultRunConfig());
  ASSERT_FALSE(c.ok()) << text;
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << text;
  EXPECT_NE(c.status().message().find(field), std::string::npos) << c.status().ToString();
  if (!more.empty()) {
    EXPECT_NE(c.status().message().find(more), std::string::npos) << c.status().ToString();
  }
}

TEST(TrainConfig, BadConfigsNameFieldValueAndRange) {
  ExpectConfigError("{", "not valid JSON");
  ExpectConfigError("[1]", "JSON object");
  ExpectConfigError(R"({"modle": {}})", "unknown config section 'modle'");
  ExpectConfigError(R"({"model": {"layers": 3}})", "model.layers", "n_layer");
  ExpectConfigError(R"({"model": {"n_layer": 0}})", "model.n_layer", "1..4096");
  ExpectConfigError(R"({"model": {"n_layer": "four"}})", "model.n_layer", "\"four\"");
  ExpectConfigError(R"({"model": {"d_model": 100, "n_head": 3}})", "n_head", "divisor");
  ExpectConfigError(R"({"engine": {"device_budget": "lots"}})", "engine.device_budget", "MiB");
  ExpectConfigError(R"({"engine": {"compute_dtype": "int8"}})", "engine.compute_dtype", "bf16");
  ExpectConfigError(R"({"engine": {"device": "tpu"}})", "engine.device", "cuda");
  ExpectConfigError(R"({"engine": {"beta2": 1.5}})", "engine.beta2", "[0, 1)");
  ExpectConfigError(R"({"train": {"lr": -1}})", "train.lr", "-1");
  ExpectConfigError(R"({"train": {"lr": 0.001, "min_lr": 0.01}})", "train.min_lr");
  ExpectConfigError(R"({"data": {"digits": 12}})", "data.digits", "1..9");
  // Numbers beyond double's range are an error, not an uncaught exception.
  ExpectConfigError(R"({"train": {"lr": 1e400}})", "1e400");
  ExpectConfigError(R"({"model": {"n_layer": -1e400}})", "1e400");
  // Sizes parse from human strings; comments are allowed.
  auto ok = ParseRunConfig(R"({"engine": {"host_budget": "1.5 GiB"}} // note)", DefaultRunConfig());
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->engine.host_budget, uint64_t{3} << 29);
  // The written config parses back to itself.
  auto again = ParseRunConfig(RunConfigToJson(*ok), DefaultRunConfig());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(RunConfigToJson(*again), RunConfigToJson(*ok));
  // Sizes that are no round number of a unit come back exactly too (written as byte counts).
  for (const uint64_t bytes : {uint64_t{20000000}, uint64_t{1} << 20, uint64_t{12345}, uint64_t{0},
                               (uint64_t{3} << 30) + 1}) {
    RunConfig c = DefaultRunConfig();
    c.engine.host_budget = bytes;
    c.engine.device_budget = bytes + (uint64_t{1} << 20);
    auto back = ParseRunConfig(RunConfigToJson(c), DefaultRunConfig());
    ASSERT_TRUE(back.ok()) << bytes << ": " << back.status().ToString();
    EXPECT_EQ(back->engine.host_budget, bytes);
    EXPECT_EQ(back->engine.device_budget, bytes + (uint64_t{1} << 20));
  }
}

TEST(TrainConfig, FlagsOverride) {
  RunConfig c = DefaultRunConfig();
  std::string path;
  ASSERT_TRUE(
      ApplyFlags({"--config", "x.json", "--steps", "7", "--metrics", "m.jsonl", "--report",
                  "r.json", "--device-budget", "12MiB", "--dtype", "fp16", "--text", "t.txt"},
                 c, &path)
          .ok());
  EXPECT_EQ(path, "x.json");
  EXPECT_EQ(c.train.steps, 7);
  EXPECT_EQ(c.output.metrics, "m.jsonl");
  EXPECT_EQ(c.output.report, "r.json");
  EXPECT_EQ(c.engine.device_budget, uint64_t{12} << 20);
  EXPECT_EQ(c.engine.compute_dtype, DType::kF16);
  EXPECT_EQ(c.data.kind, "text");
  Status bad = ApplyFlags({"--stpes", "3"}, c, &path);
  EXPECT_NE(bad.message().find("unknown option '--stpes'"), std::string::npos) << bad.ToString();
  bad = ApplyFlags({"--steps", "-3"}, c, &path);
  EXPECT_NE(bad.message().find("train.steps"), std::string::npos) << bad.ToString();
  // A value that is not UTF-8 could not be written into the run's config.json.
  bad = ApplyFlags({"--nvme-path", "/tmp/\xff"}, c, &path);
  EXPECT_NE(bad.message().find("not UTF-8"), std::string::npos) << bad.ToString();
}

TEST(TrainConfig, FlagsThatBreakARuleAcrossFieldsAreRefusedBeforeTheRun) {
  // --lr below the default min_lr: each value is fine alone, the two together are not (the
  // run's config.json would not load back for export or resume).
  RunConfig c = DefaultRunConfig();
  std::string path;
  ASSERT_TRUE(ApplyFlags({"--lr", "0.00005"}, c, &path).ok());
  const Status bad = ValidateRunConfig(c);
  EXPECT_NE(bad.message().find("'train.min_lr' (0.0001) exceeds 'train.lr' (5e-05)"),
            std::string::npos)
      << bad.ToString();
  // Note [A floor below the rate asked for]: a run's config, where nothing names min_lr, takes
  // a tenth of a rate below the default floor; one named is kept, and refused.
  auto lowered = LoadRunConfig({"--lr", "0.00005"});
  ASSERT_TRUE(lowered.ok()) << lowered.status().ToString();
  EXPECT_FLOAT_EQ(lowered->train.min_lr, 0.000005f);
  TempDir dir;
  // Of the rate the flags leave, not the file's (its floor was kept: review 51).
  std::ofstream(dir / "low.json") << R"({"train": {"lr": 0.00005}})";
  auto raised = LoadRunConfig({"--config", dir / "low.json", "--lr", "0.001"});
  ASSERT_TRUE(raised.ok()) << raised.status().ToString();
  EXPECT_FLOAT_EQ(raised->train.min_lr, 0.0001f);
  std::ofstream(dir / "floor.json") << R"({"train": {"min_lr": 0.0001}})";
  auto named = LoadRunConfig({"--config", dir / "floor.json", "--lr", "0.00005"});
  ASSERT_FALSE(named.ok());
  EXPECT_NE(named.status().message().find("exceeds 'train.lr'"), std::string::npos);
  EXPECT_EQ(Train({"--config", dir / "floor.json", "--lr", "0.00005", "--run-dir",
                   dir / "never-created"}),
            1);
  EXPECT_FALSE(fs::exists(dir / "never-created"));
  // A config file that lowers min_lr makes the same flag valid: the rule is checked on the
  // result, not on each source.
  RunConfig d =
      *ParseRunConfig(R"({"train": {"lr": 0.001, "min_lr": 0.00001}})", DefaultRunConfig());
  ASSERT_TRUE(ApplyFlags({"--lr", "0.00005"}, d, &path).ok());
  EXPECT_TRUE(ValidateRunConfig(d).ok());
}

std::vector<json> ReadLines(const std::string& path) {
  std::vector<json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}

// A one-block model that trains a step in milliseconds, all in memory.
void WriteTinyConfig(const std::string& path, int eval_every) {
  std::ofstream(path) << R"({"model": {"seq_len": 6, "d_model": 32, "n_layer": 1, "n_head": 2},
      "data": {"digits": 1}, "train": {"batch_size": 4, "eval_batches": 1, "eval_every": )"
                      << eval_every << R"(},
      "engine": {"device_budget": "4 MiB", "host_budget": "4 MiB", "nvme_budget": "0"}})";
}

TEST(Train, UnwritableOutputsFailBeforeTheFirstStepAndAFullDiskStopsTheRun) {
  TempDir dir;
  WriteTinyConfig(dir / "c.json", 0);
  const std::string metrics = dir / "m.jsonl";
  // A checkpoint directory that cannot exist: the run stops before training anything.
  EXPECT_NE(Train({"--config", dir / "c.json", "--steps", "5", "--metrics", metrics, "--run-dir",
                   dir / "run1", "--checkpoint", "/dev/null/checkpoint", "--quiet"}),
            0);
  EXPECT_TRUE(ReadLines(metrics).empty());
  // Metrics on a full disk (/dev/full: every write fails with ENOSPC): an error, not exit 0.
  EXPECT_NE(Train({"--config", dir / "c.json", "--steps", "5", "--metrics", "/dev/full",
                   "--run-dir", dir / "run2", "--quiet"}),
            0);
}

TEST(Train, ResumingFromAnEarlierCheckpointKeepsEachStepOnceInTheMetrics) {
  TempDir dir;
  WriteTinyConfig(dir / "c.json", 4);
  const std::string run = dir / "run", metrics = dir / "run/metrics.jsonl";
  const std::vector<std::string> base = {"--config", dir / "c.json", "--run-dir", run, "--quiet"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> a = base;
    a.insert(a.end(), more.begin(), more.end());
    return a;
  };
  ASSERT_EQ(Train(with({"--steps", "6"})), 0);
  fs::copy(run + "/checkpoint", dir / "at6", fs::copy_options::recursive);
  ASSERT_EQ(Train(with({"--resume", run + "/checkpoint", "--steps", "10"})), 0);
  // As after a crash: the metrics ran ahead of the checkpoint used, and the last line is torn.
  { std::ofstream(metrics, std::ios::app) << R"({"step": 11, "lo)"; }
  // Another checkpoint than the directory's own: the run at step 10 is replaced, so it is asked
  // for (--overwrite); without it the run is refused and nothing changes. Replaced, the metrics
  // file is the new run's alone (docs/outputs.md: never pieces of two runs): steps 7 to 9.
  auto bytes = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  const std::string before = bytes(metrics);
  EXPECT_EQ(Train(with({"--resume", dir / "at6", "--steps", "9"})), 1);
  EXPECT_EQ(bytes(metrics), before);
  ASSERT_EQ(Train(with({"--resume", dir / "at6", "--steps", "9", "--overwrite"})), 0);
  std::vector<int> steps;
  for (const json& m : ReadLines(metrics))
    if (m.contains("loss")) steps.push_back(m["step"].get<int>());
  EXPECT_EQ(steps, (std::vector<int>{7, 8, 9}));
  // In place, a resume from an earlier checkpoint of the same directory trims what came after it.
  fs::copy(run + "/checkpoint", dir / "at9", fs::copy_options::recursive);
  ASSERT_EQ(Train(with({"--resume", run + "/checkpoint", "--steps", "12"})), 0);
  fs::remove_all(run + "/checkpoint");
  fs::copy(dir / "at9", run + "/checkpoint", fs::copy_options::recursive);
  // As after a crash: the metrics ran ahead of the checkpoint, and the last line is torn.
  { std::ofstream(metrics, std::ios::app) << R"({"step": 13, "lo)"; }
  ASSERT_EQ(Train(with({"--resume", run + "/checkpoint", "--steps", "11"})), 0);
  steps.clear();
  for (const json& m : ReadLines(metrics))
    if (m.contains("loss")) steps.push_back(m["step"].get<int>());
  EXPECT_EQ(steps, (std::vector<int>{7, 8, 9, 10, 11}));
}

TEST(Train, SmallRunLearnsResumesAndExports) {
  TempDir dir;
  {
    std::ofstream cfg(dir / "c.json");
    cfg << R"({"model": {"seq_len": 6, "d_model": 64, "n_layer": 2, "n_head": 4},
               "data": {"digits": 1},
               "train": {"batch_size": 32, "lr": 0.003, "min_lr": 0.0003, "warmup_steps": 20,
                         "eval_every": 100, "eval_batches": 8},
               "engine": {"device_budget": "4 MiB", "host_budget": "2 MiB", "nvme_budget": "64 MiB"}})";
  }
  const std::string metrics = dir / "m.jsonl", report = dir / "r.json";
  ASSERT_EQ(Train({"--config", dir / "c.json", "--steps", "300", "--metrics", metrics, "--report",
                   report, "--run-dir", dir / "run", "--quiet", "--profile-step", "250"}),
            0);
  double first_acc = -1, last_acc = -1, first_loss = 0, last_loss = 0;
  int steps = 0;
  for (const json& m : ReadLines(metrics)) {
    if (m.contains("val_accuracy")) {
      if (first_acc < 0) first_acc = m["val_accuracy"];
      last_acc = m["val_accuracy"];
    }
    if (m.contains("loss")) {
      // Where the step's time went: parts of it, each within the step (a little slack for the
      // clock reads between them).
      const double step_s = m["step_s"], fb = m["forward_backward_s"], st = m["engine_step_s"];
      EXPECT_GT(fb, 0);
      EXPECT_GE(st, 0);
      EXPECT_LE(fb + st, step_s * 1.01 + 1e-4);
      EXPECT_LE(m["parameter_wait_s"].get<double>() + m["update_wait_s"].get<double>(),
                fb + st + 1e-4);
      if (steps == 0) first_loss = m["loss"];
      last_loss = m["loss"];
      ++steps;
    }
  }
  EXPECT_EQ(steps, 300);
  EXPECT_LT(last_loss, first_loss / 4);
  // One-digit sums: chance of an exact match is at most 1 in 10 (about 1 in 100 for two-digit
  // sums); the model must be well above it.
  EXPECT_LE(first_acc, 0.15);
  EXPECT_GE(last_acc, 0.5) << "accuracy after 300 steps";
  // The report exists and says where memory went.
  std::ifstream r(report);
  json rep = json::parse(r);
  EXPECT_EQ(rep["schema"], "tierzero-report");
  EXPECT_GT(rep["tiers"]["nvme"]["used"].get<uint64_t>(), 0u);
  EXPECT_GT(rep["moments"].size(), 0u);
  // --profile-step 250: step 250's iteration (after the 8 evaluation batches at step 0 and
  // those at step 100 and 200, and the 249 training iterations before it).
  EXPECT_EQ(rep["profile"]["iteration"].get<int64_t>(), 3 * 8 + 249);

  // Resume for 20 more steps from the final checkpoint, then export and start from the export.
  ASSERT_EQ(Train({"--config", dir / "c.json", "--steps", "320", "--metrics", dir / "m2.jsonl",
                   "--resume", dir / "run/checkpoint", "--run-dir", dir / "run2", "--quiet"}),
            0);
  int resumed = 0;
  for (const json& m : ReadLines(dir / "m2.jsonl")) resumed += m.contains("loss");
  EXPECT_EQ(resumed, 20);
  ASSERT_EQ(Export({dir / "run2/checkpoint", "-o", dir / "w.safetensors"}), 0);
  ASSERT_EQ(Train({"--config", dir / "c.json", "--steps", "0", "--init-from", dir / "w.safetensors",
                   "--run-dir", dir / "run3", "--quiet"}),
            0);
  // Errors are exit codes with messages, not crashes.
  EXPECT_EQ(Train({"--config", dir / "missing.json"}), 1);
  EXPECT_EQ(
      Train({"--config", dir / "c.json", "--resume", dir / "nothing", "--run-dir", dir / "run4"}),
      1);
  EXPECT_EQ(
      Train({"--config", dir / "c.json", "--text", dir / "nothing.txt", "--run-dir", dir / "run5"}),
      1);
}

}  // namespace
}  // namespace tierzero::app
