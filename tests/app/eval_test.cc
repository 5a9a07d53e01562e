// `tierzero eval` against the fp64 GPT reference (tests/gpt/gpt_reference.h): the mean loss over a
// token file's consecutive windows (16-bit ids, and a Llama 3 shard's 32-bit ones) (Note
// [Evaluation windows], apps/tierzero/eval.cc), whatever the batch size, and the errors a user
// meets.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "../gpt/gpt_reference.h"
#include "gpt/gpt.h"
#include "tierzero/engine.h"
#include "train.h"

namespace tierzero::app {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("tz-eval-" + std::to_string(::getpid()));
  TempDir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

// The mean loss `tierzero eval` prints, or NaN.
double EvalLoss(const std::vector<std::string>& args, int* rc) {
  testing::internal::CaptureStdout();
  *rc = Eval(args);
  const std::string out = testing::internal::GetCapturedStdout();
  const size_t at = out.find("mean loss ");
  return at == std::string::npos ? std::nan("") : std::stod(out.substr(at + 10));
}

// The model `mc` with random weights (larger than the 0.02 init, so every path carries signal),
// exported to `path`; its weights in `params`.
void ExportRandomModel(const gpt::GptConfig& mc, const std::string& path, gpt::Params* params) {
  EngineConfig ec;
  ec.device = DeviceChoice::kHost;
  ec.compute_dtype = DType::kF32;
  auto engine = Engine::Create(ec);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto model = gpt::Gpt::Create(**engine, mc);
  ASSERT_TRUE(model.ok());
  ASSERT_TRUE((*engine)->Finalize().ok());
  *params = gpt::RandomParams(**engine, 5);
  ASSERT_FALSE(params->empty());
  ASSERT_TRUE((*engine)->ExportSafetensors(path, DType::kF32).ok());
}

// The first `windows` evaluation windows of `tokens` as the spec cuts them (Note [Evaluation
// windows]): window w holds tokens w T .. w T + T - 1, each scored on the next token.
template <typename Id>
gpt::Batch Windows(const std::vector<Id>& tokens, int T, int windows) {
  gpt::Batch all;
  all.batch = windows;
  all.seq = T;
  for (int w = 0; w < windows; ++w) {
    for (int t = 0; t < T; ++t) {
      all.tokens.push_back(static_cast<int32_t>(tokens[static_cast<size_t>(w * T + t)]));
      all.targets.push_back(static_cast<int32_t>(tokens[static_cast<size_t>(w * T + t + 1)]));
      all.mask.push_back(1.0f);
    }
  }
  return all;
}

TEST(Eval, MeanLossOverConsecutiveWindowsEqualsTheFp64Reference) {
  TempDir dir;
  gpt::GptConfig mc;
  mc.vocab = 11;
  mc.seq_len = 5;
  mc.d_model = 8;
  mc.n_layer = 2;
  mc.n_head = 2;
  gpt::Params params;
  ASSERT_NO_FATAL_FAILURE(ExportRandomModel(mc, dir / "model.safetensors", &params));
  // 43 tokens of raw uint16: windows of 4 + 1 start at 0, 4, ..., 36 (10 windows; the tokens
  // after 40 do not fill one).
  std::vector<uint16_t> tokens(43);
  std::mt19937 rng(9);
  for (uint16_t& t : tokens) t = static_cast<uint16_t>(rng() % 11);
  {
    std::ofstream f(dir / "data.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(tokens.data()),
            static_cast<std::streamsize>(tokens.size() * 2));
    std::ofstream(dir / "c.json") << R"({"model": {"vocab": 11, "seq_len": 5, "d_model": 8,
        "n_layer": 2, "n_head": 2}, "engine": {"compute_dtype": "fp32", "device_budget": "4 MiB",
        "host_budget": "4 MiB", "nvme_budget": "0"}})";
  }
  const int T = 4, windows = 10;
  const gpt::Batch all = Windows(tokens, T, windows);
  const gpt::Ref ref{mc.vocab, T, mc.d_model, mc.n_layer, mc.n_head, params};
  const double want = ref.Loss(all);
  // Batches of 1, 3 (the last one padded) and 10 windows: the same mean over the 40 tokens.
  for (const char* rows : {"1", "3", "10"}) {
    int rc = -1;
    const double got =
        EvalLoss({"--config", dir / "c.json", "--init-from", dir / "model.safetensors", "--data",
                  dir / "data.bin", "--seq-len", "4", "--batch-size", rows},
                 &rc);
    ASSERT_EQ(rc, 0) << rows;
    EXPECT_NEAR(got, want, 2e-5 * want) << "batches of " << rows;
  }
  // The model's own context by default: windows of 5 + 1.
  int rc = -1;
  EvalLoss({"--config", dir / "c.json", "--init-from", dir / "model.safetensors", "--data",
            dir / "data.bin"},
           &rc);
  EXPECT_EQ(rc, 0);
  // Errors, not crashes: a window longer than the context, no model, no data, an id beyond the
  // vocabulary.
  EXPECT_EQ(Eval({"--config", dir / "c.json", "--init-from", dir / "model.safetensors", "--data",
                  dir / "data.bin", "--seq-len", "6"}),
            1);
  EXPECT_EQ(Eval({"--config", dir / "c.json", "--data", dir / "data.bin"}), 1);
  EXPECT_EQ(Eval({"--config", dir / "c.json", "--init-from", dir / "model.safetensors"}), 1);
  EXPECT_EQ(Eval({"--config", dir / "c.json", "--init-from", dir / "model.safetensors", "--data",
                  dir / "data.bin", "--vocab", "5"}),
            1);
}

