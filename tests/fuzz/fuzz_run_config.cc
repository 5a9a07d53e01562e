// Fuzz target: `tierzero train --config FILE` (ParseRunConfig). Properties: no crash or
// exception on any input; a config that parses writes back (RunConfigToJson, the config.json
// beside every checkpoint) to JSON that parses again to the same config.
#include <string>

#include "fuzz_common.h"
#include "train.h"

using namespace tierzero;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(fuzz::AsText(data, size));
  auto cfg = app::ParseRunConfig(text, app::DefaultRunConfig());
  if (!cfg.ok()) {
    FUZZ_CHECK(!cfg.status().message().empty(), "an error without a message");
    return 0;
  }
  const std::string written = app::RunConfigToJson(*cfg);
  auto again = app::ParseRunConfig(written, app::DefaultRunConfig());
  FUZZ_CHECK(again.ok(), "the written config does not load: %s\n%s",
             again.status().ToString().c_str(), written.c_str());
  FUZZ_CHECK(app::RunConfigToJson(*again) == written, "the config changed on a round trip:\n%s",
             written.c_str());
  return 0;
}
