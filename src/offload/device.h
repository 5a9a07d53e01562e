// Device: the one interface between the engine and an accelerator (like leveldb's Env).
//
// Device memory with a hard capacity, streams that execute their work in order, events that
// order streams against each other and against the host, asynchronous copies between host and
// device, and the few compute kernels the engine itself needs. Implementations:
//   - HostSimDevice (host_sim_device.h): host memory with a capacity, a worker thread per stream,
//     optional bandwidth throttling. Every engine test runs on it.
//   - CudaDevice (cuda_device.h): one reserved cudaMalloc slab, non-blocking CUDA streams.
//   - DeviceWrapper / FaultInjectionDevice (device_wrapper.h): decorators for tests.
// The engine cannot tell them apart; the contract tests in tests/offload/device_test.cc run
// against each.
//
// Errors: calls that enqueue work validate their arguments and return InvalidArgument before
// anything is queued; a failure of the device itself comes back from the call or from the next
// synchronisation. Allocation beyond the capacity is OutOfMemory and leaves the device usable.
//
// Thread-safety: every method may be called from any thread. Work enqueued on one stream from
// several threads runs in the order the calls returned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "core/memory_stat.h"
#include "core/status.h"
#include "tierzero/types.h"

namespace tierzero {

enum class DeviceKind : uint8_t { kHostSim, kCuda };
enum class CopyKind : uint8_t { kHostToDevice, kDeviceToHost, kDeviceToDevice };

std::string_view CopyKindName(CopyKind kind);

// What a device can do (ggml-style capability flags). Absent capabilities have documented
// fallbacks at the call sites, never silent misbehaviour.
struct DeviceCaps {
  bool async_copy = false;    // copies run concurrently with the host and with other streams
  bool pinned_host = false;   // RegisterHostMemory page-locks memory for DMA
  bool event_timing = false;  // ElapsedSeconds is supported
  bool throttled = false;     // copies are slowed to a configured bandwidth (HostSim only)
  // Device memory is host memory and the trainer computes on the CPU in program order; a
  // stream's queued work may need gating to the trainer's calls so that events time the
  // trainer's compute (offload/compute_gate.h).
  bool host_compute = false;
};

struct DeviceInfo {
  DeviceKind kind = DeviceKind::kHostSim;
  std::string name;             // "hostsim" or the GPU's name
  int ordinal = 0;              // CUDA device ordinal; 0 for HostSim
  uint64_t capacity_bytes = 0;  // the most device memory Allocate can hand out
  DeviceCaps caps;
};

// Opaque handles, owned through the RAII Stream and Event classes below.
struct StreamHandle {
  void* impl = nullptr;
};
struct EventHandle {
  void* impl = nullptr;
};

// Alignment of every device allocation. Default matches cudaMalloc's guarantee.
inline constexpr size_t kDeviceAlignment = 256;

class Device {
 public:
  virtual ~Device() = default;

  virtual const DeviceInfo& info() const = 0;

  // ---- Memory ----
  // Returns `bytes` (> 0) of device memory aligned to kDeviceAlignment. OutOfMemory, naming
  // the request, the capacity and the bytes in use, when it cannot be served.
  virtual StatusOr<void*> Allocate(size_t bytes) = 0;
  // REQUIRES: `ptr` came from Allocate on this device, is not yet freed, and no queued work
  // still uses it. nullptr is ignored.
  virtual void Free(void* ptr) = 0;
  // Bytes of allocations, as handed out (rounded to kDeviceAlignment).
  virtual MemoryStat memory_stat() const = 0;
  // The largest single allocation that would succeed now.
  virtual uint64_t largest_free_block() const = 0;

  // ---- Streams ----
  // `name` labels the stream in logs and traces ("compute", "h2d").
  virtual StatusOr<StreamHandle> CreateStream(std::string_view name) = 0;
  // Waits for the stream's queued work, then destroys it.
  virtual void DestroyStream(StreamHandle stream) = 0;
  // Blocks until all work enqueued on `stream` before the call is done.
  virtual Status SynchronizeStream(StreamHandle stream) = 0;
  // Blocks until all work enqueued on every stream before the call is done.
  virtual Status Synchronize() = 0;

