// Hugging Face model directories (gpt/hf.h).
#include "gpt/hf.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <tuple>
#include <vector>

#include "tierzero/files.h"

namespace tierzero::gpt {
namespace {

using nlohmann::json;

// config.json's fields, each read with an error naming the file and the field.
class HfConfig {
 public:
  HfConfig(json j, std::string path) : j_(std::move(j)), path_(std::move(path)) {}
  bool has(const char* k) const { return j_.contains(k) && !j_[k].is_null(); }
  bool written(const char* k) const { return j_.contains(k); }  // (null included)
  StatusOr<int64_t> Int(const char* k) const {
    if (!has(k)) return Bad(k, "is missing");
    if (!j_[k].is_number_integer()) return Bad(k, "is " + j_[k].dump() + ", not an integer");
    // (An unsigned beyond int64's range: said as written, not wrapped to a negative.)
    if (j_[k].is_number_unsigned() &&
        j_[k].get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return Bad(k, "is " + j_[k].dump() + ", beyond any size a model has");
    return j_[k].get<int64_t>();
  }
  StatusOr<int64_t> Int(const char* k, int64_t dflt) const { return has(k) ? Int(k) : dflt; }
  StatusOr<double> Num(const char* k, double dflt) const {
    if (!has(k)) return dflt;
    if (!j_[k].is_number()) return Bad(k, "is " + j_[k].dump() + ", not a number");
    return j_[k].get<double>();
  }
  StatusOr<bool> Bool(const char* k, bool dflt) const {
    if (!has(k)) return dflt;
    if (!j_[k].is_boolean()) return Bad(k, "is " + j_[k].dump() + ", not true or false");
    return j_[k].get<bool>();
  }
  // A string field's value; another JSON value as its text (shown in errors as it is).
  // (Control characters escaped as JSON writes them: a NUL cut the message that quoted it.)
  std::string Str(const char* k) const {
    if (!has(k)) return "";
    if (!j_[k].is_string()) return j_[k].dump();
    const std::string v = j_[k].get<std::string>();
    if (std::none_of(v.begin(), v.end(), [](char ch) { return ch >= 0 && ch < 0x20; })) return v;
    const std::string quoted = j_[k].dump();
    return quoted.substr(1, quoted.size() - 2);
  }
  const json& raw(const char* k) const { return j_[k]; }
  Status Bad(const std::string& k, const std::string& why) const {
    return InvalidArgumentError(Named(k) + " " + why);
  }
  std::string Named(const std::string& k) const { return path_ + ": \"" + k + "\""; }
  const std::string& path() const { return path_; }
  Status Unsupported(const std::string& k, const std::string& why) const {
    return UnsupportedError(path_ + ": \"" + k + "\" " + why);
  }

 private:
  json j_;
  std::string path_;
};

// A value in 1..max as an int.
StatusOr<int> Sized(const HfConfig& c, const char* k, int64_t v, int64_t max) {
  if (v < 1 || v > max)
    return c.Bad(k, "is " + std::to_string(v) + "; accepted: 1.." + std::to_string(max));
  return static_cast<int>(v);
}

StatusOr<json> ReadJson(const std::string& path, const std::string& what) {
  // A model directory holds files: a FIFO here would wait for a writer (read twice by eval).
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    return InvalidArgumentError(path + " is " + FileKindName(st.st_mode) + ", not a " + what +
                                " file");
  TZ_ASSIGN_OR_RETURN(const std::string text, ReadFileBounded(path, kMaxConfigBytes, what));
  TZ_RETURN_IF_ERROR(CheckOutsideJson(text, path));
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return InvalidArgumentError(path + " is not a JSON object");
  return j;
}

// The tensor names in a safetensors file's header (the engine checks the entries when it loads).
using Shapes = std::map<std::string, std::vector<int64_t>>;

// The tensor names in a safetensors file's header and their shapes.
StatusOr<Shapes> SafetensorsShapes(const std::string& path) {
  // A regular file only: a FIFO would block here waiting for a writer, and the engine's loader
  // refuses one anyway.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0)
    return ErrnoError("cannot open " + path, errno,
                      errno == ENOENT ? StatusCode::kNotFound : StatusCode::kIoError);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoError("stat of " + path, errno);
  if (!S_ISREG(st.st_mode))
    return InvalidArgumentError(path + " is " + FileKindName(st.st_mode) +
                                ", not a safetensors file");
  // Note [A model directory's weights checked before the model is made]
  // The header checked whole, as the load checks it: a download cut short, or a header whose
  // entries are not what their bytes hold, was found only once the model its config says was
  // allocated and initialised (seconds and gigabytes for a large one; hunt 51), and an entry
  // that was no tensor was said as a shape config.json disagrees with.
  return ReadSafetensorsShapes(path);
}

std::string ShapeText(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

// Note [A model directory's config checked against its weights]
// config.json alone sizes the run: its budgets are the machine's (Note [Budgets of a model
// brought from a directory]), allocated before the weights load, and the engine compares each
// tensor's shape only as it loads. A config that disagrees with its weights (edited, or copied
// from another model) then cost gigabytes and seconds before the error. The headers are read
// here anyway, so the tensors that carry every shape field are compared with the config now:
// the embedding (vocab x width), the first block's query, key and MLP projections (heads, key/
// value heads, MLP width), that every block the config names is there, and that the embedding
// is (weights without it are another model's). A tensor the files lack otherwise is left to the
// engine (which names every missing one).
Status CheckShapesAgainstConfig(const std::string& dir, const GptConfig& g, const Shapes& shapes) {
  const int64_t d = g.d_model, hd = g.head_dim();
  std::vector<std::pair<std::string, std::vector<int64_t>>> expect;
  std::string layer;  // the blocks' names' prefix
  if (g.arch == Arch::kLlama) {
    layer = "model.layers.";
    expect = {{"model.embed_tokens.weight", {g.vocab, d}},
              {"model.layers.0.self_attn.q_proj.weight", {int64_t{g.n_head} * hd, d}},
              {"model.layers.0.self_attn.k_proj.weight", {int64_t{g.kv_heads()} * hd, d}},
              {"model.layers.0.mlp.gate_proj.weight", {g.ffn(), d}}};
  } else {
    const bool bare = shapes.count("wte.weight") > 0 && shapes.count("transformer.wte.weight") == 0;
    const std::string p = bare ? "" : "transformer.";
    layer = p + "h.";
    expect = {{p + "wte.weight", {g.vocab, d}},
              {p + "wpe.weight", {g.positions(), d}},
              {p + "h.0.attn.c_attn.weight", {d, 3 * d}},
              {p + "h.0.mlp.c_fc.weight", {d, 4 * d}}};
  }
  // Every model has its embedding: weights without it are not this config's model (another
  // architecture's names, or tensors of something else), said before the model is allocated.
  if (shapes.count(expect.front().first) == 0) {
    std::string some;
    int listed = 0;
    for (const auto& [name, shape] : shapes) {
      if (listed++ == 3) break;
      some += (some.empty() ? "" : ", ") + name;
    }
    return NotFoundError(dir + ": the weights have no tensor " + expect.front().first +
                         (some.empty()
                              ? std::string(" (they hold none)")
                              : " (they hold " + some + (shapes.size() > 3 ? ", ..." : "") + ")") +
                         ": they are not the model config.json describes");
  }
  for (const auto& [name, want] : expect) {
    const auto it = shapes.find(name);
    if (it == shapes.end() || it->second == want) continue;
    return InvalidArgumentError(dir + ": the weights hold " + name + " as " +
                                ShapeText(it->second) + ", but config.json makes it " +
                                ShapeText(want) +
                                ": the config and the weights disagree (config.json edited, or "
                                "another model's?)");
  }
  // The blocks: the highest index in the names is the config's last.
  int64_t most = -1;
  for (const auto& [name, shape] : shapes) {
    if (name.rfind(layer, 0) != 0) continue;
    const std::string rest = name.substr(layer.size());
    const size_t dot = rest.find('.');
    if (dot == 0 || dot == std::string::npos || rest.find_first_not_of("0123456789") != dot ||
        dot > 6)
      continue;
    most = std::max<int64_t>(most, std::stoll(rest.substr(0, dot)));
  }
  // (More blocks than the config's load its first ones, the rest counted as unused: a model cut
  // short on purpose, as transformers loads it.)
  if (most >= 0 && most + 1 < g.n_layer)
    return InvalidArgumentError(dir + ": the weights hold " + std::to_string(most + 1) +
                                " blocks, but config.json makes the model " +
                                std::to_string(g.n_layer) +
                                ": the config and the weights disagree (config.json edited, or "
                                "another model's?)");
  return Status::OK();
}

}  // namespace

bool HasHfTensorNames(const std::string& path) {
  auto shapes = SafetensorsShapes(path);
  if (!shapes.ok()) return false;
  for (const auto& [name, shape] : *shapes) {
    for (const char* prefix :
         {"transformer.h.", "transformer.wte.", "model.layers.", "model.embed_tokens."})
      if (name.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

bool IsHfDir(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return false;
  return ::stat((path + "/config.json").c_str(), &st) == 0;
}

namespace {

// What a model directory without tierzero's files holds instead, and what to do: PyTorch's
// pickled weights (which tierzero does not read), or safetensors shards without their index.
std::string WhatWeightsItHas(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> bins, shards, others;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const auto ends = [&](std::string_view tail) {
      return name.size() >= tail.size() &&
             name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
    };
    // (transformers' names: pytorch_model*.bin, model-00001-of-00002.safetensors; a
    // training_args.bin or an adapter's safetensors is not the model's weights.)
    if (name.rfind("pytorch_model", 0) == 0 && ends(".bin")) bins.push_back(name);
    if (ends(".safetensors"))
      (name.rfind("model-", 0) == 0 && name.find("-of-") != std::string::npos ? shards : others)
          .push_back(name);
  }
  std::sort(bins.begin(), bins.end());
  std::sort(shards.begin(), shards.end());
  std::sort(others.begin(), others.end());
  auto listed = [](const std::vector<std::string>& v) {
    return v.front() + (v.size() > 1 ? " and " + std::to_string(v.size() - 1) + " more" : "");
  };
  if (!shards.empty())
    return ": it has " + listed(shards) +
           " without the index that names which tensor each holds: download "
           "model.safetensors.index.json beside them";
  if (!bins.empty())
    return ": it has " + listed(bins) +
           ", PyTorch's pickled weights, which tierzero does not read (they can run code when "
           "loaded): download the model's safetensors files, or convert them (transformers' "
           "save_pretrained(..., safe_serialization=True))";
  if (!others.empty())
    return ": it has " + listed(others) +
           ", not the model's weights by transformers' names (an adapter's? a consolidated "
           "file of another layout?): tierzero reads model.safetensors, or the shards "
           "model.safetensors.index.json names";
  return ": download the model's weights (model.safetensors) into it";
}

}  // namespace

// Note [Special tokens carried]
// A model's special tokens (beginning and end of sequence, padding) are ids its config.json
// names; generation stops at the end-of-sequence id transformers reads there (its
// generation_config.json defaults to them). Not the model's shape, so nothing here computes with
// them, but an export that dropped them (hunt 52) gave transformers LlamaConfig's defaults, 1 and
// 2: ordinary tokens of another tokenizer, and no end of sequence for a Llama 3 (128009).
// Read from --init-from DIR into model.token_ids, recorded by the run and its checkpoints,
// written back by `export --format hf`. Never compared between a checkpoint and a run (a
// record, not the model: Note [A checkpoint resumes its own model] skips it).
StatusOr<std::string> TokenIdsText(const json& ids, const std::string& from) {
  if (!ids.is_object()) return InvalidArgumentError(from + " is not a JSON object of token ids");
  json out = json::object();
  for (const auto& [key, v] : ids.items()) {
    if (key != "bos_token_id" && key != "eos_token_id" && key != "pad_token_id")
      return InvalidArgumentError(from + " names " + json(key).dump() +
                                  "; its keys: bos_token_id, eos_token_id, pad_token_id");
    if (v.is_null()) continue;
    auto id = [](const json& x) {
      return x.is_number_unsigned() || (x.is_number_integer() && x.get<int64_t>() >= 0);
    };
    const bool ok = (id(v) && v.get<uint64_t>() <= INT32_MAX) ||
                    (v.is_array() && !v.empty() && v.size() <= 64 &&
                     std::all_of(v.begin(), v.end(), [&](const json& x) {
                       return id(x) && x.get<uint64_t>() <= INT32_MAX;
                     }));
    if (!ok)
      return InvalidArgumentError(from + ": " + key + " is " + v.dump().substr(0, 80) +
                                  "; a token id (a non-negative integer) or a list of them");
    out[key] = v;
  }
  return out.empty() ? std::string() : out.dump();
}

StatusOr<HfModel> ReadHfDir(const std::string& dir, const GptConfig& base) {
  const std::string cfg_path = dir + "/config.json";
  TZ_ASSIGN_OR_RETURN(json j, ReadJson(cfg_path, "Hugging Face config"));
  const HfConfig c(std::move(j), cfg_path);
  HfModel m;
  GptConfig g = base;
  // Note [Special tokens carried]: what config.json names of them (a value that is no id, as
  // transformers' own tolerates in old configs, is left out rather than refusing the model).
  {
    json ids = json::object();
    for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
      if (!c.has(key) || c.raw(key).is_null()) continue;
      if (TokenIdsText(json{{key, c.raw(key)}}, "config.json").ok()) ids[key] = c.raw(key);
    }
    g.token_ids = ids.empty() ? std::string() : ids.dump();
  }
  // The frequency scaling is config.json's alone: none without its rope_scaling, whatever the
  // run's config says (a run's rope_factor silently rescaled a model that has none).
  const GptConfig unscaled;
  g.rope_factor = unscaled.rope_factor;
  g.rope_low_freq_factor = unscaled.rope_low_freq_factor;
  g.rope_high_freq_factor = unscaled.rope_high_freq_factor;
  g.rope_original_positions = unscaled.rope_original_positions;
  std::string arch;
  if (c.has("architectures") && c.raw("architectures").is_array() &&
      !c.raw("architectures").empty() && c.raw("architectures")[0].is_string())
    arch = c.raw("architectures")[0].get<std::string>();
  if (arch.find('\0') != std::string::npos) {  // (said whole: a NUL cut the message)
    const std::string quoted = c.raw("architectures")[0].dump();
    arch = quoted.substr(1, quoted.size() - 2);
  }
  const std::string type = c.Str("model_type");
  m.source = !arch.empty() ? arch : type;
  const bool gpt2 = arch == "GPT2LMHeadModel" || (arch.empty() && type == "gpt2");
  const bool llama = arch == "LlamaForCausalLM" || arch == "MistralForCausalLM" ||
                     (arch.empty() && (type == "llama" || type == "mistral"));
  if (!gpt2 && !llama) {
    // A tierzero run directory (its config.json has the run's sections): a run resumes.
    if (!c.has("architectures") && !c.has("model_type") && c.has("model") && c.has("train"))
      return InvalidArgumentError(
          dir + " is a tierzero run directory, not a Hugging Face model: --resume " + dir +
          "/checkpoint continues it (with --config " + dir + "/config.json)");
    if (arch == "Qwen2ForCausalLM" || type == "qwen2")
      return c.Unsupported("architectures",
                           "is Qwen 2, whose q, k and v projections have biases and o's has none: "
                           "not a layout tierzero's Llama takes yet (docs/models.md)");
    // (What the file holds, as it is: a string where a list belongs, or neither key.)
    if (!c.has("architectures") && !c.has("model_type"))
      return c.Bad("architectures",
                   "and \"model_type\" are both missing: the file does not say which model it "
                   "is (GPT2LMHeadModel, LlamaForCausalLM or MistralForCausalLM load)");
    if (arch.empty() && c.has("architectures") && type.empty())
      return c.Bad("architectures", "is " + c.raw("architectures").dump() +
                                        ", not a list of model class names such as "
                                        "[\"LlamaForCausalLM\"]");
    // (The key the model was named by: model_type where no architectures are listed.)
    if (arch.empty())
      return c.Unsupported("model_type", "is \"" + type +
                                             "\"; tierzero reads gpt2, llama and mistral (model "
                                             "classes GPT2LMHeadModel, LlamaForCausalLM and "
                                             "MistralForCausalLM)");
    return c.Unsupported(
        "architectures",
        "is \"" + m.source +
            "\"; tierzero reads GPT2LMHeadModel, LlamaForCausalLM and MistralForCausalLM");
  }
  if (c.has("torch_dtype")) {
    const std::string t = c.Str("torch_dtype");
    if (t == "float32")
      m.dtype = DType::kF32;
    else if (t == "float16")
      m.dtype = DType::kF16;
    else if (t == "bfloat16")
      m.dtype = DType::kBF16;
    else
      return c.Unsupported("torch_dtype", "is \"" + t + "\"; float32, float16 or bfloat16 load");
  }
  if (gpt2) {
    g.arch = Arch::kGpt2;
    TZ_ASSIGN_OR_RETURN(const int64_t v, c.Int("vocab_size"));
    TZ_ASSIGN_OR_RETURN(g.vocab, Sized(c, "vocab_size", v, 1 << 20));
    TZ_ASSIGN_OR_RETURN(const int64_t e, c.Int("n_embd"));
    TZ_ASSIGN_OR_RETURN(g.d_model, Sized(c, "n_embd", e, 65536));
    TZ_ASSIGN_OR_RETURN(const int64_t l, c.Int("n_layer"));
    TZ_ASSIGN_OR_RETURN(g.n_layer, Sized(c, "n_layer", l, 4096));
    TZ_ASSIGN_OR_RETURN(const int64_t h, c.Int("n_head"));
    TZ_ASSIGN_OR_RETURN(g.n_head, Sized(c, "n_head", h, 65536));
    TZ_ASSIGN_OR_RETURN(const int64_t p, c.Int("n_positions"));
    TZ_ASSIGN_OR_RETURN(g.max_positions, Sized(c, "n_positions", p, 1 << 22));
    g.n_kv_head = 0;
    g.d_ff = 0;
    if (c.has("n_inner")) {
      TZ_ASSIGN_OR_RETURN(const int64_t inner, c.Int("n_inner"));
      if (inner != 4 * g.d_model)
        return c.Unsupported("n_inner",
                             "is " + std::to_string(inner) + "; GPT-2's MLP is 4 n_embd wide here");
    }
    const std::string act = c.Str("activation_function");
    if (!act.empty() && act != "gelu_new" && act != "gelu_pytorch_tanh")
      return c.Unsupported("activation_function",
                           "is \"" + act + "\"; GPT-2's tanh GELU (gelu_new) is what runs");
    TZ_ASSIGN_OR_RETURN(const double eps, c.Num("layer_norm_epsilon", 1e-5));
    if (eps != 1e-5) return c.Unsupported("layer_norm_epsilon", "is not 1e-5, GPT-2's");
    TZ_ASSIGN_OR_RETURN(const bool tie, c.Bool("tie_word_embeddings", true));
    if (!tie) return c.Unsupported("tie_word_embeddings", "is false; GPT-2's head is tied");
    TZ_ASSIGN_OR_RETURN(const bool scale, c.Bool("scale_attn_weights", true));
    if (!scale) return c.Unsupported("scale_attn_weights", "is false");
    for (const char* k : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"}) {
      TZ_ASSIGN_OR_RETURN(const bool on, c.Bool(k, false));
      if (on) return c.Unsupported(k, "is true");
    }
    g.tie_embeddings = g.attention_bias = true;
    g.norm_eps = 1e-5;
    // The context: the base's when it fits, else the positions.
    if (g.seq_len > g.max_positions) g.seq_len = g.max_positions;
  } else {
    g.arch = Arch::kLlama;
    TZ_ASSIGN_OR_RETURN(const int64_t v, c.Int("vocab_size"));
    TZ_ASSIGN_OR_RETURN(g.vocab, Sized(c, "vocab_size", v, 1 << 20));
    TZ_ASSIGN_OR_RETURN(const int64_t e, c.Int("hidden_size"));
    TZ_ASSIGN_OR_RETURN(g.d_model, Sized(c, "hidden_size", e, 65536));
    TZ_ASSIGN_OR_RETURN(const int64_t l, c.Int("num_hidden_layers"));
    TZ_ASSIGN_OR_RETURN(g.n_layer, Sized(c, "num_hidden_layers", l, 4096));
    TZ_ASSIGN_OR_RETURN(const int64_t h, c.Int("num_attention_heads"));
    TZ_ASSIGN_OR_RETURN(g.n_head, Sized(c, "num_attention_heads", h, 65536));
    TZ_ASSIGN_OR_RETURN(const int64_t kv, c.Int("num_key_value_heads", h));
    TZ_ASSIGN_OR_RETURN(g.n_kv_head, Sized(c, "num_key_value_heads", kv, 65536));
    TZ_ASSIGN_OR_RETURN(const int64_t f, c.Int("intermediate_size"));
    TZ_ASSIGN_OR_RETURN(g.d_ff, Sized(c, "intermediate_size", f, 1 << 20));
    // (transformers' defaults where the file has none: LlamaConfig's 2048, MistralConfig's
    // 4096 x 32; the config class, and so its default, is model_type's where it is given.)
    const bool mistral = arch == "MistralForCausalLM" || (arch.empty() && type == "mistral");
    const bool mistral_config = type.empty() ? mistral : type == "mistral";
    TZ_ASSIGN_OR_RETURN(const int64_t p,
                        c.Int("max_position_embeddings", mistral_config ? 131072 : 2048));
    TZ_ASSIGN_OR_RETURN(g.max_positions, Sized(c, "max_position_embeddings", p, 1 << 22));
    if (g.d_model % g.n_head != 0)
      return c.Bad("num_attention_heads", "does not divide hidden_size");
    if (c.has("head_dim")) {
      TZ_ASSIGN_OR_RETURN(const int64_t hd, c.Int("head_dim"));
      if (hd != g.d_model / g.n_head)
        return c.Unsupported("head_dim",
                             "is " + std::to_string(hd) +
                                 "; heads here are hidden_size / num_attention_heads (" +
                                 std::to_string(g.d_model / g.n_head) + ") wide");
    }
    const std::string act = c.Str("hidden_act");
    if (!act.empty() && act != "silu")
      return c.Unsupported("hidden_act", "is \"" + act + "\"; SwiGLU's SiLU is what runs");
    TZ_ASSIGN_OR_RETURN(g.norm_eps, c.Num("rms_norm_eps", 1e-6));
    TZ_ASSIGN_OR_RETURN(g.rope_theta, c.Num("rope_theta", 10000.0));
    TZ_ASSIGN_OR_RETURN(g.tie_embeddings, c.Bool("tie_word_embeddings", false));
    TZ_ASSIGN_OR_RETURN(g.attention_bias, c.Bool("attention_bias", false));
    // transformers' Mistral has no attention biases whatever the field says (it is no Mistral
    // field: the biases' tensors load as unexpected and are dropped); run with them, the model
    // was another than transformers' (hunt 48).
    if (mistral && g.attention_bias)
      return c.Unsupported("attention_bias",
                           "is true, but MistralForCausalLM has no attention biases (transformers "
                           "ignores the field and drops the bias tensors): remove the field to "
                           "load it as transformers does, or name the architecture "
                           "LlamaForCausalLM to train with the biases");
    TZ_ASSIGN_OR_RETURN(const bool mlp_bias, c.Bool("mlp_bias", false));
    if (mlp_bias) return c.Unsupported("mlp_bias", "is true; the MLP here has no biases");
    // Note [RoPE settings in either layout]
    // transformers up to 4.x writes `rope_theta` and `rope_scaling` at the top level;
    // transformers 5 writes one `rope_parameters` object holding both (`rope_theta`,
    // `rope_type`: "default", "llama3", ...; the type's own fields). Read only at the top level,
    // a v5 directory ran with theta 10000 and no scaling, silently (hunt 39). Both layouts are
    // read: `rope_parameters` when present (a top-level value beside it must agree), and any
    // type but "default" and Llama 3's is refused by name from either.
    auto scaling = [&](const json& rs, const std::string& field) -> Status {
      const std::string type =
          rs.is_object() && rs.contains("rope_type") && rs["rope_type"].is_string()
              ? rs["rope_type"].get<std::string>()
          : rs.is_object() && rs.contains("type") && rs["type"].is_string()
              ? rs["type"].get<std::string>()
              : "";
      // (Llama 3's fields without a type, or a type that is not a string, are not "default".)
      const bool scaled_fields =
          rs.is_object() && (rs.contains("factor") || rs.contains("low_freq_factor") ||
                             rs.contains("original_max_position_embeddings"));
      // (The "default" type is no scaling whichever key holds it, as transformers reads it.)
      if (type == "default" || (field == "rope_parameters" && type.empty() && !scaled_fields))
        return Status::OK();
      if (type != "llama3")
        return c.Unsupported(field,
                             "is " + rs.dump() + "; the \"llama3\" type is taken (docs/models.md)");
      auto num = [&](const char* k, double* out) -> Status {
        if (!rs.contains(k) || !rs[k].is_number() || !(rs[k].get<double>() > 0))
          return c.Bad(field + "." + k, "is missing or not a positive number");
        *out = rs[k].get<double>();
        return Status::OK();
      };
      double original = 0;
      TZ_RETURN_IF_ERROR(num("factor", &g.rope_factor));
      TZ_RETURN_IF_ERROR(num("low_freq_factor", &g.rope_low_freq_factor));
      TZ_RETURN_IF_ERROR(num("high_freq_factor", &g.rope_high_freq_factor));
      TZ_RETURN_IF_ERROR(num("original_max_position_embeddings", &original));
      if (original != std::floor(original) || original < 1 || original > (1 << 22))
        return c.Bad(field + ".original_max_position_embeddings",
                     "is " + rs["original_max_position_embeddings"].dump() +
                         "; a whole number of positions, 1.." + std::to_string(1 << 22));
      if (!(g.rope_high_freq_factor > g.rope_low_freq_factor))
        return c.Bad(field, "has high_freq_factor not above low_freq_factor");
      g.rope_original_positions = static_cast<int>(original);
      return Status::OK();
    };
    // Rotary embeddings over part of each head (Phi, GPT-NeoX-style models): refused, not run
    // as full rotary.
    const json* top = c.has("partial_rotary_factor") ? &c.raw("partial_rotary_factor") : nullptr;
    const json* inner = c.has("rope_parameters") && c.raw("rope_parameters").is_object() &&
                                c.raw("rope_parameters").contains("partial_rotary_factor")
                            ? &c.raw("rope_parameters").at("partial_rotary_factor")
                            : nullptr;
    for (const json* at : {top, inner}) {
      if (at == nullptr || at->is_null()) continue;
      if (!at->is_number() || at->get<double>() != 1.0)
        return c.Unsupported("partial_rotary_factor",
                             "is " + at->dump() + "; rotary embeddings here span the whole head");
    }
    if (c.has("rope_parameters")) {
      const json& rp = c.raw("rope_parameters");
      if (!rp.is_object()) return c.Bad("rope_parameters", "is not an object");
      // transformers 5 may write one set per attention type ({"full_attention": {...},
      // "sliding_attention": {...}}): every layer here attends alike, so they must agree.
      for (const auto& [k, v] : rp.items())
        if (v.is_object())
          return c.Unsupported("rope_parameters",
                               "holds settings per attention type (\"" + k +
                                   "\"); every layer here attends with one RoPE");
      if (rp.contains("rope_theta")) {
        if (!rp["rope_theta"].is_number() || !(rp["rope_theta"].get<double>() > 0))
          return c.Bad("rope_parameters.rope_theta", "is not a positive number");
        const double theta = rp["rope_theta"].get<double>();
        if (c.has("rope_theta") && theta != g.rope_theta)
          return c.Bad("rope_theta", "is " + c.raw("rope_theta").dump() +
                                         " but rope_parameters.rope_theta is " +
                                         rp["rope_theta"].dump() + ": which one holds?");
        g.rope_theta = theta;
      }
      TZ_RETURN_IF_ERROR(scaling(rp, "rope_parameters"));
      if (c.has("rope_scaling") && !c.raw("rope_scaling").is_null()) {
        // Every field of the scaling, not its factor alone: one low_freq_factor from each took
        // rope_scaling's over rope_parameters', a wrong loss with exit 0 (hunt 51).
        auto fields = [&] {
          return std::tuple(g.rope_factor, g.rope_low_freq_factor, g.rope_high_freq_factor,
                            g.rope_original_positions);
        };
        const auto from_parameters = fields();
        TZ_RETURN_IF_ERROR(scaling(c.raw("rope_scaling"), "rope_scaling"));
        if (fields() != from_parameters)
          return c.Bad("rope_scaling", "disagrees with rope_parameters: which one holds?");
      }
    } else if (c.has("rope_scaling") && !c.raw("rope_scaling").is_null()) {
      // Llama 3's (HF's _compute_llama3_parameters); any other type is refused.
      TZ_RETURN_IF_ERROR(scaling(c.raw("rope_scaling"), "rope_scaling"));
    }
    // The context: the base's when it fits, else the positions.
    if (g.seq_len > g.max_positions) g.seq_len = g.max_positions;
    // Note [Whose sliding window]
    // transformers applies a window in Mistral's attention only: MistralConfig's sliding_window
    // (4096 where the file has none; null: no window). Llama's attention sees every earlier
    // token whatever its config says: a "sliding_window" key in a LlamaForCausalLM's config.json
    // (left by a conversion) was taken as Mistral's, refusing contexts transformers runs and
    // cutting an export's max_position_embeddings to it (hunt 51).
    const bool windowed =
        mistral && (c.has("sliding_window") || (mistral_config && !c.written("sliding_window")));
    if (windowed) {
      TZ_ASSIGN_OR_RETURN(const int64_t w, c.Int("sliding_window", 4096));
      if (w < 1)
        return c.Bad("sliding_window",
                     "is " + std::to_string(w) + "; a window is 1 or more tokens");
      if (w < g.seq_len)
        return c.Unsupported("sliding_window", "is " + std::to_string(w) +
                                                   ", shorter than the context " +
                                                   std::to_string(g.seq_len) +
                                                   ": attention here sees every "
                                                   "earlier token; use --seq-len " +
                                                   std::to_string(w));
      // Attention that sees every earlier token is the window's only within it: the model
      // tierzero computes is one whose context is the window, and is recorded so (a checkpoint,
      // an export's max_position_embeddings), where an export said the positions, and
      // transformers then ran it beyond the window as another model (hunt 46).
      if (w < g.max_positions) g.max_positions = static_cast<int>(w);
    }
  }
  // The model's ranges said in config.json's names (hunt 50: "model field 'norm_eps'" named
  // neither the file nor its "rms_norm_eps").
  const std::string rope_key = c.has("rope_parameters") ? "rope_parameters." : "rope_scaling.";
  const std::string theta_key = c.has("rope_parameters") && c.raw("rope_parameters").is_object() &&
                                        c.raw("rope_parameters").contains("rope_theta")
                                    ? "rope_parameters.rope_theta"
                                    : "rope_theta";
  const bool is_gpt2 = g.arch == Arch::kGpt2;
  auto key_of = [&](const char* field) -> std::string {
    static const std::map<std::string, std::pair<const char*, const char*>> kKeys = {
        // tierzero's field: (GPT-2's key, Llama's)
        {"vocab", {"vocab_size", "vocab_size"}},
        {"max_positions", {"n_positions", "max_position_embeddings"}},
        {"d_model", {"n_embd", "hidden_size"}},
        {"n_layer", {"n_layer", "num_hidden_layers"}},
        {"n_head", {"n_head", "num_attention_heads"}},
        {"n_kv_head", {nullptr, "num_key_value_heads"}},
        {"d_ff", {"n_inner", "intermediate_size"}},
        {"norm_eps", {"layer_norm_epsilon", "rms_norm_eps"}},
        {"rope_factor", {nullptr, "factor"}},
        {"rope_low_freq_factor", {nullptr, "low_freq_factor"}},
        {"rope_high_freq_factor", {nullptr, "high_freq_factor"}},
        {"rope_original_positions", {nullptr, "original_max_position_embeddings"}}};
    std::string key;
    if (std::string(field) == "rope_theta" && !is_gpt2) {
      key = theta_key;
    } else if (const auto it = kKeys.find(field); it != kKeys.end()) {
      const char* k = is_gpt2 ? it->second.first : it->second.second;
      if (k == nullptr) return "";
      key = (std::string(field).rfind("rope_", 0) == 0 ? rope_key : "") + k;
    } else {
      return "";
    }
    return key;
  };
  TZ_RETURN_IF_ERROR(ValidateGptConfig(g, key_of, c.path()));
  m.config = g;
  // Note [Dropout a model directory asks for]
  // tierzero trains without dropout (as most pretraining now does). A config asking for some
  // (GPT-2's checkpoints ask 0.1 of each) is taken, not refused, and its dropout said, so a
  // fine-tune that differs from transformers' in train mode is not silent (hunt 48).
  for (const char* k : {"resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout",
                        "hidden_dropout", "dropout"}) {
    if (!c.has(k) || !c.raw(k).is_number() || !(c.raw(k).get<double>() > 0)) continue;
    m.dropout += (m.dropout.empty() ? "" : ", ") + std::string(k) + " " + c.raw(k).dump();
  }

  // The files: model.safetensors when it is there (as transformers picks), else the index's. A
  // dangling link counts as there (and fails to open, naming it).
  const std::string single = dir + "/model.safetensors";
  const std::string index = dir + "/model.safetensors.index.json";
  struct stat st {};
  Shapes shapes;
  if (::lstat(single.c_str(), &st) != 0 && ::lstat(index.c_str(), &st) == 0) {
    TZ_ASSIGN_OR_RETURN(const json ij, ReadJson(index, "safetensors index"));
    if (!ij.contains("weight_map") || !ij["weight_map"].is_object())
      return InvalidArgumentError(index + " has no \"weight_map\" object");
    std::set<std::string> files;
    for (const auto& item : ij["weight_map"].items()) {
      if (!item.value().is_string())
        return InvalidArgumentError(index + ": the weight_map entry of '" + item.key() +
                                    "' is not a file name");
      const std::string f = item.value().get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f.find('\0') != std::string::npos ||
          f == "." || f == "..")
        return InvalidArgumentError(index + ": " + item.value().dump() +
                                    " is not a file name in the directory (the index may "
                                    "only name files beside it)");
      files.insert(f);
    }
    if (files.empty()) return InvalidArgumentError(index + " names no file");
    for (const std::string& f : files) m.files.push_back(dir + "/" + f);
  } else {
    if (errno = 0; ::lstat(single.c_str(), &st) != 0 && errno == ENOENT)
      return NotFoundError(dir + " has neither model.safetensors nor model.safetensors.index.json" +
                           WhatWeightsItHas(dir));
    m.files.push_back(single);
  }
  for (const std::string& f : m.files) {
    TZ_ASSIGN_OR_RETURN(const Shapes in, SafetensorsShapes(f));
    shapes.insert(in.begin(), in.end());
  }
  TZ_RETURN_IF_ERROR(CheckShapesAgainstConfig(dir, g, shapes));
  for (const auto& [name, shape] : shapes) m.tensors.push_back(name);
  return m;
}

Engine::TensorNames HfTensorNames(const GptConfig& config,
                                  const std::vector<std::string>& available) {
  if (config.arch == Arch::kLlama) return nullptr;  // the same names
  // GPT-2: transformers writes "transformer.wte.weight"; the original checkpoints "wte.weight".
  const bool bare =
      !available.empty() &&
      std::find(available.begin(), available.end(), "transformer.wte.weight") == available.end() &&
      std::find(available.begin(), available.end(), "wte.weight") != available.end();
  const std::string prefix = bare ? "" : "transformer.";
  return [prefix](const std::string& name) {
    if (name == "wte" || name == "wpe") return prefix + name + ".weight";
    return prefix + name;
  };
}

}  // namespace tierzero::gpt
