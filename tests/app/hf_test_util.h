// What the Hugging Face directory tests share (hf_test.cc, hf_refusals_test.cc): a safetensors
// writer and reader of the tests' own, a tiny random Llama written as transformers writes one,
// token files, and `tierzero eval`'s printed loss.
#pragma once

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
#include "gpt/hf.h"
#include "tierzero/convert.h"
#include "train.h"

namespace tierzero::app::hf_testing {

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
inline void WriteSafetensors(const std::string& path, const std::map<std::string, Tensor>& ts) {
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
inline std::map<std::string, Tensor> ReadDir(const std::string& dir) {
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
inline Tensor RandomBf16(std::vector<int64_t> shape, std::mt19937_64& rng, bool norm,
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
                   {"bos_token_id", 17},
                   {"eos_token_id", {18, 16}},
                   {"pad_token_id", nullptr},
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
inline double EvalLoss(const std::vector<std::string>& args, int* rc) {
  testing::internal::CaptureStdout();
  *rc = Eval(args);
  const std::string out = testing::internal::GetCapturedStdout();
  const size_t at = out.find("mean loss ");
  return at == std::string::npos ? std::nan("") : std::stod(out.substr(at + 10));
}

inline void WriteTokens(const std::string& path, const std::vector<uint16_t>& tokens) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(tokens.data()),
          static_cast<std::streamsize>(tokens.size() * 2));
}

// A Llama's config.json with `extra` over it.
inline json Llama(const json& extra) {
  json c = {{"architectures", {"LlamaForCausalLM"}},
            {"vocab_size", 19},
            {"hidden_size", 16},
            {"intermediate_size", 24},
            {"num_hidden_layers", 1},
            {"num_attention_heads", 4}};
  c.update(extra);
  return c;
}

}  // namespace tierzero::app::hf_testing
