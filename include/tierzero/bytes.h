// Human byte sizes, as the engine's budgets and the CLI's flags take and print them: parsing
// ("512MiB", "2GiB", "1.5GB", "4096") and printing ("1.5 GiB", "1.25 GB/s").
//
// Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "tierzero/status.h"

namespace tierzero {

// Parses a byte size: a non-negative decimal number (an optional fraction), optional spaces,
// then an optional unit, case-insensitive: B; KB MB GB TB (powers of 1000); KiB MiB GiB TiB and
// the shorthands K M G T (powers of 1024). The result must be a whole number of bytes that fits
// in 64 bits. Errors are InvalidArgument and quote the input.
StatusOr<uint64_t> ParseByteSize(std::string_view text);

// Formats with binary units and at most two decimals, trailing zeros dropped: "0 B", "100 B",
// "1.5 KiB", "512 MiB", "2 GiB".
std::string FormatBytes(uint64_t bytes);
// A size as a flag takes it, in whole MiB rounded up so it is never short of `bytes`: "3776MiB".
std::string FormatWholeMiB(uint64_t bytes);
// The same for a rate: "1.25 GB/s" (decimal units, as bandwidths are usually quoted).
std::string FormatBandwidth(double bytes_per_second);

}  // namespace tierzero
