// Hugging Face model directories through the CLI (apps/tierzero/hf_io.cc, models/gpt/hf.h): a
// tiny random Llama (grouped-query attention, untied head) written by this test as HF writes it
// (config.json, bf16 safetensors sharded with model.safetensors.index.json, by a writer of the
// test's own): `eval --init-from DIR` equals the fp64 reimplementation of HF's Llama
// (tests/gpt/llama_reference.h); a 0-step run exported with --format hf holds the very tensors
// (names, shapes, dtypes, bytes) of its input; GPT-2's layout reads with and without the
// "transformer." prefix. What a directory may not say: hf_refusals_test.cc; what they share:
// hf_test_util.h.
#include "gpt/hf.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "../gpt/llama_reference.h"
#include "gpt/gpt.h"
#include "hf_test_util.h"
#include "tierzero/convert.h"
#include "train.h"

namespace tierzero::app {
namespace {
using namespace hf_testing;

// (Llama 3's scaling or none; transformers 5's rope_parameters or the top-level keys: Note [RoPE
// settings in either layout].)
class HfLlamaEval : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(HfLlamaEval, EqualsTheFp64ReimplementationOfHfLlama) {
  TempDir dir;
  TinyLlama m;
  m.scaled = std::get<0>(GetParam());
  m.v5 = std::get<1>(GetParam());
  m.Write(dir / "llama");
  // 60 tokens: windows of 7 + 1 start at 0, 7, ..., 49 (8 windows; the last 3 tokens fill
  // none).
  std::vector<uint16_t> tokens(60);
  std::mt19937 rng(3);
  for (uint16_t& t : tokens) t = static_cast<uint16_t>(rng() % TinyLlama::V);
  WriteTokens(dir / "data.bin", tokens);
  const int T = 7, windows = 8;
  gpt::Batch all;
  all.batch = windows;
  all.seq = T;
  for (int w = 0; w < windows; ++w)
    for (int t = 0; t < T; ++t) {
      all.tokens.push_back(tokens[static_cast<size_t>(w * T + t)]);
      all.targets.push_back(tokens[static_cast<size_t>(w * T + t + 1)]);
      all.mask.push_back(1.0f);
    }
  gpt::LlamaRef ref{TinyLlama::V, T,        TinyLlama::C, TinyLlama::L, TinyLlama::H, TinyLlama::KV,
                    TinyLlama::F, 500000.0, 1e-6,         false,        false,        m.params};
  if (m.scaled) {
    ref.factor = 8;
    ref.low_freq = 1;
    ref.high_freq = 4;
    ref.original = 16;
  }
  const double want = ref.Loss(all);
  for (const char* rows : {"1", "3", "8"}) {
    int rc = -1;
    const double got =
        EvalLoss({"--init-from", dir / "llama", "--data", dir / "data.bin", "--seq-len", "7",
                  "--batch-size", rows, "--dtype", "fp32", "--device", "host"},
                 &rc);
    ASSERT_EQ(rc, 0) << rows;
    EXPECT_NEAR(got, want, 2e-5 * want) << "batches of " << rows;
  }
  // A flag contradicting config.json is refused, naming the field.
  testing::internal::CaptureStderr();
  EXPECT_EQ(Eval({"--init-from", dir / "llama", "--data", dir / "data.bin", "--layers", "3"}), 1);
  EXPECT_NE(testing::internal::GetCapturedStderr().find("model.n_layer is 3"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(RopeScaling, HfLlamaEval,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "Llama3" : "None") +
                                  (std::get<1>(info.param) ? "_RopeParameters" : "_TopLevel");
                         });

TEST(HfModels, AZeroStepRunExportsItsInputTensorForTensor) {
  TempDir dir;
  TinyLlama m;
  m.Write(dir / "llama");
  std::vector<uint16_t> tokens(3000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i * 7 % 19);
  WriteTokens(dir / "data.bin", tokens);
  ASSERT_EQ(Train({"--init-from", dir / "llama", "--data", dir / "data.bin", "--steps", "0",
                   "--seq-len", "16", "--run-dir", dir / "run", "--device", "host", "--quiet"}),
            0);
  for (const char* shard : {"600", "0"}) {
    const std::string out = dir / (std::string("out-") + shard);
    std::vector<std::string> args = {dir / "run/checkpoint", "--format", "hf", "-o", out};
    if (std::string(shard) != "0") args.insert(args.end(), {"--max-shard-size", shard});
    testing::internal::CaptureStdout();
    ASSERT_EQ(Export(args), 0);
    testing::internal::GetCapturedStdout();
    EXPECT_EQ(fs::exists(out + "/model.safetensors.index.json"), std::string(shard) != "0");
    const auto in = ReadDir(dir / "llama"), got = ReadDir(out);
    ASSERT_EQ(in.size(), got.size());
    for (const auto& [name, t] : in) {
      auto g = got.find(name);
      ASSERT_NE(g, got.end()) << name;
      EXPECT_EQ(g->second.dtype, t.dtype) << name;
      EXPECT_EQ(g->second.shape, t.shape) << name;
      EXPECT_TRUE(g->second.bytes == t.bytes) << name << " differs";
    }
    // Its config.json reads back to the same model.
    auto back = gpt::ReadHfDir(out, gpt::GptConfig{});
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->config.n_kv_head, TinyLlama::KV);
    EXPECT_EQ(back->config.d_ff, TinyLlama::F);
    EXPECT_FALSE(back->config.tie_embeddings);
    EXPECT_EQ(back->config.rope_theta, 500000.0);
    EXPECT_EQ(back->config.norm_eps, 1e-6);
    // Note [Special tokens carried]: the ids it came with (they were dropped: transformers then
    // read LlamaConfig's 1 and 2, and a generation had no end of sequence: hunt 52).
    const json out_config = json::parse(std::ifstream(out + "/config.json"));
    EXPECT_EQ(out_config.value("bos_token_id", json()), json(17));
    EXPECT_EQ(out_config.value("eos_token_id", json()), json({18, 16}));
    EXPECT_FALSE(out_config.contains("pad_token_id"));
  }
  // Never into a directory holding files, nor into the model directory a run reads.
  EXPECT_EQ(Export({dir / "run/checkpoint", "--format", "hf", "-o", dir / "llama"}), 1);
  EXPECT_EQ(
      Train({"--init-from", dir / "llama", "--data", dir / "data.bin", "--steps", "0", "--seq-len",
             "16", "--run-dir", dir / "llama/run", "--device", "host", "--quiet"}),
      1);
}

TEST(HfModels, Gpt2ReadsWithAndWithoutItsPrefixAndSkipsItsBuffers) {
  TempDir dir;
  for (const std::string prefix : {"transformer.", ""}) {
    const std::string d = dir / ("gpt2" + std::to_string(prefix.size()));
    fs::create_directories(d);
    std::mt19937_64 rng(5);
    std::map<std::string, Tensor> ts;
    gpt::Params unused;
    const int V = 23, C = 8, P = 12;
    auto add = [&](const std::string& n, std::vector<int64_t> shape, bool norm = false) {
      std::vector<double> v;
      ts[prefix + n] = RandomBf16(std::move(shape), rng, norm, &v);
    };
    add("wte.weight", {V, C});
    add("wpe.weight", {P, C});
    add("h.0.ln_1.weight", {C}, true);
    add("h.0.ln_1.bias", {C});
    add("h.0.attn.c_attn.weight", {C, 3 * C});
    add("h.0.attn.c_attn.bias", {3 * C});
    add("h.0.attn.c_proj.weight", {C, C});
    add("h.0.attn.c_proj.bias", {C});
    add("h.0.ln_2.weight", {C}, true);
    add("h.0.ln_2.bias", {C});
    add("h.0.mlp.c_fc.weight", {C, 4 * C});
    add("h.0.mlp.c_fc.bias", {4 * C});
    add("h.0.mlp.c_proj.weight", {4 * C, C});
    add("h.0.mlp.c_proj.bias", {C});
    add("ln_f.weight", {C}, true);
    add("ln_f.bias", {C});
    add("h.0.attn.bias", {1, 1, P, P});  // the causal mask buffer old checkpoints carry
    WriteSafetensors(d + "/model.safetensors", ts);
    std::ofstream(d + "/config.json") << json({{"architectures", {"GPT2LMHeadModel"}},
                                               {"vocab_size", V},
                                               {"n_embd", C},
                                               {"n_layer", 1},
                                               {"n_head", 2},
                                               {"n_positions", P},
                                               {"activation_function", "gelu_new"},
                                               {"torch_dtype", "float32"}})
                                             .dump();
    std::vector<uint16_t> tokens(200);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i % V);
    WriteTokens(d + "/../data.bin", tokens);
    int rc = -1;
    const double loss = EvalLoss(
        {"--init-from", d, "--data", dir / "data.bin", "--seq-len", "12", "--device", "host"}, &rc);
    EXPECT_EQ(rc, 0) << prefix;
    EXPECT_TRUE(std::isfinite(loss)) << prefix;
  }
}

// The tiny Llama's config.json fields with `extra` over them.

// Tensors compared as torch.equal compares them (transformers' test for a tie): -0.0 equals 0.0,
// a NaN equals nothing, across types and files; another shape differs; a missing name is
// NotFound.
TEST(HfModels, SafetensorsTensorsAreComparedAsTorchEqualDoes) {
  TempDir dir;
  auto f32 = [](std::vector<float> v, std::vector<int64_t> shape) {
    return Tensor{"F32", std::move(shape),
                  std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4)};
  };
  const float nan = std::nanf("");
  std::vector<uint16_t> bf(4);
  const std::vector<float> half = {0.5f, -0.0f, 2.0f, 3.0f};
  ASSERT_TRUE(CastElements(half.data(), DType::kF32, bf.data(), DType::kBF16, 4).ok());
  WriteSafetensors(dir / "a.safetensors", {{"zero", f32({0.5f, 0.0f, 2.0f, 3.0f}, {2, 2})},
                                           {"nan", f32({nan, 0.0f, 2.0f, 3.0f}, {2, 2})},
                                           {"flat", f32({0.5f, 0.0f, 2.0f, 3.0f}, {4})}});
  WriteSafetensors(
      dir / "b.safetensors",
      {{"negzero",
        Tensor{"BF16", {2, 2}, std::string(reinterpret_cast<const char*>(bf.data()), 8)}}});
  const std::vector<std::string> files = {dir / "a.safetensors", dir / "b.safetensors"};
  EXPECT_TRUE(*SafetensorsTensorsEqual(files, "zero", "negzero"));
  EXPECT_FALSE(*SafetensorsTensorsEqual(files, "nan", "nan"));
  EXPECT_FALSE(*SafetensorsTensorsEqual(files, "zero", "flat"));
  EXPECT_EQ(SafetensorsTensorsEqual(files, "zero", "lm_head.weight").status().code(),
            StatusCode::kNotFound);
}

