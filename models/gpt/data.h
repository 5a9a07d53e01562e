// Training data for the GPT: a built-in synthetic task and byte-level text (models/gpt).
//
// - "addition" (the default, no download): rows "a+b=c\n" with a and b uniform below
//   10^digits, one problem per row, padded with '\n' (with pad_operands, every number has its
//   full width: "07+45=052\n"). The loss covers the answer digits and the
//   final newline only. A problem belongs to the validation split when a hash of (a, b) says so
//   (10%), so validation problems are never trained on. Scored by exact match: a row is right
//   when every answer position's argmax is the target, which is exactly when greedy decoding
//   would produce the whole answer.
// - "text": any UTF-8 file (checked), byte-level (vocabulary 256); the first 90% trains, the last
//   10% validates; rows are windows at pseudo-random offsets; every position counts.
// - "tokens": files of token ids from any tokenizer (gpt/token_data.h: llm.c shards or raw
//   uint16), split as Note [Token splits] says; rows are windows at pseudo-random offsets.
//
// Batches are pure functions of (split, index): batch k of training is the same in every run
// with the same seed, which is what makes resumed runs repeat an uninterrupted run exactly.
//
// Thread-safety: const methods may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpt/gpt.h"
#include "gpt/token_data.h"

namespace tierzero::gpt {

struct DataConfig {
  std::string kind = "addition";  // "addition", "text" or "tokens"
  std::string text_path;          // kind "text": the file
  std::string token_path;         // kind "tokens": a file or a glob of shards
  int digits = 3;                 // kind "addition": operands below 10^digits (1..9)
  bool reverse_answer = true;     // kind "addition": the sum's digits least significant first
  // kind "addition": operands written with `digits` digits and the sum with digits + 1, zeros in
  // front ("07+45=052", reversed "250"), so every digit sits at the same position in every row.
  bool pad_operands = false;
  uint64_t seed = 1;
};

// The largest text file a text dataset reads: it is held whole in memory, so an endless device
// or a huge sparse file is refused (a byte-level model on more text than this is not what the
// text task is for).
inline constexpr uint64_t kMaxTextBytes = uint64_t{1} << 30;

class Dataset {
 public:
  // InvalidArgument naming the field (unknown kind, digits out of range, rows that would not fit
  // seq_len); NotFound for a missing file; InvalidArgument for a file that is not UTF-8 (with the
  // byte offset) or too short for one row per split.
  // `vocab`: the model's vocabulary (token files are checked against it).
  static StatusOr<std::unique_ptr<Dataset>> Create(const DataConfig& config, int seq_len,
                                                   int vocab = 256);
  ~Dataset();

  // Batch `index` of a split. Token files can fail to read (DataLoss: changed under the run).
  StatusOr<Batch> Fetch(bool validation, uint64_t index, int batch_size) const;
  // Fetch for data that cannot fail to read (addition, text); a failed read of token files gives
  // an empty batch (0 rows), which the model refuses.
  Batch Get(bool validation, uint64_t index, int batch_size) const;
  // Exact-match accuracy of a batch (addition only; 0 for text).
  double Accuracy(const Batch& batch, const std::vector<int32_t>& predictions) const;
  bool has_accuracy() const { return cfg_.kind == "addition"; }
  // Tokens the task needs per row (addition: 3 digits + 3).
  static int RowTokens(const DataConfig& config);
  std::string Describe() const;
  // A hash of what the dataset reads (the task's settings; the text's size and its first and
  // last MiB; the token files' sizes and ends): ranks started on different data under one path
  // (each machine its own copy) differ here.
  uint64_t Fingerprint() const;
  // Kind "tokens": the files (for `tierzero eval`'s consecutive windows); else null.
  const TokenShards* token_shards() const { return tokens_.get(); }

 private:
  Dataset(const DataConfig& c, int seq_len) : cfg_(c), seq_len_(seq_len) {}
  void AdditionRow(bool validation, uint64_t key, int32_t* tokens, int32_t* targets,
                   float* mask) const;
  DataConfig cfg_;
  int seq_len_;
  std::string text_;                     // kind text
  std::unique_ptr<TokenShards> tokens_;  // kind tokens
};

}  // namespace tierzero::gpt
