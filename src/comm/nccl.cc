// The NCCL communicator (nccl.h). NCCL's header gives the types; the functions come from dlopen.
#include "comm/nccl.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "comm/collective.h"
#include "core/mutex.h"
#include "core/tunable.h"
#include "kernels/cuda_status.h"

namespace tierzero {

namespace {
TZ_TUNABLE(std::string, kNcclLibrary, "TZ_NCCL_LIBRARY", "libnccl.so.2",
           "the NCCL library loaded at run time (a file name on the loader path, or a path)");
}  // namespace
namespace {

using zero::CollectiveKind;

// The NCCL functions tierzero calls, from the shared library.
struct NcclApi {
  ncclResult_t (*GetVersion)(int*);
  ncclResult_t (*GetUniqueId)(ncclUniqueId*);
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int);
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommSplit)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*);  // NCCL >= 2.18
  const char* (*GetErrorString)(ncclResult_t);
  const char* (*GetLastError)(ncclComm_t);
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                                cudaStream_t);
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();
  int version = 0;
  // The non-blocking configuration needs a library at least as new as our header (the config
  // struct is versioned forwards, not backwards).
  bool config = false;
};

template <typename F>
bool Bind(void* lib, const char* name, F*& fn) {
  fn = reinterpret_cast<F*>(dlsym(lib, name));
  return fn != nullptr;
}

StatusOr<const NcclApi*> LoadNccl() {
  static const StatusOr<const NcclApi*> api = []() -> StatusOr<const NcclApi*> {
    const std::string path = kNcclLibrary.Get();
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      return UnavailableError("NCCL could not be loaded from " + path + " (" +
                              (why != nullptr ? why : "unknown error") +
                              "); put libnccl.so.2 on the loader path or name it in "
                              "TZ_NCCL_LIBRARY");
    }
    auto* a = new NcclApi();
    bool ok =
        Bind(lib, "ncclGetVersion", a->GetVersion) &&
        Bind(lib, "ncclGetUniqueId", a->GetUniqueId) &&
        Bind(lib, "ncclCommInitRank", a->CommInitRank) &&
        Bind(lib, "ncclCommGetAsyncError", a->CommGetAsyncError) &&
        Bind(lib, "ncclCommAbort", a->CommAbort) && Bind(lib, "ncclCommDestroy", a->CommDestroy) &&
        Bind(lib, "ncclGetErrorString", a->GetErrorString) &&
        Bind(lib, "ncclAllGather", a->AllGather) &&
        Bind(lib, "ncclReduceScatter", a->ReduceScatter) &&
        Bind(lib, "ncclAllReduce", a->AllReduce) && Bind(lib, "ncclBroadcast", a->Broadcast) &&
        Bind(lib, "ncclSend", a->Send) && Bind(lib, "ncclRecv", a->Recv) &&
        Bind(lib, "ncclGroupStart", a->GroupStart) && Bind(lib, "ncclGroupEnd", a->GroupEnd);
    if (!ok) {
      delete a;
      return UnavailableError(path + " lacks NCCL functions tierzero needs (NCCL 2.12 or newer)");
    }
    // Optional (newer NCCL): the configured, non-blocking initialisation and the last error.
    Bind(lib, "ncclCommInitRankConfig", a->CommInitRankConfig);
    Bind(lib, "ncclGetLastError", a->GetLastError);
    Bind(lib, "ncclCommSplit", a->CommSplit);
    a->GetVersion(&a->version);
    a->config = a->CommInitRankConfig != nullptr && a->version >= NCCL_VERSION_CODE;
    return static_cast<const NcclApi*>(a);
  }();
  return api;
}

StatusOr<ncclDataType_t> NcclType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    case DType::kI8:
    case DType::kI4:  // moved as bytes (count / 2), never reduced
      return ncclInt8;
  }
  return InvalidArgumentError("dtype has no NCCL type");
}

// Elements as NCCL counts them: int4 travels as bytes.
size_t NcclCount(DType dtype, size_t count) { return dtype == DType::kI4 ? count / 2 : count; }

// Note [A mean over one rank is a sum]
// On the first GPU run (an H100, one rank, the NCCL that the machine's PyTorch carries), an
// out-of-place fp32 ncclAvg over 70001 elements returned other bits than its input, where the
// in-place one, every ncclSum and the bf16 and fp16 means were exact. A mean over one rank is
// the value itself, so one rank asks for a sum, which NCCL does as a copy.
ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMean:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
  }
  return ncclSum;
}