// A model directory is the model: the run's config may not add what config.json leaves out (Llama
// 3's rope scaling, absent there, silently rescaled the model), the weights file given alone is
// sent to its directory, and a config.json that is a dangling link is said to be one.
TEST(HfModels, TheRunsConfigAddsNothingToADirectorysModel) {
  TempDir dir;
  TinyLlama m;
  m.Write(dir / "llama");
  std::vector<uint16_t> tokens(60, 3);
  WriteTokens(dir / "data.bin", tokens);
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"model", {{"arch", "llama"}, {"rope_factor", 8.0}, {"rope_original_positions", 16}}}},
       "model.rope_factor is 8"},
      {{{"model", {{"arch", "llama"}, {"rope_original_positions", 16}}}},
       "model.rope_original_positions is 16"},
  };
  int i = 0;
  for (const auto& [cfg, says] : cases) {
    const std::string c = dir / ("rope" + std::to_string(i++) + ".json");
    std::ofstream(c) << cfg.dump();
    testing::internal::CaptureStderr();
    EXPECT_EQ(Eval({"--init-from", dir / "llama", "--config", c, "--data", dir / "data.bin"}), 1);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find(says), std::string::npos) << err;
  }
  // rope_scaling of the "default" type is no scaling, as in rope_parameters (it was refused).
  int rc = -1;
  const double plain =
      EvalLoss({"--init-from", dir / "llama", "--data", dir / "data.bin", "--seq-len", "7"}, &rc);
  ASSERT_EQ(rc, 0);
  const std::string dflt = dir / "dflt";
  fs::create_directories(dflt);
  WriteSafetensors(dflt + "/model.safetensors", ReadDir(dir / "llama"));
  json dc = json::parse(std::ifstream(dir / "llama/config.json"));
  dc["rope_scaling"] = {{"rope_type", "default"}};
  std::ofstream(dflt + "/config.json") << dc.dump();
  EXPECT_EQ(EvalLoss({"--init-from", dflt, "--data", dir / "data.bin", "--seq-len", "7"}, &rc),
            plain);
  EXPECT_EQ(rc, 0);
  // The weights file alone (its tensors have Hugging Face's names): the directory is named.
  const std::string one = dir / "one";
  fs::create_directories(one);
  WriteSafetensors(one + "/model.safetensors", ReadDir(dir / "llama"));
  fs::copy_file(dir / "llama/config.json", one + "/config.json");
  testing::internal::CaptureStderr();
  EXPECT_EQ(Eval({"--init-from", one + "/model.safetensors", "--data", dir / "data.bin", "--arch",
                  "llama", "--vocab", "19", "--width", "16", "--layers", "2", "--heads", "4",
                  "--kv-heads", "2", "--seq-len", "7"}),
            1);
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("give the directory (--init-from " + one + ")"), std::string::npos) << err;
  // Weights of something else beside a config.json: said before the model is allocated.
  const std::string other = dir / "other";
  fs::create_directories(other);
  fs::copy_file(dir / "llama/config.json", other + "/config.json");
  WriteSafetensors(other + "/model.safetensors",
                   {{"foo.weight", {"F32", {1}, std::string(4, '\0')}}});
  testing::internal::CaptureStderr();
  EXPECT_EQ(Eval({"--init-from", other, "--data", dir / "data.bin"}), 1);
  err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("no tensor model.embed_tokens.weight (they hold foo.weight)"),
            std::string::npos)
      << err;
  // config.json a link to nothing.
  fs::remove(one + "/config.json");
  fs::create_symlink("gone.json", one + "/config.json");
  testing::internal::CaptureStderr();
  EXPECT_EQ(Eval({"--init-from", one, "--data", dir / "data.bin"}), 1);
  err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("config.json cannot be read"), std::string::npos) << err;
  // The weights file copied out of its directory: named as a model directory's weights.
  const std::string lone = dir / "lone.safetensors";
  fs::copy_file(dir / "one/model.safetensors", lone);
  testing::internal::CaptureStderr();
  EXPECT_EQ(Eval({"--init-from", lone, "--data", dir / "data.bin"}), 1);
  err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("named as a Hugging Face model's"), std::string::npos) << err;
  // A directory without model.safetensors or its index says what it has instead.
  const std::vector<std::pair<std::string, std::string>> instead = {
      {"pytorch_model.bin", "PyTorch's pickled weights"},
      {"model-00001-of-00002.safetensors", "without the index"},
      {"", "download the model's weights"}};
  for (const auto& [name, says] : instead) {
    const std::string d = dir / ("instead" + std::to_string(&name - &instead[0].first));
    fs::create_directories(d);
    fs::copy_file(dir / "llama/config.json", d + "/config.json");
    if (!name.empty()) fs::copy_file(lone, d + "/" + name);
    testing::internal::CaptureStderr();
    EXPECT_EQ(Eval({"--init-from", d, "--data", dir / "data.bin"}), 1) << name;
    err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("neither model.safetensors nor model.safetensors.index.json"),
              std::string::npos)
        << err;
    EXPECT_NE(err.find(says), std::string::npos) << err;
  }
  // Without architectures, an unknown model_type is named as model_type.
  const std::string falcon = dir / "falcon";
  fs::create_directories(falcon);
  json c = json::parse(std::ifstream(dir / "llama/config.json"));
  c.erase("architectures");
  c["model_type"] = "falcon";
  std::ofstream(falcon + "/config.json") << c.dump();
  testing::internal::CaptureStderr();
  EXPECT_EQ(Eval({"--init-from", falcon, "--data", dir / "data.bin"}), 1);
  err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("\"model_type\" is \"falcon\""), std::string::npos) << err;
}

