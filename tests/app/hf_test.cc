// Hugging Face model directories through the CLI (apps/tierzero/hf_io.cc, models/gpt/hf.h): a
// tiny random Llama (grouped-query attention, untied head) written by this test as HF writes it
// (config.json, bf16 safetensors sharded with model.safetensors.index.json, by a writer of the
// test's own): `eval --init-from DIR` equals the fp64 reimplementation of HF's Llama
// (tests/gpt/llama_reference.h); a 0-step run exported with --format hf holds the very tensors
// (names, shapes, dtypes, bytes) of its input; GPT-2's layout reads with and without the
// "transformer." prefix; what a directory may not say is refused naming the field.
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
#include "tierzero/convert.h"
#include "train.h"

namespace tierzero::app {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("tz-hf-" + std::to_string(::getpid()));
  TempDir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

// A tensor as a safetensors file holds it.
struct Tensor {
  std::string dtype;  // "BF16", "F32"
  std::vector<int64_t> shape;
  std::string bytes;
};

// Writes tensors as one safetensors file (header of sorted names, data in that order).
void WriteSafetensors(const std::string& path, const std::map<std::string, Tensor>& ts) {
  json h = json::object();
  uint64_t off = 0;
  for (const auto& [name, t] : ts) {
    h[name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  h["__metadata__"] = {{"format", "pt"}};
  std::string hs = h.dump();
  while (hs.size() % 8 != 0) hs.push_back(' ');
  std::ofstream f(path, std::ios::binary);
  const uint64_t n = hs.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << hs;
  for (const auto& [name, t] : ts) f << t.bytes;
}

// Every tensor of the safetensors files of a directory (index or model.safetensors).
std::map<std::string, Tensor> ReadDir(const std::string& dir) {
  std::vector<std::string> files;
  if (fs::exists(dir + "/model.safetensors.index.json")) {
    std::ifstream in(dir + "/model.safetensors.index.json");
    const json ij = json::parse(in);
    std::map<std::string, bool> seen;
    for (const auto& item : ij["weight_map"].items()) seen[item.value().get<std::string>()] = true;
    for (const auto& [f, _] : seen) files.push_back(dir + "/" + f);
  } else {
    files.push_back(dir + "/model.safetensors");
  }
  std::map<std::string, Tensor> out;
  for (const std::string& f : files) {
    std::ifstream in(f, std::ios::binary);
    uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), 8);
    std::string hs(n, '\0');
    in.read(hs.data(), static_cast<std::streamsize>(n));
    const std::string data((std::istreambuf_iterator<char>(in)), {});
    const json h = json::parse(hs);
    for (const auto& item : h.items()) {
      if (item.key() == "__metadata__") continue;
      Tensor t;
      t.dtype = item.value()["dtype"];
      t.shape = item.value()["shape"].get<std::vector<int64_t>>();
      const uint64_t b = item.value()["data_offsets"][0], e = item.value()["data_offsets"][1];
      t.bytes = data.substr(b, e - b);
      out[item.key()] = std::move(t);
    }
  }
  return out;
}

// Random bf16 weights (norms about 1), and the same values as doubles for the reference.
Tensor RandomBf16(std::vector<int64_t> shape, std::mt19937_64& rng, bool norm,
                  std::vector<double>* values) {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  std::normal_distribution<double> nd(0.0, 0.4);
  std::vector<float> f(n);
  for (float& x : f) x = static_cast<float>(nd(rng) + (norm ? 1.0 : 0.0));
  std::vector<uint16_t> b(n);
  EXPECT_TRUE(CastElements(f.data(), DType::kF32, b.data(), DType::kBF16, n).ok());
  EXPECT_TRUE(CastElements(b.data(), DType::kBF16, f.data(), DType::kF32, n).ok());
  values->assign(f.begin(), f.end());
  return {"BF16", std::move(shape), std::string(reinterpret_cast<const char*>(b.data()), n * 2)};
}

// The tiny Llama: vocab 19, 2 layers of width 16, 4 heads of 4, 2 key/value heads, MLP 24,
// untied head, rms eps 1e-6, theta 500000; its tensors in three shards.
struct TinyLlama {
  static constexpr int V = 19, C = 16, L = 2, H = 4, KV = 2, F = 24, P = 64;
  gpt::Params params;
  bool scaled = false;  // Llama 3's rope_scaling, with bands a 4-wide head spans
  bool v5 = false;      // transformers 5's layout: rope_parameters, no top-level rope keys
  // Tied (tie_word_embeddings true), with lm_head.weight the embedding's copy or other values.
  enum class Head { kUntied, kTiedCopy, kTiedOther } head = Head::kUntied;
  std::map<std::string, Tensor> all;  // every tensor written, by name
  void Write(const std::string& dir) {
    fs::create_directories(dir);
    std::mt19937_64 rng(7);
    all.clear();
    auto add = [&](const std::string& name, std::vector<int64_t> shape, bool norm = false) {
      all[name] = RandomBf16(std::move(shape), rng, norm, &params[name]);
    };
    add("model.embed_tokens.weight", {V, C});
    for (int l = 0; l < L; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      add(p + "self_attn.q_proj.weight", {C, C});
      add(p + "self_attn.k_proj.weight", {KV * 4, C});
      add(p + "self_attn.v_proj.weight", {KV * 4, C});
      add(p + "self_attn.o_proj.weight", {C, C});
      add(p + "mlp.gate_proj.weight", {F, C});
      add(p + "mlp.up_proj.weight", {F, C});
      add(p + "mlp.down_proj.weight", {C, F});
      add(p + "input_layernorm.weight", {C}, true);
      add(p + "post_attention_layernorm.weight", {C}, true);
    }
    add("model.norm.weight", {C}, true);
    add("lm_head.weight", {V, C});
    if (head == Head::kTiedCopy) all["lm_head.weight"] = all["model.embed_tokens.weight"];
    // Three shards by name, with the index.
    std::map<std::string, Tensor> shard[3];
    json map = json::object();
    uint64_t total = 0;
    int i = 0;
    for (const auto& [name, t] : all) {
      const int s = i++ % 3;
      shard[s][name] = t;
      const std::string file = "model-0000" + std::to_string(s + 1) + "-of-00003.safetensors";
      map[name] = file;
      total += t.bytes.size();
    }
    for (int s = 0; s < 3; ++s)
      WriteSafetensors(dir + "/model-0000" + std::to_string(s + 1) + "-of-00003.safetensors",
                       shard[s]);
    std::ofstream(dir + "/model.safetensors.index.json")
        << json({{"metadata", {{"total_size", total}}}, {"weight_map", map}}).dump(2);
    const json llama3 = {{"rope_type", "llama3"},
                         {"factor", 8.0},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 16}};
    json config = {{"architectures", {"LlamaForCausalLM"}},
                   {"model_type", "llama"},
                   {"vocab_size", V},
                   {"hidden_size", C},
                   {"intermediate_size", F},
                   {"num_hidden_layers", L},
                   {"num_attention_heads", H},
                   {"num_key_value_heads", KV},
                   {"max_position_embeddings", P},
                   {"rms_norm_eps", 1e-6},
                   {"rope_theta", 500000.0},
                   {"hidden_act", "silu"},
                   {"tie_word_embeddings", head != Head::kUntied},
                   {"attention_bias", false},
                   {"rope_scaling", scaled ? llama3 : json(nullptr)},
                   {"torch_dtype", "bfloat16"}};
    if (v5) {
      json rp = scaled ? llama3 : json{{"rope_type", "default"}};
      rp["rope_theta"] = 500000.0;
      config.erase("rope_theta");
      config.erase("rope_scaling");
      config["rope_parameters"] = rp;
    }
    std::ofstream(dir + "/config.json") << config.dump(2);
  }
};

