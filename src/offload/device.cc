#include "offload/device.h"

#include <utility>

namespace tierzero {

std::string_view CopyKindName(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return "H2D";
    case CopyKind::kDeviceToHost:
      return "D2H";
    case CopyKind::kDeviceToDevice:
      return "D2D";
  }
  return "?";
}

StatusOr<Stream> Stream::Create(Device& device, std::string_view name) {
  ASSIGN_OR_RETURN(StreamHandle h, device.CreateStream(name));
  Stream s;
  s.device_ = &device;
  s.handle_ = h;
  return s;
}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = std::exchange(other.device_, nullptr);
    handle_ = std::exchange(other.handle_, StreamHandle{});
  }
  return *this;
}

void Stream::Reset() {
  if (device_ != nullptr) device_->DestroyStream(handle_);
  device_ = nullptr;
  handle_ = {};
}

StatusOr<Event> Event::Create(Device& device) {
  ASSIGN_OR_RETURN(EventHandle h, device.CreateEvent());
  Event e;
  e.device_ = &device;
  e.handle_ = h;
  return e;
}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = std::exchange(other.device_, nullptr);
    handle_ = std::exchange(other.handle_, EventHandle{});
  }
  return *this;
}

void Event::Reset() {
  if (device_ != nullptr) device_->DestroyEvent(handle_);
  device_ = nullptr;
  handle_ = {};
}

StatusOr<DeviceBuffer> DeviceBuffer::Allocate(Device& device, size_t bytes) {
  ASSIGN_OR_RETURN(void* p, device.Allocate(bytes));
  DeviceBuffer b;
  b.device_ = &device;
  b.data_ = p;
  b.bytes_ = bytes;
  return b;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = std::exchange(other.device_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (device_ != nullptr) device_->Free(data_);
  device_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace tierzero
