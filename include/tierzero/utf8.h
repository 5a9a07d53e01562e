// UTF-8 validation (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF), the
// rule JSON writers enforce: a string that passes can be written into a config or report.
//
// Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <string_view>

namespace tierzero {

// The offset of the first byte that breaks UTF-8, or -1 when all of `s` is valid.
int64_t FirstInvalidUtf8(std::string_view s);

}  // namespace tierzero
