// Typed tunables with environment overrides, defined where they are used (NCCL_PARAM style):
//
//   // In a .cc file, at namespace scope:
//   TZ_TUNABLE(int64_t, kNvmeQueueDepth, "TZ_NVME_QUEUE_DEPTH", 32,
//              "io_uring submission queue depth for the NVMe store");
//   ... int64_t depth = kNvmeQueueDepth.Get();
//
// Get() returns, in order of precedence: a value set with Set() (tests, the CLI), the
// environment variable parsed as T, or the default. An environment value that does not parse
// is reported once in the log and ignored; ValidateTunables() reports every such value as one
// Status so a program can refuse to start on a typo. Supported T: bool, int64_t, double,
// std::string, and byte sizes through ByteSize ("512MiB").
//
// Thread-safety: Get/Set/Reset are safe from any thread. Tunables are process-wide by nature
// (like environment variables); everything else in tierzero is passed explicitly.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/mutex.h"
#include "core/status.h"
#include "tierzero/tunables.h"

namespace tierzero {

// A byte count parsed from a human string ("2GiB") by ParseByteSize.
struct ByteSize {
  uint64_t bytes = 0;
  friend bool operator==(ByteSize a, ByteSize b) { return a.bytes == b.bytes; }
};

class TunableBase {
 public:
  TunableBase(const char* env_name, const char* help);
  TunableBase(const TunableBase&) = delete;
  TunableBase& operator=(const TunableBase&) = delete;
  virtual ~TunableBase() = default;

  const char* env_name() const { return env_name_; }
  const char* help() const { return help_; }
  // The effective value as text, and the default as text.
  virtual std::string ValueString() const = 0;
  virtual std::string DefaultString() const = 0;
  // Checks that the environment value, if any, parses.
  virtual Status ValidateEnv() const = 0;

 protected:
  // The environment variable's value, or nullopt when unset or empty.
  std::optional<std::string> EnvValue() const;

 private:
  const char* env_name_;
  const char* help_;
};

// Every tunable linked into the process, in registration order.
std::vector<const TunableBase*> AllTunables();
// ListTunables and ValidateTunables are public (tierzero/tunables.h).

namespace internal {
StatusOr<bool> ParseTunable(std::string_view text, bool*);
StatusOr<int64_t> ParseTunable(std::string_view text, int64_t*);
StatusOr<double> ParseTunable(std::string_view text, double*);
StatusOr<std::string> ParseTunable(std::string_view text, std::string*);
StatusOr<ByteSize> ParseTunable(std::string_view text, ByteSize*);
std::string TunableToString(bool v);
std::string TunableToString(int64_t v);
std::string TunableToString(double v);
std::string TunableToString(const std::string& v);
std::string TunableToString(ByteSize v);
void WarnBadTunable(const char* env_name, const Status& status);
}  // namespace internal

template <typename T>
class Tunable final : public TunableBase {
 public:
  Tunable(const char* env_name, T default_value, const char* help)
      : TunableBase(env_name, help), default_(std::move(default_value)) {}
  // A number accepted only within [lo, hi] (a timeout of -1 s, or of 1e20 s whose milliseconds
  // overflow): outside it the environment's value is refused as a malformed one is.
  Tunable(const char* env_name, T default_value, const char* help, T lo, T hi)
      : TunableBase(env_name, help), default_(std::move(default_value)), range_({lo, hi}) {}
  // A string accepted only as one of `choices` (a typo of "off" is refused, not taken as the
  // default): outside them the environment's value is refused as a malformed one is.
  Tunable(const char* env_name, T default_value, const char* help, std::vector<T> choices)
      : TunableBase(env_name, help),
        default_(std::move(default_value)),
        choices_(std::move(choices)) {}

