// Tokenized data files for the GPT (`--data PATH`, data kind "tokens"; docs/data.md): a file or a
// glob of shards in llm.c's format (a header of 256 int32: magic 20240520, version 1, the token
// count; then that many uint16 tokens; or Llama 3's: magic 20240801, version 7, uint32 tokens:
// Note [Token widths] in token_data.cc) or raw uint16 tokens (nanoGPT's `.bin`), each opened once
// and read window by window (pread), never whole into memory. Not mapped: a file truncated or
// rewritten while a run reads it (regenerating train.bin in place) would end a mapping's reader
// with SIGBUS; a read says DataLoss instead.
//
// Note [Token splits]: with several shards the last (in sorted order) validates and the others
// train, as llm.c's `*_val_*` shard does; one file trains on its first 90% and validates on its
// last 10%. Every token id is checked against the model's vocabulary (a tokenizer's ids beyond
// model.vocab would index past the embedding), with the file and position of the first bad one
// named: the files' first 4 GiB when they open (seconds), and every window as it is read, so a
// bad id further on ends the run between two steps with its steps saved (Note [A checkpoint
// after a data error]) instead of the set-up reading a terabyte for many minutes.
//
// Thread-safety: const methods may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tierzero/status.h"

namespace tierzero::gpt {

class TokenShards {
 public:
  // `pattern`: a file, or a glob (`data/fineweb_train_*.bin`) matching one or more; `vocab`: the
  // model's vocabulary. NotFound when nothing matches; InvalidArgument naming the file for one
  // that is not a regular file, not a shard (a bad header, a size that disagrees with its count)
  // nor raw uint16 tokens (an odd size; 32-bit ids, text, .npy or Arrow written raw), holds an id
  // >= vocab, or a split shorter than `min_tokens` (0: the splits are not used, only the evaluation
  // windows). `scan_at_open`: the bytes whose ids are checked here (every window's are checked as
  // it is read).
  // `vocab_fixed`: the model's vocabulary cannot change (an evaluation of a trained model): an id
  // past it is said as data of another tokenizer, not as a --vocab to give.
  static StatusOr<std::unique_ptr<TokenShards>> Open(const std::string& pattern, int vocab,
                                                     uint64_t min_tokens,
                                                     uint64_t scan_at_open = uint64_t{4} << 30,
                                                     bool vocab_fixed = false);
  ~TokenShards();
  TokenShards(const TokenShards&) = delete;
  TokenShards& operator=(const TokenShards&) = delete;

  // A window of seq + 1 consecutive tokens of the split, at a start that is a function of `key`:
  // tokens[t] = window[t], targets[t] = window[t + 1].
  // DataLoss when the file changed under the run (shorter than when it opened, or written since:
  // Note [A token file written under the run]).
  Status Window(bool validation, uint64_t key, int seq, int32_t* tokens, int32_t* targets) const;

  // Evaluation windows (`tierzero eval`): each file a stream of its own, window i of a file
  // starting at its token i x seq and holding seq + 1 tokens (a partial last window is dropped);
  // the files' windows in order. `validation`: of the validation split alone (Note [Token
  // splits]: the last file, or one file's last 10%, a stream of its own), else of every file.
  uint64_t NumEvalWindows(int seq, bool validation = false) const;
  Status EvalWindow(uint64_t index, int seq, int32_t* tokens, int32_t* targets,
                    bool validation = false) const;

  uint64_t tokens() const;  // in every file
  uint64_t split_tokens(bool validation) const;
  size_t files() const { return files_.size(); }
  // The files, their format and tokens: split into train and validate (`split`, what a
  // training run reads), or all of them (what an evaluation scores).
  std::string Describe(bool split = true) const;
  // The validation split in words: "the last file, 'PATH' (N tokens)" or "the last 10% of 'PATH'
  // (N tokens)".
  std::string DescribeValidation() const;
  // A hash of the files' sizes and of their first and last 64 KiB: ranks comparing theirs find
  // one path naming different data on two machines (Dataset::Fingerprint). Taken once, at Open:
  // what the run reads, which a checkpoint records (a file grown or cut under the run afterwards
  // is not what it read).
  uint64_t Fingerprint() const { return fingerprint_; }

 private:
  struct File {
    std::string path;
    int fd = -1;
    uint64_t offset = 0;  // of token 0 (the header's size for a shard)
    uint64_t count = 0;
    uint64_t bytes = 0;  // its size at Open
    // Its identity and last modification at Open (Note [A token file written under the run]).
    uint64_t dev = 0, ino = 0;
    int64_t mtime_ns = 0;
    bool shard = false;  // llm.c's header (else raw uint16)
    uint64_t width = 2;  // bytes a token: 4 in Llama 3's shards (Note [Token widths])
  };
  // InvalidArgument for a raw file whose start reads as 32-bit ids (Note [Token widths]), or as
  // text, NumPy's .npy or Arrow's (Note [Files that are not tokens]).
  static Status RefuseNotRawTokens(const File& f, int vocab);
  // Whether `f`'s ids need checking against the vocabulary (16-bit ones cannot pass 65535).
  bool Checked(const File& f) const { return f.width == 4 || vocab_ < 65536; }
  uint64_t ComputeFingerprint() const;
  uint64_t fingerprint_ = 0;
  // Tokens [first, first + n) of file `f`, widened to int32 into `out`.
  Status Read(const File& f, uint64_t first, uint64_t n, int32_t* out) const;
  // InvalidArgument naming the first of `ids` (tokens [first, first + n) of `f`) outside the
  // vocabulary, and what to do (`at_open`: before a step, when the vocabulary may still change).
  Status CheckIds(const File& f, uint64_t first, uint64_t n, const int32_t* ids,
                  bool at_open) const;
  Status ReadWindow(const File& f, uint64_t first, int seq, int32_t* tokens,
                    int32_t* targets) const;
  struct Span {  // tokens [begin, end) of a file
    size_t file;
    uint64_t begin, end;
  };
  TokenShards() = default;
  const std::vector<Span>& split(bool validation) const { return validation ? val_ : train_; }
  const std::vector<Span>& EvalSpans(bool validation) const { return validation ? val_ : all_; }

  std::string pattern_;
  int vocab_ = 0;
  bool vocab_fixed_ = false;
  std::vector<File> files_;
  std::vector<Span> train_, val_, all_;  // all_: each file whole (the evaluation's windows)
};

}  // namespace tierzero::gpt
