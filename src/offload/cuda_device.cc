#include "offload/cuda_device.h"

#include <cuda_runtime.h>

#include <mutex>
#include <sstream>
#include <string>
#include <unordered_set>

#include "core/bytes.h"
#include "core/check.h"
#include "core/logging.h"
#include "kernels/cast.h"
#include "kernels/cuda_status.h"
#include "offload/slab_allocator.h"

namespace tierzero {
namespace {

cudaMemcpyKind ToCuda(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return cudaMemcpyHostToDevice;
    case CopyKind::kDeviceToHost:
      return cudaMemcpyDeviceToHost;
    case CopyKind::kDeviceToDevice:
      return cudaMemcpyDeviceToDevice;
  }
  return cudaMemcpyDefault;
}

// The first exception a host function threw on any of a device's streams: kept as a CUDA
// context keeps a kernel's fault, and returned by every later synchronisation (Note [An exception
// on a simulated stream], host_sim_device.cc: the same on a GPU, where the host function runs on
// the CUDA driver's thread and an exception escaping it ended the process in std::terminate).
struct HostFault {
  void Keep(Status s) {
    std::lock_guard<std::mutex> lock(mu);
    if (first.ok()) first = std::move(s);
  }
  Status Get() {
    std::lock_guard<std::mutex> lock(mu);
    return first;
  }
  std::mutex mu;
  Status first;
};

struct HostWork {
  std::function<void()> fn;
  HostFault* fault;
};

void CUDART_CB RunHostFunc(void* arg) {
  std::unique_ptr<HostWork> work(static_cast<HostWork*>(arg));
  try {
    work->fn();
  } catch (...) {
    work->fault->Keep(StatusOfCurrentException().WithContext("a host function on a GPU stream"));
  }
}

class CudaDevice final : public Device {
 public:
  CudaDevice(DeviceInfo info, uint8_t* slab)
      : info_(std::move(info)),
        slab_(slab),
        memory_(slab, info_.capacity_bytes, kDeviceAlignment, "GPU '" + info_.name + "'") {}

  ~CudaDevice() override {
    cudaSetDevice(info_.ordinal);
    cudaDeviceSynchronize();
    cudaFree(slab_);
  }

  const DeviceInfo& info() const override { return info_; }

  StatusOr<void*> Allocate(size_t bytes) override { return memory_.Allocate(bytes); }
  void Free(void* ptr) override { memory_.Free(ptr); }
  MemoryStat memory_stat() const override { return memory_.stat(); }
  uint64_t largest_free_block() const override { return memory_.largest_free_block(); }

