// The library's tunables: settings read from environment variables (TZ_NVME_QUEUE_DEPTH,
// TZ_STAGING_TIMEOUT_S, ...) for what a config need not say (docs/config.md, "Tunables").
// `tierzero tunables` prints this list.
//
// Thread-safety: reentrant.
#pragma once

#include <string>
#include <vector>

#include "tierzero/status.h"

namespace tierzero {

struct TunableInfo {
  std::string name;           // the environment variable
  std::string value;          // the value in effect
  std::string default_value;  // the value when the variable is unset
  std::string help;
};

// Every tunable of the library, in registration order.
std::vector<TunableInfo> ListTunables();

// One InvalidArgument listing every environment value that does not parse (a program may refuse
// to start on a typo); OK otherwise. A bad value is otherwise logged once and ignored.
Status ValidateTunables();

}  // namespace tierzero
