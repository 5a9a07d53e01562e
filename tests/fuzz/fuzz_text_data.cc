// Fuzz target: a text dataset file (data.kind "text"). Properties: no crash; a file that is
// accepted yields batches of byte tokens whose targets are the next bytes.
#include <string>

#include "fuzz_common.h"
#include "gpt/data.h"

using namespace tierzero;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::ScratchDir() + "/input.txt";
  fuzz::WriteFile(path, data, size);
  gpt::DataConfig cfg;
  cfg.kind = "text";
  cfg.text_path = path;
  constexpr int kSeq = 8;
  auto ds = gpt::Dataset::Create(cfg, kSeq);
  if (!ds.ok()) return 0;
  for (bool validation : {false, true}) {
    for (uint64_t k = 0; k < 3; ++k) {
      const gpt::Batch b = (*ds)->Get(validation, k, 2);
      FUZZ_CHECK(b.tokens.size() == 2 * kSeq && b.targets.size() == 2 * kSeq,
                 "a batch of the wrong size");
      for (size_t i = 0; i < b.tokens.size(); ++i) {
        FUZZ_CHECK(b.tokens[i] >= 0 && b.tokens[i] < 256, "token %d", b.tokens[i]);
        FUZZ_CHECK(b.targets[i] >= 0 && b.targets[i] < 256, "target %d", b.targets[i]);
        if (i % kSeq + 1 < kSeq)
          FUZZ_CHECK(b.targets[i] == b.tokens[i + 1], "a target is not the next byte");
      }
    }
  }
  return 0;
}
