// Fuzz target: a Hugging Face model directory's config.json (gpt::ReadHfDir, `train --init-from
// DIR`). The input's first byte chooses what it is: even, config.json itself (beside a valid
// index and file); odd, model.safetensors.index.json (beside a valid config.json). Properties: no
// crash or exception; an accepted directory gives a model config that validates, names files
// inside the directory only, and reads back to itself through HfConfigJson.
#include <filesystem>
#include <string>

#include "fuzz_common.h"
#include "gpt/gpt.h"
#include "gpt/hf.h"

using namespace tierzero;

namespace {

const char kConfig[] = R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 32,
  "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4,
  "num_key_value_heads": 2, "max_position_embeddings": 64})";
// A safetensors file of one empty tensor: enough for the names ReadHfDir lists.
const unsigned char kFile[] = {24,  0,   0,   0,   0,   0,   0,   0,   '{', '"', 'x', '"', ':', '{',
                               '"', 'd', 't', 'y', 'p', 'e', '"', ':', '"', 'F', '3', '2', '"', ',',
                               '"', 's', 'h', 'a', 'p', 'e', '"', ':', '[', '0', ']', ',', '"', 'd',
                               'a', 't', 'a', '_', 'o', 'f', 'f', 's', 'e', 't', 's', '"', ':', '[',
                               '0', ',', '0', ']', '}', '}', ' ', ' ', ' ', ' ', ' ', ' '};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string dir = fuzz::ScratchDir() + "/hf";
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::filesystem::create_directories(dir, ec);
  const bool config = size == 0 || data[0] % 2 == 0;
  const uint8_t* body = size > 0 ? data + 1 : data;
  const size_t n = size > 0 ? size - 1 : 0;
  if (config) {
    fuzz::WriteFile(dir + "/config.json", body, n);
  } else {
    fuzz::WriteFile(dir + "/config.json", reinterpret_cast<const uint8_t*>(kConfig),
                    sizeof kConfig - 1);
    fuzz::WriteFile(dir + "/model.safetensors.index.json", body, n);
  }
  fuzz::WriteFile(dir + "/model.safetensors", kFile, sizeof kFile);
  auto m = gpt::ReadHfDir(dir, gpt::GptConfig{});
  if (!m.ok()) return 0;
  FUZZ_CHECK(gpt::ValidateGptConfig(m->config).ok(), "an accepted config does not validate");
  for (const std::string& f : m->files) {
    FUZZ_CHECK(f.rfind(dir + "/", 0) == 0 && f.find('/', dir.size() + 1) == std::string::npos,
               "a file outside the directory: %s", f.c_str());
  }
  // Its own config.json reads back to the same shape.
  const std::string back = fuzz::ScratchDir() + "/hf-back";
  std::filesystem::remove_all(back, ec);
  std::filesystem::create_directories(back, ec);
  const std::string text = gpt::HfConfigJson(m->config, m->dtype);
  fuzz::WriteFile(back + "/config.json", reinterpret_cast<const uint8_t*>(text.data()),
                  text.size());
  fuzz::WriteFile(back + "/model.safetensors", kFile, sizeof kFile);
  auto again = gpt::ReadHfDir(back, gpt::GptConfig{});
  FUZZ_CHECK(again.ok(), "its own config.json is refused: %s", again.status().ToString().c_str());
  const gpt::GptConfig& a = m->config;
  const gpt::GptConfig& b = again->config;
  FUZZ_CHECK(a.arch == b.arch && a.vocab == b.vocab && a.d_model == b.d_model &&
                 a.n_layer == b.n_layer && a.n_head == b.n_head && a.kv_heads() == b.kv_heads() &&
                 a.ffn() == b.ffn() && a.positions() == b.positions() &&
                 a.tie_embeddings == b.tie_embeddings && a.attention_bias == b.attention_bias,
             "config.json does not read back to the same shape");
  return 0;
}