  StatusOr<StreamHandle> CreateStream(std::string_view name) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(info_.ordinal));
    cudaStream_t s;
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return StreamHandle{s};
  }
  void DestroyStream(StreamHandle h) override {
    if (h.impl == nullptr) return;
    cudaSetDevice(info_.ordinal);
    cudaStreamSynchronize(Cast(h));
    cudaStreamDestroy(Cast(h));
  }
  Status SynchronizeStream(StreamHandle h) override {
    RETURN_IF_ERROR(CheckStream(h));
    RETURN_IF_ERROR(Current());
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(Cast(h)));
    return fault_.Get();
  }
  Status Synchronize() override {
    RETURN_IF_ERROR(Current());
    CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
    return fault_.Get();
  }

  StatusOr<EventHandle> CreateEvent() override {
    RETURN_IF_ERROR(Current());
    cudaEvent_t e;
    CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
    return EventHandle{e};
  }
  void DestroyEvent(EventHandle h) override {
    if (h.impl == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(recorded_mu_);
      recorded_.erase(h.impl);
    }
    cudaSetDevice(info_.ordinal);
    cudaEventDestroy(Cast(h));
  }
  Status RecordEvent(EventHandle e, StreamHandle s) override {
    RETURN_IF_ERROR(CheckEvent(e));
    RETURN_IF_ERROR(CheckStream(s));
    RETURN_IF_ERROR(Current());
    CUDA_RETURN_IF_ERROR(cudaEventRecord(Cast(e), Cast(s)));
    std::lock_guard<std::mutex> lock(recorded_mu_);
    recorded_.insert(e.impl);
    return Status::OK();
  }
  Status StreamWaitEvent(StreamHandle s, EventHandle e) override {
    RETURN_IF_ERROR(CheckEvent(e));
    RETURN_IF_ERROR(CheckStream(s));
    RETURN_IF_ERROR(Current());
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(Cast(s), Cast(e), 0));
    return Status::OK();
  }
  Status SynchronizeEvent(EventHandle e) override {
    RETURN_IF_ERROR(CheckEvent(e));
    RETURN_IF_ERROR(Current());
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(Cast(e)));
    return fault_.Get();
  }
  StatusOr<bool> EventDone(EventHandle e) override {
    RETURN_IF_ERROR(CheckEvent(e));
    RETURN_IF_ERROR(Current());
    cudaError_t err = cudaEventQuery(Cast(e));
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // "not ready" is an answer, not an error to keep
      return false;
    }
    CUDA_RETURN_IF_ERROR(err);
    RETURN_IF_ERROR(fault_.Get());
    return true;
  }
  StatusOr<double> ElapsedSeconds(EventHandle start, EventHandle end) override {
    RETURN_IF_ERROR(CheckEvent(start));
    RETURN_IF_ERROR(CheckEvent(end));
    const Status not_ready =
        FailedPreconditionError("ElapsedSeconds needs two recorded, completed events");
    {
      // Asked of an event never recorded, CUDA fails with an invalid-handle error, which
      // compute-sanitizer reports as an API error: answer without asking it.
      std::lock_guard<std::mutex> lock(recorded_mu_);
      if (!recorded_.count(start.impl) || !recorded_.count(end.impl)) return not_ready;
    }
    RETURN_IF_ERROR(Current());
    for (EventHandle e : {start, end}) {
      ASSIGN_OR_RETURN(const bool done, EventDone(e));
      if (!done) return not_ready;
    }
    float ms = 0;
    cudaError_t err = cudaEventElapsedTime(&ms, Cast(start), Cast(end));
    CUDA_RETURN_IF_ERROR(err);
    return ms / 1e3;
  }

  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                   StreamHandle s) override {
    RETURN_IF_ERROR(CheckStream(s));
    if (bytes == 0) return Status::OK();
    if (dst == nullptr || src == nullptr)
      return InvalidArgumentError("CopyAsync with a null pointer");
    RETURN_IF_ERROR(Current());
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, ToCuda(kind), Cast(s)));
    return Status::OK();
  }
  Status MemsetAsync(void* dst, uint8_t value, size_t bytes, StreamHandle s) override {
    RETURN_IF_ERROR(CheckStream(s));
    if (bytes == 0) return Status::OK();
    RETURN_IF_ERROR(Current());
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, value, bytes, Cast(s)));
    return Status::OK();
  }
  Status CastAsync(const void* src, DType src_type, void* dst, DType dst_type, size_t n,
                   StreamHandle s) override {
    RETURN_IF_ERROR(CheckStream(s));
    RETURN_IF_ERROR(Current());
    return kernels::CastCudaAsync(src, src_type, dst, dst_type, n, s.impl);
  }
  Status AccumulateAsync(float* acc, const void* src, DType src_type, size_t n,
                         StreamHandle s) override {
    RETURN_IF_ERROR(CheckStream(s));
    RETURN_IF_ERROR(Current());
    return kernels::AccumulateCudaAsync(acc, src, src_type, n, s.impl);
  }
  Status LaunchHostFunc(StreamHandle s, std::function<void()> fn) override {
    RETURN_IF_ERROR(CheckStream(s));
    if (!fn) return InvalidArgumentError("LaunchHostFunc with an empty function");
    RETURN_IF_ERROR(Current());
    auto* work = new HostWork{std::move(fn), &fault_};
    cudaError_t err = cudaLaunchHostFunc(Cast(s), RunHostFunc, work);
    if (err != cudaSuccess) {
      delete work;
      return CudaStatus(err, "cudaLaunchHostFunc", __FILE__, __LINE__);
    }
    return Status::OK();
  }

  Status RegisterHostMemory(void* ptr, size_t bytes) override {
    RETURN_IF_ERROR(Current());
    cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
    if (err != cudaSuccess) {
      return CudaStatus(err, "cudaHostRegister", __FILE__, __LINE__)
          .WithContext("page-locking " + FormatBytes(bytes) + " of host memory");
    }
    return Status::OK();
  }
  Status UnregisterHostMemory(void* ptr) override {
    RETURN_IF_ERROR(Current());
    CUDA_RETURN_IF_ERROR(cudaHostUnregister(ptr));
    return Status::OK();
  }

 private:
  // A null handle would be CUDA's legacy default stream, which does not order against these
  // non-blocking streams: refuse it, as HostSim does.
  static Status CheckStream(StreamHandle h) {
    if (h.impl == nullptr) return InvalidArgumentError("null stream");
    return Status::OK();
  }
  static Status CheckEvent(EventHandle h) {
    if (h.impl == nullptr) return InvalidArgumentError("null event");
    return Status::OK();
  }
  static cudaStream_t Cast(StreamHandle h) { return static_cast<cudaStream_t>(h.impl); }
  static cudaEvent_t Cast(EventHandle h) { return static_cast<cudaEvent_t>(h.impl); }
  Status Current() const {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(info_.ordinal));
    return Status::OK();
  }

  const DeviceInfo info_;
  std::mutex recorded_mu_;
  std::unordered_set<void*> recorded_;  // events recorded at least once (ElapsedSeconds)
  uint8_t* const slab_;
  DeviceSlab memory_;  // the device memory, handed out from slab_
  HostFault fault_;    // outlives the host functions: the destructor synchronises first
};

}  // namespace

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return n;
}

