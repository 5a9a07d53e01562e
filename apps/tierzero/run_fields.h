// The run config's fields by section (run_config.cc), for the flags that set them
// (run_flags.cc): each field sets itself from JSON, checking its range, and reads back as JSON.
#pragma once

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "train.h"

namespace tierzero::app {

struct Field {
  std::function<Status(const nlohmann::json&)> set;
  std::function<nlohmann::json()> get;
};
using Section = std::map<std::string, Field>;

// Every field of `c`, by section and name, pointing into `c`.
std::map<std::string, Section> Fields(RunConfig& c);

}  // namespace tierzero::app
