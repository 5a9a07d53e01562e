// DeviceWrapper forwards every call to a target Device (leveldb's EnvWrapper); subclasses
// override what they decorate. FaultInjectionDevice makes chosen operations fail on demand so
// tests can prove that device failures surface as Status and leave state intact.
//
// Thread-safety: as for Device. The target must outlive the wrapper.
#pragma once

#include <atomic>
#include <mutex>
#include <vector>

#include "core/mutex.h"
#include "offload/device.h"

namespace tierzero {

class DeviceWrapper : public Device {
 public:
  explicit DeviceWrapper(Device* target) : target_(target) {}
  Device* target() const { return target_; }

  const DeviceInfo& info() const override { return target_->info(); }
  StatusOr<void*> Allocate(size_t bytes) override { return target_->Allocate(bytes); }
  void Free(void* ptr) override { target_->Free(ptr); }
  MemoryStat memory_stat() const override { return target_->memory_stat(); }
  uint64_t largest_free_block() const override { return target_->largest_free_block(); }
  StatusOr<StreamHandle> CreateStream(std::string_view name) override {
    return target_->CreateStream(name);
  }
  void DestroyStream(StreamHandle s) override { target_->DestroyStream(s); }
  Status SynchronizeStream(StreamHandle s) override { return target_->SynchronizeStream(s); }
  Status Synchronize() override { return target_->Synchronize(); }
  StatusOr<EventHandle> CreateEvent() override { return target_->CreateEvent(); }
  void DestroyEvent(EventHandle e) override { target_->DestroyEvent(e); }
  Status RecordEvent(EventHandle e, StreamHandle s) override { return target_->RecordEvent(e, s); }
  Status StreamWaitEvent(StreamHandle s, EventHandle e) override {
    return target_->StreamWaitEvent(s, e);
  }
  Status SynchronizeEvent(EventHandle e) override { return target_->SynchronizeEvent(e); }
  StatusOr<bool> EventDone(EventHandle e) override { return target_->EventDone(e); }
  StatusOr<double> ElapsedSeconds(EventHandle a, EventHandle b) override {
    return target_->ElapsedSeconds(a, b);
  }
  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                   StreamHandle s) override {
    return target_->CopyAsync(dst, src, bytes, kind, s);
  }
  Status MemsetAsync(void* dst, uint8_t value, size_t bytes, StreamHandle s) override {
    return target_->MemsetAsync(dst, value, bytes, s);
  }
  Status CastAsync(const void* src, DType st, void* dst, DType dt, size_t n,
                   StreamHandle s) override {
    return target_->CastAsync(src, st, dst, dt, n, s);
  }
  Status AccumulateAsync(float* acc, const void* src, DType st, size_t n, StreamHandle s) override {
    return target_->AccumulateAsync(acc, src, st, n, s);
  }
  Status LaunchHostFunc(StreamHandle s, std::function<void()> fn) override {
    return target_->LaunchHostFunc(s, std::move(fn));
  }
  Status RegisterHostMemory(void* ptr, size_t bytes) override {
    return target_->RegisterHostMemory(ptr, bytes);
  }
  Status UnregisterHostMemory(void* ptr) override { return target_->UnregisterHostMemory(ptr); }

 private:
  Device* target_;
};

// Operations FaultInjectionDevice can fail.
enum class DeviceOp : uint8_t {
  kAllocate,
  kCopyH2D,
  kCopyD2H,
  kCopyD2D,
  kMemset,
  kCast,
  kAccumulate,   // AccumulateAsync (device gradient shards under accumulation)
  kSynchronize,  // SynchronizeStream, Synchronize and SynchronizeEvent (where async errors surface)
  kCreateStream,
  kRegisterHost,
};

// "Skip the next `skip` calls of `op`, then fail the following `count` with `code`."
struct DeviceFault {
  DeviceOp op = DeviceOp::kAllocate;
  int skip = 0;
  int count = 1;
  StatusCode code = StatusCode::kInternal;
};

class FaultInjectionDevice final : public DeviceWrapper {
 public:
  explicit FaultInjectionDevice(Device* target) : DeviceWrapper(target) {}

  // Adds a fault rule. Rules are independent; each counts only calls of its own op.
  void Inject(DeviceFault fault);
  // Removes all rules.
  void Clear();
  // How many calls have failed by injection so far.
  int injected() const { return injected_.load(); }

  StatusOr<void*> Allocate(size_t bytes) override;
  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                   StreamHandle s) override;
  Status MemsetAsync(void* dst, uint8_t value, size_t bytes, StreamHandle s) override;
  Status CastAsync(const void* src, DType st, void* dst, DType dt, size_t n,
                   StreamHandle s) override;
  Status AccumulateAsync(float* acc, const void* src, DType st, size_t n, StreamHandle s) override;
  Status SynchronizeStream(StreamHandle s) override;
  Status Synchronize() override;
  Status SynchronizeEvent(EventHandle e) override;
  StatusOr<StreamHandle> CreateStream(std::string_view name) override;
  Status RegisterHostMemory(void* ptr, size_t bytes) override;

 private:
  // The injected error for this call of `op`, or OK.
  Status MaybeFail(DeviceOp op, std::string_view what);

  Mutex mu_;
  std::vector<DeviceFault> faults_ TZ_GUARDED_BY(mu_);
  std::atomic<int> injected_{0};
};

}  // namespace tierzero
