#include "offload/tier.h"

namespace tierzero {

std::string_view TierName(Tier t) {
  switch (t) {
    case Tier::kDevice:
      return "device";
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      return "nvme";
  }
  return "?";
}

}  // namespace tierzero