// Note [Budgets of a model brought from a directory]: a model from a directory gets the machine's
// budgets when the run sets none (the built-in 12 MiB device is the toy's), and keeps every
// budget as given when the run sets any one of them.
TEST(HfModels, ABroughtModelGetsTheMachinesBudgetsUnlessTheRunSetsOne) {
  TempDir dir;
  TinyLlama m;
  m.Write(dir / "llama");
  const RunConfig dflt = DefaultRunConfig();
  const uint64_t memory = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
                          static_cast<uint64_t>(::sysconf(_SC_PAGE_SIZE));
  auto sized = LoadRunConfig({"--init-from", dir / "llama", "--device", "host"});
  ASSERT_TRUE(sized.ok()) << sized.status().ToString();
  EXPECT_GE(sized->engine.device_budget + (uint64_t{1} << 20), memory / 8);
  EXPECT_LE(sized->engine.device_budget, memory / 8);
  EXPECT_EQ(sized->engine.device_shard_budget, sized->engine.device_budget);
  EXPECT_GE(sized->engine.host_budget + (uint64_t{1} << 20), memory / 2);
  EXPECT_EQ(sized->engine.nvme_budget, dflt.engine.nvme_budget);
  for (const char* flag : {"--device-budget", "--host-budget", "--nvme-budget"}) {
    auto given = LoadRunConfig({"--init-from", dir / "llama", "--device", "host", flag, "40MiB"});
    ASSERT_TRUE(given.ok()) << given.status().ToString();
    EXPECT_EQ(given->engine.device_shard_budget, dflt.engine.device_shard_budget) << flag;
    EXPECT_EQ(
        std::string(flag) == "--device-budget" ? uint64_t{40} << 20 : dflt.engine.device_budget,
        given->engine.device_budget)
        << flag;
    EXPECT_EQ(std::string(flag) == "--host-budget" ? uint64_t{40} << 20 : dflt.engine.host_budget,
              given->engine.host_budget)
        << flag;
  }
  // The built-in model keeps the built-in budgets.
  auto builtin = LoadRunConfig({"--device", "host"});
  ASSERT_TRUE(builtin.ok());
  EXPECT_EQ(builtin->engine.device_budget, dflt.engine.device_budget);
  EXPECT_EQ(builtin->engine.host_budget, dflt.engine.host_budget);
}

}  // namespace
}  // namespace tierzero::app