uint64_t CudaFreeBytes(int ordinal) {
  if (ordinal < 0 || ordinal >= CudaDeviceCount() || cudaSetDevice(ordinal) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return free_bytes;
}

StatusOr<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions& options) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    const char* why = err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice
                          ? "no NVIDIA GPU with a working driver on this machine"
                          : "CUDA could not enumerate GPUs";
    return UnavailableError(std::string(why) + " (CUDA: " + cudaGetErrorString(err) +
                            "); use the host device");
  }
  if (options.ordinal < 0 || options.ordinal >= count) {
    return UnavailableError("CUDA device " + std::to_string(options.ordinal) + " does not exist (" +
                            std::to_string(count) + " found)");
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(options.ordinal));
  cudaDeviceProp prop;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options.ordinal));
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  uint64_t capacity = options.capacity_bytes;
  if (capacity == 0) {
    if (free_bytes <= options.headroom_bytes) {
      return OutOfMemoryError("GPU " + std::string(prop.name) + " has only " +
                              FormatBytes(free_bytes) + " free, less than the headroom of " +
                              FormatBytes(options.headroom_bytes));
    }
    capacity = free_bytes - options.headroom_bytes;
  }
  capacity = AlignUp(capacity, kDeviceAlignment);
  if (capacity > free_bytes) {
    return OutOfMemoryError("GPU " + std::string(prop.name) + ": the device budget of " +
                            FormatBytes(capacity) + " exceeds the " + FormatBytes(free_bytes) +
                            " free (lower the budget)");
  }
  void* slab = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&slab, capacity));
  DeviceInfo info;
  info.kind = DeviceKind::kCuda;
  info.name = prop.name;
  info.ordinal = options.ordinal;
  info.capacity_bytes = capacity;
  info.caps.async_copy = true;
  info.caps.pinned_host = true;
  info.caps.event_timing = true;
  TZ_LOG(kInfo, kOffload) << "CUDA device " << options.ordinal << " '" << prop.name
                          << "': reserved " << FormatBytes(capacity) << " of "
                          << FormatBytes(total_bytes);
  return std::unique_ptr<Device>(new CudaDevice(std::move(info), static_cast<uint8_t*>(slab)));
}

}  // namespace tierzero