// The mean loss `tierzero eval` prints, or NaN.
double EvalLoss(const std::vector<std::string>& args, int* rc) {
  testing::internal::CaptureStdout();
  *rc = Eval(args);
  const std::string out = testing::internal::GetCapturedStdout();
  const size_t at = out.find("mean loss ");
  return at == std::string::npos ? std::nan("") : std::stod(out.substr(at + 10));
}

void WriteTokens(const std::string& path, const std::vector<uint16_t>& tokens) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(tokens.data()),
          static_cast<std::streamsize>(tokens.size() * 2));
}

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
json Llama(const json& extra) {
  json c = {{"architectures", {"LlamaForCausalLM"}},
            {"vocab_size", 19},
            {"hidden_size", 16},
            {"intermediate_size", 24},
            {"num_hidden_layers", 1},
            {"num_attention_heads", 4}};
  c.update(extra);
  return c;
}

TEST(HfModels, WhatADirectoryMayNotSayIsRefusedNamingTheField) {
  TempDir dir;
  std::vector<uint16_t> tokens(100, 1);
  WriteTokens(dir / "data.bin", tokens);
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"architectures", {"BertModel"}}}, "architectures"},
      {{{"architectures", {"Qwen2ForCausalLM"}}}, "Qwen 2"},
      {Llama({{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 8.0}}}}), "rope_scaling"},
      // transformers 5's layout: another type refused from there too; two thetas that disagree.
      {Llama(
           {{"rope_parameters", {{"rope_type", "linear"}, {"factor", 4.0}, {"rope_theta", 1e4}}}}),
       "\"rope_parameters\" is"},
      {Llama({{"rope_theta", 500.0},
              {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e4}}}}),
       "which one holds"},
      // One set per attention type; Llama 3's fields with no type; rotary over part of a head.
      {Llama({{"rope_parameters",
               {{"full_attention", {{"rope_type", "default"}, {"rope_theta", 500.0}}},
                {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 500.0}}}}}}),
       "per attention type"},
      {Llama({{"rope_parameters", {{"factor", 8.0}, {"rope_theta", 1e4}}}}),
       "\"rope_parameters\" is"},
      {Llama({{"partial_rotary_factor", 0.5}}), "partial_rotary_factor"},
      {Llama({{"hidden_act", "gelu"}}), "hidden_act"},
      // transformers' Mistral has no attention biases, whatever the field says (hunt 48).
      {Llama({{"architectures", {"MistralForCausalLM"}}, {"attention_bias", true}}),
       "MistralForCausalLM has no attention biases"},
      {{{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", "19"}}, "vocab_size"},
      {{{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 16}}, "vocab_size"},
      // Said as the file has it: a string where a list belongs, neither key, a size past int64.
      {{{"architectures", "LlamaForCausalLM"}}, "not a list of model class names"},
      {{{"vocab_size", 19}}, "\"model_type\" are both missing"},
      {{{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", json(~uint64_t{0})}},
       "18446744073709551615"},
      // The model's ranges in the file's own names (hunt 50: "model field 'norm_eps'").
      {Llama({{"rms_norm_eps", 0}}), "config.json: \"rms_norm_eps\" (model.norm_eps) is 0"},
      // rope_parameters and rope_scaling that differ past their factor (hunt 51: rope_scaling's
      // low_freq_factor was taken, a wrong loss).
      {Llama({{"rope_parameters",
               {{"rope_type", "llama3"},
                {"factor", 8.0},
                {"low_freq_factor", 1.0},
                {"high_freq_factor", 4.0},
                {"original_max_position_embeddings", 16}}},
              {"rope_scaling",
               {{"rope_type", "llama3"},
                {"factor", 8.0},
                {"low_freq_factor", 2.0},
                {"high_freq_factor", 4.0},
                {"original_max_position_embeddings", 16}}}}),
       "\"rope_scaling\" disagrees with rope_parameters"},
      {Llama({{"num_key_value_heads", 3}}),
       "\"num_key_value_heads\" (model.n_kv_head) is 3; accepted: a divisor of "
       "num_attention_heads"},
      // Its ranges too ("a divisor of d_model", a name the file does not have).
      {Llama({{"num_attention_heads", 16}}),
       "(model.n_head) is 16; accepted: a divisor of hidden_size leaving even heads"},
      {Llama({{"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 0.5}}}}),
       "\"rope_parameters.rope_theta\" (model.rope_theta) is 0.5"},
      // A factor a float keeps as 0: every gradient infinite, every step skipped (hunt 50).
      {Llama({{"rope_scaling",
               {{"rope_type", "llama3"},
                {"factor", 1e-300},
                {"low_freq_factor", 1.0},
                {"high_freq_factor", 4.0},
                {"original_max_position_embeddings", 16}}}}),
       "\"rope_scaling.factor\" (model.rope_factor) is 1e-300"},
  };
  int i = 0;
  for (const auto& [cfg, field] : cases) {
    const std::string d = dir / ("m" + std::to_string(i++));
    fs::create_directories(d);
    std::ofstream(d + "/config.json") << cfg.dump();
    testing::internal::CaptureStderr();
    EXPECT_EQ(Eval({"--init-from", d, "--data", dir / "data.bin"}), 1) << field;
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find(field), std::string::npos) << err;
  }
  // An index naming a file outside the directory.
  const std::string d = dir / "escape";
  fs::create_directories(d);
  TinyLlama m;
  m.Write(d);
  std::ofstream(d + "/model.safetensors.index.json")
      << R"({"weight_map": {"lm_head.weight": "../x.safetensors"}})";
  testing::internal::CaptureStderr();
  EXPECT_EQ(Eval({"--init-from", d, "--data", dir / "data.bin"}), 1);
  EXPECT_NE(testing::internal::GetCapturedStderr().find("not a file name in the directory"),
            std::string::npos);
}

// A config.json without max_position_embeddings has transformers' default: LlamaConfig's 2048,
// MistralConfig's 4096 x 32 (hunt 50: 4096 for both).
// Note [Whose sliding window] (hf.cc): the positions a model knows, as transformers defaults and
// windows them: LlamaConfig's 2048; MistralConfig's 131072 within its window, 4096 where the file
// has none, none where it is null; a Llama's "sliding_window" is not its attention's (hunt 51).
// Note [A weights file holding more than the model] (hf_io.cc): one file's tensors that the
// run's model has no parameter for (a layer more, an untied head beside a config that ties it)
// were dropped without a word, and a loss printed (hunt 51). Its own model loads.
TEST(HfModels, AWeightsFileHoldingMoreThanTheModelIsRefused) {
  TempDir dir;
  TinyLlama m;
  m.Write(dir / "m");
  WriteSafetensors(dir / "alone.safetensors", m.all);
  std::vector<uint16_t> tokens(60);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i * 7 % 19);
  WriteTokens(dir / "data.bin", tokens);
  auto eval = [&](int layers, bool tied) {
    const json model = {
        {"arch", "llama"},      {"vocab", TinyLlama::V},  {"d_model", TinyLlama::C},
        {"n_layer", layers},    {"n_head", TinyLlama::H}, {"n_kv_head", TinyLlama::KV},
        {"d_ff", TinyLlama::F}, {"seq_len", 7},           {"tie_embeddings", tied}};
    std::ofstream(dir / "c.json") << json({{"model", model}}).dump();
    testing::internal::CaptureStderr();
    const int rc = Eval({"--init-from", dir / "alone.safetensors", "--config", dir / "c.json",
                         "--data", dir / "data.bin", "--dtype", "fp32", "--device", "host"});
    return std::pair(rc, testing::internal::GetCapturedStderr());
  };
  auto [rc, err] = eval(1, false);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find("holds 9 tensors the model has no parameter for (model.layers.1."),
            std::string::npos)
      << err;
  std::tie(rc, err) = eval(2, true);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find("holds 1 tensor the model has no parameter for (lm_head.weight)"),
            std::string::npos)
      << err;
  std::tie(rc, err) = eval(2, false);
  EXPECT_EQ(rc, 0) << err;
}

// Note [A model directory's weights checked before the model is made] (hf.cc): a shard cut short
// (a download interrupted) is refused by ReadHfDir, before any model is made; a Git LFS pointer
// where a shard goes is said as one, with what to do (hunt 51).
TEST(HfModels, WeightsCutShortOrLeftAsLfsPointersAreRefusedBeforeTheModel) {
  TempDir dir;
  TinyLlama m;
  m.Write(dir / "cut");
  const std::string shard = dir / "cut/model-00002-of-00003.safetensors";
  fs::resize_file(shard, fs::file_size(shard) - 64);
  auto got = gpt::ReadHfDir(dir / "cut", gpt::GptConfig{});
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kDataLoss) << got.status().ToString();
  EXPECT_NE(got.status().message().find("outside the data section"), std::string::npos)
      << got.status().ToString();
  m.Write(dir / "lfs");
  std::ofstream(dir / "lfs/model-00001-of-00003.safetensors", std::ios::trunc)
      << "version https://git-lfs.github.com/spec/v1\noid sha256:"
         "4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 4976698672\n";
  got = gpt::ReadHfDir(dir / "lfs", gpt::GptConfig{});
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("is a Git LFS pointer"), std::string::npos)
      << got.status().ToString();
  EXPECT_NE(got.status().message().find("git lfs pull"), std::string::npos);
}

