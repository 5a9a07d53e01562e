// BlockIo: asynchronous positional reads and writes on a set of open files — the one interface
// between NvmeStore and the kernel (leveldb's Env for block devices). Implementations:
//   - io_uring (CreateUringBlockIo): registered files, optional registered (fixed) buffers and
//     SQPOLL, a completion thread.
//   - a thread pool doing pread/pwrite (CreateThreadPoolBlockIo), for kernels or sandboxes
//     without io_uring.
//   - FaultInjectionBlockIo: a wrapper that fails, delays or shortens requests, for tests.
// A BlockIo moves bytes and reports raw results; checking them (short transfers, errors,
// checksums) is NvmeStore's job, so every backend gets the same checks.
//
// Thread-safety: Submit may be called from any thread. Completions run on the backend's own
// threads (or, for requests a wrapper fails outright, on the submitting thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace tierzero {

struct IoRequest {
  enum class Op : uint8_t { kRead, kWrite };
  Op op = Op::kRead;
  int file = 0;         // index into the files given at creation
  uint64_t offset = 0;  // bytes; 4 KiB aligned for O_DIRECT files
  void* buf = nullptr;  // 4 KiB aligned for O_DIRECT files
  uint32_t len = 0;
  int transient_retries = 0;  // EINTR/EAGAIN results resubmitted so far (NvmeStore::Complete)
  // Called once with the kernel's result: bytes transferred (possibly fewer than len), or
  // -errno. Must not block for long: it runs on a completion thread.
  std::function<void(int64_t result)> done;
};

class BlockIo {
 public:
  virtual ~BlockIo() = default;
  // Queues a request. Blocks while `queue_depth` requests are already in flight. The request
  // must stay alive until its `done` runs. An error here means the request was not queued and
  // `done` will not run.
  virtual Status Submit(IoRequest* request) = 0;
  // Queues `request` again from inside a `done` callback that is running on this BlockIo's
  // completion thread (a short transfer's remainder). It reuses the completing request's
  // in-flight permit, so it never blocks: a Submit there could wait forever for a permit that
  // only the completion thread itself would return.
  // REQUIRES: called from a `done` callback of this BlockIo, at most once per callback.
  virtual Status Resubmit(IoRequest* request) = 0;
  // Registers memory as fixed buffers (io_uring); requests whose buffers lie inside a
  // registered region use the fixed-buffer opcodes. A no-op for backends without the notion.
  virtual Status RegisterBuffers(const std::vector<std::pair<void*, size_t>>& regions) = 0;
  // "io_uring", "io_uring+sqpoll", "threadpool", ...
  virtual std::string name() const = 0;
};

struct BlockIoOptions {
  int queue_depth = 32;  // requests in flight at most. Default: 32.
  bool sqpoll = false;   // io_uring: a kernel thread polls the submission queue. Default: off.
  int threads = 4;       // thread pool: worker threads. Default: 4.
};

// io_uring over `fds` (registered as fixed files). Unavailable when io_uring cannot be set up
// (EPERM/ENOSYS from a sandbox or an old kernel, or kernel.io_uring_disabled), so callers can
// fall back to the thread pool.
StatusOr<std::unique_ptr<BlockIo>> CreateUringBlockIo(const std::vector<int>& fds,
                                                      const BlockIoOptions& options);
// pread/pwrite on worker threads over `fds`.
StatusOr<std::unique_ptr<BlockIo>> CreateThreadPoolBlockIo(const std::vector<int>& fds,
                                                           const BlockIoOptions& options);

// Fault rules for FaultInjectionBlockIo: "skip `skip` matching requests, then apply to `count`".
struct BlockIoFault {
  enum class Kind : uint8_t {
    kFail,     // complete with -error_code without doing the I/O
    kShorten,  // do only the first half (4 KiB aligned, at least 4 KiB) and report that
    kDelay,    // do the I/O, then hold the completion for delay_ms
  };
  Kind kind = Kind::kFail;
  IoRequest::Op op = IoRequest::Op::kRead;
  int skip = 0;
  int count = 1;
  int error_code = 5;  // EIO
  int delay_ms = 0;
};

class FaultInjectionBlockIo final : public BlockIo {
 public:
  explicit FaultInjectionBlockIo(std::unique_ptr<BlockIo> target);
  ~FaultInjectionBlockIo() override;
  void Inject(BlockIoFault fault);
  // Removes every rule (requests in flight keep what they got).
  void Clear();
  // Requests that a rule applied to so far.
  int injected() const;

  Status Submit(IoRequest* request) override;
  Status Resubmit(IoRequest* request) override;
  Status RegisterBuffers(const std::vector<std::pair<void*, size_t>>& regions) override {
    return target_->RegisterBuffers(regions);
  }
  std::string name() const override { return target_->name() + "+faults"; }

 private:
  Status Apply(IoRequest* request, bool resubmit);
  struct State;
  std::unique_ptr<BlockIo> target_;
  std::unique_ptr<State> state_;
};

}  // namespace tierzero
