// Fuzz target: `tierzero train` command-line values (ApplyFlags). The input is the argument list,
// one argument per line. Properties: no crash or exception; a config the flags produce that
// passes ValidateRunConfig (as `train` requires) writes back to JSON that parses to the same
// config.
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "train.h"

using namespace tierzero;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args;
  std::string cur;
  for (char c : fuzz::AsText(data, size)) {
    if (c == '\n') {
      args.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) args.push_back(cur);
  app::RunConfig cfg = app::DefaultRunConfig();
  std::string config_path;
  if (!app::ApplyFlags(args, cfg, &config_path).ok() || !app::ValidateRunConfig(cfg).ok()) return 0;
  const std::string written = app::RunConfigToJson(cfg);
  auto again = app::ParseRunConfig(written, app::DefaultRunConfig());
  FUZZ_CHECK(again.ok(), "flags made a config that does not load: %s\n%s",
             again.status().ToString().c_str(), written.c_str());
  FUZZ_CHECK(app::RunConfigToJson(*again) == written, "the config changed on a round trip:\n%s",
             written.c_str());
  return 0;
}