// State shared by the communicator and its requests: the NCCL communicator and whether it was
// aborted (after a deadline, or by Abort), so no one uses it afterwards.
struct NcclShared {
  const NcclApi* api = nullptr;
  ncclComm_t comm = nullptr;
  int ordinal = 0;
  std::recursive_mutex mu;  // held across every NCCL call, so none races an abort
  bool aborted = false;

  Status Error(ncclResult_t r, const std::string& what) {
    std::string text = api->GetErrorString(r);
    if (api->GetLastError != nullptr) {
      const char* last = api->GetLastError(comm);
      if (last != nullptr && *last != '\0') text += " (" + std::string(last) + ")";
    }
    return InternalError("NCCL " + what + " failed: " + text);
  }
  // The communicator's asynchronous state: OK, or the error it hit; `in_progress` tells whether
  // a non-blocking call is still under way.
  Status AsyncState(const std::string& what, bool* in_progress) {
    *in_progress = false;
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (aborted) return FailedPreconditionError("the NCCL communicator was aborted");
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = api->CommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return Error(r, "CommGetAsyncError");
    if (state == ncclInProgress) {
      *in_progress = true;
      return Status::OK();
    }
    if (state != ncclSuccess) {
      Status e = Error(state, what);
      AbortComm();  // an asynchronous error leaves the communicator unusable
      return e;
    }
    return Status::OK();
  }
  void AbortComm() {
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (aborted || comm == nullptr) return;
    aborted = true;
    api->CommAbort(comm);
  }
  // Waits while a non-blocking call is in progress (initialisation, or a collective being
  // enqueued), up to `timeout_s`; aborts the communicator on the deadline.
  Status Settle(ncclResult_t r, const std::string& what, double timeout_s) {
    if (r != ncclSuccess && r != ncclInProgress) return Error(r, what);
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      bool busy = false;
      RETURN_IF_ERROR(AsyncState(what, &busy));
      if (!busy) return Status::OK();
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >
          timeout_s) {
        AbortComm();
        return DeadlineExceededError("NCCL " + what + " did not finish in " +
                                     std::to_string(static_cast<int>(timeout_s)) +
                                     " s: another rank has failed or not joined");
      }
      std::this_thread::yield();
    }
  }
};

// A collective queued on the comm stream: done when the stream passes its event.
class NcclRequest final : public CommRequest {
 public:
  NcclRequest(std::shared_ptr<NcclShared> shared, cudaEvent_t event, std::string what,
              double timeout_s)
      : shared_(std::move(shared)),
        event_(event),
        what_(std::move(what)),
        timeout_s_(timeout_s),
        enqueued_(std::chrono::steady_clock::now()) {}
  ~NcclRequest() override {
    (void)Wait();
    cudaSetDevice(shared_->ordinal);
    cudaEventDestroy(event_);
  }
  Status Wait() override {
    for (;;) {
      auto t = Test();
      if (!t.ok()) return t.status();
      if (*t) return Status::OK();
      std::this_thread::yield();
    }
  }
  // The deadline counts from the enqueue, so a request only ever tested times out too; one that
  // completed is done however late it is first tested.
  StatusOr<bool> Test() override {
    MutexLock lock(mu_);
    if (!done_) {
      cudaSetDevice(shared_->ordinal);
      const cudaError_t e = cudaEventQuery(event_);
      if (e == cudaSuccess) {
        done_ = true;
      } else if (e != cudaErrorNotReady) {
        done_ = true;
        status_ = CudaStatus(e, "the stream of NCCL " + what_, __FILE__, __LINE__);
      } else if (std::chrono::duration<double>(std::chrono::steady_clock::now() - enqueued_)
                     .count() > timeout_s_) {
        // Aborting the communicator ends its kernels, so the stream (and the buffers) are free.
        shared_->AbortComm();
        done_ = true;
        status_ = DeadlineExceededError("NCCL " + what_ + " did not complete in " +
                                        std::to_string(static_cast<int>(timeout_s_)) +
                                        " s: another rank has failed, stopped, or started a "
                                        "different collective");
      } else {
        bool busy = false;
        Status s = shared_->AsyncState(what_, &busy);
        if (!s.ok()) {
          done_ = true;
          status_ = std::move(s);
        }
      }
    }
    if (!status_.ok()) return status_;
    return done_;
  }

