// What the engine hands a trainer and takes back: parameter initializers, activation buffers
// (allocated on the device, counted in the chunk manager's budget) and parameter scopes.
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/bytes.h"
#include "core/logging.h"
#include "engine/engine_impl.h"

namespace tierzero {

// ---- Initializers
// ------------------------------------------------------------------

namespace {
uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
double Unit(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53; }
}  // namespace

Initializer InitNormal(float stddev, uint64_t seed) {
  return [stddev, seed](std::span<float> values) {
    // Box-Muller on pairs: elements 2j and 2j+1 share the uniform pair of counter j. Pairs are
    // independent, so fixed blocks of them run in parallel (a 2B-parameter model draws 2B
    // values at initialisation).
    const uint64_t key = SplitMix64(seed);
    const size_t n = values.size(), pairs = (n + 1) / 2;
    constexpr size_t kPairsPerBlock = size_t{1} << 15;
    tbb::parallel_for(size_t{0}, (pairs + kPairsPerBlock - 1) / kPairsPerBlock, [&](size_t blk) {
      const size_t end = std::min(pairs, (blk + 1) * kPairsPerBlock);
      for (size_t j = blk * kPairsPerBlock; j < end; ++j) {
        const double u1 = Unit(SplitMix64(key ^ (2 * j)));
        const double u2 = Unit(SplitMix64(key ^ (2 * j + 1) ^ 0xA5A5A5A5A5A5A5A5ull));
        const double r = std::sqrt(-2.0 * std::log(u1));
        const double angle = 2.0 * 3.14159265358979323846 * u2;
        values[2 * j] = static_cast<float>(stddev * r * std::cos(angle));
        if (2 * j + 1 < n) values[2 * j + 1] = static_cast<float>(stddev * r * std::sin(angle));
      }
    });
  };
}

Initializer InitConstant(float value) {
  return [value](std::span<float> values) { std::fill(values.begin(), values.end(), value); };
}

// ---- Activation buffers
// -------------------------------------------------------------------------

ActivationBuffer::ActivationBuffer(ActivationBuffer&& o) noexcept
    : owner_(o.owner_), alive_(std::move(o.alive_)), data_(o.data_), bytes_(o.bytes_) {
  o.owner_ = nullptr;
  o.data_ = nullptr;
  o.bytes_ = 0;
}

ActivationBuffer& ActivationBuffer::operator=(ActivationBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    owner_ = o.owner_;
    alive_ = std::move(o.alive_);
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.owner_ = nullptr;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

ActivationBuffer::~ActivationBuffer() { Reset(); }

void ActivationBuffer::Reset() {
  // (An engine already gone freed its device, and this buffer with it.)
  if (owner_ != nullptr && data_ != nullptr && !alive_.expired())
    owner_->FreeActivation(data_, bytes_);
  owner_ = nullptr;
  alive_.reset();
  data_ = nullptr;
  bytes_ = 0;
}

// ---- Scopes
// -------------------------------------------------------------------------------------

ParamScope::ParamScope(ParamScope&& o) noexcept
    : engine_(o.engine_),
      alive_(std::move(o.alive_)),
      params_(std::move(o.params_)),
      phase_(o.phase_) {
  o.engine_ = nullptr;
}

ParamScope::~ParamScope() {
  Status s = Release();
  if (!s.ok()) TZ_LOG(kError, kEngine) << "releasing a parameter scope: " << s.ToString();
}

void* ParamScope::data(ParamId p) const {
  if (engine_ == nullptr || alive_.expired() ||
      std::find(params_.begin(), params_.end(), p) == params_.end())
    return nullptr;
  return engine_->ScopeData(p);
}

void* ParamScope::grad(ParamId p) const {
  if (engine_ == nullptr || alive_.expired() || phase_ != Phase::kBackward ||
      std::find(params_.begin(), params_.end(), p) == params_.end())
    return nullptr;
  return engine_->ScopeGrad(p);
}

Status ParamScope::Release() {
  if (engine_ == nullptr) return Status::OK();
  Engine* e = engine_;
  engine_ = nullptr;
  if (alive_.expired()) return Status::OK();  // the engine is gone, and what it held
  return e->ScopeRelease(params_, phase_);
}

StatusOr<ActivationBuffer> Engine::AllocateActivation(uint64_t bytes) {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("activations are allocated after Finalize");
  if (bytes == 0) return ActivationBuffer();
  auto p = im.device->Allocate(bytes);
  if (!p.ok()) {
    return std::move(p).status().WithContext(
        "allocating " + FormatBytes(bytes) + " of activations with " + FormatBytes(im.act_current) +
        " already in use; lower the batch size or sequence length, checkpoint activations (where "
        "the model does not already), or raise device_budget");
  }
  static_assert(kDeviceAllocationAlignment == kDeviceAlignment);
  im.act_current += DeviceAllocationBytes(bytes);  // what the device took
  im.act_peak = std::max(im.act_peak, im.act_current);
  im.cm->OnNonModelBytes(im.act_current);
  return ActivationBuffer(&im, im.alive, *p, bytes);
}

void Engine::Impl::FreeActivation(void* p, uint64_t bytes) {
  device->Free(p);
  act_current -= DeviceAllocationBytes(bytes);
  if (cm) cm->OnNonModelBytes(act_current);
}

}  // namespace tierzero
