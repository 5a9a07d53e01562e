#include "core/bytes.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace tierzero {
namespace {

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

std::string TrimZeros(std::string s) {
  if (s.find('.') == std::string::npos) return s;
  while (!s.empty() && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

}  // namespace

StatusOr<uint64_t> ParseByteSize(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return InvalidArgumentError("invalid byte size '" + std::string(text) + "': " +
                                std::string(why) + " (examples: 4096, 512MiB, 2GiB, 1.5GB, 64K)");
  };
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  if (s.empty()) return bad("empty");

  // Digits with at most one '.', at least one digit.
  size_t i = 0;
  uint64_t whole = 0;
  bool any_digit = false;
  bool overflow = false;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
    uint64_t d = static_cast<uint64_t>(s[i] - '0');
    if (whole > (UINT64_MAX - d) / 10) overflow = true;
    whole = whole * 10 + d;
    any_digit = true;
    ++i;
  }
  // Fraction as numerator / 10^k, at most 18 digits kept exact.
  uint64_t frac_num = 0, frac_den = 1;
  bool dropped_nonzero = false;  // fraction digits beyond what we keep exactly
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
      if (frac_den < 1000000000000000000ull) {
        frac_num = frac_num * 10 + static_cast<uint64_t>(s[i] - '0');
        frac_den *= 10;
      } else if (s[i] != '0') {
        dropped_nonzero = true;
      }
      any_digit = true;
      ++i;
    }
  }
  if (!any_digit) {
    return bad(s.front() == '-' ? "negative sizes are not allowed" : "no number");
  }
  if (overflow) return bad("too large");
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  std::string_view unit = s.substr(i);

  struct Unit {
    std::string_view name;
    uint64_t factor;
  };
  static constexpr Unit kUnits[] = {
      {"", 1},
      {"B", 1},
      {"KB", 1000},
      {"MB", 1000000},
      {"GB", 1000000000},
      {"TB", 1000000000000},
      {"PB", 1000000000000000},
      {"EB", 1000000000000000000},
      {"KiB", kKiB},
      {"MiB", kMiB},
      {"GiB", kGiB},
      {"TiB", kTiB},
      {"PiB", 1024 * kTiB},
      {"EiB", 1024 * 1024 * kTiB},
      {"K", kKiB},
      {"M", kMiB},
      {"G", kGiB},
      {"T", kTiB},
      {"P", 1024 * kTiB},
      {"E", 1024 * 1024 * kTiB},
  };
  uint64_t factor = 0;
  for (const Unit& u : kUnits) {
    if (EqualsIgnoreCase(unit, u.name)) {
      factor = u.factor;
      break;
    }
  }
  if (factor == 0) return bad("unknown unit '" + std::string(unit) + "'");
  if (dropped_nonzero) return bad("not a whole number of bytes");

  if (whole != 0 && factor > UINT64_MAX / whole) return bad("too large");
  uint64_t bytes = whole * factor;
  if (frac_num != 0) {
    // factor * frac_num / frac_den must be a whole number of bytes.
    unsigned __int128 num = static_cast<unsigned __int128>(factor) * frac_num;
    if (num % frac_den != 0) return bad("not a whole number of bytes");
    unsigned __int128 extra = num / frac_den;
    if (extra > UINT64_MAX - bytes) return bad("too large");
    bytes += static_cast<uint64_t>(extra);
  }
  return bytes;
}

namespace {

// `v` with two decimals, trailing zeros trimmed, a decimal point whatever the process's locale
// (snprintf wrote "1,50 KiB" in a comma-decimal locale, which ParseByteSize refuses: hunt 48).
std::string Fixed2(double v) {
  char buf[400];  // (1e300 B/s is 1e288 TB/s: 289 digits)
  const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed, 2);
  if (r.ec != std::errc()) return "?";
  return TrimZeros(std::string(buf, r.ptr));
}

}  // namespace

std::string FormatBytes(uint64_t bytes) {
  static constexpr const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  double v = static_cast<double>(bytes);
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0) return std::to_string(bytes) + " B";
  // Rounded to two decimals before its unit is final: 1048575 bytes is "1 MiB", not "1024 KiB".
  if (std::round(v * 100) / 100 >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  // The most bytes there are, 2^64 - 1, rounds to "16 EiB", which is 2^64: not a size any parse
  // takes. The top unit is cut, not rounded, to stay below it ("15.99 EiB").
  // (In integers: as a double, 2^64 - 1 is already 2^64.)
  if (u == 6 && bytes >= (uint64_t{1} << 60)) {  // (not a PiB figure rounded up to 1 EiB)
    const uint64_t whole = bytes >> 60;
    const auto hundredths = static_cast<uint64_t>(
        (static_cast<unsigned __int128>(bytes & ((uint64_t{1} << 60) - 1)) * 100) >> 60);
    return Fixed2(static_cast<double>(whole) + static_cast<double>(hundredths) / 100) + " " +
           kNames[u];
  }
  return Fixed2(v) + " " + kNames[u];
}

std::string FormatWholeMiB(uint64_t bytes) {
  return std::to_string(bytes / kMiB + (bytes % kMiB != 0)) + "MiB";
}

std::string FormatBandwidth(double bps) {
  static constexpr const char* kNames[] = {"B/s", "KB/s", "MB/s", "GB/s", "TB/s"};
  int u = 0;
  while (std::fabs(bps) >= 1000.0 && u < 4) {
    bps /= 1000.0;
    ++u;
  }
  if (!std::isfinite(bps)) return std::string(std::isnan(bps) ? "nan " : "inf ") + kNames[u];
  return Fixed2(bps) + " " + kNames[u];
}

}  // namespace tierzero