 private:
  std::shared_ptr<NcclShared> shared_;
  cudaEvent_t event_;
  std::string what_;
  double timeout_s_;
  std::chrono::steady_clock::time_point enqueued_;
  Mutex mu_;  // a request may be waited for from any thread
  bool done_ TZ_GUARDED_BY(mu_) = false;
  Status status_ TZ_GUARDED_BY(mu_);
};

class NcclCommunicator final : public Communicator {
 public:
  static StatusOr<std::shared_ptr<Communicator>> Create(const NcclOptions& o) {
    if (!o.bootstrap) return InvalidArgumentError("the NCCL communicator needs a bootstrap");
    // What one rank lacks fails every rank (Note [Agreeing on an outcome]), before NCCL waits
    // for ranks that will never join.
    Status usable = Status::OK();
    const NcclApi* api = nullptr;
    ncclUniqueId id{};
    if (o.device == nullptr || o.device->info().kind != DeviceKind::kCuda) {
      usable = UnavailableError("the NCCL communicator needs a CUDA device");
    } else if (o.stream.impl == nullptr) {
      usable = InvalidArgumentError("the NCCL communicator needs a stream");
    } else if (auto loaded = LoadNccl(); !loaded.ok()) {
      usable = loaded.status();
    } else {
      api = *loaded;
      // Rank 0's unique id reaches every rank over the bootstrap.
      if (o.bootstrap->rank() == 0) {
        if (ncclResult_t r = api->GetUniqueId(&id); r != ncclSuccess)
          usable = InternalError(std::string("NCCL GetUniqueId failed: ") + api->GetErrorString(r));
      }
    }
    RETURN_IF_ERROR(AgreeOnStatus(*o.bootstrap, usable));
    auto c = std::shared_ptr<NcclCommunicator>(new NcclCommunicator());
    c->shared_ = std::make_shared<NcclShared>();
    c->shared_->api = api;
    c->shared_->ordinal = o.device->info().ordinal;
    c->device_ = o.device;
    c->stream_ = static_cast<cudaStream_t>(o.stream.impl);
    c->bootstrap_ = o.bootstrap;
    c->topo_ = o.bootstrap->topology();
    c->timeout_s_ = o.timeout_s;

    ASSIGN_OR_RETURN(auto bcast, o.bootstrap->Broadcast(&id, sizeof id, DType::kI8, 0));
    RETURN_IF_ERROR(bcast->Wait());

    CUDA_RETURN_IF_ERROR(cudaSetDevice(c->shared_->ordinal));
    ncclResult_t r;
    if (api->config) {
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      r = api->CommInitRankConfig(&c->shared_->comm, c->topo_.size, id, c->topo_.rank, &config);
    } else {
      r = api->CommInitRank(&c->shared_->comm, c->topo_.size, id, c->topo_.rank);
    }
    Status inited =
        r != ncclSuccess && r != ncclInProgress
            ? InternalError(std::string("NCCL CommInitRank failed: ") + api->GetErrorString(r) +
                            " (each rank needs its own GPU: " +
                            std::to_string(c->topo_.local_size) + " ranks on this node)")
            : c->shared_->Settle(r, "CommInitRank", c->timeout_s_);
    RETURN_IF_ERROR(AgreeOnStatus(*o.bootstrap, inited));
    ASSIGN_OR_RETURN(void* scratch, o.device->Allocate(kDeviceAlignment));
    c->scratch_ = scratch;
    return std::shared_ptr<Communicator>(std::move(c));
  }

