// Status lives in the public header so a trainer sees the same type; this header lets modules
// include it as "core/status.h" with everything else from core.
#pragma once

#include "tierzero/status.h"
