// Fuzz target: `tierzero train --config FILE` (ParseRunConfig). Properties: no crash or
// exception on any input; an accepted config names no key twice in an object and nests at most
// 64 levels (checked here independently, with nlohmann's parser callback rather than the SAX
// pass the parser uses: Note [Outside JSON parsed strictly]); a config that parses writes back
// (RunConfigToJson, the config.json beside every checkpoint) to JSON that parses again to the same
// config.
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "train.h"

using namespace tierzero;

namespace {

// Whether `text` (JSON with comments) names a key twice in one object or nests deeper than 64.
// Stops counting at the first problem; false for text that is not JSON.
bool DuplicateOrTooDeep(const std::string& text) {
  using json = nlohmann::json;
  std::vector<std::set<std::string>> objects;  // the keys of each open object (arrays: none)
  std::vector<bool> is_object;
  bool bad = false;
  const json::parser_callback_t cb = [&](int depth, json::parse_event_t event, json& parsed) {
    if (bad) return false;
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        is_object.push_back(event == json::parse_event_t::object_start);
        objects.emplace_back();
        if (depth + 1 > 64) bad = true;
        break;
      case json::parse_event_t::key:
        if (!objects.empty() && !objects.back().insert(parsed.get<std::string>()).second)
          bad = true;
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!objects.empty()) objects.pop_back();
        if (!is_object.empty()) is_object.pop_back();
        break;
      default:
        break;
    }
    return !bad;
  };
  try {
    const json ignored =
        json::parse(text, cb, /*allow_exceptions=*/false, /*ignore_comments=*/true);
    (void)ignored;
  } catch (...) {
  }
  return bad;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(fuzz::AsText(data, size));
  auto cfg = app::ParseRunConfig(text, app::DefaultRunConfig());
  if (!cfg.ok()) {
    FUZZ_CHECK(!cfg.status().message().empty(), "an error without a message");
    return 0;
  }
  FUZZ_CHECK(!DuplicateOrTooDeep(text),
             "a config with a key twice in an object, or nested deeper than 64, was accepted");
  const std::string written = app::RunConfigToJson(*cfg);
  auto again = app::ParseRunConfig(written, app::DefaultRunConfig());
  FUZZ_CHECK(again.ok(), "the written config does not load: %s\n%s",
             again.status().ToString().c_str(), written.c_str());
  FUZZ_CHECK(app::RunConfigToJson(*again) == written, "the config changed on a round trip:\n%s",
             written.c_str());
  return 0;
}
