// Hugging Face model directories written (gpt/hf.h): an export's config.json and safetensors
// index; reading one is hf.cc.
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gpt/hf.h"

namespace tierzero::gpt {

using json = nlohmann::json;

namespace {

const char* TorchDType(DType d) {
  return d == DType::kF32 ? "float32" : d == DType::kF16 ? "float16" : "bfloat16";
}

}  // namespace

std::string HfConfigJson(const GptConfig& g, DType dtype) {
  json j;
  if (g.arch == Arch::kGpt2) {
    j = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
         {"vocab_size", g.vocab},
         {"n_positions", g.positions()},
         {"n_ctx", g.positions()},
         {"n_embd", g.d_model},
         {"n_layer", g.n_layer},
         {"n_head", g.n_head},
         {"n_inner", nullptr},
         {"activation_function", "gelu_new"},
         {"layer_norm_epsilon", 1e-5},
         {"initializer_range", 0.02},
         {"resid_pdrop", 0.0},
         {"embd_pdrop", 0.0},
         {"attn_pdrop", 0.0},
         {"scale_attn_weights", true},
         {"tie_word_embeddings", true},
         {"torch_dtype", TorchDType(dtype)}};
  } else {
    j = {{"architectures", {"LlamaForCausalLM"}},
         {"model_type", "llama"},
         {"vocab_size", g.vocab},
         {"hidden_size", g.d_model},
         {"intermediate_size", g.ffn()},
         {"num_hidden_layers", g.n_layer},
         {"num_attention_heads", g.n_head},
         {"num_key_value_heads", g.kv_heads()},
         {"head_dim", g.head_dim()},
         {"max_position_embeddings", g.positions()},
         {"rms_norm_eps", g.norm_eps},
         {"rope_theta", g.rope_theta},
         {"rope_scaling",
          g.rope_factor > 0 ? json{{"rope_type", "llama3"},
                                   {"factor", g.rope_factor},
                                   {"low_freq_factor", g.rope_low_freq_factor},
                                   {"high_freq_factor", g.rope_high_freq_factor},
                                   {"original_max_position_embeddings", g.rope_original_positions}}
                            : json(nullptr)},
         {"hidden_act", "silu"},
         {"attention_bias", g.attention_bias},
         {"attention_dropout", 0.0},
         {"mlp_bias", false},
         {"initializer_range", 0.02},
         {"tie_word_embeddings", g.tie_embeddings},
         {"torch_dtype", TorchDType(dtype)}};
  }
  // Note [Special tokens carried] (hf.cc): the ids the model came with.
  if (!g.token_ids.empty()) {
    const json ids = json::parse(g.token_ids, nullptr, /*allow_exceptions=*/false);
    if (ids.is_object())
      for (const auto& [key, v] : ids.items()) j[key] = v;
  }
  return j.dump(2) + "\n";
}

std::string HfIndexJson(const std::vector<Engine::SafetensorsShard>& shards) {
  json map = json::object();
  uint64_t total = 0;
  for (const auto& s : shards) {
    total += s.bytes;
    for (const std::string& t : s.tensors) map[t] = s.file;
  }
  json j = {{"metadata", {{"total_size", total}}}, {"weight_map", map}};
  return j.dump(2) + "\n";
}

}  // namespace tierzero::gpt
