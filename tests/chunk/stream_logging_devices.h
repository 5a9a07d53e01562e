// Device wrappers the chunk manager's tests watch it through: what it queues on the compute
// stream (CountingDevice), and where on the D2H stream the events it waits for are recorded
// (OrderLoggingDevice).
#pragma once

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "offload/device_wrapper.h"

namespace tierzero {

// Counts what is queued on one stream (Note [One wait per moment]).
class CountingDevice final : public DeviceWrapper {
 public:
  using DeviceWrapper::DeviceWrapper;
  StreamHandle watched{};
  int records = 0, waits = 0, memsets = 0, others = 0;
  bool Watched(StreamHandle s) const { return watched.impl != nullptr && s.impl == watched.impl; }
  Status RecordEvent(EventHandle e, StreamHandle s) override {
    records += Watched(s);
    return DeviceWrapper::RecordEvent(e, s);
  }
  Status StreamWaitEvent(StreamHandle s, EventHandle e) override {
    waits += Watched(s);
    return DeviceWrapper::StreamWaitEvent(s, e);
  }
  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                   StreamHandle s) override {
    others += Watched(s);
    return DeviceWrapper::CopyAsync(dst, src, bytes, kind, s);
  }
  Status MemsetAsync(void* dst, uint8_t value, size_t bytes, StreamHandle s) override {
    memsets += Watched(s);
    return DeviceWrapper::MemsetAsync(dst, value, bytes, s);
  }
  Status CastAsync(const void* src, DType st, void* dst, DType dt, size_t n,
                   StreamHandle s) override {
    others += Watched(s);
    return DeviceWrapper::CastAsync(src, st, dst, dt, n, s);
  }
  Status LaunchHostFunc(StreamHandle s, std::function<void()> fn) override {
    others += Watched(s);
    return DeviceWrapper::LaunchHostFunc(s, std::move(fn));
  }
};

// Remembers, for every event recorded on the stream that copies gradients out (the one other
// than `compute` that takes device-to-host copies), what was queued on it just before, and which
// of those events the trainer's thread waited for (Note [A gradient chunk's memory outlives only
// its reads]).
class OrderLoggingDevice final : public DeviceWrapper {
 public:
  using DeviceWrapper::DeviceWrapper;
  enum class Op { kNone, kCopy, kAdd, kHostFunc, kOther };
  StreamHandle compute{};
  std::vector<Op> waited_after;  // per wait for a D2H-stream event: what preceded its record
  Status RecordEvent(EventHandle e, StreamHandle s) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      recorded_[e.impl] = {s.impl, last_[s.impl]};
    }
    return DeviceWrapper::RecordEvent(e, s);
  }
  Status SynchronizeEvent(EventHandle e) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = recorded_.find(e.impl);
      if (it != recorded_.end() && it->second.first == d2h_) {
        waited_after.push_back(it->second.second);
      }
    }
    return DeviceWrapper::SynchronizeEvent(e);
  }
  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                   StreamHandle s) override {
    Note(s, Op::kCopy);
    if (kind == CopyKind::kDeviceToHost && s.impl != compute.impl) {
      std::lock_guard<std::mutex> lock(mu_);
      d2h_ = s.impl;
    }
    return DeviceWrapper::CopyAsync(dst, src, bytes, kind, s);
  }
  Status AccumulateAsync(float* acc, const void* src, DType st, size_t n, StreamHandle s) override {
    Note(s, Op::kAdd);
    return DeviceWrapper::AccumulateAsync(acc, src, st, n, s);
  }
  Status MemsetAsync(void* dst, uint8_t value, size_t bytes, StreamHandle s) override {
    Note(s, Op::kOther);
    return DeviceWrapper::MemsetAsync(dst, value, bytes, s);
  }
  Status CastAsync(const void* src, DType st, void* dst, DType dt, size_t n,
                   StreamHandle s) override {
    Note(s, Op::kOther);
    return DeviceWrapper::CastAsync(src, st, dst, dt, n, s);
  }
  Status LaunchHostFunc(StreamHandle s, std::function<void()> fn) override {
    Note(s, Op::kHostFunc);
    return DeviceWrapper::LaunchHostFunc(s, std::move(fn));
  }

 private:
  void Note(StreamHandle s, Op op) {
    std::lock_guard<std::mutex> lock(mu_);
    last_[s.impl] = op;
  }
  std::mutex mu_;
  std::map<const void*, Op> last_;
  std::map<const void*, std::pair<const void*, Op>> recorded_;  // stream, op before
  const void* d2h_ = nullptr;
};

}  // namespace tierzero