// A vocabulary past 65536 (Llama 3's is 128256) on llm.c's Llama 3 shard (uint32 ids, Note
// [Token widths] in models/gpt/token_data.cc): the loss over ids above 65535 is the fp64
// reference's on the ids as written, not on their low 16 bits.
TEST(Eval, ThirtyTwoBitIdsOfALlama3ShardEqualTheFp64Reference) {
  TempDir dir;
  gpt::GptConfig mc;
  mc.vocab = 70001;
  mc.seq_len = 4;
  mc.d_model = 8;
  mc.n_layer = 1;
  mc.n_head = 2;
  gpt::Params params;
  ASSERT_NO_FATAL_FAILURE(ExportRandomModel(mc, dir / "model.safetensors", &params));
  std::vector<uint32_t> tokens(33);
  std::mt19937 rng(4);
  for (uint32_t& t : tokens) t = 65536 + rng() % 4465;  // every id past 16 bits
  tokens[7] = 5;
  {
    std::vector<int32_t> header(256, 0);
    header[0] = 20240801;
    header[1] = 7;
    header[2] = static_cast<int32_t>(tokens.size());
    std::ofstream f(dir / "llama3.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(header.data()), 1024);
    f.write(reinterpret_cast<const char*>(tokens.data()),
            static_cast<std::streamsize>(tokens.size() * 4));
    std::ofstream(dir / "c.json") << R"({"model": {"vocab": 70001, "seq_len": 4, "d_model": 8,
        "n_layer": 1, "n_head": 2}, "engine": {"compute_dtype": "fp32", "device_budget": "64 MiB",
        "host_budget": "64 MiB", "nvme_budget": "0"}})";
  }
  const int T = 4, windows = 8;
  const gpt::Batch all = Windows(tokens, T, windows);
  const double want = gpt::Ref{mc.vocab, T, mc.d_model, mc.n_layer, mc.n_head, params}.Loss(all);
  int rc = -1;
  const double got = EvalLoss({"--config", dir / "c.json", "--init-from", dir / "model.safetensors",
                               "--data", dir / "llama3.bin"},
                              &rc);
  ASSERT_EQ(rc, 0);
  EXPECT_NEAR(got, want, 2e-5 * want);
  // An id at the vocabulary: refused, naming it.
  tokens[20] = 70001;
  {
    std::fstream f(dir / "llama3.bin", std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(1024 + 4 * 20);
    f.write(reinterpret_cast<const char*>(&tokens[20]), 4);
  }
  EXPECT_EQ(Eval({"--config", dir / "c.json", "--init-from", dir / "model.safetensors", "--data",
                  dir / "llama3.bin"}),
            1);
}

TEST(Eval, TrainingOnATokenFileLowersTheLossAndItsCheckpointEvaluates) {
  TempDir dir;
  // A repeating pattern of 13 ids of 300 (a tokenizer's ids beyond the 256 of bytes): learnable.
  std::vector<uint16_t> tokens(20000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>((i % 13) * 23 % 300);
  {
    std::ofstream f(dir / "train.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(tokens.data()),
            static_cast<std::streamsize>(tokens.size() * 2));
    std::ofstream(dir / "c.json") << R"({"model": {"d_model": 32, "n_layer": 1, "n_head": 2},
        "train": {"batch_size": 8, "eval_every": 0, "eval_batches": 2, "warmup_steps": 5,
                  "lr": 0.01, "min_lr": 0.001},
        "engine": {"device_budget": "4 MiB", "host_budget": "4 MiB", "nvme_budget": "0"}})";
  }
  ASSERT_EQ(Train({"--config", dir / "c.json", "--data", dir / "train.bin", "--vocab", "300",
                   "--seq-len", "16", "--steps", "150", "--run-dir", dir / "run", "--quiet"}),
            0);
  std::ifstream m(dir / "run/metrics.jsonl");
  std::vector<double> val;
  for (std::string line; std::getline(m, line);) {
    const size_t at = line.find("\"val_loss\":");
    if (at != std::string::npos) val.push_back(std::stod(line.substr(at + 11)));
  }
  ASSERT_EQ(val.size(), 2u);  // at step 0 and at the end
  EXPECT_LT(val[1], val[0] / 3) << "validation loss " << val[0] << " -> " << val[1];
  // The checkpoint's model comes from its run's config.json.
  int rc = -1;
  const double loss =
      EvalLoss({"--resume", dir / "run/checkpoint", "--data", dir / "train.bin"}, &rc);
  EXPECT_EQ(rc, 0);
  EXPECT_LT(loss, val[0] / 3);
  // Another shape than the checkpoint's is refused, naming the field.
  EXPECT_EQ(Eval({"--resume", dir / "run/checkpoint", "--data", dir / "train.bin", "--heads", "4"}),
            1);
  // Without --data, the run's recorded token path is taken when it is absolute, as here (a
  // relative one is refused: cli_trust's resume_notes).
  EXPECT_EQ(Eval({"--resume", dir / "run/checkpoint"}), 0);
}

}  // namespace
}  // namespace tierzero::app