TEST(HfModels, PositionsAndWindowsDefaultAsTransformersDoes) {
  TempDir dir;
  struct Case {
    const char* arch;
    json window;  // (a discarded value: no key)
    int positions;
  };
  const Case cases[] = {{"LlamaForCausalLM", json::value_t::discarded, 2048},
                        {"MistralForCausalLM", json::value_t::discarded, 4096},
                        {"MistralForCausalLM", nullptr, 131072},
                        {"MistralForCausalLM", 8192, 8192},
                        {"LlamaForCausalLM", 16, 2048}};
  int i = 0;
  for (const Case& k : cases) {
    const std::string d = dir / ("m" + std::to_string(i++));
    TinyLlama m;
    m.Write(d);
    json c = json::parse(std::ifstream(d + "/config.json"));
    c.erase("max_position_embeddings");
    c.erase("sliding_window");
    if (!k.window.is_discarded()) c["sliding_window"] = k.window;
    c["architectures"] = {k.arch};
    c["model_type"] = std::string(k.arch) == "LlamaForCausalLM" ? "llama" : "mistral";
    std::ofstream(d + "/config.json") << c.dump();
    auto got = gpt::ReadHfDir(d, gpt::GptConfig{});
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->config.max_positions, k.positions) << c.dump();
  }
}