  T Get() const {
    MutexLock lock(mu_);
    if (override_) return *override_;
    if (!env_loaded_) {
      env_loaded_ = true;
      if (auto text = EnvValue()) {
        auto parsed = InRange(internal::ParseTunable(*text, static_cast<T*>(nullptr)));
        if (parsed.ok()) {
          env_ = *parsed;
        } else {
          internal::WarnBadTunable(env_name(), parsed.status());
        }
      }
    }
    return env_ ? *env_ : default_;
  }
  // Overrides the environment and the default until Reset().
  void Set(T value) {
    MutexLock lock(mu_);
    override_ = std::move(value);
    generation_.fetch_add(1, std::memory_order_release);
  }
  void Reset() {
    MutexLock lock(mu_);
    override_.reset();
    generation_.fetch_add(1, std::memory_order_release);
  }
  // Changes with every Set/Reset: hot paths cache a value derived from Get() and refresh it
  // when this moves, instead of taking the mutex each time.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  const T& default_value() const { return default_; }

  std::string ValueString() const override { return internal::TunableToString(Get()); }
  std::string DefaultString() const override { return internal::TunableToString(default_); }
  Status ValidateEnv() const override {
    if (auto text = EnvValue()) {
      auto parsed = InRange(internal::ParseTunable(*text, static_cast<T*>(nullptr)));
      if (!parsed.ok()) return std::move(parsed).status().WithContext(env_name());
    }
    return Status::OK();
  }

 private:
  StatusOr<T> InRange(StatusOr<T> v) const {
    if constexpr (std::is_arithmetic_v<T>) {
      if (v.ok() && range_ && !(*v >= range_->first && *v <= range_->second))
        return InvalidArgumentError("is " + internal::TunableToString(*v) +
                                    "; accepted: " + internal::TunableToString(range_->first) +
                                    " to " + internal::TunableToString(range_->second));
    }
    if constexpr (std::is_same_v<T, std::string>) {
      if (v.ok() && !choices_.empty() &&
          std::find(choices_.begin(), choices_.end(), *v) == choices_.end()) {
        std::string accepted;
        for (const std::string& c : choices_) accepted += (accepted.empty() ? "" : ", ") + c;
        return InvalidArgumentError("is \"" + *v + "\"; accepted: " + accepted);
      }
    }
    return v;
  }

  const T default_;
  const std::optional<std::pair<T, T>> range_;
  const std::vector<T> choices_;
  mutable Mutex mu_;
  mutable bool env_loaded_ TZ_GUARDED_BY(mu_) = false;
  mutable std::optional<T> env_ TZ_GUARDED_BY(mu_);
  std::optional<T> override_ TZ_GUARDED_BY(mu_);
  std::atomic<uint64_t> generation_{1};
};

// A tunable of seconds as a duration: the deadlines of waits.
inline std::chrono::milliseconds TunableSeconds(const Tunable<double>& seconds) {
  // (Clamped as well: a Set() in a test is not range-checked.)
  const double s = seconds.Get();
  return std::chrono::milliseconds(
      static_cast<int64_t>((s >= 0 ? (s < 1e9 ? s : 1e9) : 0.0) * 1e3));
}

// Sets a tunable for the lifetime of a scope (tests).
template <typename T>
class ScopedTunable {
 public:
  ScopedTunable(Tunable<T>& tunable, T value) : tunable_(tunable) { tunable_.Set(value); }
  ~ScopedTunable() { tunable_.Reset(); }
  ScopedTunable(const ScopedTunable&) = delete;
  ScopedTunable& operator=(const ScopedTunable&) = delete;

 private:
  Tunable<T>& tunable_;
};

}  // namespace tierzero

#define TZ_TUNABLE(type, var, env_name, default_value, help) \
  ::tierzero::Tunable<type> var(env_name, default_value, help)
#define TZ_TUNABLE_RANGE(type, var, env_name, default_value, help, lo, hi) \
  ::tierzero::Tunable<type> var(env_name, default_value, help, lo, hi)
#define TZ_TUNABLE_CHOICE(var, env_name, default_value, help, ...) \
  ::tierzero::Tunable<std::string> var(env_name, default_value, help, {__VA_ARGS__})
