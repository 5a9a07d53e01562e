#include "offload/device_wrapper.h"

#include <string>

#include "core/bytes.h"
#include "core/mutex.h"

namespace tierzero {
namespace {

DeviceOp CopyOp(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return DeviceOp::kCopyH2D;
    case CopyKind::kDeviceToHost:
      return DeviceOp::kCopyD2H;
    case CopyKind::kDeviceToDevice:
      return DeviceOp::kCopyD2D;
  }
  return DeviceOp::kCopyD2D;
}

}  // namespace

void FaultInjectionDevice::Inject(DeviceFault fault) {
  MutexLock lock(mu_);
  faults_.push_back(fault);
}

void FaultInjectionDevice::Clear() {
  MutexLock lock(mu_);
  faults_.clear();
}

Status FaultInjectionDevice::MaybeFail(DeviceOp op, std::string_view what) {
  MutexLock lock(mu_);
  for (DeviceFault& f : faults_) {
    if (f.op != op || f.count <= 0) continue;
    if (f.skip > 0) {
      --f.skip;
      continue;
    }
    --f.count;
    ++injected_;
    return Status(f.code, "injected fault: " + std::string(what));
  }
  return Status::OK();
}

StatusOr<void*> FaultInjectionDevice::Allocate(size_t bytes) {
  RETURN_IF_ERROR(MaybeFail(DeviceOp::kAllocate, "allocate " + FormatBytes(bytes)));
  return DeviceWrapper::Allocate(bytes);
}

Status FaultInjectionDevice::CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                                       StreamHandle s) {
  RETURN_IF_ERROR(
      MaybeFail(CopyOp(kind), std::string(CopyKindName(kind)) + " copy of " + FormatBytes(bytes)));
  return DeviceWrapper::CopyAsync(dst, src, bytes, kind, s);
}

Status FaultInjectionDevice::MemsetAsync(void* dst, uint8_t value, size_t bytes, StreamHandle s) {
  RETURN_IF_ERROR(MaybeFail(DeviceOp::kMemset, "memset"));
  return DeviceWrapper::MemsetAsync(dst, value, bytes, s);
}

Status FaultInjectionDevice::CastAsync(const void* src, DType st, void* dst, DType dt, size_t n,
                                       StreamHandle s) {
  RETURN_IF_ERROR(MaybeFail(DeviceOp::kCast, "cast"));
  return DeviceWrapper::CastAsync(src, st, dst, dt, n, s);
}

Status FaultInjectionDevice::AccumulateAsync(float* acc, const void* src, DType st, size_t n,
                                             StreamHandle s) {
  RETURN_IF_ERROR(MaybeFail(DeviceOp::kAccumulate, "accumulate"));
  return DeviceWrapper::AccumulateAsync(acc, src, st, n, s);
}

Status FaultInjectionDevice::SynchronizeStream(StreamHandle s) {
  // The real synchronisation happens first, so the stream is idle when the error is reported.
  Status real = DeviceWrapper::SynchronizeStream(s);
  RETURN_IF_ERROR(MaybeFail(DeviceOp::kSynchronize, "stream synchronize"));
  return real;
}

Status FaultInjectionDevice::Synchronize() {
  Status real = DeviceWrapper::Synchronize();
  RETURN_IF_ERROR(MaybeFail(DeviceOp::kSynchronize, "device synchronize"));
  return real;
}

Status FaultInjectionDevice::SynchronizeEvent(EventHandle e) {
  Status real = DeviceWrapper::SynchronizeEvent(e);
  RETURN_IF_ERROR(MaybeFail(DeviceOp::kSynchronize, "event synchronize"));
  return real;
}

StatusOr<StreamHandle> FaultInjectionDevice::CreateStream(std::string_view name) {
  RETURN_IF_ERROR(MaybeFail(DeviceOp::kCreateStream, "create stream"));
  return DeviceWrapper::CreateStream(name);
}

Status FaultInjectionDevice::RegisterHostMemory(void* ptr, size_t bytes) {
  RETURN_IF_ERROR(MaybeFail(DeviceOp::kRegisterHost, "register host memory"));
  return DeviceWrapper::RegisterHostMemory(ptr, bytes);
}

}  // namespace tierzero
