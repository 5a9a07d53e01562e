// What a Hugging Face model directory, or a weights file given alone, may not say: refused,
// naming the field, the file, or what to do (apps/tierzero/hf_io.cc, models/gpt/hf.cc), and the
// positions and windows transformers gives a model whose config leaves them out.
#include "hf_test_util.h"

namespace tierzero::app {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace hf_testing;

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

}  // namespace
}  // namespace tierzero::app
