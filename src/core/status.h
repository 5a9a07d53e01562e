// Status lives in the public header so a trainer sees the same type; this header lets modules
// include it as "core/status.h" with everything else from core.
#pragma once

#include "tierzero/status.h"

// The library's own short spellings of the exported TZ_ macros.
#define RETURN_IF_ERROR(expr) TZ_RETURN_IF_ERROR(expr)
#define ASSIGN_OR_RETURN(lhs, expr) TZ_ASSIGN_OR_RETURN(lhs, expr)