  // ---- Events ----
  virtual StatusOr<EventHandle> CreateEvent() = 0;
  virtual void DestroyEvent(EventHandle event) = 0;
  // The event completes when all work enqueued on `stream` before this call is done.
  virtual Status RecordEvent(EventHandle event, StreamHandle stream) = 0;
  // Work enqueued on `stream` after this call waits for the event's latest record (as of this
  // call). An event never recorded does not delay the stream.
  virtual Status StreamWaitEvent(StreamHandle stream, EventHandle event) = 0;
  // Blocks the calling thread until the event's latest record completes.
  virtual Status SynchronizeEvent(EventHandle event) = 0;
  // True when the event's latest record has completed (or it was never recorded).
  virtual StatusOr<bool> EventDone(EventHandle event) = 0;
  // Seconds between the completions of two recorded, completed events.
  // FailedPrecondition when either is unrecorded or not done; Unsupported without event_timing.
  virtual StatusOr<double> ElapsedSeconds(EventHandle start, EventHandle end) = 0;

  // ---- Work ----
  // Copies `bytes` between host and device memory as `kind` says. Host memory may be pageable,
  // but only memory registered with RegisterHostMemory (or the pinned arena) copies
  // asynchronously on CUDA. REQUIRES: the ranges do not overlap and stay valid until done.
  virtual Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                           StreamHandle stream) = 0;
  // Sets `bytes` of device memory to `value`.
  virtual Status MemsetAsync(void* dst, uint8_t value, size_t bytes, StreamHandle stream) = 0;
  // Casts n elements of device memory between fp32, bf16 and fp16 with the rounding of
  // core/convert.h (bit-identical on every device).
  virtual Status CastAsync(const void* src, DType src_type, void* dst, DType dst_type, size_t n,
                           StreamHandle stream) = 0;
  // acc[i] += src[i] widened to fp32, for n elements of device memory (src fp32, bf16 or fp16):
  // one fp32 add per element, bit-identical on every device (gradient accumulation into a
  // gradient shard kept on the device).
  virtual Status AccumulateAsync(float* acc, const void* src, DType src_type, size_t n,
                                 StreamHandle stream) = 0;
  // Runs `fn` on a host thread after the stream's earlier work; later work waits for it.
  // REQUIRES (CUDA's rules for cudaLaunchHostFunc, enforced nowhere else, so follow them on every
  // device): `fn` is non-empty (InvalidArgument otherwise), makes no call into any Device (no CUDA
  // API call at all), does not throw, and releases no last reference to a Stream or Event. It may
  // block, but on CUDA host functions of all streams can share one driver thread, so a blocking
  // `fn` can delay the others. If the stream fails before reaching it, `fn` may never run.
  virtual Status LaunchHostFunc(StreamHandle stream, std::function<void()> fn) = 0;

  // ---- Host memory ----
  // Page-locks [ptr, ptr+bytes) for DMA where caps.pinned_host; otherwise succeeds doing nothing.
  virtual Status RegisterHostMemory(void* ptr, size_t bytes) = 0;
  virtual Status UnregisterHostMemory(void* ptr) = 0;
};

// ---- RAII owners --------------------------------------------------------------------------------

// A stream, destroyed (after its queued work) when the owner goes away. Move-only.
class Stream {
 public:
  Stream() = default;
  static StatusOr<Stream> Create(Device& device, std::string_view name);
  Stream(Stream&& other) noexcept { *this = std::move(other); }
  Stream& operator=(Stream&& other) noexcept;
  ~Stream() { Reset(); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  StreamHandle handle() const { return handle_; }
  Status Synchronize() const { return device_->SynchronizeStream(handle_); }
  void Reset();

 private:
  Device* device_ = nullptr;
  StreamHandle handle_;
};

// An event, destroyed when the owner goes away. Move-only.
class Event {
 public:
  Event() = default;
  static StatusOr<Event> Create(Device& device);
  Event(Event&& other) noexcept { *this = std::move(other); }
  Event& operator=(Event&& other) noexcept;
  ~Event() { Reset(); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  EventHandle handle() const { return handle_; }
  Status Record(const Stream& stream) const {
    return device_->RecordEvent(handle_, stream.handle());
  }
  Status Synchronize() const { return device_->SynchronizeEvent(handle_); }
  void Reset();

 private:
  Device* device_ = nullptr;
  EventHandle handle_;
};

// A device allocation, freed when the owner goes away. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static StatusOr<DeviceBuffer> Allocate(Device& device, size_t bytes);
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  void Reset();

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace tierzero
