// Hugging Face model directories in and out (docs/models.md): config.json (GPT2LMHeadModel or
// LlamaForCausalLM, and the families that share Llama's layout) and safetensors files, one
// (model.safetensors) or sharded with model.safetensors.index.json; the tensors' names and
// layouts are Hugging Face's.
//
// In: ReadHfConfig turns config.json into the model's shape; HfTensorNames maps the model's
// parameter names to the files' (GPT-2 checkpoints come with and without the "transformer."
// prefix); Engine::LoadSafetensors then streams each tensor into its chunk's tier.
// Out: HfConfigJson writes the config.json transformers reads back, HfIndexJson the index of a
// sharded export (Engine::ExportSafetensorsShards writes the files).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gpt/gpt.h"
#include "tierzero/engine.h"
#include "tierzero/status.h"
#include "tierzero/types.h"

namespace tierzero::gpt {

struct HfModel {
  GptConfig config;                  // the shape; the rest as the `base` given
  std::vector<std::string> files;    // the safetensors files, full paths
  std::vector<std::string> tensors;  // every tensor name the files hold (sorted)
  DType dtype = DType::kBF16;        // torch_dtype (bf16 when it says none)
  std::string source;                // what config.json named: "LlamaForCausalLM", ...
  std::string dropout;  // the dropout config.json asks for ("resid_pdrop 0.1, ..."), not applied
};

// The model of Hugging Face directory `dir`: its config.json read into `base`'s shape fields
// (architecture, vocab, width, depth, heads, key/value heads, MLP width, positions, norm eps,
// rope theta, tying, biases); a field it does not take (an activation other than GPT-2's tanh
// GELU or Llama's SiLU, rope_scaling, MLP biases, a head width other than width / heads,
// Qwen 2's q/k/v-only biases...) is an error naming it. The files: the index's when
// model.safetensors.index.json is there, else model.safetensors.
StatusOr<HfModel> ReadHfDir(const std::string& dir, const GptConfig& base);

// Note [Special tokens carried] (hf.cc): `ids`, a JSON object of bos_token_id, eos_token_id and
// pad_token_id (each a non-negative id or a list of them; null is none), as GptConfig::token_ids
// holds it (compact); InvalidArgument naming what is wrong. `from` names it in the error.
StatusOr<std::string> TokenIdsText(const nlohmann::json& ids, const std::string& from);

// True when `path` is a directory holding config.json (an HF model directory).
bool IsHfDir(const std::string& path);

// True when safetensors file `path` holds tensors named as transformers names a GPT-2's or a
// Llama's ("transformer.h.0...", "model.layers.0..."): the weights of a model directory. False
// when it cannot be read.
bool HasHfTensorNames(const std::string& path);

// The files' tensor name of each parameter of a model of `config` (`available`: the names the
// files hold, to choose GPT-2's prefix; empty: the prefix transformers writes).
Engine::TensorNames HfTensorNames(const GptConfig& config,
                                  const std::vector<std::string>& available);

// config.json for a model of `config` stored in `dtype`.
std::string HfConfigJson(const GptConfig& config, DType dtype);
// model.safetensors.index.json for shards (total_size: their tensors' bytes).
std::string HfIndexJson(const std::vector<Engine::SafetensorsShard>& shards);

}  // namespace tierzero::gpt