// Note [A tied head beside its own weights]: a tied model's files holding an lm_head.weight of
// other values mean another model to transformers 5 (untied) than to 4.x (tied): refused, saying
// how to choose. A copy of the embedding loads as tied, and scores the loss of the same weights
// untied. Dropout the config asks for is said (Note [Dropout a model directory asks for]).
TEST(HfModels, ATiedHeadWithOtherWeightsIsRefusedAndDropoutIsSaid) {
  TempDir dir;
  std::vector<uint16_t> tokens(60);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i * 7 % 19);
  WriteTokens(dir / "data.bin", tokens);
  const std::vector<std::string> flags = {"--data",  dir / "data.bin", "--seq-len", "7",
                                          "--dtype", "fp32",           "--device",  "host"};
  auto args = [&](const std::string& d) {
    std::vector<std::string> a = {"--init-from", d};
    a.insert(a.end(), flags.begin(), flags.end());
    return a;
  };
  TinyLlama other;
  other.head = TinyLlama::Head::kTiedOther;
  other.Write(dir / "other");
  testing::internal::CaptureStderr();
  EXPECT_EQ(Eval(args(dir / "other")), 1);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("lm_head.weight with other values than model.embed_tokens.weight"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("\"tie_word_embeddings\": false"), std::string::npos) << err;
  TinyLlama copy, untied;
  copy.head = TinyLlama::Head::kTiedCopy;
  copy.Write(dir / "copy");
  untied.Write(dir / "untied");
  // The untied model with its head set to the embedding's values: the tied model's loss.
  auto cfg = json::parse(std::ifstream(dir / "copy/config.json"));
  cfg["tie_word_embeddings"] = false;
  cfg["attention_dropout"] = 0.25;
  std::ofstream(dir / "copy_untied.json") << cfg.dump();
  fs::create_directories(dir / "untied_copy");
  for (const auto& e : fs::directory_iterator(dir / "copy"))
    fs::copy(e.path(), fs::path(dir / "untied_copy") / e.path().filename());
  fs::copy(dir / "copy_untied.json", dir / "untied_copy/config.json",
           fs::copy_options::overwrite_existing);
  int rc = -1;
  const double tied = EvalLoss(args(dir / "copy"), &rc);
  EXPECT_EQ(rc, 0);
  testing::internal::CaptureStdout();
  EXPECT_EQ(Eval(args(dir / "untied_copy")), 0);
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("dropout (attention_dropout 0.25) is not applied"), std::string::npos) << out;
  const size_t at = out.find("mean loss ");
  ASSERT_NE(at, std::string::npos) << out;
  EXPECT_EQ(std::stod(out.substr(at + 10)), tied);
  EXPECT_TRUE(std::isfinite(tied));
}

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
