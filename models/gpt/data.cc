#include "gpt/data.h"

#include <algorithm>
#include <string>

#include "tierzero/files.h"
#include "tierzero/utf8.h"

namespace tierzero::gpt {
namespace {

uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

bool IsValidationPair(uint64_t a, uint64_t b) { return Mix(a * 1000003 + b) % 10 == 0; }

}  // namespace

int Dataset::RowTokens(const DataConfig& c) { return 3 * c.digits + 3; }

Dataset::~Dataset() = default;

StatusOr<std::unique_ptr<Dataset>> Dataset::Create(const DataConfig& config, int seq_len,
                                                   int vocab) {
  std::unique_ptr<Dataset> d(new Dataset(config, seq_len));
  if (config.kind == "tokens") {
    TZ_ASSIGN_OR_RETURN(d->tokens_, TokenShards::Open(config.token_path, vocab,
                                                      static_cast<uint64_t>(seq_len) + 1));
    return d;
  }
  // Every token the task makes must be inside the model's vocabulary (found now, not at the
  // first step: a run told to --overwrite another must fail before it removes anything).
  if ((config.kind == "addition" && vocab < 62) || (config.kind == "text" && vocab < 256)) {
    return InvalidArgumentError(
        "the " + config.kind + " task's tokens are bytes" +
        (config.kind == "addition" ? std::string(" up to '=' (61)") : std::string()) +
        "; model.vocab is " + std::to_string(vocab) + " (at least " +
        (config.kind == "addition" ? "62" : "256") + ")");
  }
  if (config.kind == "addition") {
    if (config.digits < 1 || config.digits > 9)
      return InvalidArgumentError("data field 'digits' is " + std::to_string(config.digits) +
                                  "; accepted: 1..9");
    if (RowTokens(config) > seq_len)
      return InvalidArgumentError("addition with " + std::to_string(config.digits) +
                                  " digits needs rows of " + std::to_string(RowTokens(config)) +
                                  " tokens; model field 'seq_len' is " + std::to_string(seq_len));
    return d;
  }
  if (config.kind != "text")
    return InvalidArgumentError("data field 'kind' is '" + config.kind +
                                "'; accepted: addition, text, tokens");
  if (config.text_path.empty())
    return InvalidArgumentError("data kind 'text' needs 'text_path' (a UTF-8 file)");
  // Held whole in memory: bounded, so /dev/zero or a huge sparse file is refused, not read.
  TZ_ASSIGN_OR_RETURN(d->text_, ReadFileBounded(config.text_path, kMaxTextBytes, "text file"));
  const int64_t bad = FirstInvalidUtf8(d->text_);
  if (bad >= 0)
    return InvalidArgumentError("'" + config.text_path + "' is not UTF-8 text (invalid byte at " +
                                "offset " + std::to_string(bad) + ")");
  const uint64_t need = 10 * (static_cast<uint64_t>(seq_len) + 2);
  if (d->text_.size() < need)
    return InvalidArgumentError("'" + config.text_path + "' has " +
                                std::to_string(d->text_.size()) + " bytes; at least " +
                                std::to_string(need) + " are needed for seq_len " +
                                std::to_string(seq_len) + " (a window per split)");
  return d;
}

void Dataset::AdditionRow(bool validation, uint64_t key, int32_t* tokens, int32_t* targets,
                          float* mask) const {
  uint64_t limit = 1;
  for (int i = 0; i < cfg_.digits; ++i) limit *= 10;
  uint64_t a = 0, b = 0;
  for (uint64_t attempt = 0;; ++attempt) {
    const uint64_t r = Mix(key ^ Mix(attempt));
    a = r % limit;
    b = Mix(r) % limit;
    if (IsValidationPair(a, b) == validation) break;
  }
  auto digits = [&](uint64_t v, int width) {
    std::string d = std::to_string(v);
    if (cfg_.pad_operands && static_cast<int>(d.size()) < width)
      d.insert(0, static_cast<size_t>(width) - d.size(), '0');
    return d;
  };
  std::string sum = digits(a + b, cfg_.digits + 1);
  if (cfg_.reverse_answer) std::reverse(sum.begin(), sum.end());
  const std::string s = digits(a, cfg_.digits) + "+" + digits(b, cfg_.digits) + "=" + sum + "\n";
  const size_t eq = s.find('=');
  for (int t = 0; t < seq_len_; ++t) {
    const size_t i = static_cast<size_t>(t);
    tokens[t] = i < s.size() ? static_cast<unsigned char>(s[i]) : '\n';
    targets[t] = i + 1 < s.size() ? static_cast<unsigned char>(s[i + 1]) : '\n';
    mask[t] = (i >= eq && i + 1 < s.size()) ? 1.0f : 0.0f;
  }
}

Batch Dataset::Get(bool validation, uint64_t index, int batch_size) const {
  StatusOr<Batch> b = Fetch(validation, index, batch_size);
  return b.ok() ? std::move(b).value() : Batch{};
}

StatusOr<Batch> Dataset::Fetch(bool validation, uint64_t index, int batch_size) const {
  Batch b;
  b.batch = batch_size;
  b.seq = seq_len_;
  const size_t n = static_cast<size_t>(batch_size) * static_cast<size_t>(seq_len_);
  b.tokens.resize(n);
  b.targets.resize(n);
  b.mask.resize(n);
  for (int r = 0; r < batch_size; ++r) {
    const uint64_t key =
        Mix(Mix(cfg_.seed * 2 + (validation ? 1 : 0)) ^ Mix(index) * 31 ^ static_cast<uint64_t>(r));
    const size_t o = static_cast<size_t>(r) * static_cast<size_t>(seq_len_);
    if (cfg_.kind == "addition") {
      AdditionRow(validation, key, &b.tokens[o], &b.targets[o], &b.mask[o]);
      continue;
    }
    if (tokens_) {
      TZ_RETURN_IF_ERROR(tokens_->Window(validation, key, seq_len_, &b.tokens[o], &b.targets[o]));
      std::fill(b.mask.begin() + static_cast<std::ptrdiff_t>(o),
                b.mask.begin() + static_cast<std::ptrdiff_t>(o) + seq_len_, 1.0f);
      continue;
    }
    const uint64_t split = text_.size() * 9 / 10;
    const uint64_t begin = validation ? split : 0;
    const uint64_t end = validation ? text_.size() : split;
    const uint64_t span = end - begin - static_cast<uint64_t>(seq_len_) - 1;
    const uint64_t start = begin + key % (span + 1);
    for (int t = 0; t < seq_len_; ++t) {
      b.tokens[o + static_cast<size_t>(t)] =
          static_cast<unsigned char>(text_[start + static_cast<uint64_t>(t)]);
      b.targets[o + static_cast<size_t>(t)] =
          static_cast<unsigned char>(text_[start + static_cast<uint64_t>(t) + 1]);
      b.mask[o + static_cast<size_t>(t)] = 1.0f;
    }
  }
  return b;
}

double Dataset::Accuracy(const Batch& batch, const std::vector<int32_t>& predictions) const {
  if (!has_accuracy() || batch.batch == 0) return 0;
  int right = 0;
  for (int r = 0; r < batch.batch; ++r) {
    bool ok = true;
    for (int t = 0; t < batch.seq; ++t) {
      const size_t i =
          static_cast<size_t>(r) * static_cast<size_t>(batch.seq) + static_cast<size_t>(t);
      if (batch.mask[i] > 0 && predictions[i] != batch.targets[i]) ok = false;
    }
    right += ok;
  }
  return static_cast<double>(right) / batch.batch;
}

uint64_t Dataset::Fingerprint() const {
  if (tokens_) return tokens_->Fingerprint();
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const std::string& s) {
    for (const char c : s) {
      h ^= static_cast<uint8_t>(c);
      h *= 1099511628211ull;
    }
  };
  mix(cfg_.kind + "/" + std::to_string(cfg_.digits) + "/" + std::to_string(cfg_.reverse_answer) +
      "/" + std::to_string(cfg_.pad_operands) + "/" + std::to_string(text_.size()));
  const size_t mib = size_t{1} << 20;
  mix(text_.substr(0, mib));
  if (text_.size() > mib) mix(text_.substr(text_.size() - mib));
  return h;
}

std::string Dataset::Describe() const {
  if (cfg_.kind == "addition")
    return "synthetic addition, operands below 10^" + std::to_string(cfg_.digits) +
           ", exact-match accuracy";
  if (tokens_) return tokens_->Describe();
  return "text '" + cfg_.text_path + "' (" + std::to_string(text_.size()) + " bytes, byte-level)";
}

}  // namespace tierzero::gpt