  ~NcclCommunicator() override {
    cudaSetDevice(shared_->ordinal);
    // The stream's collectives first, up to the deadline (a dead peer would hold them forever:
    // then the communicator is aborted, which ends them).
    const auto t0 = std::chrono::steady_clock::now();
    while (cudaStreamQuery(stream_) == cudaErrorNotReady) {
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >
          timeout_s_) {
        shared_->AbortComm();
        break;
      }
      std::this_thread::yield();
    }
    {
      std::lock_guard<std::recursive_mutex> lock(shared_->mu);
      if (!shared_->aborted && shared_->comm != nullptr) shared_->api->CommDestroy(shared_->comm);
      shared_->aborted = true;
    }
    if (scratch_ != nullptr) device_->Free(scratch_);
  }

  int rank() const override { return topo_.rank; }
  int size() const override { return topo_.size; }

  // See Note [A mean over one rank is a sum].
  ncclRedOp_t OpFor(ReduceOp op) const {
    return topo_.size == 1 && op == ReduceOp::kMean ? ncclSum : NcclOp(op);
  }
  Topology topology() const override { return topo_; }
  std::string backend() const override { return "nccl"; }

  StatusOr<std::unique_ptr<CommRequest>> AllGather(const void* send, void* recv, size_t count,
                                                   DType dtype) override {
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kAllGather, count, dtype, false));
    ASSIGN_OR_RETURN(ncclDataType_t t, NcclType(dtype));
    const NcclApi* a = shared_->api;
    return Enqueue("all_gather", CollectiveKind::kAllGather, count, dtype, false, [&] {
      return a->AllGather(send, recv, NcclCount(dtype, count), t, shared_->comm, stream_);
    });
  }

  StatusOr<std::unique_ptr<CommRequest>> ReduceScatter(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kReduceScatter, count, dtype, true, op));
    ASSIGN_OR_RETURN(ncclDataType_t t, NcclType(dtype));
    const NcclApi* a = shared_->api;
    return Enqueue("reduce_scatter", CollectiveKind::kReduceScatter, count, dtype, false, [&] {
      return a->ReduceScatter(send, recv, count, t, OpFor(op), shared_->comm, stream_);
    });
  }

  StatusOr<std::unique_ptr<CommRequest>> AllReduce(const void* send, void* recv, size_t count,
                                                   DType dtype, ReduceOp op) override {
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kAllReduce, count, dtype, true, op));
    ASSIGN_OR_RETURN(ncclDataType_t t, NcclType(dtype));
    const NcclApi* a = shared_->api;
    return Enqueue("all_reduce", CollectiveKind::kAllReduce, count, dtype, false, [&] {
      return a->AllReduce(send, recv, count, t, OpFor(op), shared_->comm, stream_);
    });
  }

  // One grouped send and receive per peer (ncclAlltoAll is only in the newest NCCL).
  StatusOr<std::unique_ptr<CommRequest>> AllToAll(const void* send, void* recv, size_t count,
                                                  DType dtype) override {
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kAllToAll, count, dtype, false));
    ASSIGN_OR_RETURN(ncclDataType_t t, NcclType(dtype));
    const NcclApi* a = shared_->api;
    const size_t n = NcclCount(dtype, count);
    const size_t block = DTypeBytes(dtype, count);
    return Enqueue("all_to_all", CollectiveKind::kAllToAll, count, dtype, false, [&] {
      ncclResult_t r = a->GroupStart();
      for (int p = 0; p < topo_.size && (r == ncclSuccess || r == ncclInProgress); ++p) {
        r = a->Send(static_cast<const uint8_t*>(send) + p * block, n, t, p, shared_->comm, stream_);
        if (r == ncclSuccess || r == ncclInProgress)
          r = a->Recv(static_cast<uint8_t*>(recv) + p * block, n, t, p, shared_->comm, stream_);
      }
      const ncclResult_t end = a->GroupEnd();
      return r == ncclSuccess || r == ncclInProgress ? end : r;
    });
  }

  StatusOr<std::unique_ptr<CommRequest>> Broadcast(void* buf, size_t count, DType dtype,
                                                   int root) override {
    RETURN_IF_ERROR(zero::CheckBroadcast(count, dtype, root, topo_.size));
    ASSIGN_OR_RETURN(ncclDataType_t t, NcclType(dtype));
    const NcclApi* a = shared_->api;
    return Enqueue("broadcast", CollectiveKind::kBroadcast, count, dtype, root == topo_.rank, [&] {
      return a->Broadcast(buf, buf, NcclCount(dtype, count), t, root, shared_->comm, stream_);
    });
  }

  // Every rank has queued everything before it and the stream has run it: an all_reduce of one
  // float on the comm stream, waited for.
  Status Barrier() override {
    const NcclApi* a = shared_->api;
    auto req = Enqueue("barrier", CollectiveKind::kAllReduce, 1, DType::kF32, false, [&] {
      return a->AllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, shared_->comm, stream_);
    });
    if (!req.ok()) return req.status();
    return (*req)->Wait();
  }

  CommStats stats() const override {
    return {collectives_.load(std::memory_order_relaxed), bytes_.load(std::memory_order_relaxed),
            cross_bytes_.load(std::memory_order_relaxed)};
  }
  StatusOr<std::shared_ptr<Communicator>> Duplicate() override {
    return UnsupportedError("duplicating an NCCL communicator (create another one instead)");
  }
  // The bootstrap splits the same way (the sub-communicator's agreements and abort go over it);
  // the NCCL communicator is split from this one (ncclCommSplit) and queues on the same stream.
  StatusOr<std::shared_ptr<Communicator>> Split(SplitBy by) override {
    RETURN_IF_ERROR(zero::CheckSplit(by));
    ASSIGN_OR_RETURN(std::shared_ptr<Communicator> boot, bootstrap_->Split(by));
    const NcclApi* api = shared_->api;
    RETURN_IF_ERROR(AgreeOnStatus(
        *boot, api->CommSplit != nullptr
                   ? Status::OK()
                   : UnsupportedError("splitting an NCCL communicator needs NCCL 2.18 or newer")));
    auto c = std::shared_ptr<NcclCommunicator>(new NcclCommunicator());
    c->shared_ = std::make_shared<NcclShared>();
    c->shared_->api = api;
    c->shared_->ordinal = shared_->ordinal;
    c->device_ = device_;
    c->stream_ = stream_;
    c->bootstrap_ = boot;
    c->topo_ = boot->topology();
    c->timeout_s_ = timeout_s_;
    const bool by_node = by == SplitBy::kNode;
    CUDA_RETURN_IF_ERROR(cudaSetDevice(shared_->ordinal));
    ncclResult_t r;
    {
      std::lock_guard<std::recursive_mutex> lock(shared_->mu);
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      r = api->CommSplit(shared_->comm, by_node ? topo_.node : topo_.local_rank,
                         by_node ? topo_.local_rank : topo_.node, &c->shared_->comm,
                         api->config ? &config : nullptr);
    }
    Status split = r != ncclSuccess && r != ncclInProgress
                       ? shared_->Error(r, "CommSplit")
                       : c->shared_->Settle(r, "CommSplit", timeout_s_);
    RETURN_IF_ERROR(AgreeOnStatus(*boot, split));
    ASSIGN_OR_RETURN(void* scratch, device_->Allocate(kDeviceAlignment));
    c->scratch_ = scratch;
    return std::shared_ptr<Communicator>(std::move(c));
  }
  void SetTimeout(double seconds) override { timeout_s_ = seconds; }
  double timeout() const override { return timeout_s_; }
  [[noreturn]] void Abort(int exit_code) override {
    shared_->AbortComm();
    bootstrap_->Abort(exit_code);
    std::_Exit(exit_code);  // not reached (the interface cannot mark a virtual noreturn)
  }

 private:
  NcclCommunicator() = default;

  template <typename F>
  StatusOr<std::unique_ptr<CommRequest>> Enqueue(const char* what, CollectiveKind kind,
                                                 size_t count, DType dtype, bool is_root,
                                                 F&& call) {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(shared_->ordinal));
    std::lock_guard<std::recursive_mutex> lock(shared_->mu);
    if (shared_->aborted)
      return FailedPreconditionError(std::string("NCCL ") + what +
                                     ": the communicator was aborted after an earlier failure");
    RETURN_IF_ERROR(shared_->Settle(call(), what, timeout_s_));
    cudaEvent_t ev = nullptr;
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    if (cudaError_t e = cudaEventRecord(ev, stream_); e != cudaSuccess) {
      cudaEventDestroy(ev);
      return CudaStatus(e, "cudaEventRecord", __FILE__, __LINE__);
    }
    collectives_.fetch_add(1, std::memory_order_relaxed);
    const uint64_t sent = zero::BytesSent(kind, count, dtype, topo_.size, is_root);
    bytes_.fetch_add(sent, std::memory_order_relaxed);
    cross_bytes_.fetch_add(zero::CrossNodeBytes(sent, topo_), std::memory_order_relaxed);
    return std::unique_ptr<CommRequest>(new NcclRequest(shared_, ev, what, timeout_s_));
  }

  std::shared_ptr<NcclShared> shared_;
  Device* device_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<Communicator> bootstrap_;
  Topology topo_;
  double timeout_s_ = 300;
  void* scratch_ = nullptr;
  std::atomic<uint64_t> collectives_{0}, bytes_{0}, cross_bytes_{0};
};

}  // namespace

StatusOr<std::shared_ptr<Communicator>> CreateNcclCommunicator(const NcclOptions& options) {
  return NcclCommunicator::Create(options);
}

Status NcclLoadable() { return LoadNccl().status(); }

}  // namespace tierzero
