// Fuzz target: a token file (data.kind "tokens", `--data`: llm.c's shards of 16- or 32-bit ids,
// raw uint16). Properties: no crash; a file that is accepted holds only ids inside the vocabulary
// in every window it gives, each window's targets are its tokens shifted by one, and the
// evaluation windows are the file's tokens in order.
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "gpt/token_data.h"

using namespace tierzero;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::ScratchDir() + "/input.bin";
  fuzz::WriteFile(path, data, size);
  // A vocabulary of 300 (16-bit ids checked) and one past 65536 (32-bit ids checked alone).
  for (const int vocab : {300, 70000}) {
    constexpr int kSeq = 4;
    auto s = gpt::TokenShards::Open(path, vocab, kSeq + 1, /*scan_at_open=*/64);
    if (!s.ok()) continue;
    FUZZ_CHECK((*s)->split_tokens(false) >= kSeq + 1 && (*s)->split_tokens(true) >= kSeq + 1,
               "a split shorter than a window");
    std::vector<int32_t> tok(kSeq), tgt(kSeq);
    for (const bool validation : {false, true}) {
      for (uint64_t key = 0; key < 4; ++key) {
        // (Past the 64 bytes checked at open an id is checked as it is read: an error then.)
        if (!(*s)->Window(validation, key * 7919, kSeq, tok.data(), tgt.data()).ok()) continue;
        for (int t = 0; t < kSeq; ++t) {
          FUZZ_CHECK(tok[t] >= 0 && tok[t] < vocab, "token %d of vocabulary %d", tok[t], vocab);
          FUZZ_CHECK(tgt[t] >= 0 && tgt[t] < vocab, "target %d of vocabulary %d", tgt[t], vocab);
          if (t + 1 < kSeq) FUZZ_CHECK(tgt[t] == tok[t + 1], "a target is not the next token");
        }
      }
    }
    const uint64_t windows = (*s)->NumEvalWindows(kSeq);
    std::vector<int32_t> prev_tgt;
    for (uint64_t w = 0; w < windows && w < 8; ++w) {
      if (!(*s)->EvalWindow(w, kSeq, tok.data(), tgt.data()).ok()) break;
      for (int t = 0; t + 1 < kSeq; ++t) FUZZ_CHECK(tgt[t] == tok[t + 1], "an eval target");
      // (Windows of one file follow each other: this one's first token is the last target.)
      if (!prev_tgt.empty() && (*s)->files() == 1)
        FUZZ_CHECK(prev_tgt.back() == tok[0], "evaluation windows are not consecutive");
      prev_tgt = tgt;
    }
  }
  return 0;
}
