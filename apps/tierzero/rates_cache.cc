// rates_cache.h: this machine's rates cache for `tierzero plan`.
#include "rates_cache.h"

#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "tierzero/files.h"
#include "tierzero/report.h"
#include "train.h"

namespace tierzero::app {
namespace fs = std::filesystem;

namespace {

// HOME, or where it is unset (a service, `env -i`) the user's home from the password database,
// as a shell finds it: not a file in whatever directory the command ran in. "" when neither.
std::string HomeDir() {
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') return h;
  if (const passwd* pw = ::getpwuid(::getuid());
      pw != nullptr && pw->pw_dir != nullptr && *pw->pw_dir != '\0')
    return pw->pw_dir;
  return "";
}

}  // namespace

// rates_cache.h
std::string RatesCachePath(bool gpu) {
  if (const char* f = std::getenv("TZ_RATES_FILE"); f != nullptr && *f != '\0') return f;
  const std::string name = gpu ? "rates-gpu.json" : "rates.json";
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0')
    return std::string(x) + "/tierzero/" + name;
  if (const std::string home = HomeDir(); !home.empty()) return home + "/.cache/tierzero/" + name;
  return ".tierzero-" + name;
}

// rates_cache.h
std::optional<MachineRates> CachedRates(const std::string& cache) {
  auto text = ReadTextFile(cache, "rates file");
  if (!text.ok()) return std::nullopt;
  auto r = MachineRatesFromJson(*text);
  if (r.ok()) return *r;
  std::printf("  (the cached rates in %s are unreadable: %s)\n", cache.c_str(),
              r.status().ToString().c_str());
  return std::nullopt;
}

namespace {

// Note [A rates cache is written over only when it is one]
// The cache's path can name a file that is not a cache: `--rates FILE --calibrate` (a rates file
// written by hand, docs/plan.md's H100 example), or a TZ_RATES_FILE with a typo, or naming a
// user's file. Writing over it lost that machine's figures, or the user's file. So a cache is
// written where there is no file yet, or over a rates file a calibration wrote (its name says
// so) for the same device, or over the communicator's alone; anything else is kept, and the plan
// says why its rates are not cached.
Status CacheWritable(const std::string& cache, const MachineRates& r) {
  struct stat st {};
  if (::lstat(cache.c_str(), &st) != 0) return Status::OK();
  // (Advice to remove it only for a regular file that is no cache of this build's: never a device,
  // a directory, or a file it merely could not read; hunt 41.)
  auto keep = [&](const std::string& why, bool removable = true) {
    return FailedPreconditionError(
        cache + " " + why + ", so it is not written over: " + (removable ? "remove it, or " : "") +
        "name the cache elsewhere (TZ_RATES_FILE)");
  };
  if (!S_ISREG(st.st_mode))
    return keep(std::string("is ") + FileKindName(st.st_mode), /*removable=*/false);
  auto text = ReadTextFile(cache, "rates file");
  if (!text.ok())
    return keep("cannot be read (" + std::string(text.status().message()) + ")",
                /*removable=*/false);
  auto old = MachineRatesFromJson(*text);
  if (!old.ok()) return keep("is not a rates file");
  if (old->name == kCachedComm || old->name == r.name) return Status::OK();
  if (old->name == kCachedCpu || old->name == kCachedGpu)
    return keep("holds the rates of " + old->name);
  return keep("is a rates file not written by a calibration (\"" + old->name + "\")");
}

}  // namespace

// rates_cache.h
void CacheRates(const std::string& cache, const MachineRates& r) {
  if (Status w = CacheWritable(cache, r); !w.ok()) {
    std::printf("  (the rates are not cached: %s)\n", std::string(w.message()).c_str());
    return;
  }
  std::error_code ec;
  // The cache's own directories are made (~/.cache/tierzero), inside a home or XDG_CACHE_HOME
  // that exists (HOME=/nonexistent, a service account's, makes nothing); a TZ_RATES_FILE's
  // directory is the user's to give, never made.
  const char* named = std::getenv("TZ_RATES_FILE");
  // Only the default cache's (a --rates FILE's is the user's too); under a HOME that exists (an
  // XDG_CACHE_HOME set is made, as the XDG base directory specification asks).
  const bool default_cache = (named == nullptr || *named == '\0') &&
                             (cache == RatesCachePath(false) || cache == RatesCachePath(true));
  if (default_cache) {
    const char* xdg = std::getenv("XDG_CACHE_HOME");
    const std::string home = HomeDir();
    if ((xdg == nullptr || *xdg == '\0') && !home.empty() && !fs::is_directory(home, ec)) {
      std::printf(
          "  (the rates are not cached: HOME %s is not a directory; TZ_RATES_FILE names a "
          "cache)\n",
          home.c_str());
      return;
    }
    // (Its own error when it cannot be made, an unwritable XDG_CACHE_HOME: the write below
    // would say only that the directory does not exist.)
    if (const fs::path parent = fs::path(cache).parent_path();
        !parent.empty() && (fs::create_directories(parent, ec), ec)) {
      std::printf("  (the rates are not cached: cannot make %s: %s; TZ_RATES_FILE names a cache)\n",
                  fs::path(cache).parent_path().c_str(), ec.message().c_str());
      return;
    }
  }
  if (Status s = WriteTextFile(cache, MachineRatesToJson(r)); !s.ok()) {
    std::printf("  (the rates are not cached: %s)\n", s.ToString().c_str());
  } else {
    std::printf("  rates cached in %s (--calibrate measures them again)\n", cache.c_str());
  }
}

}  // namespace tierzero::app
