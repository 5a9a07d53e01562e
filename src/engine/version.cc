#include "tierzero/engine.h"

namespace tierzero {

const char* Version() { return TZ_VERSION; }

}  // namespace tierzero
